#!/bin/bash
export PYTHONPATH=$PWD BASE_MOE_COMMIT=$(cat .trial_sha)
L=$OUT/log.txt; : > $L; t0=$(date +%s)
( MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.txt 2>&1; echo "build rc=$? $(( $(date +%s)-t0 ))s" ) >> $L
timeout 200 python3 -m pytest -m cuda tests/test_experts_cuda.py -q -x > $OUT/test_experts.txt 2>&1; echo "test_experts rc=$? $(tail -1 $OUT/test_experts.txt) $(( $(date +%s)-t0 ))s" >> $L
M="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__issue_active.avg.pct_of_peak_sustained_active"
for spec in "256 16 V1L" "256 16 V1X" "64 16 V1" "64 16 V1Y" "16 16 V1" "16 None V1"; do
  set -- $spec
  BASE_MOE_EXPERTS_CONFIG=$3 timeout 60 ncu --metrics $M -k regex:expert_gemm --launch-skip 2 --launch-count 2 --csv python3 dev_ncu.py $1 $2 > $OUT/ncu_$1_$2_$3.csv 2>&1
  echo "ncu $spec rc=$?" >> $L
done
echo "ncu done $(( $(date +%s)-t0 ))s" >> $L
for tool in memcheck racecheck; do
  SANITIZE_CONFIGS=V1X,V1Y timeout 120 compute-sanitizer --tool $tool python3 benchmarks/sanitize_experts.py > $OUT/san_$tool.txt 2>&1
  echo "$tool rc=$? $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' $OUT/san_$tool.txt | tail -1) $(( $(date +%s)-t0 ))s" >> $L
done
timeout 240 python3 benchmarks/bench_layer.py --variants-only --variant-points all --variants default,V1,V1W,V1X,V1Y,V1L --out $OUT/variants.json > $OUT/bench_variants.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-t0 ))s" >> $L
cat $L; grep variants $OUT/bench_variants.txt
python3 - <<'PY'
import csv, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/ncu_*.csv")):
    rows = [r for r in csv.reader(open(f)) if len(r) > 10]
    if not rows: print(f, "no rows"); continue
    hdr = rows[0]; ki = hdr.index("Kernel Name"); mi = hdr.index("Metric Name"); vi = hdr.index("Metric Value")
    out = {}
    for r in rows[1:]:
        key = ("gu" if "Lb1E" in r[ki] or "true" in r[ki] else "dn")
        out.setdefault(key, []).append(f"{r[mi].split('__',1)[1][:28]}={r[vi]}")
    print(os.path.basename(f)); [print("  ", k, " ".join(v)) for k, v in out.items()]
PY
