#!/usr/bin/env bash
# Create .venv (if missing), install the pinned Python dependencies (incl. the CUTLASS headers wheel)
# and build + install qmoe into it. Incremental: the CMake build tree lives in build/py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -r requirements.txt
# CMAKE_BUILD_PARALLEL_LEVEL: all cores (CUDA files compile slowly).
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
python -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/py .
