#!/bin/bash
export PYTHONPATH=$PWD BASE_MOE_COMMIT=$(cat .trial_sha)
t0=$(date +%s)
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.txt 2>&1; echo "build rc=$? $(( $(date +%s)-t0 ))s"
for c in V1X V1Y V1D; do
  echo "== $c qwen T=16 M=16"; BASE_MOE_EXPERTS_CONFIG=$c CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 dev_ncu.py 16 16 2>&1 | grep -i error | head -3
  echo "== $c memcheck"; SANITIZE_CONFIGS=$c timeout 60 compute-sanitizer --print-limit 3 --tool memcheck python3 benchmarks/sanitize_experts.py 2>&1 | grep -v '^=========     \(Host\|#\)' | head -30
done
timeout 120 python3 -m pytest -m cuda tests/test_experts_cuda.py -q -k "V1X or V1Y or V1D" --tb=line 2>&1 | tail -15
