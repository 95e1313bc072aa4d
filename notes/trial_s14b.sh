#!/bin/bash
# Session 14, call 2 (developer tooling; run from the repo root with notes/id_batches.patch applied in the tree):
# 1. ids loaded in batches (routing and token lists): expert tests, layer variants
# 2. main (the patch reversed): layer variants, same machine
# 3. the patch + notes/diag_stamps_s14.patch: per-CTA stamps at b64/M16, b16/M16, b1, b256/M16
export VARIANTS=default PYTHONPATH=$PWD PYTHONUNBUFFERED=1
run() {
  name=$1; shift
  touch csrc/experts.cu
  echo "### $name: experts.cu $(md5sum csrc/experts.cu | cut -c1-8), load_ids $(grep -c load_ids csrc/experts.cu)"
  bash notes/device_trial.sh "$@" | grep -E "build|passed|failed|error|ERROR SUMMARY|RACECHECK SUMMARY|== "
  for f in variants pytest_experts memcheck racecheck; do
    for x in json log; do [ -f "$OUT/$f.$x" ] && mv "$OUT/$f.$x" "$OUT/${f}_$name.$x"; done
  done
}
run ids texp var
git apply -R notes/id_batches.patch || { echo "revert failed"; exit 1; }
run main var
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
names = [n for n in ("main", "ids") if os.path.exists(f"{out}/variants_{n}.json")]
d = {n: json.load(open(f"{out}/variants_{n}.json")) for n in names}
print("copy TB/s", {n: round(v["copy_bandwidth_TBps"], 2) for n, v in d.items()})
print("batch budget active " + " ".join(f"{n:>8}" for n in names))
for i, r in enumerate(d[names[0]]["variants"]):
    print(f"{r['batch']:5} {str(r['budget']):6} {r['active']:6} " + " ".join(f"{d[n]['variants'][i]['us']['default']:8.1f}" for n in names))
PY
rm -f $OUT/*.log
git apply notes/id_batches.patch && git apply notes/diag_stamps_s14.patch || { echo "diag does not apply"; exit 1; }
touch csrc/experts.cu
bash notes/device_trial.sh | grep -E "build|error"
for pt in "--batch 64 --budget 16" "--batch 16 --budget 16" "--batch 1" "--batch 256 --budget 16"; do
  echo "== stamps $pt"
  BASE_MOE_DIAG=64 timeout 60 python3 benchmarks/profile_layer.py --op experts --calls 4 $pt 2>&1 | grep -E "^(gate_up|down)" | tail -2
done
