#!/usr/bin/env bash
# Build everything and run every test: C++ (GoogleTest via CTest) and Python (pytest).
# GPU tests (pytest marker `gpu`) skip themselves without a CUDA GPU; on the GPU machine use
# scripts/gpu_tests.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ctest --test-dir build/py --output-on-failure -j"$(nproc)"
python -m pytest -q tests/python "$@"
