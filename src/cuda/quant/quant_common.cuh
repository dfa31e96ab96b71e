// Shared pieces of the GPU quantizers (src/cuda/quant/*.cu): device guard, launch check, grid
// sizing for grid-stride loops, real-input loads (float32 / bf16 bits), and the one arithmetic
// helper that must copy the host's NaN behaviour to stay bit-identical with the CPU functions.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/device_guard.h"
#include "qmoe/error.h"
#include "qmoe/formats.h"
#include "qmoe/tensor.h"

namespace qmoe::cuda {

// Defined in src/cuda/common/cuda_check.cu (also declared in cuda/launch.h).
void check_cuda(cudaError_t err, const char* what);

namespace quant {

constexpr int kThreads = 256;
// Grid-stride loops cover any size; this cap keeps gridDim.x far below its limit.
constexpr int64_t kMaxBlocks = 65536;

inline unsigned grid_for(int64_t work_items, int threads = kThreads) {
  const int64_t blocks = (work_items + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks, kMaxBlocks)));
}

// Throws (kRuntime) when the launch just made failed (bad configuration, no kernel image, ...).
inline void check_launch(const char* what) { check_cuda(cudaGetLastError(), what); }

template <class T> T* data(const TensorRef& t) { return static_cast<T*>(t.data); }

__device__ __forceinline__ float load_real(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_real(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

// a / b rounded to nearest (IEEE, never contracted), with the NaN that x86 SSE division gives,
// because the sign of that NaN becomes the sign bit of an e4m3 NaN code (0x7F | sign) on the CPU:
// a NaN operand comes back quieted (the dividend first), and an invalid operation (0/0, inf/inf)
// gives the x86 "default NaN" 0xFFC00000 (sign set). CUDA's division would give 0x7FFFFFFF.
__device__ __forceinline__ float div_as_host(float a, float b) {
  if (isnan(a)) return bits_float(float_bits(a) | 0x00400000u);
  if (isnan(b)) return bits_float(float_bits(b) | 0x00400000u);
  const float r = __fdiv_rn(a, b);
  return isnan(r) ? bits_float(0xffc00000u) : r;
}

// |v| as ordered bits with every NaN mapped to one code above +inf: the maximum of these over a
// block is the CPU's amax (fmax over non-NaN |v|) or, when any NaN is present, kNanBits. max is
// order-independent, so any reduction tree (or atomicMax order) gives the same bits.
constexpr uint32_t kNanBits = 0x7fc00000u;
__device__ __forceinline__ uint32_t abs_bits(float v) {
  const uint32_t a = float_bits(v) & 0x7fffffffu;
  return a > 0x7f800000u ? kNanBits : a;
}

// Maximum over the block of `value`; every thread of the block must call it. Result valid in all.
__device__ __forceinline__ uint32_t block_max(uint32_t value) {
  __shared__ uint32_t warp_max[kThreads / 32];
  value = __reduce_max_sync(0xffffffffu, value);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // NOTE: a previous call's readers must be done before warp_max is rewritten
  if (lane == 0) warp_max[warp] = value;
  __syncthreads();
  uint32_t m = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) m = max(m, warp_max[w]);
  return m;
}

}  // namespace quant
}  // namespace qmoe::cuda
