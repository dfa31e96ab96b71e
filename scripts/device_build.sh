#!/usr/bin/env bash
# Build qmoe on the GPU machine (device tool): library, C++ tests when GoogleTest is there, and
# the extension for that machine's python3. The CUTLASS headers travel in .dev/cutlass (carry).
# Afterwards: export PYTHONPATH=$PWD/build/device/pkg
set -euo pipefail
cd "$(dirname "$0")/.."
CUTLASS_DIR=${CUTLASS_DIR:-$PWD/.dev/cutlass}
# The image's default $CXX (/opt/gcc) links libstdc++ statically into shared objects; inside a
# Python process that already holds the system libstdc++ (torch) the extension then crashed in
# std::ostream. Build with the system compiler, the one nvcc uses as its host compiler.
if [[ -x /usr/bin/g++ ]]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
if [[ -f build/device/CMakeCache.txt ]] && ! grep -q "CMAKE_CXX_COMPILER:[A-Z]*=$CXX\$" build/device/CMakeCache.txt; then
  rm -rf build/device
fi
cmake -S . -B build/device -G Ninja -DQMOE_BUILD_PYTHON=ON -DQMOE_BUILD_TESTS=ON \
  -DCUTLASS_DIR="$CUTLASS_DIR" -DCMAKE_CUDA_HOST_COMPILER="$CXX" -DPython_EXECUTABLE="$(command -v python3)" > /tmp/qmoe_configure.log
cmake --build build/device -j"$(nproc)"
rm -rf build/device/pkg && mkdir -p build/device/pkg
cp -r python/qmoe build/device/pkg/
cp build/device/_C*.so build/device/pkg/qmoe/
echo "device build ok: PYTHONPATH=$PWD/build/device/pkg"
