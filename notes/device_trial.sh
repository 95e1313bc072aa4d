#!/bin/bash
# One device call (developer tooling, notes/STATUS.md): build, then the named steps; logs under $OUT. Usage from the repo root:
#   bash notes/device_trial.sh wssmoke texp tall mem race var varnostore layer layerq layero layerqnp bsel bselall bselt bselhot bselwhot tsel tselnc selsan selmem selrace selraceh e2e e2enorm e2eeager thf quick wspair ncuplan ncuws ncuwst selstamps wsstamps micro wsn stream ptx80 splits ncuexp sync timeline stamps
# The device copy's .git does not follow local commits: write `git rev-parse HEAD > .trial_sha` (untracked) first.
# Steps whose comment says "needs notes/X.patch" for a patch no longer in notes/: notes/PATCHES.md says where it is.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BASE_MOE_COMMIT=${BASE_MOE_COMMIT:-$(cat .trial_sha 2>/dev/null || git rev-parse HEAD)}
nvidia-smi -L; python3 -c "import torch;print(torch.__version__)"
s=$SECONDS
# The synced tree keeps this machine's mtimes, older than a warm machine's objects: after compare_variants reverted a
# variant's patches, ninja rebuilt nothing and session 27's call 6 ran the variant's library. So every file of csrc
# whose content differs from what the last build here compiled is touched (a header's dependents then rebuild through
# ninja's depfiles), and only those rebuild: a variant of one kernel file costs that file's compile, not all of csrc's.
# (Session 49: before, any difference touched every file.)
find csrc -type f | sort | xargs md5sum > /tmp/csrc_sums_now
if [ -f build/.csrc_file_sums ]; then
  diff <(cat build/.csrc_file_sums) /tmp/csrc_sums_now | awk '/^> /{print $3}' | xargs -r touch
else
  find csrc -type f -exec touch {} +
