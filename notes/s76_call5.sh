#!/bin/bash
# session 76, call 5 (~240 s of budget left): the build, then the CUDA tests that reach the new route_select variant
# (kSoftmaxBiasOrGroups: softmax with a selection bias or a group limit) and its dispatch
python3 -c "import torch; print(torch.cuda.get_device_name(), torch.__version__)"
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
echo "build $SECONDS s"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 60 python3 -m pytest -m cuda tests/test_select_cuda.py tests/test_ops.py -q -x -p no:cacheprovider \
  -k "softmax_groups or softmax_bias or softmax_after_topk_groups or biased or group_score or sigmoid_groups" 2>&1 | tail -3
echo "call wall $SECONDS s"
