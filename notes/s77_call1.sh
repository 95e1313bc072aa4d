#!/bin/bash
# The GPU call written to merge wip/softmax-bias (session 76: group-limited softmax for DeepSeek-V2, softmax +
# selection bias for ERNIE-4.5, both in route_select's kSoftmaxBiasOrGroups instances). Session 77 got too little
# device time for it and merged after notes/s77_call2.sh's leaner run; this call is what is left to run, at main's head.
# Before it:
#   rm -rf notes/ab_main_csrc && mkdir -p notes/ab_main_csrc &&
#     git archive 1c58867 csrc | tar -x -C notes/ab_main_csrc --strip-components=1
# (the csrc before the merge, untracked: it travels with the tree; delete it after, `duplicates` reads it).
# `bash notes/s77_call1.sh tests` (~330 s): the build, the whole CUDA suite (no -x), the selection sanitizers, the new
# shapes' selection; then, warm, `bash notes/s77_call1.sh ab` (~250 s): an A/B/A of both models' selection (head /
# before / head). The 81 instances from before compile to the same machine code at the head (session 76, compiled
# here), so the rows should agree within noise.
python3 -c "import torch, transformers; print(torch.cuda.get_device_name(), torch.__version__, transformers.__version__)"
bash notes/device_trial.sh | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ "$1" = tests ]; then
timeout 260 python3 -m pytest -m cuda tests -q -p no:cacheprovider > $OUT/pytest_all.log 2>&1
grep -E "^(FAILED|ERROR)" $OUT/pytest_all.log | cut -c1-220 | head -20; tail -1 $OUT/pytest_all.log
bash notes/device_trial.sh selsan | grep -E "SUMMARY|selsan"
# the detection's CPU tests against this machine's transformers 5.17 (the meta-device stand-in, wip/meta-stand-in)
timeout 60 python3 -m pytest tests/test_layouts.py tests/test_hf_families.py -q -p no:cacheprovider -m "not cuda" \
  > $OUT/pytest_layouts.log 2>&1; grep -E "^(FAILED|ERROR)" $OUT/pytest_layouts.log | cut -c1-200 | head; tail -1 $OUT/pytest_layouts.log
timeout 100 python3 benchmarks/bench_select.py --models deepseek-v2-like,ernie-4.5-like --replays 30 \
  --out $OUT/bsel_new_rules.json > $OUT/bsel_new_rules.log 2>&1; grep -E "^\| (deepseek|ernie)" $OUT/bsel_new_rules.log
echo "call wall $SECONDS s"; exit 0
fi
[ -d notes/ab_main_csrc ] || { echo "no notes/ab_main_csrc: no A/B"; exit 0; }
bench() {
  timeout 100 python3 benchmarks/bench_select.py --replays 30 --out $OUT/bsel_$1.json > $OUT/bsel_$1.log 2>&1
  echo "== $1"; grep -E "^\| (qwen3|deepseek)" $OUT/bsel_$1.log | cut -d'|' -f2-7
}
bench branch1
mkdir -p /tmp/branch_csrc && cp -r csrc/. /tmp/branch_csrc/ && rm -rf csrc && mkdir csrc && cp -r notes/ab_main_csrc/. csrc/
bash notes/device_trial.sh | tail -1
bench main
rm -rf csrc && mkdir csrc && cp -r /tmp/branch_csrc/. csrc/
bash notes/device_trial.sh | tail -1
bench branch2
echo "call wall $SECONDS s"
