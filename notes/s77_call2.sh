#!/bin/bash
# The lean GPU call that merges wip/meta-stand-in (wip/softmax-bias under it), for a budget near 300 s after the start:
# the build, the CUDA tests of what the branch changed (the selection ops and kernels, the HF families), then the
# selection sanitizers (memcheck, then racecheck, as time allows). `bash notes/s77_call2.sh`.
python3 -c "import torch, transformers; print(torch.cuda.get_device_name(), torch.__version__, transformers.__version__)"
bash notes/device_trial.sh | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 130 python3 -m pytest -m cuda tests/test_select_cuda.py tests/test_ops.py tests/test_hf_families.py -q \
  -p no:cacheprovider > $OUT/pytest_sel.log 2>&1
grep -E "^(FAILED|ERROR)" $OUT/pytest_sel.log | cut -c1-220 | head -20; tail -1 $OUT/pytest_sel.log
echo "wall after tests $SECONDS s"
timeout 60 compute-sanitizer --tool memcheck python3 tests/test_select_cuda.py sanitize small > $OUT/selmem.log 2>&1
tail -2 $OUT/selmem.log
timeout 60 compute-sanitizer --tool racecheck python3 tests/test_select_cuda.py sanitize small > $OUT/selrace.log 2>&1
tail -2 $OUT/selrace.log
echo "call wall $SECONDS s"
