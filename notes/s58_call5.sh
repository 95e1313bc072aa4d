# session 58 call 5: on an H200 only (any other GPU exits at once, before the build), the selection and layer tables
# at the head for README's H200 tables (sessions 51-52's; rp_bias_early and routing_helpers since)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | grep -q H200 || { nvidia-smi -L; echo "not an H200: nothing run"; exit 3; }
bash notes/device_trial.sh bselall layerq layero | grep -v "^[0-9.]*+\|^GPU"
