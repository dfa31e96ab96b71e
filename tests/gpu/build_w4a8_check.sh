#!/usr/bin/env bash
# Builds tests/gpu/w4a8_gemm_check.cu with only the sources it needs (core, reference, API, tactics,
# the GEMM kernel), so it does not depend on the rest of the tree compiling. Output: $1 (binary).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-build/w4a8_gemm_check}
mkdir -p "$(dirname "$OUT")"
NVCC_FLAGS="-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo -Iinclude -Isrc"
nvcc $NVCC_FLAGS ${EXTRA_NVCC_FLAGS:-} -o "$OUT" tests/gpu/w4a8_gemm_check.cu \
  src/core/tensor.cpp src/reference/formats.cpp src/reference/w4a8_moe_mm.cpp src/api/grouped_gemm.cpp \
  src/tune/tactics.cpp src/cuda/gemm/sm90_grouped_gemm_w4a8_int4.cu src/cuda/common/cuda_check.cu -lpthread
