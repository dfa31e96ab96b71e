// Gather + dequantization of GEMM1's operand for the bf16 x 4-bit fused MoE (w4a16, w4a16_int4,
// w4a4, w4a8; sm90_fused_moe_bf16_w4.cu, fused_moe_kernels.h):
//
//   slot = input_permutation[r], t = slot / k, e = local[slot]     for rows r < expert_offsets[E_l]
//   A1[r, h] = bf16 x[t, h]                                   (w4a16*: a copy)
//            = e2m1(x[t, h]) * e4m3(x_scale[t, h / 16])       (w4a4: NVFP4 x, row-major scales)
//            = e4m3(x[t, h]) * 2^(x_scale[t, h / 32] - 127)   (w4a8: MXFP8 x, row-major ue8m0 scales)
//   s1[r]    = w1_alpha[e] * per_token_scale[t]               (each optional, 1 if absent)
//
// The products are exact in bf16 (DESIGN.md 3: an e2m1 x e4m3 product has at most 6 significant
// bits; e4m3 times a power of two stays exact while inside bf16's range), and they are formed with
// the reference's scalar codecs (qmoe/formats.h), so A1 holds exactly the reference's operand xd.
// s1 is the reference's FP4 GEMM1 scale (w1_alpha * s1(t)); for w4a16_int4 s1(t) = 1, so the
// reference's (acc * 1) * w1_alpha is the same product.
//
// Each thread converts 8 consecutive features (one 16-byte bf16 store; 16 / 4 / 8 input bytes), so
// H % 8 == 0 and a 16-byte aligned x are required (the caller checks; GPU FP4 modes have H % 32 == 0,
// so a chunk never straddles a scale block). One block per row, grid-stride over the rows.
// Rows r >= expert_offsets[E_l] (read on the device) are neither read nor written.
#include <cuda_runtime.h>

#include "cuda/fused/fused_moe_common.cuh"
#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/launch.h"
#include "qmoe/formats.h"
#include "cuda/common/pdl.cuh"

namespace qmoe::cuda::fused {

namespace {

constexpr int kThreads = 128;  // 128 x 8 features = 1024 per CTA: H = 7168 is 7 CTAs per row
constexpr int kChunk = 8;      // features per thread

struct GatherDequantArgs {
  RowRouting routing;
  const void* x;
  const uint8_t* x_scale;  // kNvfp4 / kMxfp8 only
  int64_t hidden;
  const float* per_token_scale;  // nullptr: 1
  const float* w1_alpha;         // nullptr: 1
  uint16_t* a_out;
  float* s1;
};

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return static_cast<uint32_t>(float_to_bf16(lo)) | (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
}

// Features [8c, 8c + 8) of token t as 8 bf16 (little-endian pairs: feature 8c in the low half of .x).
template <ActivationInput kInput>
__device__ __forceinline__ uint4 dequant_chunk(const GatherDequantArgs& p, int64_t t, int64_t c) {
  const int64_t H = p.hidden;
  if constexpr (kInput == ActivationInput::kBf16) {
    return reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + t * H)[c];
  } else if constexpr (kInput == ActivationInput::kNvfp4) {
    // 8 e2m1 codes in 4 bytes; even feature in the low nibble, so nibble j is feature 8c + j.
    const uint32_t codes = reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(p.x) + t * (H / 2))[c];
    const float sf = e4m3_to_float(p.x_scale[t * (H / 16) + (kChunk * c) / 16]);
    float v[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[j] = e2m1_to_float(static_cast<uint8_t>((codes >> (4 * j)) & 0xfu)) * sf;
    return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                      pack_bf16x2(v[6], v[7]));
  } else {
    const uint2 codes = reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(p.x) + t * H)[c];
    const float s = ue8m0_to_float(p.x_scale[t * (H / 32) + (kChunk * c) / 32]);
    float v[kChunk];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = e4m3_to_float(static_cast<uint8_t>(codes.x >> (8 * j))) * s;
      v[4 + j] = e4m3_to_float(static_cast<uint8_t>(codes.y >> (8 * j))) * s;
    }
    return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                      pack_bf16x2(v[6], v[7]));
  }
}

// blockIdx.y = row (grid-stride over rows), blockIdx.x * kThreads + threadIdx.x = chunk of kChunk features.
template <ActivationInput kInput>
__global__ void __launch_bounds__(kThreads) gather_dequant_kernel(const GatherDequantArgs p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  const RowRouting& rt = p.routing;
  const int64_t valid_rows = rt.expert_offsets[rt.num_local];
  const int64_t rows = valid_rows < rt.max_rows ? valid_rows : rt.max_rows;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool in_row = c < p.hidden / kChunk;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int32_t slot = rt.input_permutation[r];
    if (slot < 0) continue;  // cannot happen for r < valid rows; guards a corrupted routing
    const int64_t t = slot / rt.topk;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      const float alpha = p.w1_alpha != nullptr ? p.w1_alpha[rt.local_ids[slot]] : 1.0f;
      p.s1[r] = alpha * (p.per_token_scale != nullptr ? p.per_token_scale[t] : 1.0f);
    }
    if (in_row) reinterpret_cast<uint4*>(p.a_out + r * p.hidden)[c] = dequant_chunk<kInput>(p, t, c);
  }
}

}  // namespace

void gather_dequantize(const RowRouting& routing, ActivationInput input, const void* x, const uint8_t* x_scale,
                       int64_t hidden, const float* per_token_scale, const float* w1_alpha, uint16_t* a_out,
                       float* s1, cudaStream_t stream) {
  if (routing.max_rows <= 0) return;
  const GatherDequantArgs p{routing, x, x_scale, hidden, per_token_scale, w1_alpha, a_out, s1};
  if (hidden <= 0) return;
  const dim3 grid = rows_by_chunks(routing.max_rows, hidden, int64_t{kThreads} * kChunk);
  switch (input) {
    case ActivationInput::kBf16:
      launch_kernel(gather_dequant_kernel<ActivationInput::kBf16>, grid, kThreads, 0, stream, p);
      break;
    case ActivationInput::kNvfp4:
      launch_kernel(gather_dequant_kernel<ActivationInput::kNvfp4>, grid, kThreads, 0, stream, p);
      break;
    case ActivationInput::kMxfp8:
      launch_kernel(gather_dequant_kernel<ActivationInput::kMxfp8>, grid, kThreads, 0, stream, p);
      break;
  }
  check_cuda(cudaGetLastError(), "launch of fused_moe gather_dequantize");
}

}  // namespace qmoe::cuda::fused
