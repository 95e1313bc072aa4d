# session 56 call 2 (after call 1's patches merged): the selection table for README (bench_select, both models, new
# behind-a-norm columns), then the expert racechecks call 1 leaves (99 KiB cap with T16..W128; WS)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bash notes/device_trial.sh bselall | grep -v "^[0-9.]*+\|^GPU"
BASE_MOE_EXPERTS_SMEM_KIB=99 SAN=T16,T32,W64,W128 bash notes/device_trial.sh race | grep -v "^build\|^[0-9.]*+\|^GPU"
SAN=WS bash notes/device_trial.sh race | grep -v "^build\|^[0-9.]*+\|^GPU"
timeout 300 compute-sanitizer --tool racecheck python3 tests/test_select_cuda.py sanitize small > $OUT/selrace.log 2>&1; tail -3 $OUT/selrace.log
