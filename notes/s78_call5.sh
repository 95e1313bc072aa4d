#!/bin/bash
# Session 78, a lean H100 call for ~300 s of budget: the build, the Qwen3 layer table with bench_layer's rotated router
# and predictor weights (never run on a GPU before), then the detection's tests on the GPU and against the machine's
# transformers 5.17 (the meta-device stand-ins of 18bfb30..: block output checks, interface refusals), as time allows.
python3 -c "import torch, transformers; print(torch.cuda.get_device_name(), torch.__version__, transformers.__version__)"
bash notes/device_trial.sh layerq | grep -v "^[0-9.]*+"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 90 python3 -m pytest tests/test_layouts.py tests/test_hf_families.py tests/test_hf.py -q -p no:cacheprovider \
  > $OUT/pytest_detect.log 2>&1; grep -E "^(FAILED|ERROR)" $OUT/pytest_detect.log | cut -c1-200 | head; tail -1 $OUT/pytest_detect.log
echo "call wall $SECONDS s"
