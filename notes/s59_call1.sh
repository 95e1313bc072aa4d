# session 59 call 1: on an H200 the selection and layer tables at the head (README's H200 tables are sessions 51-52's);
# on any other GPU the whole CUDA suite (test_hf's CUDA-graph capture with fill="substitute" has never run on a GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if nvidia-smi -L | grep -q H200; then
  bash notes/device_trial.sh bselall layerq layero | grep -v "^[0-9.]*+\|^GPU"
else
  bash notes/device_trial.sh tall
fi
