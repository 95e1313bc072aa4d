#!/bin/bash
# Session 79's changes on a GPU (never run: no device started for it): test_hf with the build-without-kernels CUDA test
# (test_cuda_build_without_kernels_runs_the_references) and the apply changes, then the whole CUDA suite, through
# device_trial.sh's build and steps. `bash notes/s79_call4.sh` (~450 s with the build).
python3 -c "import torch, transformers, torch.cuda as c; print(c.get_device_name(), torch.__version__, transformers.__version__)"
bash notes/device_trial.sh thf tall
echo "call wall $SECONDS s"
