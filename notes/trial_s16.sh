# Session 16's first device calls, prepared in session 15 (notes/STATUS.md, next steps 1-3). Locally first:
# `git rev-parse HEAD > .trial_sha`. Call A (~350 s): the microbenchmarks, then the selection bisect of the BASE-layer
# regression. Call B (~300 s): select_experts' stall reasons after a selection and after the expert kernels, on main
# and on the wip, at batch 1 and 16.
#   bash notes/trial_s16.sh A     bash notes/trial_s16.sh B
case $1 in
  A) bash notes/device_trial.sh micro stream 2>&1 | grep -v "^GPU\|^2.11"
     bash notes/compare_variants.sh -s "bsel layerq" main= bias=notes/select_bisect_bias.patch \
       push=notes/select_bisect_push.patch all=notes/select_replicated_s15.patch;;
  B) for b in 1 16; do
       echo "## batch $b"
       B=$b bash notes/compare_variants.sh -s ncuicache main= all=notes/select_replicated_s15.patch
     done;;
  *) echo "usage: bash notes/trial_s16.sh A|B";;
esac
