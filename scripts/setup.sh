#!/usr/bin/env bash
# Sets up a fresh machine for base_moe: a virtual environment in .venv with torch and the
# dependencies, then an editable build of the package (CUDA kernels too where a CUDA toolkit exists).
# Usage: bash scripts/setup.sh, then `source .venv/bin/activate`. (scripts/test.sh and quickstart.sh source it; an
# interactive shell should not: it sets -euo pipefail and changes directory.)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
python -m pip install -q "torch==2.14.1" ninja pybind11 numpy safetensors tqdm "transformers>=5,<6" \
  matplotlib pytest hypothesis
# torch otherwise guesses the CUDA root from the nvcc on PATH: where that is a wrapper (e.g. /usr/local/bin/nvcc)
# it guesses /usr/local, and the link fails on -lcudart
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
python -m pip install -q --no-build-isolation -e .
python -c "import base_moe, torch; print('base_moe', base_moe.__version__, 'torch', torch.__version__, \
  '| CUDA kernels built:', torch._C._dispatch_has_kernel_for_dispatch_key('base_moe::experts', 'CUDA'), \
  '| usable here:', base_moe.cuda_available())"
