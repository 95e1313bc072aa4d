#!/bin/bash
# One device call that compares the expert op of main (the tree as it is, clean) with variants given as patches
# (developer tooling, notes/STATUS.md). From the repo root, after `git rev-parse HEAD > .trial_sha` on this machine
# (the device copy's .git does not follow local commits):
#   bash notes/compare_variants.sh [-s "STEPS"] NAME=PATCH[,PATCH...] [-s "STEPS"] NAME=... ...
# Every variant's patches are checked against main first. Then each variant: its patches applied (all or none), a
# forced build, the steps of notes/device_trial.sh given by the last -s before it (default "texp var"; e.g. "texp var
# mem race", "stamps" with notes/diag_stamps_main.patch among the patches), the patches reverted. The JSON's git_commit names .trial_sha plus the patches.
# Then, if any variant ran "var", main's "var" and one table of the default configuration's microseconds at every batch
# x budget point of those variants, main first. Under $OUT the variants / pytest_experts / memcheck / racecheck /
# bench_layer_q / bench_select / timeline files are renamed by variant; other steps' logs keep
# device_trial.sh's names (the last variant's survive). An empty patch list (`main=`) runs the steps on main itself,
# e.g. session 16's call 1 (the selection bisect; its patches are in git history at 9ef34e8): -s "bsel layerq" main=
# bias=notes/select_bisect_bias.patch push=notes/select_bisect_push.patch all=notes/select_replicated_s15.patch
# Session 14 ran its calls 2, 3 and 5 as one-off scripts of this form (git history: 4dbf907).
steps="texp var"
names=()
# The device tool brings back at most 8 files from $OUT (session 22 lost a call's timelines to it): at exit, more than
# 8 files go into one $OUT/all.tgz (`tar xzf all.tgz` here).
pack_out() {
  local n
  n=$(find "$OUT" -type f | wc -l)
  [ "$n" -gt 8 ] || return 0
  tar czf /tmp/all.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/all.tgz "$OUT/all.tgz"
  echo "packed $n files into \$OUT/all.tgz"
}
trap pack_out EXIT
compared=0
main_commit=$(cat .trial_sha 2>/dev/null || git rev-parse HEAD)
# One git apply per patch (one call over several patches of the same file does not always compose them); on a
# failure the patches already applied are reverted, so the tree is main again.
revert_all() {  # PATCH...: reverted last first
  local i
  for ((i = $#; i >= 1; i--)); do git apply -R "${!i}" || return 1; done
}
apply_all() {  # PATCH...: applied in order, all or none
  local applied=() p
  for p in "$@"; do
    git apply "$p" || { revert_all "${applied[@]}"; return 1; }
    applied+=("$p")
  done
}
for arg in "$@"; do  # every variant's patches must apply to main before any device time goes to a build
  case $arg in
    *=*) IFS=, read -ra patches <<< "${arg#*=}"
         if ! { apply_all "${patches[@]}" && revert_all "${patches[@]}"; }; then
           echo "${arg%%=*}: its patches do not apply to main"
           exit 1
         fi;;
  esac
done
export VARIANTS=${VARIANTS:-default} PYTHONPATH=$PWD PYTHONUNBUFFERED=1
run() {  # NAME STEP...
  local name=$1
  shift
  # (device_trial.sh rebuilds all of csrc whenever its checksum differs from its last build's: a warm machine's
  # ninja skipped a changed file in session 13 and a reverted .cpp in session 20)
  echo "### $name: experts.cu $(md5sum csrc/experts.cu | cut -c1-8)"
  local keep="build|passed|failed|error|ERROR SUMMARY|RACECHECK SUMMARY|^stamps |^(gate_up|down) |^PHASES|^T= *[0-9]+ |== |^qwen3|^olmoe|^\\| qwen3|^select_experts after|stalled_|gpu__time_duration|issue_active|^batch +[0-9]+ |^recompile lines|^\\| |^rc |^BASE_MOE_WS_PAIR|[Cc]luster|^M(16|32)$|lts__t|dram__|pipe_tensor|ws_gemm_kernel|^ws |^wsstamps|^prefetch |^sel |^selstamps|^select batch|call to call| start +[0-9.]+ end "
  bash notes/device_trial.sh "$@" | grep -E "$keep"
  for f in variants pytest_experts memcheck racecheck bench_layer bench_layer_q bench_layer_o bench_select bench_select_t rphases timeline \
      e2enorm bench_e2e_norm e2e bench_e2e quickstart_cuda e2eeager bench_e2e_norm_eager bench_layer_q_nopair \
      wspair_1 wspair_0 ncu_plan_m16 ncu_plan_m32; do
    for x in json log txt; do [ -f "$OUT/$f.$x" ] && mv "$OUT/$f.$x" "$OUT/${f}_$name.$x"; done
  done
}
while [ $# -gt 0 ]; do
  if [ "$1" = "-s" ]; then steps=$2; shift 2; continue; fi
  name=${1%%=*}
  IFS=, read -ra patches <<< "${1#*=}"
  shift
  apply_all "${patches[@]}" || { echo "$name: its patches do not apply"; exit 1; }
  BASE_MOE_COMMIT="$main_commit + ${patches[*]}" run "$name" $steps
  [[ " $steps " == *" var "* ]] && compared=1
  revert_all "${patches[@]}" || { echo "$name: reverting its patches failed"; exit 1; }
  names+=("$name")
done
[ $compared = 1 ] || exit 0
BASE_MOE_COMMIT=$main_commit run main var
NAMES="main ${names[*]}" python3 - <<'PY'
import json, os
out = os.environ["OUT"]
names = [n for n in os.environ["NAMES"].split() if os.path.exists(f"{out}/variants_{n}.json")]
runs = {n: json.load(open(f"{out}/variants_{n}.json")) for n in names}
if "main" not in runs:
    raise SystemExit("main's variants did not run: no table")
print("copy TB/s", {n: round(r["copy_bandwidth_TBps"], 2) for n, r in runs.items()})
print("batch budget active " + " ".join(f"{n:>8}" for n in names))
for i, row in enumerate(runs["main"]["variants"]):
    us = " ".join(f"{runs[n]['variants'][i]['us']['default']:8.1f}" for n in names)
    print(f"{row['batch']:5} {str(row['budget']):6} {row['active']:6} {us}")
PY
