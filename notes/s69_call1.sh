# session 69, call 1: build; the voting flags of the selection ops (wip/voting-ops) against the reference and the
# "voting tokens alone" property on CUDA; the policies' and the HF integration's CUDA tests; the selection sanitizers;
# what finished_tokens costs a block now (one select_experts call with voting flags)
set -o pipefail
nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
s=$SECONDS
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "build $((SECONDS-s)) s"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_ops.py tests/test_select_cuda.py 2>&1 | tee $OUT/t_ops.log | tail -4
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_policies.py tests/test_hf.py 2>&1 | tee $OUT/t_pol_hf.log | tail -4
python3 -m pytest -q -p no:cacheprovider tests/test_hf.py -k "finished or generate" 2>&1 | tee $OUT/t_finished.log | tail -3
timeout 100 compute-sanitizer --tool memcheck python3 tests/test_select_cuda.py sanitize small > $OUT/selmem.log 2>&1; tail -2 $OUT/selmem.log
timeout 200 compute-sanitizer --tool racecheck python3 tests/test_select_cuda.py sanitize small > $OUT/selrace.log 2>&1; tail -2 $OUT/selrace.log
timeout 120 python3 notes/s68_voting_cost.py 2>&1 | tee $OUT/voting_cost.log | tail -5
echo "total $SECONDS s"
