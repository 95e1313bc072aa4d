#!/bin/bash
# session 76, call 4: the test fixed after call 3, then an A/B/A of the selection on one machine: this branch's csrc,
# main's (207061f, copied under notes/s76_main_csrc), this branch's again; both models, bench_select.py --replays 30
python3 -c "import torch; print(torch.cuda.get_device_name(), torch.__version__)"
bash notes/device_trial.sh | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 60 python3 -m pytest -m cuda tests/test_select_cuda.py -q -p no:cacheprovider -k checks_before_launching 2>&1 | tail -1
bench() {
  timeout 100 python3 benchmarks/bench_select.py --replays 30 --out $OUT/bsel_$1.json > $OUT/bsel_$1.log 2>&1
  echo "== $1"; grep -E "^\| (qwen3|deepseek)" $OUT/bsel_$1.log | cut -d'|' -f2-7
}
bench branch1
mkdir -p /tmp/branch_csrc && cp -r csrc/. /tmp/branch_csrc/
cp -r notes/s76_main_csrc/. csrc/
bash notes/device_trial.sh | tail -1
bench main
cp -r /tmp/branch_csrc/. csrc/
bash notes/device_trial.sh | tail -1
bench branch2
echo "call wall $SECONDS s"
