# session 64, call 4 (any sm_90 GPU): the expert tests at the head's sm_90a build (the WS tests now skip only where the
# build lacks sm_90a code: they must all run here), then the TORCH_CUDA_ARCH_LIST="8.0+PTX" build through the JIT (not
# run since session 6), every failure listed
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bash notes/device_trial.sh texp | grep -v "^[0-9.]*+\|^GPU"
python3 -m pytest -m cuda tests/test_experts_cuda.py -q -rs -k "ws" 2>&1 | grep -E "SKIPPED|passed|failed" | tail -5
python3 -c "from tests.test_experts_cuda import build_has_sm90a as b, ws_runs as w; print('sm90a build', b(), 'ws', w())"
bash notes/device_trial.sh ptx80 | grep -v "^[0-9.]*+\|^GPU"
python3 -c "from tests.test_experts_cuda import build_has_sm90a as b, ws_runs as w; print('sm90a build', b(), 'ws', w())"
