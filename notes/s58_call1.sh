# session 58 call 1: notes/routing_helpers.patch applied (routing.h host/device helpers for the CPU op and the CUDA
# routing): the whole CUDA suite (the selection tests included; test_ops' new CUDA parameters), then the selection
# tests without clusters
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
git apply notes/routing_helpers.patch && bash notes/device_trial.sh tall tselnc | grep -v "^[0-9.]*+\|^GPU"
grep -E "passed|failed|error" $OUT/pytest_all.log | tail -3
