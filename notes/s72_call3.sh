#!/bin/bash
# session 72, call 3: on an H200 README's e2e rows at the head first (skipped on any other GPU), then
# notes/s72_oa.sh (the offset_addresses A/B and the expert suite with it) on whatever GPU came
if nvidia-smi -L | grep -q H200; then bash notes/device_trial.sh e2e | grep -v "^[0-9.]*+"; else nvidia-smi -L; fi
bash notes/s72_oa.sh
