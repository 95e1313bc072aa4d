set -x
bash notes/device_trial.sh bsel bselhot tsel 2>&1 | grep -v "^+"
git apply notes/select_phases_replicated.patch && bash notes/device_trial.sh phases > /dev/null 2>&1; git apply -R notes/select_phases_replicated.patch
grep PHASES $OUT/phases.log | grep -v "rank=15" | awk 'NR%3==0' 
bash notes/device_trial.sh selsan 2>&1 | tail -8
export PYTHONPATH=$PWD; timeout 200 python3 benchmarks/bench_layer.py --models qwen3-30b-a3b --no-hf --no-variants --out $OUT/bench_layer_q.json > $OUT/bench_layer_q.log 2>&1; tail -30 $OUT/bench_layer_q.log
