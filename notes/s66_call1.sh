# session 66, call 1: the HF-facing tests on the device's transformers (group_by='position' now makes one router call
# per block call, 0c48816), then, on an H200 only, README's H200 selection and Qwen3 layer tables at the head (H200_MORE:
# more device_trial steps, e.g. "layero e2e")
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bash notes/device_trial.sh | grep -v "^[0-9.]*+\|^GPU"
python3 -c "import transformers; print('transformers', transformers.__version__)"
s=$SECONDS
timeout 240 python3 -m pytest tests/test_hf.py tests/test_hf_fuzz.py tests/test_evaluate.py tests/test_layouts.py \
  tests/test_bench_e2e.py -q -p no:cacheprovider > $OUT/pytest_hf.log 2>&1
echo "HF tests rc $? ($((SECONDS-s)) s)"; tail -3 $OUT/pytest_hf.log; grep -E "^(FAILED|ERROR)" $OUT/pytest_hf.log | head -20
nvidia-smi -L | grep -q H200 || { echo "not an H200: no H200 tables"; exit 0; }
bash notes/device_trial.sh bselall layerq ${H200_MORE:-} | grep -v "^[0-9.]*+\|^GPU"
