#!/usr/bin/env bash
# One call on the GPU machine: record the environment, build the extension with its CUDA kernels, check that
# argument errors raise (CPU and CUDA), run every CUDA test, calibrate and evaluate the testbed on the GPU, and time
# the selection path. Set BASE_MOE_COMMIT to the commit measured (the device copy has no .git).
# Logs go to $OUT (the device tool brings them back). Usage: bash scripts/device_check.sh
set -u
failed=""  # the steps that failed: the exit status says whether any did
note() { [ "$1" -eq 0 ] || failed="$failed $2"; echo "$2 rc=$1"; }
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT="${OUT:-/tmp/base_moe_out}"; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  c++ --version | head -1; echo "commit ${BASE_MOE_COMMIT:-unknown}"; } 2>&1 | tee "$OUT/env.txt"
start=$(date +%s)
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
cat > /tmp/bad_args.py <<'PY'
import torch, base_moe
from base_moe import ops, Routing, Cost
for dev in ("cpu", "cuda"):
    for budget in (0, 4):
        try:
            ops.route_select(torch.randn(8, 16, device=dev), Routing(2), budget=budget, num_groups=3 if budget else 1,
                             cost=Cost.FREQUENCY)
        except RuntimeError as e:
            print(dev, "raised:", str(e).splitlines()[0])
PY
python3 -X faulthandler /tmp/bad_args.py; rc=$?; note $rc bad_args
if [ $rc -ne 0 ]; then
  timeout 120 cuda-gdb -batch -ex run -ex bt --args python3 /tmp/bad_args.py > "$OUT/gdb.txt" 2>&1
  grep -E "^#|signal" "$OUT/gdb.txt" | head -30
fi
timeout 240 python3 -m pytest -m cuda tests -q -p no:cacheprovider -k "not bad_arguments and not bad_inputs and not shape_errors" \
  > "$OUT/pytest_cuda.log" 2>&1; note $? pytest; grep -E "passed|failed|FAILED|Error" "$OUT/pytest_cuda.log" | tail -25
timeout 60 python3 -m pytest -m cuda tests -q -p no:cacheprovider -k "bad_arguments or bad_inputs or shape_errors" \
  > "$OUT/pytest_errors.log" 2>&1; note $? error_tests; tail -3 "$OUT/pytest_errors.log"
timeout 60 python3 -m base_moe calibrate --model testbed --text testbed/calib.txt --bytes --tokens 65536 --device cuda \
  --out "$OUT/testbed_gpu.safetensors" --no-progress > "$OUT/calibrate_gpu.log" 2>&1
note $? calibrate; tail -4 "$OUT/calibrate_gpu.log"
timeout 90 python3 -m base_moe eval --model testbed --text testbed/heldout.txt --bytes --predictors "$OUT/testbed_gpu.safetensors" \
  --batch 16 --batches 4 --budgets 7,10 --device cuda --dtype bfloat16 --json "$OUT/testbed_eval_gpu.json" --no-progress \
  > "$OUT/eval_gpu.log" 2>&1; note $? eval; tail -14 "$OUT/eval_gpu.log"
timeout 60 python3 benchmarks/bench_select.py --models qwen3-30b-a3b --replays 30 --out "$OUT/bench_select.json" \
  > "$OUT/bench_select.log" 2>&1; note $? bench_select; tail -8 "$OUT/bench_select.log"
echo "total: $(( $(date +%s) - start )) s; failed:${failed:- none}"
[ -z "$failed" ]
