// One fp32 value stored as an output element: bf16 / fp16 round to nearest even, fp32 as is.
// (The output dtypes of the GEMMs, the finalize and the expert-parallel partial sum.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace qmoe::cuda {

__device__ __forceinline__ void store_out(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_out(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }

}  // namespace qmoe::cuda
