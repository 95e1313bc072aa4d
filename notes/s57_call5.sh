# session 57 call 5: the decode boundary in the layer table: select_experts' one-launch kernel (main) against the two
# kernels at every T (notes/select_two_kernels_trial.patch), BASE layer consecutively and behind each norm
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bash notes/compare_variants.sh -s layerq main= two=notes/select_two_kernels_trial.patch
