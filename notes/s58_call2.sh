# session 58 call 2 (warm H200): routing_helpers.patch again: selection sanitizers, then bselall, layerq and e2e
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
git apply notes/routing_helpers.patch 2>/dev/null || git apply -R --check notes/routing_helpers.patch || exit 1
bash notes/device_trial.sh selsan bselall layerq e2e | grep -v "^[0-9.]*+\|^GPU"
