# session 67: README's H200 selection and Qwen3 layer tables at the head (exits at once on any other GPU, before the
# build; the machine's start is spent either way)
nvidia-smi -L | grep -q H200 || { nvidia-smi -L; echo "not an H200: nothing run"; exit 0; }
bash notes/device_trial.sh bselall layerq ${H200_MORE-layero e2e} | grep -v "^[0-9.]*+"
