#!/bin/bash
# Session 14, call 5 (developer tooling; run from the repo root with notes/down_list_first.patch applied): the down
# GEMM builds its token list before issuing its first weight stages; expert tests and layer variants, then main's
# variants on the same machine.
export VARIANTS=default PYTHONPATH=$PWD PYTHONUNBUFFERED=1
run() {
  name=$1; shift
  touch csrc/experts.cu
  echo "### $name: experts.cu $(md5sum csrc/experts.cu | cut -c1-8), issue_first_weights $(grep -c issue_first_weights csrc/experts.cu)"
  bash notes/device_trial.sh "$@" | grep -E "build|passed|failed|error|== "
  for x in json log; do [ -f "$OUT/variants.$x" ] && mv "$OUT/variants.$x" "$OUT/variants_$name.$x"; done
}
run down texp var
git apply -R notes/down_list_first.patch || { echo "revert failed"; exit 1; }
run main var
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
names = [n for n in ("main", "down") if os.path.exists(f"{out}/variants_{n}.json")]
d = {n: json.load(open(f"{out}/variants_{n}.json")) for n in names}
print("copy TB/s", {n: round(v["copy_bandwidth_TBps"], 2) for n, v in d.items()})
print("batch budget active " + " ".join(f"{n:>8}" for n in names))
for i, r in enumerate(d[names[0]]["variants"]):
    print(f"{r['batch']:5} {str(r['budget']):6} {r['active']:6} " + " ".join(f"{d[n]['variants'][i]['us']['default']:8.1f}" for n in names))
PY
rm -f $OUT/*.log
