# session 70, call 3: at the merge of notes/voting_generic.patch: every CUDA test, the selection racecheck, and the
# mask's cost per block with the flags in the GENERIC instances, then (the patch reverted in the tree) without
set -o pipefail
nvidia-smi -L
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
build() { s=$SECONDS; MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace --force > $OUT/build_$1.log 2>&1 || { tail -30 $OUT/build_$1.log; exit 1; }; echo "build $1 $((SECONDS-s)) s"; }
build head
timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee $OUT/t_cuda_all.log | tail -1
timeout 150 compute-sanitizer --tool racecheck python3 tests/test_select_cuda.py sanitize small > $OUT/selrace.log 2>&1; tail -1 $OUT/selrace.log
echo "mask cost, flags in GENERIC only:"; timeout 60 python3 notes/s68_voting_cost.py 2>&1 | tail -3
git apply -R notes/voting_generic.patch || exit 1
build before
echo "mask cost, flags in every instance:"; timeout 60 python3 notes/s68_voting_cost.py 2>&1 | tail -3
git apply notes/voting_generic.patch
echo "total $SECONDS s"
