#!/usr/bin/env bash
# The README's test command: sets up the machine (scripts/setup.sh), runs the test suite, then
# builds the C++ operator library with CMake and runs its smoke test. CUDA tests skip without a GPU.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup.sh"
cd "$REPO"
# tiny models and ops: one intra-op thread is fastest and immune to a busy machine
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" python -m pytest -q tests "$@"
BUILD_DIR="${BASE_MOE_CMAKE_BUILD:-$REPO/build_cmake}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_PREFIX_PATH="$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"  # (ninja's progress lines; compiler errors also go to stdout)
"$BUILD_DIR/base_moe_smoke"
# the installed package, as a C++ user's project finds it (find_package(base_moe), examples/cpp/CMakeLists.txt)
cmake --install "$BUILD_DIR" --prefix "$BUILD_DIR/install" >/dev/null
cmake -S examples/cpp -B "$BUILD_DIR/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$BUILD_DIR/install;$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
cmake --build "$BUILD_DIR/consumer" -j "$(nproc)"
"$BUILD_DIR/consumer/base_moe_smoke"
