# session 70, call 4: route_select's three variants (softmax without flags, softmax with flags, generic), in order of
# need (little device time left): the selection tests on CUDA, the mask's cost per block (call 3's "every instance"
# times expected), both sanitizers, the selection benchmark without flags (calls 1-2's "gen" times expected)
set -o pipefail
exec > >(tee $OUT/summary.txt) 2>&1
nvidia-smi -L
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
s=$SECONDS; MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace --force > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }; echo "build $((SECONDS-s)) s"
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_ops.py tests/test_policies.py -k "voting or opcheck or top1_union" 2>&1 | tail -1
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_select_cuda.py 2>&1 | tail -1
echo "$SECONDS s"; timeout 60 python3 notes/s68_voting_cost.py 2>&1 | tail -3
timeout 80 compute-sanitizer --tool memcheck python3 tests/test_select_cuda.py sanitize small > $OUT/selmem.log 2>&1; tail -1 $OUT/selmem.log
echo "$SECONDS s"; timeout 120 compute-sanitizer --tool racecheck python3 tests/test_select_cuda.py sanitize small > $OUT/selrace.log 2>&1; tail -1 $OUT/selrace.log
echo "$SECONDS s"; timeout 90 python3 benchmarks/bench_select.py --models qwen3-30b-a3b --replays 20 --out $OUT/bsel_variants.json > $OUT/bsel.log 2>&1; grep -E "^\| " $OUT/bsel.log | tail -5
echo "total $SECONDS s"
