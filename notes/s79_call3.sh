#!/bin/bash
# Session 79: the selection at the head on any GPU (README's selection runs predate round_logits, which the benchmarks
# now pass where the HF integration does; the rounding code was never timed on its own) and OLMoE's layer table.
# `bash notes/s79_call3.sh` (~300 s with the build).
python3 -c "import torch, torch.cuda as c; print(c.get_device_name(), torch.__version__)"
bash notes/device_trial.sh bselall layero | grep -v "^[0-9.]*+"
echo "call wall $SECONDS s"
