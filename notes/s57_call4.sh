# session 57 call 4: rp_bias_early (call 3's winner) applied: the selection tests, with and without clusters, and the
# selection sanitizers
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
git apply notes/rp_bias_early.patch && bash notes/device_trial.sh tsel tselnc selsan | grep -v "^[0-9.]*+\|^GPU"
