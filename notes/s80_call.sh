#!/bin/bash
# Session 80's CUDA-test changes and session 79's never-run CUDA test, on a short budget (~350 s with the build):
# device_trial.sh's build, then `pytest -m cuda` on test_hf (the build-without-kernels test, the compiled-generate
# agreement), test_select_cuda (the GEMV bound from torch's fp32 product) and test_ops (the dropped skips).
# `bash notes/s80_call.sh`; the whole CUDA suite and the sanitizers stay for notes/s79_call4.sh and device_trial.sh.
python3 -c "import torch, transformers, torch.cuda as c; print(c.get_device_name(), torch.__version__, transformers.__version__)"
bash notes/device_trial.sh
timeout 220 python3 -m pytest -m cuda tests/test_hf.py tests/test_select_cuda.py tests/test_ops.py -q -x \
  -p no:cacheprovider > $OUT/pytest_s80.log 2>&1
echo "pytest rc $?"; tail -15 $OUT/pytest_s80.log
echo "call wall $SECONDS s"
