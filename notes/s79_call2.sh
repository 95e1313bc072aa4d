#!/bin/bash
# Session 79: the Python-only changes after e7c4c2b (the meta device's router stand-in in the model's dtype, the
# apply-then-load test) against the device's transformers 5.17, CPU and CUDA cases: test_layouts, test_hf_families,
# test_hf. `bash notes/s79_call2.sh` (~400 s with the build).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, torch.cuda as c; print(c.get_device_name(), torch.__version__, transformers.__version__)"
s=$SECONDS
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -50 $OUT/build.log; exit 1; }
echo "build $((SECONDS-s)) s"
s=$SECONDS
timeout 420 python3 -m pytest tests/test_layouts.py tests/test_hf_families.py tests/test_hf.py -q -p no:cacheprovider \
  > $OUT/pytest_hf.log 2>&1
echo "pytest rc $? $((SECONDS-s)) s"; tail -15 $OUT/pytest_hf.log
echo "call wall $SECONDS s"
