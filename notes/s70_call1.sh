# session 70, call 1: main's head: the review's voting shapes on CUDA (session 69 never ran them) and the selection
# benchmark; then notes/voting_generic.patch (flags only in the GENERIC instances): its voting tests, the mask's cost
# per block, memcheck and the same benchmark (A = main, B = gen; call 2 repeats in the other order)
set -o pipefail
nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
build() { s=$SECONDS; MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace --force > $OUT/build_$1.log 2>&1 || { tail -30 $OUT/build_$1.log; exit 1; }; echo "build $1 $((SECONDS-s)) s"; }
bsel() { timeout 120 python3 benchmarks/bench_select.py --models qwen3-30b-a3b --replays 20 --out $OUT/bsel_$1.json > $OUT/bsel_$1.log 2>&1; grep -E "^\| " $OUT/bsel_$1.log | tail -6; }
build main
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_ops.py -k voting 2>&1 | tee $OUT/t_voting_main.log | tail -2
bsel main1
git apply notes/voting_generic.patch || exit 1
build gen
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_ops.py tests/test_policies.py -k "voting or opcheck or top1_union" 2>&1 | tee $OUT/t_voting_gen.log | tail -2
bsel gen1
timeout 60 python3 notes/s68_voting_cost.py 2>&1 | tail -4
timeout 100 compute-sanitizer --tool memcheck python3 tests/test_select_cuda.py sanitize small > $OUT/selmem_gen.log 2>&1; tail -1 $OUT/selmem_gen.log
git apply -R notes/voting_generic.patch
echo "total $SECONDS s"
