# session 62 (main's code, on an H200 only): README's H200 selection and layer tables at the head (the two selection
# kernels at every T; the layer rows at batch <= 16 in README still ran the removed one-launch kernel)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | grep -q H200 || { nvidia-smi -L; echo "not an H200: no H200 tables"; exit 0; }
bash notes/device_trial.sh bselall layerq layero | grep -v "^[0-9.]*+\|^GPU"
