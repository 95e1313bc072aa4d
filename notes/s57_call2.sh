# session 57 call 2 (warm, right after call 1): the expert racechecks session 56 left (99 KiB cap with T16..W128; WS)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
BASE_MOE_EXPERTS_SMEM_KIB=99 SAN=T16,T32,W64,W128 bash notes/device_trial.sh race | grep -v "^build\|^[0-9.]*+\|^GPU"
cp $OUT/racecheck.log $OUT/racecheck_99k.log
SAN=WS bash notes/device_trial.sh race | grep -v "^build\|^[0-9.]*+\|^GPU"
