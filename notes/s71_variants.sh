# notes/voting_variants.patch on a GPU (session 70 prepared it; its budget ran out before a machine came): route_select
# in three variants (softmax without flags, softmax with flags, generic). With the patch: the selection tests on CUDA,
# both sanitizers, the mask's cost per block and the selection benchmark without flags; then without the patch (main)
# the same cost and benchmark, in one run. Expected: without flags the benchmark's route_select alone as
# voting_generic.patch's (session 70 calls 1-2: 3.72 / 4.42 / 4.79 / 5.57 / 7.25 us against main's 3.77 / 4.53 / 4.65 /
# 5.75 / 7.42), and the mask's cost per block as main's (session 70 call 3). From the repo root, after
# `git rev-parse HEAD > .trial_sha`:  bash notes/s71_variants.sh
set -o pipefail
exec > >(tee $OUT/summary.txt) 2>&1
nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
build() { s=$SECONDS; MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace --force > $OUT/build_$1.log 2>&1 || { tail -30 $OUT/build_$1.log; exit 1; }; echo "build $1 $((SECONDS-s)) s"; }
measure() {  # NAME: the mask's cost per block, then the selection benchmark
  echo "$1: mask cost per block (batch | no mask | none finished | half finished)"
  timeout 60 python3 notes/s68_voting_cost.py 2>&1 | tail -3
  BASE_MOE_COMMIT="$(cat .trial_sha) $2" timeout 90 python3 benchmarks/bench_select.py --models qwen3-30b-a3b --replays 20 --out $OUT/bsel_$1.json > $OUT/bsel_$1.log 2>&1
  grep -E "^\| " $OUT/bsel_$1.log | tail -5
}
git apply notes/voting_variants.patch || exit 1
build variants
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_ops.py tests/test_policies.py tests/test_select_cuda.py 2>&1 | tee $OUT/t_sel.log | tail -1
timeout 80 compute-sanitizer --tool memcheck python3 tests/test_select_cuda.py sanitize small > $OUT/selmem.log 2>&1; tail -1 $OUT/selmem.log
timeout 120 compute-sanitizer --tool racecheck python3 tests/test_select_cuda.py sanitize small > $OUT/selrace.log 2>&1; tail -1 $OUT/selrace.log
measure variants "+ notes/voting_variants.patch"
git apply -R notes/voting_variants.patch
build main
measure main ""
echo "total $SECONDS s"
