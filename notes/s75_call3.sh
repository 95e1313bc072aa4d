#!/bin/bash
# session 75, call 3 (~180 s of budget left): the build, then the new families' CUDA tests (bf16, base_moe's kernels)
# against this machine's transformers (families it lacks skip)
bash notes/device_trial.sh | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import transformers; print('transformers', transformers.__version__)"
timeout 100 python3 -m pytest -m cuda tests/test_hf_families.py -q -rs -p no:cacheprovider > $OUT/pytest_families.log 2>&1
grep -E "^(FAILED|ERROR)" $OUT/pytest_families.log | cut -c1-220 | head; grep -c SKIPPED $OUT/pytest_families.log
tail -1 $OUT/pytest_families.log; echo "call wall $SECONDS s"
