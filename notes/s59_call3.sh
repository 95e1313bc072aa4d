# session 59 call 3: select_experts as router_predict + route_select at every T (the one-launch kernel removed).
# Device budget left ~290 s: the tests that reach the changed dispatch first, then what time allows.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bash notes/device_trial.sh | grep -v "^GPU"
t() {  # TAG SECONDS PYTEST-ARGS...
  local tag=$1 secs=$2; shift 2
  timeout $secs python3 -m pytest -m cuda -q -p no:cacheprovider "$@" > $OUT/pytest_$tag.log 2>&1
  echo "== $tag: $(tail -1 $OUT/pytest_$tag.log)"
}
t sel 70 tests/test_select_cuda.py -k "select_experts or graph_replay or opcheck"
t ops 40 tests/test_ops.py -k "select_experts"
t hfgraph 60 tests/test_hf.py -k "graph"
