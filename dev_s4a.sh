#!/bin/bash
# session 4 call 1: build trial branch, expert tests, sanitizers, variants bench, cluster micro
export PYTHONPATH=$PWD BASE_MOE_COMMIT=$(cat .trial_sha 2>/dev/null || echo trial)
L=$OUT/log.txt; : > $L
t0=$(date +%s)
( MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.txt 2>&1; echo "build rc=$? $(( $(date +%s)-t0 ))s" ) >> $L
( nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/micro/cluster_exchange.cu -o /tmp/cx && timeout 60 /tmp/cx ) > $OUT/micro.txt 2>&1 &
timeout 200 python3 -m pytest -m cuda tests/test_experts_cuda.py -q -x > $OUT/test_experts.txt 2>&1; echo "test_experts rc=$? $(tail -1 $OUT/test_experts.txt)" >> $L
wait
echo "micro done $(( $(date +%s)-t0 ))s" >> $L
for tool in memcheck racecheck; do
  SANITIZE_CONFIGS=default,V1,V1W,V1M,V1L timeout 150 compute-sanitizer --tool $tool python3 benchmarks/sanitize_experts.py > $OUT/san_$tool.txt 2>&1
  echo "$tool rc=$? $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' $OUT/san_$tool.txt | tail -1) $(( $(date +%s)-t0 ))s" >> $L
done
timeout 150 python3 benchmarks/bench_layer.py --variants-only --variants default,V1,V1W,V1M,V1L --out $OUT/variants.json > $OUT/bench_variants.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-t0 ))s" >> $L
timeout 100 python3 -m pytest -m cuda tests/test_hf.py -q -x > $OUT/test_hf.txt 2>&1; echo "test_hf rc=$? $(tail -1 $OUT/test_hf.txt) $(( $(date +%s)-t0 ))s" >> $L
cat $L; tail -40 $OUT/micro.txt; tail -60 $OUT/bench_variants.txt
