#!/bin/bash
# Session 79: a build without CUDA kernels on a GPU (mimicked by hiding every op's CUDA kernel) keeps the model's norms
# (test_cuda_build_without_kernels_runs_the_references), with test_hf's new apply tests, its norm tests and its
# budgeted CUDA blocks. `bash notes/s79_call4.sh` (~250 s with the build).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, torch.cuda as c; print(c.get_device_name(), torch.__version__, transformers.__version__)"
s=$SECONDS
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -50 $OUT/build.log; exit 1; }
echo "build $((SECONDS-s)) s"
s=$SECONDS
timeout 200 python3 -m pytest tests/test_hf.py -q -p no:cacheprovider \
  -k "without or norm or shared or midway or restore or cuda_bf16_budgeted" > $OUT/pytest_c4.log 2>&1
echo "pytest rc $? $((SECONDS-s)) s"; tail -6 $OUT/pytest_c4.log
echo "call wall $SECONDS s"
