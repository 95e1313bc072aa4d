#!/bin/bash
# One device call that compares the expert op of main (the tree as it is, clean) with variants given as patches
# (developer tooling, notes/STATUS.md). From the repo root, after `git rev-parse HEAD > .trial_sha` on this machine
# (the device copy's .git does not follow local commits):
#   bash notes/compare_variants.sh [-s "STEPS"] NAME=PATCH[,PATCH...] [-s "STEPS"] NAME=... ...
# Each variant: its patches applied in order, a forced build, the steps of notes/device_trial.sh given by the last -s
# before it (default "texp var"; e.g. "texp var mem race", or "stamps" with notes/diag_stamps_s14.patch among the
# patches), the patches reverted. Then, if any variant ran "var", main's "var" and one table of the default
# configuration's microseconds at every batch x budget point of those variants, main first. Logs and JSON under $OUT,
# named by variant.
# Session 14 ran its calls 2, 3 and 5 as one-off scripts of this form (git history: 4dbf907).
steps="texp var"
names=()
compared=0
export VARIANTS=${VARIANTS:-default} PYTHONPATH=$PWD PYTHONUNBUFFERED=1
run() {  # NAME STEP...
  local name=$1
  shift
  touch csrc/experts.cu  # a warm machine keeps build outputs, and ninja has skipped a changed file before (session 13)
  echo "### $name: experts.cu $(md5sum csrc/experts.cu | cut -c1-8)"
  bash notes/device_trial.sh "$@" | grep -E "build|passed|failed|error|ERROR SUMMARY|RACECHECK SUMMARY|^stamps |^(gate_up|down) |^PHASES|== "
  for f in variants pytest_experts memcheck racecheck; do
    for x in json log; do [ -f "$OUT/$f.$x" ] && mv "$OUT/$f.$x" "$OUT/${f}_$name.$x"; done
  done
}
while [ $# -gt 0 ]; do
  if [ "$1" = "-s" ]; then steps=$2; shift 2; continue; fi
  name=${1%%=*}
  IFS=, read -ra patches <<< "${1#*=}"
  shift
  for p in "${patches[@]}"; do git apply "$p" || { echo "$p does not apply"; exit 1; }; done
  run "$name" $steps
  [[ " $steps " == *" var "* ]] && compared=1
  for ((i = ${#patches[@]} - 1; i >= 0; i--)); do
    git apply -R "${patches[i]}" || { echo "reverting ${patches[i]} failed"; exit 1; }
  done
  names+=("$name")
done
[ $compared = 1 ] || exit 0
run main var
NAMES="main ${names[*]}" python3 - <<'PY'
import json, os
out = os.environ["OUT"]
names = [n for n in os.environ["NAMES"].split() if os.path.exists(f"{out}/variants_{n}.json")]
runs = {n: json.load(open(f"{out}/variants_{n}.json")) for n in names}
print("copy TB/s", {n: round(r["copy_bandwidth_TBps"], 2) for n, r in runs.items()})
print("batch budget active " + " ".join(f"{n:>8}" for n in names))
for i, row in enumerate(runs["main"]["variants"]):
    us = " ".join(f"{runs[n]['variants'][i]['us']['default']:8.1f}" for n in names)
    print(f"{row['batch']:5} {str(row['budget']):6} {row['active']:6} {us}")
PY
