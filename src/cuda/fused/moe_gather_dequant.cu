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
// so a chunk never straddles a scale block). At prefill (rows_batched) a CTA takes kRows rows per pass
// (their dependent loads -- the row's slot, then its x chunk -- in flight together) and loops over the rows
// (grid capped at ~16 CTAs per SM: rows_by_chunks_looped); one row per CTA ran at ~1 TB/s there (H200,
// s17c). Decode keeps one row per CTA (a CTA's latency is the kernel's there).
// Rows r >= expert_offsets[E_l] (read on the device) are neither read nor written.
// Own rows (routing.own_rows, decode: S <= kOwnRowsMaxSlots): the kernel runs before the routing kernel,
// token-major: it finds the rows of each token's slots itself (own_slot_rows.cuh), converts each chunk of
// the token once and stores it to those rows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "cuda/fused/fused_moe_common.cuh"
#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/fused/own_slot_rows.cuh"
#include "cuda/launch.h"
#include "qmoe/formats.h"
#include "cuda/common/pdl.cuh"

namespace qmoe::cuda::fused {

namespace {

constexpr int kThreads = 128;  // 128 x 8 features = 1024 per CTA: H = 7168 is 7 CTAs per row
constexpr int kChunk = 8;      // features per thread
constexpr int kRows = 2;       // rows per CTA pass at prefill (rows_batched; decode: 1): 3-5% faster than 4 (s19a)

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

// One thread's raw input for features [8c, 8c + 8) of a token: loaded for kRows rows before any is
// converted, so that their loads are in flight together.
struct RawChunk {
  uint4 v;         // bf16: the 8 values; NVFP4: .x = 8 e2m1 codes; MXFP8: .x, .y = 8 e4m3 codes
  uint32_t scale;  // NVFP4: the e4m3 block scale; MXFP8: the ue8m0 block scale
};

template <ActivationInput kInput>
__device__ __forceinline__ RawChunk load_chunk(const GatherDequantArgs& p, int64_t t, int64_t c) {
  const int64_t H = p.hidden;
  RawChunk r{};
  if constexpr (kInput == ActivationInput::kBf16) {
    r.v = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + t * H)[c];
  } else if constexpr (kInput == ActivationInput::kNvfp4) {
    r.v.x = reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(p.x) + t * (H / 2))[c];
    r.scale = p.x_scale[t * (H / 16) + (kChunk * c) / 16];
  } else {
    const uint2 codes = reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(p.x) + t * H)[c];
    r.v.x = codes.x, r.v.y = codes.y;
    r.scale = p.x_scale[t * (H / 32) + (kChunk * c) / 32];
  }
  return r;
}

__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 bf16x2_of(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// The 8 values as bf16 (little-endian pairs: feature 8c in the low half of .x). Every product is exact
// in bf16, so no rounding happens and the bits are those of the reference's scalar codecs (a NaN scale
// gives NaN, compared by isnan).
template <ActivationInput kInput>
__device__ __forceinline__ uint4 convert_chunk(const RawChunk& r) {
  if constexpr (kInput == ActivationInput::kBf16) {
    return r.v;
  } else if constexpr (kInput == ActivationInput::kNvfp4) {
    // The GEMM's decode (sm90_grouped_gemm_bf16_w4.cuh): e2m1 bits at bf16 bits 15 and 8..6 are
    // e2m1 * 2^-126 (codes 0, 1 subnormal); times bf16(sf * 2^118) and 2^8: e2m1 * sf. Nibble j is
    // feature 8c + j; byte k (features 2k, 2k + 1) times 0x1001, masked, puts its nibbles at bits 0..3
    // of the two halves.
    const __nv_bfloat162 sf = __float2bfloat162_rn(e4m3_to_float(static_cast<uint8_t>(r.scale)) * 3.3230699894622794e+35f);
    uint32_t out[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t pair = (((r.v.x >> (8 * k)) & 0xffu) * 0x1001u) & 0x000f000fu;
      const uint32_t e = (pair * 0x1040u) & 0x81c081c0u;
      out[k] = bf16x2_bits(__hmul2(__hmul2(bf16x2_of(e), sf), bf16x2_of(0x43804380u)));  // * 2^8
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
  } else {
    // e4m3 pairs to f16 (exact) by the hardware conversion, then fp32 times 2^(s - 127) (exact inside
    // fp32's range; an overflow is inf as in the reference) and one round-to-nearest pack to bf16,
    // which is __float2bfloat16_rn = the reference's float_to_bf16 for every non-NaN value.
    const float s = ue8m0_to_float(static_cast<uint8_t>(r.scale));
    uint32_t out[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t word = k < 2 ? r.v.x : r.v.y;
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word >> (16 * (k % 2))), __NV_E4M3);
      const float2 f = __half22float2(__half2(h));
      out[k] = bf16x2_bits(__floats2bfloat162_rn(f.x * s, f.y * s));
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
  }
}

// blockIdx.y = kRows rows (grid-stride over rows), blockIdx.x * kThreads + threadIdx.x = chunk of kChunk features.
template <ActivationInput kInput, int ROWS>
__global__ void __launch_bounds__(kThreads) gather_dequant_kernel(const GatherDequantArgs p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  const RowRouting& rt = p.routing;
  const int64_t valid_rows = rt.expert_offsets[rt.num_local];
  const int64_t rows = valid_rows < rt.max_rows ? valid_rows : rt.max_rows;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool in_row = c < p.hidden / kChunk;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * ROWS; r0 < rows; r0 += static_cast<int64_t>(gridDim.y) * ROWS) {
    int32_t slot[ROWS];  // < 0: past the rows (or a corrupted routing: nothing read or written)
#pragma unroll
    for (int j = 0; j < ROWS; ++j) slot[j] = r0 + j < rows ? rt.input_permutation[r0 + j] : -1;
    RawChunk raw[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
      if (in_row && slot[j] >= 0) raw[j] = load_chunk<kInput>(p, slot[j] / rt.topk, c);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        if (slot[j] < 0) continue;
        const float alpha = p.w1_alpha != nullptr ? p.w1_alpha[rt.local_ids[slot[j]]] : 1.0f;
        p.s1[r0 + j] = alpha * (p.per_token_scale != nullptr ? p.per_token_scale[slot[j] / rt.topk] : 1.0f);
      }
    }
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
      if (in_row && slot[j] >= 0) reinterpret_cast<uint4*>(p.a_out + (r0 + j) * p.hidden)[c] = convert_chunk<kInput>(raw[j]);
  }
}

