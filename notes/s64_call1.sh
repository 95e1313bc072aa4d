# session 64, call 1: on an H200, README's H200 selection, layer and end-to-end tables at the head (the two selection
# kernels at every T); on an H100 only the selection table (nothing for README's H200 rows)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if nvidia-smi -L | grep -q H200; then
  bash notes/device_trial.sh bselall layerq layero e2e | grep -v "^[0-9.]*+\|^GPU"
else
  nvidia-smi -L; echo "not an H200: the selection table only"
  bash notes/device_trial.sh bselall | grep -v "^[0-9.]*+\|^GPU"
fi
