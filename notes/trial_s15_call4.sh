# session 15 call 4: select_experts at wip/select-replicated: sanitizers (hazard details if any), bench, tests, phases, layer
bash notes/device_trial.sh selsan 2>&1 | tail -6
grep -m3 -B2 -A14 "Race reported\|Error:" $OUT/selrace.log $OUT/selmem.log | head -60
bash notes/device_trial.sh bsel tsel 2>&1 | grep -v "^build\|^GPU\|^2.11"
git apply notes/select_phases_replicated.patch && bash notes/device_trial.sh phases > /dev/null 2>&1; git apply -R notes/select_phases_replicated.patch
grep PHASES $OUT/phases.log | grep -v "rank=15" | awk 'NR%3==0'
export PYTHONPATH=$PWD; timeout 200 python3 benchmarks/bench_layer.py --models qwen3-30b-a3b --no-hf --no-variants --out $OUT/bench_layer_q.json > $OUT/bench_layer_q.log 2>&1; grep -E "^qwen3.* (1|4|16|64) +(16|None) " $OUT/bench_layer_q.log
cd $OUT && gzip -q selrace.log selmem.log pytest_select.log 2>/dev/null; rm -f build.log; ls
