# session 57 call 4 (warm after call 3): the decode boundary. select_experts' one-launch kernel (main) against the two
# kernels at every T (notes/select_two_kernels_trial.patch), in the layer table and behind our norm end to end
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
E2E_BATCHES=1,16,64 bash notes/compare_variants.sh -s "layerq e2enorm" main= two=notes/select_two_kernels_trial.patch
