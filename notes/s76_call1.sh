#!/bin/bash
# session 76, call 1 (at main): on an H200, README's e2e refresh and both models' selection table, then the new
# families' CUDA tests; on any other GPU, the families' CUDA tests and the HF tests against this machine's transformers
python3 -c "import torch; p = torch.cuda.get_device_properties(0)
print(p.name, 'L2', p.L2_cache_size, 'SMs', p.multi_processor_count, 'torch', torch.__version__)"
families() {
  PYTHONPATH=$PWD timeout 150 python3 -m pytest -m cuda tests/test_hf_families.py -q -rs -p no:cacheprovider \
    > $OUT/pytest_families.log 2>&1
  grep -E "^(FAILED|ERROR)" $OUT/pytest_families.log | cut -c1-220 | head; tail -1 $OUT/pytest_families.log
}
if nvidia-smi -L | grep -q H200; then
  bash notes/device_trial.sh e2e | grep -v "^[0-9.]*+"
  [ $SECONDS -lt 360 ] && bash notes/device_trial.sh bselall
  [ $SECONDS -lt 420 ] && families
else
  bash notes/device_trial.sh | tail -1
  families
  bash notes/device_trial.sh thf
fi
echo "call wall $SECONDS s"
