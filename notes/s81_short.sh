#!/bin/bash
# Session 81's shortest useful call (~250-300 s with the build), for a budget too small for notes/s81_call.sh: the
# CUDA tests that have never run on a GPU (session 81's hypothesis properties on the CUDA kernels, session 80's GEMV
# bound in test_select_cuda, session 79's build-without-kernels test and session 80's compiled-generate agreement).
python3 -c "import torch, transformers, torch.cuda as c; print(c.get_device_name(), torch.__version__, transformers.__version__)"
bash notes/device_trial.sh
timeout 200 python3 -m pytest -m cuda tests/test_ops_properties.py tests/test_select_cuda.py tests/test_hf.py -q \
  -p no:cacheprovider -k "properties or select_cuda or without_kernels or static_cache_compiled" > $OUT/pytest_s81.log 2>&1
echo "pytest rc $?"; grep -E "passed|failed|Error" $OUT/pytest_s81.log | tail -8
echo "call wall $SECONDS s"
