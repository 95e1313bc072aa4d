# session 61 (needs notes/wsc.patch applied, or branch wip/wsc): how many clusters of WSC's CTA size run at once;
# WSC's tests with both hand-offs; its racecheck after the scratch change; WSC (cluster barrier) and WSC-global
# (global counters, no clusters) against WS. Never ran (no machine).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BASE_MOE_COMMIT=${BASE_MOE_COMMIT:-$(cat .trial_sha)}
nvcc -O3 -std=c++20 -arch=sm_90a -Icsrc/include benchmarks/micro/cluster_residency.cu -o /tmp/cr && /tmp/cr
bash notes/device_trial.sh | grep -v "^[0-9.]*+\|^GPU"   # the build alone
timeout 150 python3 -m pytest -m cuda tests/test_experts_cuda.py -q -x -k "wsc or WSC" > $OUT/pytest_wsc.log 2>&1
echo "wsc tests rc $?"; tail -3 $OUT/pytest_wsc.log
timeout 150 python3 benchmarks/bench_layer.py --variants-only --variants default,WS,WSC,WSC-global \
  --out $OUT/variants_wsc.json > $OUT/variants_wsc.log 2>&1; echo "variants rc $?"; grep "^variants" $OUT/variants_wsc.log
SAN=WSC bash notes/device_trial.sh race | grep -v "^[0-9.]*+\|^GPU"
BASE_MOE_WSC_HANDOFF=global SAN=WSC bash notes/device_trial.sh mem race | grep -v "^[0-9.]*+\|^GPU"
