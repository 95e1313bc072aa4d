# session 60: on an H200 only (any other GPU exits at once, before the build), README's H200 selection and layer
# tables at the head, where select_experts is the two kernels at every T (session 59's layer and e2e rows
# at batches of up to 16 ran the removed one-launch kernel)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | grep -q H200 || { nvidia-smi -L; echo "not an H200: nothing run"; exit 3; }
bash notes/device_trial.sh bselall layerq layero | grep -v "^[0-9.]*+\|^GPU"
