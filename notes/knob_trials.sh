#!/bin/bash
# One device call for two measurement-only knobs (notes/STATUS.md, session 48's next steps 1 and 1b), from the repo
# root after `git rev-parse HEAD > .trial_sha`:  bash notes/knob_trials.sh
#   BASE_MOE_NO_FUSED=1  (notes/fused_off_trial.patch): select_experts runs the two kernels at every T
#   BASE_MOE_RP_BM=16/32 (notes/router_predict_bm_trial.patch): router_predict's token tile forced at every T
# One build with both patches, then bench_select at each setting and bench_layer with and without the fused kernel;
# outputs under $OUT as bsel_TAG.json / .log and layer_TAG.json / .log. The patches are reverted at the end.
set -u
patches="notes/fused_off_trial.patch notes/router_predict_bm_trial.patch"
git apply $patches || { echo "the patches do not apply"; exit 1; }
trap 'git apply -R $patches' EXIT
bench() {  # TAG VAR=VALUE...: bench_select (TOKENS among the settings) with those settings
  local tag=$1
  shift
  env "$@" bash notes/device_trial.sh bselt | grep -E "^build|^\| (qwen3|deepseek)"
  mv "$OUT/bench_select_t.json" "$OUT/bsel_$tag.json" && mv "$OUT/bench_select_t.log" "$OUT/bsel_$tag.log"
}
layer() {  # TAG VAR=VALUE...: bench_layer with those settings; prints Qwen3's rows at batch 1 / 4 / 16 / 64
  local tag=$1
  shift
  env "$@" bash notes/device_trial.sh layer | grep -E "^qwen3-30b-a3b +(1|4|16|64) "
  mv "$OUT/bench_layer.json" "$OUT/layer_$tag.json" && mv "$OUT/bench_layer.log" "$OUT/layer_$tag.log"
}
echo "## main"; bench main TOKENS=1,4,8,16,32,64,128,256
echo "## two kernels at every T"; bench nofused TOKENS=1,4,8,16 BASE_MOE_NO_FUSED=1
echo "## router_predict BM 16"; bench bm16 TOKENS=32,64,128,256 BASE_MOE_RP_BM=16
echo "## router_predict BM 32"; bench bm32 TOKENS=64,128,256 BASE_MOE_RP_BM=32
echo "## layer main"; layer main
echo "## layer, two kernels at every T"; layer nofused BASE_MOE_NO_FUSED=1