fi
rm -f build/.csrc_file_sums  # until this build succeeds: a failed build leaves every file to be touched next time
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -50 $OUT/build.log; exit 1; }
mkdir -p build && cp /tmp/csrc_sums_now build/.csrc_file_sums
# a warm machine keeps build outputs, and ninja has skipped a changed file before (session 13, call 11): name what it compiled
echo "build $((SECONDS-s)) s; compiled: $(grep -o 'csrc/[a-z_]*\.cu' $OUT/build.log | sort -u | tr '\n' ' ')"
# ncu --metrics output FILE: the kernel name lines (KERNEL, a regex), duration, issue activity and the stall ratios of
# 0.2 or more cycles per issued instruction (the two steps' copies of this filter let every stall through: each stall
# metric's name ends in _per_issue_active, which their "issue_active" pattern matched)
stall_lines() {
  grep -E "$2|duration|issue_active|stalled" "$1" | awk -v k="$2" '$NF+0 >= 0.2 || $0 ~ k || /duration|issue_active\.avg/' |
    cut -c1-140
}
# TAG MODEL PATTERN: one model's layer table without HF's rows or the variants (bench_layer_TAG.json / .log under
# $OUT); prints the rows matching PATTERN
layer_rows() {
  timeout 200 python3 benchmarks/bench_layer.py --models "$2" --no-hf --no-variants --out "$OUT/bench_layer_$1.json" \
    > "$OUT/bench_layer_$1.log" 2>&1
  grep -E "$3" "$OUT/bench_layer_$1.log"
}
# TAG METRICS PATTERN: ncu on the WS GEMMs alone (ncu serializes kernels: no PDL overlap) at b256 and budgets
# ${WSM:-16}: their duration and METRICS (ncu_TAG_mM.txt under $OUT); prints the lines matching PATTERN
ws_ncu() {
  for m in ${WSM:-16}; do
    timeout 120 ncu --metrics "gpu__time_duration.sum,$2" -k regex:ws_gemm --launch-skip 2 --launch-count 2 \
      python3 benchmarks/profile_layer.py --op experts --batch 256 --budget $m --calls 3 > "$OUT/ncu_$1_m$m.txt" 2>&1
    echo "M$m"; grep -E "ws_gemm_kernel|duration|$3" "$OUT/ncu_$1_m$m.txt" | sed 's/  */ /g' | cut -c1-150
  done
}
# LIMIT TOOL LOG LINES COMMAND...: compute-sanitizer TOOL on COMMAND under a LIMIT-second timeout into $OUT/LOG, then
# its exit status (99: a finding, 124: the timeout) and the log's last LINES lines
sanitize() {
  local limit=$1 tool=$2 log=$3 lines=$4
  shift 4
  timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 99 "$@" > "$OUT/$log" 2>&1
  echo "$tool rc $?"; tail -"$lines" "$OUT/$log"
}
# the expert op's tile configurations the sanitizer steps (mem, race, sync) run: $SAN, else all of them
EXPERT_CONFIGS=${SAN:-default,T16,T32,W64,W128,WS}
for step in "$@"; do
  s=$SECONDS
  case $step in
    wssmoke) for shape in qwen3 h320 i64 fp16; do { timeout 60 python3 notes/ws_smoke.py $shape 2>&1; echo "$shape: rc $?"; } | tail -4; done;;
    # route_select's phase stamps in graph replay of the two-kernel path (needs notes/route_phases_graph.patch applied)
    rphasesg) timeout 120 python3 benchmarks/micro/route_phases_graph.py > $OUT/rphases.log 2>&1; tail -8 $OUT/rphases.log;;
    texp) timeout 150 python3 -m pytest -m cuda tests/test_experts_cuda.py -q -x > $OUT/pytest_experts.log 2>&1; tail -15 $OUT/pytest_experts.log;;
    tall) timeout 300 python3 -m pytest -m cuda tests -q -x > $OUT/pytest_all.log 2>&1; tail -15 $OUT/pytest_all.log;;
    var) timeout 240 python3 benchmarks/bench_layer.py --variants-only --variant-points all --variants ${VARIANTS:-default,T16,T32,W64,W128,WS} --out $OUT/variants.json > $OUT/variants.log 2>&1; tail -45 $OUT/variants.log;;
    # the same with every expert GEMM's epilogue stores skipped (needs notes/diag_experts_nostore.patch and, for WS,
    # notes/diag_ws_stamps.patch: BASE_MOE_DIAG bit 128; wrong results, timing only): var's rows minus these are what
    # the epilogues' stores cost at each point
    varnostore) BASE_MOE_DIAG=128 timeout 240 python3 benchmarks/bench_layer.py --variants-only --variant-points all --variants ${VARIANTS:-default} --out $OUT/variants_nostore.json > $OUT/variants_nostore.log 2>&1; tail -30 $OUT/variants_nostore.log;;
    mem) SANITIZE_CONFIGS=$EXPERT_CONFIGS sanitize 200 memcheck memcheck.log 6 python3 benchmarks/sanitize_experts.py;;
    race) SANITIZE_CONFIGS=$EXPERT_CONFIGS sanitize 240 racecheck racecheck.log 6 python3 benchmarks/sanitize_experts.py;;
    ncuexp) # the expert kernels' stall reasons (cycles per issued instruction, by reason) at b64/M16 and b256/M16
      for pt in "64 16" "256 16"; do read -r b m <<< "$pt"
        # (b256 runs WS: its ws_gemm_kernel instances; their producer thread and consumer warps stall apart)
        timeout 150 ncu --metrics gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio -k regex:"expert_gemm|ws_gemm" --launch-skip 2 --launch-count 2 python3 benchmarks/profile_layer.py --batch $b --budget $m --calls 3 > $OUT/ncuexp_b${b}_m${m}.txt 2>&1
        echo "b$b/M$m"; stall_lines $OUT/ncuexp_b${b}_m${m}.txt "expert_gemm|ws_gemm"
      done;;
    layer) timeout 400 python3 benchmarks/bench_layer.py --out $OUT/bench_layer.json > $OUT/bench_layer.log 2>&1; tail -40 $OUT/bench_layer.log;;
    layerq) layer_rows q qwen3-30b-a3b "^qwen3.* (1|4|16|64|256) +(16|None) ";;
    # OLMoE's rows (I 1024: 11 gate_up tiles, so b256/M16's 176 WS items take a short second round)
    layero) layer_rows o olmoe-1b-7b "^olmoe.* (1|16|64|256) +(16|32|None) ";;
    # Qwen3 with WS's GEMMs one CTA per item (notes/ws_pair.patch's BASE_MOE_WS_PAIR=0), budgets 16 and 32
    layerqnp) BASE_MOE_WS_PAIR=0 layer_rows q_nopair qwen3-30b-a3b "^qwen3.* (64|256) +(16|32) ";;
    bsel) timeout 200 python3 benchmarks/bench_select.py --models qwen3-30b-a3b --replays 20 --out $OUT/bench_select.json > $OUT/bench_select.log 2>&1; tail -8 $OUT/bench_select.log;;
    bselhot) timeout 200 python3 benchmarks/bench_select.py --models qwen3-30b-a3b --replays 20 --hidden hot --out $OUT/bench_select_hot.json > $OUT/bench_select_hot.log 2>&1; tail -8 $OUT/bench_select_hot.log;;
    bselwhot) timeout 200 python3 benchmarks/bench_select.py --models qwen3-30b-a3b --replays 20 --weights hot --out $OUT/bench_select_whot.json > $OUT/bench_select_whot.log 2>&1; tail -8 $OUT/bench_select_whot.log;;
    sync) SANITIZE_CONFIGS=$EXPERT_CONFIGS sanitize 200 synccheck synccheck.log 6 python3 benchmarks/sanitize_experts.py;;
    timeline) for pt in ${POINTS:-1:0 16:16 64:16 256:16}; do b=${pt%:*}; m=${pt#*:}; [ "$m" = 0 ] && m=; for op in experts layer; do
           timeout 60 python3 benchmarks/profile_layer.py --timeline --model ${MODEL:-qwen3-30b-a3b} --op $op --batch $b ${m:+--budget $m} --calls 12 2>&1 | grep -v Warning |
             tee -a $OUT/timeline.log; done; done;;
    stamps) # per-CTA phase stamps of the expert GEMMs (needs notes/diag_stamps_main.patch, or one like it, applied)
      for pt in ${POINTS:-64:16 16:16 1:0 256:16}; do b=${pt%:*}; m=${pt#*:}; [ "$m" = 0 ] && m=
        echo "stamps b$b/M${m:-dense}"
        BASE_MOE_DIAG=64 timeout 60 python3 benchmarks/profile_layer.py --op experts --calls 4 --batch $b ${m:+--budget $m} 2>&1 | grep -E "^(gate_up|down)" | tail -2
      done;;
    bselall) timeout 200 python3 benchmarks/bench_select.py --replays 30 --out $OUT/bench_select.json > $OUT/bench_select.log 2>&1; tail -14 $OUT/bench_select.log;;
    # both models at the token counts in $TOKENS (default: T = 16-64)
    bselt) timeout 200 python3 benchmarks/bench_select.py --replays 30 --tokens ${TOKENS:-16,24,32,40,48,64} --out $OUT/bench_select_t.json > $OUT/bench_select_t.log 2>&1; grep -E "^\| " $OUT/bench_select_t.log;;
    ptx80) # the fallbacks of a build without sm_90 code, run on the H200 through the driver's JIT (last step: it replaces the build)
      TORCH_CUDA_ARCH_LIST="8.0+PTX" MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build80.log 2>&1 || { tail -30 $OUT/build80.log; exit 1; }
      # the next call's build must replace this one, whatever csrc's sums say
      rm -f build/.csrc_file_sums; echo "build80 $((SECONDS-s)) s"
      timeout 280 python3 -m pytest -m cuda tests/test_experts_cuda.py tests/test_select_cuda.py -q -rs > $OUT/pytest80.log 2>&1
      grep -E "^(FAILED|ERROR|SKIPPED)" $OUT/pytest80.log | cut -c1-200 | head -30; tail -2 $OUT/pytest80.log;;
    splits) for n in ${SPLITS:-1 auto}; do
           if [ $n = auto ]; then unset BASE_MOE_EXPERTS_SPLITS; else export BASE_MOE_EXPERTS_SPLITS=$n; fi
           timeout 200 python3 benchmarks/bench_layer.py --variants-only --variant-points all --variants ${VARIANTS:-default,W64,W128} --out $OUT/splits_$n.json > $OUT/splits_$n.log 2>&1; echo "splits=$n"; grep -E "T= *(64|256)" $OUT/splits_$n.log | tail -12
         done; unset BASE_MOE_EXPERTS_SPLITS;;
    tsel) timeout 200 python3 -m pytest -m cuda tests/test_select_cuda.py -q -x > $OUT/pytest_select.log 2>&1; tail -5 $OUT/pytest_select.log;;
    stream) # benchmarks/micro/stream_rate.cu: pure weight streams of the expert GEMMs' shapes (no torch needed)
      /usr/local/cuda/bin/nvcc -O3 -std=c++20 -arch=sm_90a -Icsrc/include benchmarks/micro/stream_rate.cu \
        -o /tmp/stream_rate && timeout 120 /tmp/stream_rate > $OUT/stream.log 2>&1; cat $OUT/stream.log;;
    wsn) timeout 300 python3 notes/ws_window.py --columns > $OUT/ws_n.log 2>&1; cat $OUT/ws_n.log;;
    micro) /usr/local/cuda/bin/nvcc -O3 -std=c++20 -arch=sm_90a -Icsrc/include benchmarks/micro/route_token.cu -o /tmp/route_token && /tmp/route_token > $OUT/micro.log 2>&1; cat $OUT/micro.log;;
    # the HF and bench_e2e tests, CPU ones included, against this machine's transformers (the patched decoder layers
    # re-implement its forwards; CI's CPU run has another version)
    thf) timeout 300 python3 -m pytest tests/test_hf.py tests/test_bench_e2e.py -q -x -p no:cacheprovider > $OUT/pytest_hf.log 2>&1; tail -3 $OUT/pytest_hf.log;;
    tnorm) timeout 200 python3 -m pytest -m cuda tests/test_norm_cuda.py -q -x > $OUT/pytest_norm.log 2>&1; tail -5 $OUT/pytest_norm.log;;
    normsan) for tool in memcheck racecheck; do sanitize 150 $tool norm_$tool.log 2 python3 tests/test_norm_cuda.py sanitize; done;;
    # memcheck on every shape (the 16-warp and multi-chunk ones too), racecheck on the small set (slow on the others)
    # (selmem / selrace: each half alone, to split selsan over two calls of a fresh machine)
    selsan|selmem|selrace)
      [ $step = selrace ] || sanitize 200 memcheck selmem.log 3 python3 tests/test_select_cuda.py sanitize
      [ $step = selmem ] || sanitize 300 racecheck selrace.log 3 python3 tests/test_select_cuda.py sanitize small;;
    # the selection tests with clusters and PDL off (BASE_MOE_CLUSTERS=0): the one-CTA paths of sm_80 builds, on the H200
    tselnc) BASE_MOE_CLUSTERS=0 timeout 200 python3 -m pytest -m cuda tests/test_select_cuda.py -q -x -p no:cacheprovider > $OUT/pytest_select_nc.log 2>&1; tail -3 $OUT/pytest_select_nc.log;;
    # racecheck's per-hazard report (which blocks and threads) on the small sanitizer run
    selraceh) timeout 200 compute-sanitizer --tool racecheck --racecheck-report hazard python3 tests/test_select_cuda.py sanitize small > $OUT/selraceh.log 2>&1; grep -v '^=========     #' $OUT/selraceh.log | head -40; tail -2 $OUT/selraceh.log;;
    e2e) timeout 200 python3 benchmarks/bench_e2e.py --repeats 2 --json $OUT/bench_e2e.json > $OUT/e2e.log 2>&1; tail -25 $OUT/e2e.log;;
    # BASE M=16 with base_moe's residual add + norm against the model's own (norm='model'), batch 16 and 64; the
    # recompile count says whether dynamo compiled the non-MoE function again for the second variant (it must)
    e2enorm) TORCH_LOGS=recompiles timeout 200 python3 benchmarks/bench_e2e.py --batches ${E2E_BATCHES:-16,64} --variants base_M16_model_norm --budgets 16 --repeats 2 --json $OUT/bench_e2e_norm.json > $OUT/e2enorm.log 2>&1; echo "recompile lines: $(grep -ci recompil $OUT/e2enorm.log)"; grep -v -i "warn\|recompil" $OUT/e2enorm.log | tail -7;;
    e2eeager) timeout 300 python3 benchmarks/bench_e2e.py --non-moe eager --batches 16 --variants base_M16_model_norm --budgets 16 --repeats 2 --json $OUT/bench_e2e_norm_eager.json > $OUT/e2eeager.log 2>&1; tail -5 $OUT/e2eeager.log;;
    # README's main job on the GPU (the testbed through HF's forward with base_moe's CUDA ops; quality table)
    quick) timeout 400 python3 examples/quickstart.py --device cuda --json $OUT/quickstart_cuda.json > $OUT/quickstart_cuda.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/quickstart_cuda.log | tail -24;;
    # WS's GEMMs as CTA pairs (notes/ws_pair.patch): ncu's launch statistics of the WS kernels at b256/M16 (cluster
    # size 2 where paired: both Qwen3 GEMMs), then the same with BASE_MOE_WS_PAIR=0
    wspair) for pair in 1 0; do BASE_MOE_WS_PAIR=$pair timeout 90 ncu --section LaunchStats -k regex:ws_gemm_kernel --launch-count 2 python3 benchmarks/profile_layer.py --batch 256 --budget 16 --calls 1 > $OUT/wspair_$pair.txt 2>&1; echo "BASE_MOE_WS_PAIR=$pair"; grep -i -E "ws_gemm_kernel|cluster|grid size" $OUT/wspair_$pair.txt | sed 's/  */ /g' | cut -c1-120; done;;
    # the WS GEMMs at b256/M16: is down's stream (3.3 TB/s in the op against gate_up's 4.0, session 37) slow on its
    # own, and is it HBM- or pipeline-bound (DRAM share, L2 hits, bytes)?
    ncuws) ws_ncu ws dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,lts__t_bytes.sum,smsp__issue_active.avg.pct_of_peak_sustained_active "dram__|lts__|issue";;
    # their tensor pipe and stall shares (is either GEMM's wgmma pipe busy at b256/M16? session 39)
    ncuwst) ws_ncu wst sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_membar_per_warp_active.pct "tensor|stalled";;
    # the two selection kernels' phases at T > 64 (needs notes/diag_select_stamps.patch; eager calls, the last of 4):
    # router_predict's CTAs (entry, PDL wait, k loop, first cluster barrier, exit) and route_select's (entry, wait,
    # routed, barrier, D copied, D summed, exchanged, cost gathered, ranked, filled, exit; thread 0's first token
    # scored and picked), min/median/max us
    selstamps) for b in ${SELB:-256 128}; do echo "selstamps T$b"
        BASE_MOE_DIAG=256 timeout 60 python3 benchmarks/profile_layer.py --op select --calls 4 --batch $b --budget 16 2>&1 | grep -E "^sel " | tail -2
        # the kernels' start / end in graph replay (no stamps read: BASE_MOE_DIAG unset, as a sync cannot be captured)
        timeout 60 python3 benchmarks/profile_layer.py --op select --timeline --calls 8 --batch $b --budget 16 2>&1 | tail -4
      done;;
    # the WS plan kernel alone under ncu at b256/M16 and M32 (duration, L2 bytes, issue activity; and its SASS hot spots)
    ncuplan) for m in 16 32; do timeout 60 ncu --metrics gpu__time_duration.sum,lts__t_bytes.sum,smsp__issue_active.avg.pct_of_peak_sustained_active -k regex:ws_plan --launch-skip 1 --launch-count 1 python3 benchmarks/profile_layer.py --batch 256 --budget $m --calls 3 > $OUT/ncu_plan_m$m.txt 2>&1; echo "M$m"; grep -E "duration|lts__t|issue" $OUT/ncu_plan_m$m.txt; done;;
    # WS per-CTA stamps (needs notes/diag_ws_stamps.patch): plan entry / exit and, per GEMM, items per CTA, the CTAs'
    # stream time (first stage landed -> last k loop done) and entry / init / pdl / first stage landed / first and last
    # k loop done / last epilogue / exit, min/p10/median/p90/max us from the plan's first entry (eager calls, the last
    # of 4 reported; WSDIAG=192 adds the patch's bit 128: no epilogue stores, a timing diagnostic only)
    wsstamps) for pt in ${POINTS:-256:16 256:32}; do b=${pt%:*}; m=${pt#*:}
        echo "wsstamps b$b/M$m"
        BASE_MOE_DIAG=${WSDIAG:-64} timeout 60 python3 benchmarks/profile_layer.py --op experts --calls 4 --batch $b --budget $m 2>&1 | grep -E "^ws " | tail -5
      done;;
    *) echo "unknown step $step";;
  esac
  echo "== $step $((SECONDS-s)) s"
done
