#!/bin/bash
export PYTHONPATH=$PWD BASE_MOE_COMMIT=$(cat .trial_sha)
L=$OUT/log.txt; : > $L; t0=$(date +%s)
( MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.txt 2>&1; echo "build rc=$? $(( $(date +%s)-t0 ))s" ) >> $L
timeout 200 python3 -m pytest -m cuda tests/test_experts_cuda.py -q --tb=line > $OUT/test_experts.txt 2>&1; echo "test_experts rc=$? $(tail -1 $OUT/test_experts.txt) $(( $(date +%s)-t0 ))s" >> $L
for tool in memcheck racecheck; do
  SANITIZE_CONFIGS=V1E timeout 120 compute-sanitizer --print-limit 3 --tool $tool python3 benchmarks/sanitize_experts.py > $OUT/san_$tool.txt 2>&1
  echo "$tool rc=$? $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' $OUT/san_$tool.txt | tail -1) $(( $(date +%s)-t0 ))s" >> $L
done
timeout 300 python3 benchmarks/bench_layer.py --variants-only --variant-points all --variants default,V1D,V1E,V1W,V1Y,V1X,V1L --out $OUT/variants.json > $OUT/bench_variants.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-t0 ))s" >> $L
cat $L; grep -h 'FAILED\|ERROR ' $OUT/test_experts.txt | head -5; grep variants $OUT/bench_variants.txt; tail -3 $OUT/bench_variants.txt
