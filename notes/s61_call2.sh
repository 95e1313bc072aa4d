# session 61: WSC (both expert GEMMs in one kernel, a cluster per active expert) on any sm_90 GPU: build, its tests
# (bits against WS), timing against WS at issue 8's points, then its sanitizers; then set_cost's mend (tsel, selsan)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bash notes/device_trial.sh | grep -v "^[0-9.]*+\|^GPU"   # the build alone
timeout 150 python3 -m pytest -m cuda tests/test_experts_cuda.py -q -x -k "wsc or WSC" > $OUT/pytest_wsc.log 2>&1
echo "wsc tests rc $?"; tail -15 $OUT/pytest_wsc.log
timeout 200 python3 benchmarks/bench_layer.py --variants-only --variant-points all --variants default,WS,WSC \
  --out $OUT/variants_wsc.json > $OUT/variants_wsc.log 2>&1; echo "variants rc $?"; tail -40 $OUT/variants_wsc.log
SAN=WSC bash notes/device_trial.sh mem race | grep -v "^[0-9.]*+\|^GPU"
bash notes/device_trial.sh tsel selsan | grep -v "^[0-9.]*+\|^GPU"
