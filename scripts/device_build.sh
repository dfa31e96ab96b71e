#!/usr/bin/env bash
# Build qmoe on the GPU machine (device tool): library, C++ tests when GoogleTest is there, and
# the extension for that machine's python3. The CUTLASS headers travel in .dev/cutlass (carry).
# Afterwards: export PYTHONPATH=$PWD/build/device/pkg
set -euo pipefail
cd "$(dirname "$0")/.."
CUTLASS_DIR=${CUTLASS_DIR:-$PWD/.dev/cutlass}
cmake -S . -B build/device -G Ninja -DQMOE_BUILD_PYTHON=ON -DQMOE_BUILD_TESTS=ON \
  -DCUTLASS_DIR="$CUTLASS_DIR" -DPython_EXECUTABLE="$(command -v python3)" > /tmp/qmoe_configure.log
cmake --build build/device -j"$(nproc)"
rm -rf build/device/pkg && mkdir -p build/device/pkg
cp -r python/qmoe build/device/pkg/
cp build/device/_C*.so build/device/pkg/qmoe/
echo "device build ok: PYTHONPATH=$PWD/build/device/pkg"
