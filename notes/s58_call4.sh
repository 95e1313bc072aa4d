# session 58 call 4 (head, routing_helpers merged): the HF and bench_e2e tests against the device's transformers 5.17
# (CI's CPU run has 5.25; last run on 5.17 in session 27), README's main job on the GPU; on an H200 also the selection
# and layer tables (README's H200 tables are sessions 51-52's)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
steps="thf quick"
nvidia-smi -L | grep -q H200 && steps="$steps bselall layerq layero"
bash notes/device_trial.sh $steps | grep -v "^[0-9.]*+\|^GPU"
