#!/bin/bash
export PYTHONPATH=$PWD BASE_MOE_COMMIT=$(cat .trial_sha)
L=$OUT/log.txt; : > $L; t0=$(date +%s)
( MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.txt 2>&1; echo "build rc=$? $(( $(date +%s)-t0 ))s" ) >> $L
timeout 120 python3 -m pytest -m cuda tests/test_experts_cuda.py -q --tb=line > $OUT/test_experts.txt 2>&1; echo "test_experts rc=$? $(tail -1 $OUT/test_experts.txt) $(( $(date +%s)-t0 ))s" >> $L
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --print-limit 3 --tool $tool python3 benchmarks/sanitize_experts.py > $OUT/san_$tool.txt 2>&1
  echo "$tool rc=$? $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' $OUT/san_$tool.txt | tail -1) $(( $(date +%s)-t0 ))s" >> $L
done
timeout 240 python3 benchmarks/bench_layer.py --out $OUT/bench_layer.json > $OUT/bench_layer.txt 2>&1; echo "bench_layer rc=$? $(( $(date +%s)-t0 ))s" >> $L
rem=$(( 560 - ($(date +%s)-t0) ))
timeout $rem python3 -m pytest -m cuda tests -q --tb=line -p no:cacheprovider > $OUT/test_cuda_all.txt 2>&1; echo "pytest -m cuda tests rc=$? $(tail -1 $OUT/test_cuda_all.txt) $(( $(date +%s)-t0 ))s" >> $L
cat $L; grep -h 'FAILED\|ERROR ' $OUT/test_experts.txt $OUT/test_cuda_all.txt | head -5; grep variants $OUT/bench_layer.txt; sed -n '/^model /,$p' $OUT/bench_layer.txt
