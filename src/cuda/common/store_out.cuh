// One fp32 value stored as an output element: bf16 / fp16 round to nearest even, fp32 as is.
// (The output dtypes of the GEMMs, the finalize and the expert-parallel partial sum.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace qmoe::cuda {

__device__ __forceinline__ void store_out(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_out(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }

// Two adjacent elements p[0], p[1] in one store, each rounded as store_out does; p aligned to the pair.
__device__ __forceinline__ void store_out_pair(__nv_bfloat16* p, float v0, float v1) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
}
__device__ __forceinline__ void store_out_pair(__half* p, float v0, float v1) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(v0, v1);
}
__device__ __forceinline__ void store_out_pair(float* p, float v0, float v1) {
  *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
}

}  // namespace qmoe::cuda
