#!/bin/bash
# Session 82: the sanitizers still owed without the caching allocator, split over two calls of one machine so that
# each stays inside the 600 s limit (call 1 builds, ~120 s). `bash notes/s82_call.sh 1`, then `... 2`.
python3 -c "import torch, transformers, torch.cuda as c; print(c.get_device_name(), torch.__version__, transformers.__version__)"
case $1 in
  # selection memcheck on every shape (200 s), expert op memcheck (200 s); then test_select_cuda with
  # notes/generic_routing_no_ngroup.patch (a host predicate without a redundant term: merge it where this passes)
  1) bash notes/device_trial.sh selmem mem
     if git apply notes/generic_routing_no_ngroup.patch; then
       bash notes/device_trial.sh tsel
       git apply -R notes/generic_routing_no_ngroup.patch
     fi;;
  2) bash notes/device_trial.sh selrace race;;  # selection racecheck, small set (300 s); expert op racecheck (240 s)
esac
echo "call wall $SECONDS s"
