#!/bin/bash
# Session 14's first device call, prepared in session 13 (developer tooling; run from the repo root on main):
#   git rev-parse HEAD > .trial_sha; run: bash notes/trial_s14.sh   (about 8-9 minutes: four builds)
# 1. v2 = notes/epilogue_ilp_v2.patch (wip/epilogue-ilp): the expert tests, the layer variants, memcheck / racecheck
# 2. v3 = v2 + notes/batch_rows_v3.patch (wip/batch-rows): the expert tests and the layer variants
# 3. main again: the layer variants, so all three come from one machine
# Every build is forced (touch) and checked (md5 and what ninja compiled): session 13 lost a call to a skipped build.
export VARIANTS=default PYTHONPATH=$PWD PYTHONUNBUFFERED=1
run() {
  name=$1; shift
  touch csrc/experts.cu
  echo "### $name: experts.cu $(md5sum csrc/experts.cu | cut -c1-8), silu_mul $(grep -c silu_mul csrc/experts.cu), batch_rows $(grep -c batch_rows csrc/experts.cu)"
  bash notes/device_trial.sh "$@" | grep -E "build|passed|failed|error|ERROR SUMMARY|RACECHECK SUMMARY|== "
  for f in variants pytest_experts memcheck racecheck; do
    for x in json log; do [ -f "$OUT/$f.$x" ] && mv "$OUT/$f.$x" "$OUT/${f}_$name.$x"; done
  done
}
git apply notes/epilogue_ilp_v2.patch || { echo "v2 does not apply"; exit 1; }
export SAN=default,T32,W64,W128
run v2 texp var mem race
git apply notes/batch_rows_v3.patch || { echo "v3 does not apply"; exit 1; }
run v3 texp var
git apply -R notes/batch_rows_v3.patch && git apply -R notes/epilogue_ilp_v2.patch || { echo "revert failed"; exit 1; }
run main var
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
names = [n for n in ("main", "v2", "v3") if os.path.exists(f"{out}/variants_{n}.json")]
d = {n: json.load(open(f"{out}/variants_{n}.json")) for n in names}
print("copy TB/s", {n: round(v["copy_bandwidth_TBps"], 2) for n, v in d.items()})
print("batch budget active " + " ".join(f"{n:>8}" for n in names))
for i, r in enumerate(d[names[0]]["variants"]):
    print(f"{r['batch']:5} {str(r['budget']):6} {r['active']:6} " + " ".join(f"{d[n]['variants'][i]['us']['default']:8.1f}" for n in names))
PY
# 4. (last: only this is lost if the call runs out of time) per-CTA stamps of v3, to see what batch rows changed in
#    gate_up's prologue (compare with session13.txt call 9)
git apply notes/epilogue_ilp_v2.patch && git apply notes/batch_rows_v3.patch && git apply notes/diag_stamps_v3.patch || { echo "diag does not apply"; exit 1; }
touch csrc/experts.cu
bash notes/device_trial.sh | grep -E "build|error"
for pt in "--batch 64 --budget 16" "--batch 16 --budget 16" "--batch 1"; do
  echo "== stamps $pt"
  BASE_MOE_DIAG=64 timeout 60 python3 benchmarks/profile_layer.py --op experts --calls 4 $pt 2>&1 | grep -E "^(gate_up|down)" | tail -2
done
