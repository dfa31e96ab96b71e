// Finalize of the GPU fused MoE: combine each token's expert rows back into token order
// (fused_moe_kernels.h; DESIGN.md 3b). rsf = routed_scaling_factor, row_j = y[output_permutation[t*k + j]]
// (GEMM2's bf16 row, alpha2 and a2 applied), slots j in order, -1 slots skipped:
//
//   deterministic: out[t, n] = round_out(rsf * sum_j (w[t, j] * row_j[n]))   fp32 product, fp32 sum
//   fused:         o = 0; o = round_out(o + bf16(rsf * w[t, j] * row_j[n])); out[t, n] = o
//
// round_out = rounding to the output dtype (bf16 / f16 RNE, f32 exact). Explicit __fmul_rn /
// __fadd_rn keep the compiler from contracting into FMAs, so each step rounds as the reference's
// does. Every output element is written; a token without a local slot gets 0.
//
// NOTE: the "fused" mode is a per-token gather with the reference's fused rounding order, so it
// is deterministic too. Its products use GEMM2's bf16 row where the reference uses the fp32 y
// (one extra bf16 rounding, inside the tolerance). A true atomic scatter-add from GEMM2's
// epilogue (no y buffer, no extra pass) is a later optimisation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/fused/fused_moe_common.cuh"
#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/launch.h"

namespace qmoe::cuda::fused {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// Rounding to the output type, and the store.
__device__ __forceinline__ float round_out(float v, __nv_bfloat16*) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float round_out(float v, __half*) { return __half2float(__float2half_rn(v)); }
__device__ __forceinline__ float round_out(float v, float*) { return v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

// One block per token (grid-stride over tokens); threads walk the H features.
template <class OutT, bool kDeterministic>
__global__ void __launch_bounds__(kThreads) finalize_kernel(const uint16_t* __restrict__ y,
                                                            const int32_t* __restrict__ output_permutation,
                                                            const float* __restrict__ topk_weights, int64_t tokens,
                                                            int topk, int64_t hidden, float rsf, OutT* out) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int32_t* rows = output_permutation + t * topk;
    const float* w = topk_weights + t * topk;
    OutT* out_row = out + t * hidden;
    for (int64_t n = threadIdx.x; n < hidden; n += blockDim.x) {
      float o = 0.0f;
      for (int j = 0; j < topk; ++j) {
        const int32_t r = rows[j];
        if (r < 0) continue;
        const float row = bf16_bits_to_float(y[static_cast<int64_t>(r) * hidden + n]);
        if (kDeterministic) {
          o = __fadd_rn(o, __fmul_rn(w[j], row));
        } else {
          const float term = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(rsf, w[j]), row)));
          o = round_out(__fadd_rn(o, term), static_cast<OutT*>(nullptr));
        }
      }
      store(out_row + n, kDeterministic ? __fmul_rn(rsf, o) : o);
    }
  }
}

template <class OutT>
void launch(const uint16_t* y, const int32_t* output_permutation, const float* topk_weights, int64_t tokens, int topk,
            int64_t hidden, float rsf, bool deterministic, void* out, cudaStream_t stream) {
  const unsigned grid = grid_for(tokens, kMaxBlocks);
  OutT* o = static_cast<OutT*>(out);
  if (deterministic) {
    finalize_kernel<OutT, true><<<grid, kThreads, 0, stream>>>(y, output_permutation, topk_weights, tokens, topk,
                                                                hidden, rsf, o);
  } else {
    finalize_kernel<OutT, false><<<grid, kThreads, 0, stream>>>(y, output_permutation, topk_weights, tokens, topk,
                                                                 hidden, rsf, o);
  }
  check_cuda(cudaGetLastError(), "launch of fused_moe finalize");
}

}  // namespace

void finalize(const uint16_t* y, const int32_t* output_permutation, const float* topk_weights, int64_t tokens,
              int topk, int64_t hidden, float routed_scaling_factor, bool deterministic, DType out_dtype, void* out,
              cudaStream_t stream) {
  if (tokens <= 0 || hidden <= 0) return;
  switch (out_dtype) {
    case DType::kBFloat16:
      launch<__nv_bfloat16>(y, output_permutation, topk_weights, tokens, topk, hidden, routed_scaling_factor,
                            deterministic, out, stream);
      break;
    case DType::kFloat16:
      launch<__half>(y, output_permutation, topk_weights, tokens, topk, hidden, routed_scaling_factor, deterministic,
                     out, stream);
      break;
    case DType::kFloat32:
      launch<float>(y, output_permutation, topk_weights, tokens, topk, hidden, routed_scaling_factor, deterministic,
                    out, stream);
      break;
    default:
      throw Error("output", "bfloat16, float16 or float32", dtype_name(out_dtype));
  }
}

}  // namespace qmoe::cuda::fused
