# session 68, call 1: build; the finished_tokens tests (CPU and CUDA cases) on the device's transformers; the CUDA
# cases of test_policies / test_hf; what finished_tokens costs a block; on an H200 also README's H200 rows
set -o pipefail
nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
s=$SECONDS
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "build $((SECONDS-s)) s"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider tests/test_hf.py -k "finished or generate" 2>&1 | tee $OUT/t_finished.log | tail -4
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_policies.py tests/test_hf.py 2>&1 | tee $OUT/t_cuda.log | tail -4
timeout 200 python3 notes/s68_voting_cost.py 2>&1 | tee $OUT/voting_cost.log | tail -6
nvidia-smi -L | grep -q H200 && H200_MORE="${H200_MORE-layero e2e}" bash notes/device_trial.sh bselall layerq $H200_MORE | grep -v "^[0-9.]*+"
echo "total $SECONDS s"
