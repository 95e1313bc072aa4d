# session 61, call 1: the CUDA suite and the selection sanitizers at the head (set_cost's one-line mend), then on an
# H200 only README's H200 selection, layer and end-to-end tables at the head (the two kernels at every T)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bash notes/device_trial.sh tall selsan | grep -v "^[0-9.]*+\|^GPU"
nvidia-smi -L | grep -q H200 || { nvidia-smi -L; echo "not an H200: no H200 tables"; exit 0; }
bash notes/device_trial.sh bselall layerq layero e2e | grep -v "^[0-9.]*+\|^GPU"
