#!/usr/bin/env bash
# Build and run the main job: `qmoe bench` (GPU benchmark; without a GPU, the CPU reference on a
# small real-model-shaped problem). Extra arguments go to `qmoe bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
qmoe bench "$@"
