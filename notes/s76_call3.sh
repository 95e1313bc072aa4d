#!/bin/bash
# session 76, call 3 (branch wip/softmax-bias: group-limited softmax, ERNIE-4.5's softmax + selection bias, the
# detection changes after review): the build, the whole CUDA suite (no -x), the selection sanitizers, both models'
# selection table (the generic instances changed); on an H200 then README's e2e refresh if time is left
python3 -c "import torch, transformers; p = torch.cuda.get_device_properties(0)
print(p.name, 'L2', p.L2_cache_size, 'SMs', p.multi_processor_count, 'torch', torch.__version__, 'transformers', transformers.__version__)"
bash notes/device_trial.sh | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 250 python3 -m pytest -m cuda tests -q -p no:cacheprovider > $OUT/pytest_all.log 2>&1
grep -E "^(FAILED|ERROR)" $OUT/pytest_all.log | cut -c1-220 | head -20; tail -1 $OUT/pytest_all.log
echo "after tests $SECONDS s"
bash notes/device_trial.sh selsan | grep -E "SUMMARY|selsan"
bash notes/device_trial.sh bselall | tail -12
echo "after bselall $SECONDS s"
if nvidia-smi -L | grep -q H200 && [ $SECONDS -lt 400 ]; then bash notes/device_trial.sh e2e | grep -v "^[0-9.]*+"; fi
echo "call wall $SECONDS s"
