# session 15 call 6: the BASE layer (selection + experts) of the wip tree against main's select_experts.cu and the
# wip without the start barrier, one machine: bench_layer (Qwen3 only, no HF) and bench_select per variant.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for v in wip main nobar; do
  case $v in main) git apply notes/select_main_file.patch;; nobar) git apply notes/no_start_barrier.patch;; esac
  echo "### $v"
  bash notes/device_trial.sh bsel 2>&1 | grep "qwen3\|build"
  timeout 100 python3 benchmarks/bench_layer.py --models qwen3-30b-a3b --no-hf --no-variants --out $OUT/layer_$v.json > $OUT/layer_$v.log 2>&1
  grep -E "^qwen3.* (1|4|16|64|256) +(16|None) " $OUT/layer_$v.log
  case $v in main) git apply -R notes/select_main_file.patch;; nobar) git apply -R notes/no_start_barrier.patch;; esac
done
rm -f $OUT/*.log $OUT/bench_select.json
