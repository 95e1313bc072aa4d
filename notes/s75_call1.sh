#!/bin/bash
# session 75, call 1 (run with notes/round_logits.patch applied to the tree): the L2 size, the build, the whole CUDA
# suite (round_logits; the misaligned-weights test; the two-GPU one skips on one GPU), the selection memcheck, and on
# an H200 whose suite passed, README's e2e refresh
python3 -c "import torch; p = torch.cuda.get_device_properties(0)
print(p.name, 'L2', p.L2_cache_size, 'SMs', p.multi_processor_count)"
bash notes/device_trial.sh tall
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 100 compute-sanitizer --tool memcheck python3 tests/test_select_cuda.py sanitize small > $OUT/selmem.log 2>&1
tail -3 $OUT/selmem.log
if nvidia-smi -L | grep -q H200 && grep -q " passed" $OUT/pytest_all.log && ! grep -q "failed\|error" $OUT/pytest_all.log \
   && [ $SECONDS -lt 380 ]; then
  bash notes/device_trial.sh e2e | grep -v "^[0-9.]*+"
fi
echo "call wall $SECONDS s"
