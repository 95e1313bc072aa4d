#!/bin/bash
# session 72, call 1 (an H200 only: exits at once on any other GPU, before the build): README's H200 e2e rows at the
# head, then WS's per-CTA phase stamps at b256/M16 (and b64/M16, b256/M32 beside it) with
# notes/diag_ws_stamps_on_main.patch applied and reverted afterwards (a diagnostic build; nothing timed with it kept)
nvidia-smi -L | grep -q H200 || { nvidia-smi -L; echo "not an H200: nothing run"; exit 0; }
bash notes/device_trial.sh e2e | grep -v "^[0-9.]*+"
git apply notes/diag_ws_stamps_on_main.patch || exit 1
POINTS="256:16 64:16 256:32" bash notes/device_trial.sh wsstamps | grep -v "^[0-9.]*+"
git apply -R notes/diag_ws_stamps_on_main.patch
