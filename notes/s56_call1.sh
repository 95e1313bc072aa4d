# session 56 call 1: the eight prepared patches stacked, one build; the whole CUDA suite (no -x), the cluster-less
# selection suite, the selection sanitizers, expert memcheck at a 99 KiB cap
P="route_warps8 inbox_push_one_template experts_small_smem ws_capture_first cuda_host_checks zero_weight_cost drop_renorm_subnormal sigmoid_double"
for p in $P; do git apply notes/$p.patch || { echo "apply $p failed"; exit 1; }; done
export BASE_MOE_COMMIT="$(cat .trial_sha) + $P"
bash notes/device_trial.sh  # the build alone
s=$SECONDS; timeout 240 python3 -m pytest -m cuda tests -v -p no:cacheprovider > $OUT/pytest_all.log 2>&1; echo "tall rc $? $((SECONDS-s)) s"
grep -E "FAILED|ERROR" $OUT/pytest_all.log | head -20; grep -c PASSED $OUT/pytest_all.log; tail -3 $OUT/pytest_all.log
bash notes/device_trial.sh tselnc selsan | grep -v "^build\|^[0-9.]*+\|^GPU"
BASE_MOE_EXPERTS_SMEM_KIB=99 SAN=T16,T32,W64,W128 bash notes/device_trial.sh mem | grep -v "^[0-9.]*+\|^GPU"
