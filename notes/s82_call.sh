#!/bin/bash
# Session 82: the sanitizers still owed without the caching allocator, then the waiting patch, in three calls of one
# machine so that each stays inside the 600 s limit at its steps' timeouts: `bash notes/s82_call.sh 1`, then `... 2`,
# then `... 3`. Call 1 builds main (~120 s on a fresh machine), call 2 reuses that build, call 3 rebuilds the files
# that include select_kernels.h with the patch (and the next call's build rebuilds them back).
python3 -c "import torch, transformers, torch.cuda as c; print(c.get_device_name(), torch.__version__, transformers.__version__)"
case $1 in
  1) bash notes/device_trial.sh selmem mem;;  # selection memcheck on every shape (200 s), expert op memcheck (200 s)
  2) bash notes/device_trial.sh selrace race;;  # selection racecheck, small set (300 s); expert op racecheck (240 s)
  # test_select_cuda with notes/generic_routing_no_ngroup.patch (a host predicate without a redundant term: merge it
  # where this passes)
  3) if git apply notes/generic_routing_no_ngroup.patch; then
       bash notes/device_trial.sh tsel
       git apply -R notes/generic_routing_no_ngroup.patch
     fi;;
esac
echo "call wall $SECONDS s"
