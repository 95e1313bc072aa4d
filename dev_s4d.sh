#!/bin/bash
export PYTHONPATH=$PWD BASE_MOE_COMMIT=$(cat .trial_sha)
L=$OUT/log.txt; : > $L; t0=$(date +%s)
( MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.txt 2>&1; echo "build rc=$? $(( $(date +%s)-t0 ))s" ) >> $L
timeout 200 python3 -m pytest -m cuda tests/test_experts_cuda.py -q --tb=line > $OUT/test_experts.txt 2>&1; echo "test_experts rc=$? $(tail -1 $OUT/test_experts.txt) $(( $(date +%s)-t0 ))s" >> $L
for tool in memcheck racecheck; do
  SANITIZE_CONFIGS=V1X,V1Y,V1D timeout 120 compute-sanitizer --print-limit 3 --tool $tool python3 benchmarks/sanitize_experts.py > $OUT/san_$tool.txt 2>&1
  echo "$tool rc=$? $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' $OUT/san_$tool.txt | tail -1) $(( $(date +%s)-t0 ))s" >> $L
done
M="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct"
BASE_MOE_EXPERTS_CONFIG=V1X timeout 60 ncu --metrics $M -k regex:expert_gemm --launch-skip 2 --launch-count 2 --csv python3 dev_ncu.py 256 16 > $OUT/ncu_V1X.csv 2>&1
timeout 300 python3 benchmarks/bench_layer.py --variants-only --variant-points all --variants default,V1,V1W,V1X,V1Y,V1D,V1L --out $OUT/variants.json > $OUT/bench_variants.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-t0 ))s" >> $L
cat $L; grep -h 'FAILED\|ERROR ' $OUT/test_experts.txt | head -5; grep variants $OUT/bench_variants.txt; tail -3 $OUT/bench_variants.txt
grep -o '"gpu__time_duration.sum","[^"]*","[^"]*"\|"[a-z_]*__[a-z_.]*","[^"]*","[0-9.,]*"' $OUT/ncu_V1X.csv | head -20
