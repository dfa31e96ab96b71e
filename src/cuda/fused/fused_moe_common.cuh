// Device helpers shared by the fused-MoE kernels (moe_gather_quantize.cu, moe_gather_dequant.cu,
// moe_activation_requant.cu, moe_finalize.cu): the dynamic per-tensor fp8 scale, the
// NaN-propagating amax reduction, the e4m3 encoder and the rows x column-chunks launch grid.
//
// amax as unsigned bits: for |v| (sign cleared) the IEEE order of non-negative floats is the
// unsigned order of their bits, and every NaN's bits (> 0x7F800000) exceed +inf's, so an unsigned
// max keeps NaN (DESIGN.md 3b: a NaN is never hidden), with no float atomics and no order effects.
//
// Grid of the per-row kernels (decode: few rows, so one CTA per row would leave most SMs idle and
// make each thread walk the whole row): blockIdx.x = a chunk of columns (each thread V consecutive
// columns), blockIdx.y = row, grid-stride over rows past gridDim.y (<= 65535).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "qmoe/formats.h"

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

// Grid for `rows` rows of `cols` columns, `cols_per_block` columns per CTA (see the top comment).
inline dim3 rows_by_chunks(int64_t rows, int64_t cols, int64_t cols_per_block) {
  constexpr int64_t kMaxGridY = 65535;
  const int64_t gx = (cols + cols_per_block - 1) / cols_per_block;
  const int64_t gy = rows < kMaxGridY ? rows : kMaxGridY;
  return dim3(static_cast<unsigned>(gx > 0 ? gx : 1), static_cast<unsigned>(gy > 0 ? gy : 1));
}

// ~16 CTAs per SM of a 132-SM GPU: the per-row kernels' CTAs that run at once.
constexpr int64_t kResidentCtas = 132 * 16;

// Whether one row per CTA would need more CTAs than run at once (prefill): then the per-row kernels take
// several rows per CTA pass and loop (rows_by_chunks_looped); otherwise (decode) one row per CTA, since
// there a CTA's latency is the kernel's and more rows per CTA only lengthen it (H200, s17f: T = 1 layers
// 5-20% slower with 2-4 rows per CTA).
inline bool rows_batched(int64_t rows, int64_t cols, int64_t cols_per_block) {
  const int64_t gx = (cols + cols_per_block - 1) / cols_per_block;
  return rows * (gx > 0 ? gx : 1) > kResidentCtas;
}

// The grid for kernels that take `rows_per_pass` rows per CTA pass (their loads in flight together),
// capped at kResidentCtas so that CTAs loop over rows instead of paying a launch and a prologue per row
// (prefill: 32K rows x 7 column chunks would be 229K CTAs). rows_per_pass 1 below kResidentCtas: rows_by_chunks.
inline dim3 rows_by_chunks_looped(int64_t rows, int64_t cols, int64_t cols_per_block, int64_t rows_per_pass) {
  dim3 g = rows_by_chunks((rows + rows_per_pass - 1) / rows_per_pass, cols, cols_per_block);
  const int64_t cap = kResidentCtas / g.x > 0 ? kResidentCtas / g.x : 1;
  if (g.y > cap) g.y = static_cast<unsigned>(cap);
  return g;
}

inline bool aligned_to(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// ---- e4m3 encoding ------------------------------------------------------------------------------
// Two codes (lo in the low byte) equal to qmoe::float_to_e4m3(lo), float_to_e4m3(hi) for EVERY fp32
// input. kHardwareE4m3: one cvt.rn.satfinite.e4m3x2.f32 (RNE, |x| >= 448 and inf saturate to
// +-448, subnormals exact, as the software codec; formats.h records the agreement over all 2^32
// non-NaN inputs) plus a NaN fix-up, since the hardware gives 0x7F for every NaN while the codec
// keeps the sign (0x7F | sign). tests/gpu/e4m3_cvt_check.cu checks the two over all 2^32 inputs in
// both halves; set kHardwareE4m3 = false to fall back to the software codec.
constexpr bool kHardwareE4m3 = true;

__device__ __forceinline__ uint32_t e4m3_nan_code(uint32_t bits) { return ((bits >> 24) & 0x80u) | 0x7fu; }

__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  if constexpr (kHardwareE4m3) {
    uint32_t c = __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
    const uint32_t ul = __float_as_uint(lo), uh = __float_as_uint(hi);
    if ((ul & 0x7fffffffu) > 0x7f800000u) c = (c & 0xff00u) | e4m3_nan_code(ul);
    if ((uh & 0x7fffffffu) > 0x7f800000u) c = (c & 0x00ffu) | (e4m3_nan_code(uh) << 8);
    return c;
  } else {
    return static_cast<uint32_t>(float_to_e4m3(lo)) | (static_cast<uint32_t>(float_to_e4m3(hi)) << 8);
  }
}

// Four codes in one word (v0 in the low byte).
__device__ __forceinline__ uint32_t e4m3x4(float v0, float v1, float v2, float v3) {
  return e4m3x2(v0, v1) | (e4m3x2(v2, v3) << 16);
}

__device__ __forceinline__ uint8_t e4m3_of(float v) { return static_cast<uint8_t>(e4m3x2(v, 0.0f)); }

}  // namespace qmoe::cuda::fused
