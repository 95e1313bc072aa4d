#!/usr/bin/env bash
# The README's main command: sets up the machine (scripts/setup.sh) and runs the main job.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup.sh"
cd "$REPO"
python examples/quickstart.py "$@"
