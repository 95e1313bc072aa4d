#!/bin/bash
# Session 81 on a short budget (~350 s with the build): the whole `pytest -m cuda tests` at the head, which holds
# session 79's never-run build-without-kernels test, session 80's GEMV bound and compiled-generate agreement, and
# session 81's hypothesis properties on the CUDA kernels (test_ops_properties). `bash notes/s81_call.sh`; the
# sanitizers stay for `bash notes/device_trial.sh selsan normsan mem race`.
python3 -c "import torch, transformers, torch.cuda as c; print(c.get_device_name(), torch.__version__, transformers.__version__)"
bash notes/device_trial.sh tall
grep -E "passed|failed|error" $OUT/pytest_all.log | tail -3
echo "call wall $SECONDS s"
