# session 62, call 1 (branch wip/wsc; replaces s61_call3.sh, which never ran): how many clusters of WSC's CTA size
# run at once; the build; WSC (cluster barrier) and WSC-global (global counters, no clusters) against WS first (the
# verdict, should the call be cut short); WSC's tests with both hand-offs; WS's own suite (claim_slot and count_ids
# touched WS's producer and plan kernel, block_exclusive_scan the default kernels')
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BASE_MOE_COMMIT=${BASE_MOE_COMMIT:-$(cat .trial_sha)}
nvcc -O3 -std=c++20 -arch=sm_90a -Icsrc/include benchmarks/micro/cluster_residency.cu -o /tmp/cr && /tmp/cr
bash notes/device_trial.sh | grep -v "^[0-9.]*+\|^GPU"   # the build alone
timeout 150 python3 benchmarks/bench_layer.py --variants-only --variants default,WS,WSC,WSC-global \
  --out $OUT/variants_wsc.json > $OUT/variants_wsc.log 2>&1; echo "variants rc $?"; grep "^variants" $OUT/variants_wsc.log
timeout 150 python3 -m pytest -m cuda tests/test_experts_cuda.py -q -x -k "wsc or WSC" > $OUT/pytest_wsc.log 2>&1
echo "wsc tests rc $?"; tail -3 $OUT/pytest_wsc.log
bash notes/device_trial.sh texp | grep -v "^[0-9.]*+\|^GPU"
