# session 70, call 2: the selection benchmark of call 1 in the other order (B = notes/voting_generic.patch first, then
# main), then every CUDA test at main's head (the review's voting shapes, voting_tokens and the last read's mends have
# not run on a GPU together)
set -o pipefail
nvidia-smi -L
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
build() { s=$SECONDS; MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace --force > $OUT/build_$1.log 2>&1 || { tail -30 $OUT/build_$1.log; exit 1; }; echo "build $1 $((SECONDS-s)) s"; }
bsel() { timeout 120 python3 benchmarks/bench_select.py --models qwen3-30b-a3b --replays 20 --out $OUT/bsel_$1.json > $OUT/bsel_$1.log 2>&1; grep -E "^\| " $OUT/bsel_$1.log | tail -6; }
git apply notes/voting_generic.patch || exit 1
build gen
bsel gen2
git apply -R notes/voting_generic.patch
build main
bsel main2
timeout 330 python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee $OUT/t_cuda_all.log | tail -2
echo "total $SECONDS s"
