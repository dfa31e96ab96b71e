// The fused finalize as a grouped-GEMM epilogue (DESIGN.md 5.2, use_fused_finalize = True; the
// reference's "fused" rounding order, src/reference/fused_moe.cpp):
//
//   s = row_slot[r];  out[s / topk, n] += bf16(rsf * topk_weights[s] * v)      (atomic; order not fixed)
//
// v is the GEMM2 value of permuted row r, feature n (already times the row's a_scale), so the rows
// never go through a y buffer and no finalize kernel runs. `out` must be zeroed before the GEMM
// (the pipeline does it, on aux_stream when given). out == nullptr: the GEMM stores into d as usual.
// The mma.sync kernels' params (decode tiles of both grouped GEMMs) carry one RowScatterAdd; the
// launchers leave it empty for plain GEMMs. Pairs of adjacent features only (scatter_add_pair).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace qmoe::cuda {

enum class ScatterOut : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };

struct RowScatterAdd {
  void* out = nullptr;                 // [T, cols] in out_dtype, zeroed; nullptr: no scatter
  ScatterOut out_dtype = ScatterOut::kBFloat16;
  const int32_t* row_slot = nullptr;   // [R] permuted row -> flat slot t * topk + j (input_permutation)
  const float* topk_weights = nullptr; // [T * topk]
  int topk = 1;
  float routed_scaling_factor = 1.f;
  int64_t cols = 0;                    // N of the GEMM = H
};

#ifdef __CUDACC__
// Fire-and-forget global reductions (red.global: no returned value, no generic-address test; a plain
// atomicAdd on the void* out compiles to generic ATOMs plus a shared-memory CAS branch for fp32).
// The adds round as atomicAdd's do (bf16 / f16 RNE of the sum, fp32 RN).
namespace scatter_detail {
__device__ __forceinline__ void red_add(__nv_bfloat162* p, __nv_bfloat162 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.relaxed.gpu.global.add.noftz.bf16x2 [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)),
               "r"(*reinterpret_cast<const uint32_t*>(&v))
               : "memory");
#else
  atomicAdd(p, v);
#endif
}
__device__ __forceinline__ void red_add(__half2* p, __half2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.relaxed.gpu.global.add.noftz.f16x2 [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)),
               "r"(*reinterpret_cast<const uint32_t*>(&v))
               : "memory");
#else
  atomicAdd(p, v);
#endif
}
__device__ __forceinline__ void red_add(float* p, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)), "f"(v) : "memory");
#else
  atomicAdd(p, v);
#endif
}
}  // namespace scatter_detail

// Two adjacent features (col even, cols even, out 4-byte aligned): one 32-bit reduction for 16-bit
// outputs. The term is exact in f16 unless it leaves f16's range (then f16 rounds it, as any sum).
__device__ __forceinline__ void scatter_add_pair(const RowScatterAdd& sc, int64_t row, int64_t col, float v0, float v1) {
  using scatter_detail::red_add;
  const int32_t s = sc.row_slot[row];
  const int64_t token = s / sc.topk;
  const float f = sc.routed_scaling_factor * sc.topk_weights[s];
  const float t0 = __bfloat162float(__float2bfloat16_rn(f * v0));
  const float t1 = __bfloat162float(__float2bfloat16_rn(f * v1));
  const int64_t at = token * sc.cols + col;
  switch (sc.out_dtype) {
    case ScatterOut::kBFloat16:
      red_add(reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(sc.out) + at), __floats2bfloat162_rn(t0, t1));
      break;
    case ScatterOut::kFloat16:
      red_add(reinterpret_cast<__half2*>(static_cast<__half*>(sc.out) + at), __floats2half2_rn(t0, t1));
      break;
    case ScatterOut::kFloat32:
      red_add(static_cast<float*>(sc.out) + at, t0);
      red_add(static_cast<float*>(sc.out) + at + 1, t1);
      break;
  }
}
#endif

}  // namespace qmoe::cuda
