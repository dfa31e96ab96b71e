// Device helpers shared by the fused-MoE kernels (moe_gather_quantize.cu, moe_activation_requant.cu):
// the dynamic per-tensor fp8 scale and the NaN-propagating amax reduction.
//
// amax as unsigned bits: for |v| (sign cleared) the IEEE order of non-negative floats is the
// unsigned order of their bits, and every NaN's bits (> 0x7F800000) exceed +inf's, so an unsigned
// max keeps NaN (DESIGN.md 3b: a NaN is never hidden), with no float atomics and no order effects.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace qmoe::cuda::fused {

// Dynamic per-tensor scale, as the reference's dynamic_fp8_scale: amax / 448, 1 when amax == 0,
// NaN stays NaN.
__device__ __forceinline__ float dynamic_fp8_scale(uint32_t amax_bits) {
  const float s = __uint_as_float(amax_bits) / 448.0f;
  return s == 0.0f ? 1.0f : s;
}

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// Every thread of the block must call this (full-warp reduction): one atomic per warp.
__device__ __forceinline__ void block_amax_commit(uint32_t local, uint32_t* amax_bits) {
  const uint32_t warp_max = __reduce_max_sync(0xffffffffu, local);
  if ((threadIdx.x & 31) == 0 && warp_max != 0) atomicMax(amax_bits, warp_max);
}

// Blocks for a grid-stride loop over `items` work items (at least 1).
inline unsigned grid_for(int64_t items, int64_t cap) {
  const int64_t g = items < cap ? items : cap;
  return static_cast<unsigned>(g > 0 ? g : 1);
}

}  // namespace qmoe::cuda::fused