// Own rows: blockIdx.y = token (grid-stride), blockIdx.x * kThreads + threadIdx.x = chunk of kChunk features.
template <ActivationInput kInput>
__global__ void __launch_bounds__(kThreads) gather_dequant_own_rows_kernel(const GatherDequantArgs p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  const RowRouting& rt = p.routing;
  __shared__ int32_t keys[kOwnRowsMaxSlots];
  __shared__ int32_t rows[kMaxTopk];  // of this token's slots, -1: dropped
  stage_slot_keys<kThreads>(rt, keys);
  const int k = rt.topk;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool in_row = c < p.hidden / kChunk;
  for (int64_t t = blockIdx.y; t < rt.max_rows / k; t += gridDim.y) {
    __syncthreads();  // keys staged; the previous token's rows read by every thread
    own_slot_rows<kThreads>(rt, keys, t, rows);
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x < k && rows[threadIdx.x] >= 0) {
      const float alpha = p.w1_alpha != nullptr ? p.w1_alpha[rt.local_ids[t * k + threadIdx.x]] : 1.0f;
      p.s1[rows[threadIdx.x]] = alpha * (p.per_token_scale != nullptr ? p.per_token_scale[t] : 1.0f);
    }
    bool any = false;
    for (int j = 0; j < k; ++j) any |= rows[j] >= 0;
    if (!in_row || !any) continue;  // no local expert (expert parallelism): nothing to read
    const uint4 v = convert_chunk<kInput>(load_chunk<kInput>(p, t, c));
    for (int j = 0; j < k; ++j)
      if (rows[j] >= 0) reinterpret_cast<uint4*>(p.a_out + rows[j] * p.hidden)[c] = v;
  }
}

}  // namespace

void gather_dequantize(const RowRouting& routing, ActivationInput input, const void* x, const uint8_t* x_scale,
                       int64_t hidden, const float* per_token_scale, const float* w1_alpha, uint16_t* a_out,
                       float* s1, cudaStream_t stream) {
  if (routing.max_rows <= 0) return;
  const GatherDequantArgs p{routing, x, x_scale, hidden, per_token_scale, w1_alpha, a_out, s1};
  if (hidden <= 0) return;
  if (routing.own_rows) {
    check_own_rows_fit(routing);
    const dim3 grid = rows_by_chunks(routing.max_rows / routing.topk, hidden, int64_t{kThreads} * kChunk);
    switch (input) {
      case ActivationInput::kBf16: launch_kernel(gather_dequant_own_rows_kernel<ActivationInput::kBf16>, grid, kThreads, 0, stream, p); break;
      case ActivationInput::kNvfp4: launch_kernel(gather_dequant_own_rows_kernel<ActivationInput::kNvfp4>, grid, kThreads, 0, stream, p); break;
      case ActivationInput::kMxfp8: launch_kernel(gather_dequant_own_rows_kernel<ActivationInput::kMxfp8>, grid, kThreads, 0, stream, p); break;
    }
    check_cuda(cudaGetLastError(), "launch of fused_moe gather_dequantize (own rows)");
    return;
  }
  const bool batched = rows_batched(routing.max_rows, hidden, int64_t{kThreads} * kChunk);
  const dim3 grid = rows_by_chunks_looped(routing.max_rows, hidden, int64_t{kThreads} * kChunk, batched ? kRows : 1);
  auto launch = [&](auto kernel_rows1, auto kernel_batched) {
    launch_kernel(batched ? kernel_batched : kernel_rows1, grid, kThreads, 0, stream, p);
  };
  switch (input) {
    case ActivationInput::kBf16:
      launch(gather_dequant_kernel<ActivationInput::kBf16, 1>, gather_dequant_kernel<ActivationInput::kBf16, kRows>);
      break;
    case ActivationInput::kNvfp4:
      launch(gather_dequant_kernel<ActivationInput::kNvfp4, 1>, gather_dequant_kernel<ActivationInput::kNvfp4, kRows>);
      break;
    case ActivationInput::kMxfp8:
      launch(gather_dequant_kernel<ActivationInput::kMxfp8, 1>, gather_dequant_kernel<ActivationInput::kMxfp8, kRows>);
      break;
  }
  check_cuda(cudaGetLastError(), "launch of fused_moe gather_dequantize");
}

}  // namespace qmoe::cuda::fused
