# session 56 call 1: the eight prepared patches stacked, one build; the whole CUDA suite (no -x), the cluster-less
# selection suite, the selection memcheck, expert memcheck at a 99 KiB cap (racechecks: call 2)
P="route_warps8 inbox_push_one_template experts_small_smem ws_capture_first cuda_host_checks zero_weight_cost drop_renorm_subnormal sigmoid_double"
for p in $P; do git apply notes/$p.patch || { echo "apply $p failed"; exit 1; }; done
export BASE_MOE_COMMIT="$(cat .trial_sha) + $P"
bash notes/device_trial.sh  # the build alone
s=$SECONDS; timeout 240 python3 -m pytest -m cuda tests -v -p no:cacheprovider > $OUT/pytest_all.log 2>&1; echo "tall rc $? $((SECONDS-s)) s"
grep -E "FAILED|ERROR" $OUT/pytest_all.log | head -20; grep -c PASSED $OUT/pytest_all.log; tail -3 $OUT/pytest_all.log
s=$SECONDS; bash notes/device_trial.sh tselnc | grep -v "^build\|^[0-9.]*+\|^GPU"; echo "tselnc $((SECONDS-s)) s"
s=$SECONDS; timeout 150 compute-sanitizer --tool memcheck python3 tests/test_select_cuda.py sanitize small > $OUT/selmem.log 2>&1; tail -3 $OUT/selmem.log; echo "selmem $((SECONDS-s)) s"
BASE_MOE_EXPERTS_SMEM_KIB=99 SAN=T16,T32,W64,W128 bash notes/device_trial.sh mem | grep -v "^build\|^[0-9.]*+\|^GPU"
