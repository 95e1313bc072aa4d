# session 64: on an H200, README's H200 selection, layer and end-to-end tables at the head (the two selection kernels
# at every T); on an H100 the steps in $H100_STEPS (call 2: e2e, as README's H100 e2e row, session 58's, ran the
# removed one-launch kernel at batch <= 16; call 3: tall thf, the CUDA suite and the HF tests at the head; none: no
# build); $H200_STEPS replaces the H200 steps
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if nvidia-smi -L | grep -q H200; then
  bash notes/device_trial.sh ${H200_STEPS:-bselall layerq layero e2e} | grep -v "^[0-9.]*+\|^GPU"
else
  nvidia-smi -L; echo "not an H200: ${H100_STEPS:-e2e}"
  [ "$H100_STEPS" = none ] || bash notes/device_trial.sh ${H100_STEPS:-e2e} | grep -v "^[0-9.]*+\|^GPU"
fi
