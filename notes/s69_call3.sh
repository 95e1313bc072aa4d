# session 69, call 3: flags only on the GENERIC instances (the softmax instances without the flags' code, as before the
# change): the voting tests on CUDA (the new shapes reach every instance and plan), the mask's cost per block, memcheck (the A/B of
# bench_select left out: too little device time left)
set -o pipefail
nvidia-smi -L
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_ops.py tests/test_policies.py -k "voting or opcheck or top1_union" 2>&1 | tee $OUT/t_voting.log | tail -1
python3 -m pytest -q -p no:cacheprovider tests/test_hf.py -k "finished or generate" 2>&1 | tail -1
timeout 60 python3 notes/s68_voting_cost.py 2>&1 | tail -4
timeout 100 compute-sanitizer --tool memcheck python3 tests/test_select_cuda.py sanitize small > $OUT/selmem.log 2>&1; tail -1 $OUT/selmem.log
echo "total $SECONDS s"
