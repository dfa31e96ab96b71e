#!/usr/bin/env bash
# Builds a GPU check program ($2, default tests/gpu/w4a8_gemm_check.cu) against the library of a device build (scripts/device_build.sh
# first: build/device/libqmoe.a). Output: $1 (binary, default build/w4a8_check).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-build/w4a8_check}
SRC=${2:-tests/gpu/w4a8_gemm_check.cu}
LIB=${QMOE_LIB:-build/device/libqmoe.a}
[[ -f "$LIB" ]] || { echo "missing $LIB: run scripts/device_build.sh first" >&2; exit 2; }
mkdir -p "$(dirname "$OUT")"
HOST_CXX=$([[ -x /usr/bin/g++ ]] && echo /usr/bin/g++ || command -v g++)
nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -ccbin "$HOST_CXX" -Iinclude -Isrc ${EXTRA_NVCC_FLAGS:-} \
  -o "$OUT" "$SRC" "$LIB" -lpthread -ldl
