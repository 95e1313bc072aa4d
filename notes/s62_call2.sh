# session 62, call 2 (branch wip/wsc, warm after call 1): racecheck on WSC after the scratch change; memcheck and
# racecheck with the global hand-off; WS's sanitizers (claim_slot)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BASE_MOE_COMMIT=${BASE_MOE_COMMIT:-$(cat .trial_sha)}
SAN=WSC bash notes/device_trial.sh race | grep -v "^[0-9.]*+\|^GPU"
BASE_MOE_WSC_HANDOFF=global SAN=WSC bash notes/device_trial.sh mem race | grep -v "^[0-9.]*+\|^GPU"
SAN=default,WS bash notes/device_trial.sh mem race | grep -v "^[0-9.]*+\|^GPU"
