#!/bin/bash
# session 75, call 2 (main with round_logits): on an H200, README's e2e refresh and both models' selection table; on
# any other GPU, the HF and bench_e2e tests (CPU ones included) against this machine's transformers
python3 -c "import torch; p = torch.cuda.get_device_properties(0)
print(p.name, 'L2', p.L2_cache_size, 'SMs', p.multi_processor_count)"
if nvidia-smi -L | grep -q H200; then
  bash notes/device_trial.sh e2e | grep -v "^[0-9.]*+"
  [ $SECONDS -lt 380 ] && bash notes/device_trial.sh bselall
else
  bash notes/device_trial.sh thf
fi
echo "call wall $SECONDS s"
