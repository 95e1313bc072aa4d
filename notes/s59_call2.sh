# session 59 call 2: the decode boundary end to end. bench_e2e's BASE rows at batch 1 / 4 / 16 with select_experts'
# one launch (main) and with the two kernels at every T (notes/fused_off_trial.patch: BASE_MOE_NO_FUSED=1), in
# alternating order, two runs each, same machine and build
# Ran at c0adf6f. notes/fused_off_trial.patch and the one-launch kernel were removed after it: git show c0adf6f:notes/fused_off_trial.patch.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
git apply notes/fused_off_trial.patch || exit 1
bash notes/device_trial.sh | grep -v "^GPU"
for i in 1 2; do
  for knob in "" 1; do
    tag=${knob:+two}; tag=${tag:-fused}_$i
    # (an empty BASE_MOE_NO_FUSED would count as set: the patch tests getenv against null)
    env ${knob:+BASE_MOE_NO_FUSED=1} timeout 150 python3 benchmarks/bench_e2e.py --variants "" --budgets 10,16 \
      --batches 1,4,16 --repeats 3 --json $OUT/e2e_$tag.json > $OUT/e2e_$tag.log 2>&1
    echo "== $tag"; grep "^batch" $OUT/e2e_$tag.log
  done
done
