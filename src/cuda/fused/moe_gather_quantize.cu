// First kernels of the GPU fused MoE (w4a8_int4): local expert ids, the dynamic activation amax,
// and the gather + FP8 quantization of GEMM1's operand in expert order (fused_moe_kernels.h):
//
//   local[s]   = id - local_expert_offset  if 0 <= id < num_experts and the result is in [0, E_l), else -1
//   amax       = max |x| over all T*H values (dynamic a1 only; NaN propagates)
//   A1[r, h]   = e4m3(x[t, h] / a1(t))  (bf16 x; e4m3 x is copied),  slot = input_permutation[r], t = slot / k
//   s1[r]      = a1(t) * w1_alpha[e]    (w1_alpha optional, 1 if absent; e = local[slot])
//
// a1(t) = x_scale[0], x_scale[t] or amax / 448 (1 when amax == 0), read on the device. The
// reference scales GEMM1 as (acc * a1) * w1_alpha; the GEMM's epilogue applies the folded s1 in
// one product, which differs by at most one fp32 rounding (identical when w1_alpha is absent).
// Division and conversion are the reference's (an IEEE fp32 division, __fdiv_rn; the e4m3 code of
// fused_moe_common.cuh's e4m3x2, bit-equal to qmoe::float_to_e4m3), so A1 is bit-identical to the
// CPU reference's operand.
// Mapping: tokens x column-chunks, 8 columns per thread, 1024 per CTA (fused_moe_common.cuh), each
// token's chunk stored to its k rows; 16-byte loads when H % 8 == 0 and x is 16-byte aligned, else one column
// at a time (x's alignment is not part of the w4a8_int4 contract).
// Rows r >= expert_offsets[E_l] (read on the device) are neither read nor written.
// Own rows (routing.own_rows, decode: S <= kOwnRowsMaxSlots): the kernel runs before the routing kernel
// and finds the rows of each token's slots itself (own_slot_rows.cuh).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/common/exact_rounding.cuh"  // UniformDivisor
#include "cuda/fused/fused_moe_common.cuh"
#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/fused/own_slot_rows.cuh"
#include "cuda/launch.h"
#include "qmoe/formats.h"
#include "cuda/common/pdl.cuh"

namespace qmoe::cuda::fused {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond: enough to fill 132 SMs many times over

__global__ void __launch_bounds__(kThreads) local_expert_ids_kernel(const int32_t* __restrict__ ids,
                                                                    int32_t* __restrict__ local, int64_t slots,
                                                                    int64_t num_experts, int64_t offset,
                                                                    int64_t num_local) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < slots;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[s];
    const int64_t l = id - offset;  // int64: no overflow for any int32 id
    local[s] = (id >= 0 && id < num_experts && l >= 0 && l < num_local) ? static_cast<int32_t>(l) : -1;
  }
}

__global__ void __launch_bounds__(kThreads) amax_bf16_kernel(const uint16_t* __restrict__ x, int64_t n,
                                                             uint32_t* amax_bits) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  uint32_t m = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t b = (static_cast<uint32_t>(x[i]) << 16) & 0x7fffffffu;  // |bf16| as fp32 bits
    m = b > m ? b : m;
  }
  block_amax_commit(m, amax_bits);  // every thread reaches this: no early return above
}

struct GatherArgs {
  RowRouting routing;
  const void* x;
  bool x_is_e4m3;
  int64_t hidden;
  const float* x_scale;  // nullptr: dynamic
  bool x_scale_per_token;
  const uint32_t* amax_bits;
  const float* w1_alpha;  // nullptr: 1
  uint8_t* a_out;
  float* s1;
};

// Columns per thread, and per CTA: H = 7168 is 7 CTAs per token, each thread one 16-byte bf16 load.
// At prefill (rows from output_permutation, H % 16 == 0, a_out 16-byte aligned) V = 16 columns per thread
// instead: 16-byte stores of the codes, half the store instructions (gather 10-18% faster at T = 4096, H200
// s30c: DeepSeek-V3 91.7 -> 79.0 us, Qwen3-30B 27.4 -> 24.1); decode keeps 8 (more CTAs per token).
constexpr int kVec = 8;
constexpr int kGatherThreads = 128;

// blockIdx.y = token (grid-stride), blockIdx.x * kGatherThreads + threadIdx.x = chunk of V columns.
// Token-major: a token's columns are quantized once and stored to each of its k rows (found through
// output_permutation), so the IEEE divisions number T*H rather than T*k*H. Row-major, they bounded
// the kernel at prefill (Qwen3-30B T = 4096: 84 us, about 5x its memory time; H200, session 8).
// kVectorized (H % 8 == 0, x 16-byte aligned, a_out 8-byte aligned): one 16-byte (bf16) or 8-byte
// (e4m3) load and k 8-byte stores per thread (V = 16: two / one 16-byte loads, k 16-byte stores); else
// the same columns one at a time.
// kOwnRows: the rows of each token's slots come from the ids (header), not from output_permutation.
template <bool kVectorized, bool kOwnRows, int V>
__global__ void __launch_bounds__(kGatherThreads) gather_quantize_kernel(const GatherArgs p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  const RowRouting& rt = p.routing;
  const int k = rt.topk;
  const int64_t tokens = rt.max_rows / k;
  const int64_t H = p.hidden;
  const int64_t h0 = (static_cast<int64_t>(blockIdx.x) * kGatherThreads + threadIdx.x) * V;
  __shared__ int32_t keys[kOwnRows ? kOwnRowsMaxSlots : 1];  // ids, E_l for a dropped slot
  __shared__ int32_t own[kOwnRows ? kMaxTopk : 1];           // rows of this token's slots, -1: dropped
  int64_t rows = rt.max_rows;
  if constexpr (kOwnRows) {
    stage_slot_keys<kGatherThreads>(rt, keys);
  } else {
    const int64_t valid_rows = rt.expert_offsets[rt.num_local];
    rows = valid_rows < rt.max_rows ? valid_rows : rt.max_rows;
  }
  // A row index is one of this launch's iff 0 <= r < rows (-1: dropped slot; the bound guards a
  // corrupted routing, as rows past the valid ones are neither read nor written).
  auto row_of = [&](int64_t slot) -> int64_t {
    if constexpr (kOwnRows) return own[slot % k];
    const int64_t r = rt.output_permutation[slot];
    return r >= 0 && r < rows ? r : -1;
  };
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y) {
    if constexpr (kOwnRows) {
      __syncthreads();  // keys staged; the previous token's rows read by every thread
      own_slot_rows<kGatherThreads>(rt, keys, t, own);
      __syncthreads();
    }
    bool any = false;
    for (int j = 0; j < k; ++j) any |= row_of(t * k + j) >= 0;
    if (!any) continue;  // no local expert (expert parallelism): nothing to read
    const float a1 = p.x_scale != nullptr ? p.x_scale[p.x_scale_per_token ? t : 0] : dynamic_fp8_scale(*p.amax_bits);
    if (blockIdx.x == 0) {
      for (int j = threadIdx.x; j < k; j += kGatherThreads) {
        const int64_t r = row_of(t * k + j);
        if (r >= 0) p.s1[r] = a1 * (p.w1_alpha != nullptr ? p.w1_alpha[rt.local_ids[t * k + j]] : 1.0f);
      }
    }
    if (h0 >= H) continue;
    if constexpr (kVectorized) {
      // The V e4m3 codes of columns h0.. (byte j = column h0 + j): one 8-byte (V = 8) or 16-byte (V = 16) word.
      using Codes = std::conditional_t<V == 16, uint4, uint2>;
      Codes codes;
      if (p.x_is_e4m3) {
        codes = *reinterpret_cast<const Codes*>(static_cast<const uint8_t*>(p.x) + t * H + h0);
      } else {
        uint32_t w[V / 2];  // bf16 pairs, one 16-byte load per 8 columns
#pragma unroll
        for (int i = 0; i < V / 8; ++i) {
          const uint4 in = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + t * H + h0 + 8 * i);
          w[4 * i] = in.x, w[4 * i + 1] = in.y, w[4 * i + 2] = in.z, w[4 * i + 3] = in.w;
        }
        float q[V];
        const UniformDivisor by_a1(a1);  // x / a1, the reference's IEEE division, bit for bit (exact_rounding.cuh)
#pragma unroll
        for (int j = 0; j < V / 2; ++j) {
          q[2 * j] = by_a1.divide(__uint_as_float(w[j] << 16));
          q[2 * j + 1] = by_a1.divide(__uint_as_float(w[j] & 0xffff0000u));
        }
        uint32_t c[V / 4];
#pragma unroll
        for (int i = 0; i < V / 4; ++i) c[i] = e4m3x4(q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]);
        if constexpr (V == 16) codes = make_uint4(c[0], c[1], c[2], c[3]);
        else codes = make_uint2(c[0], c[1]);
      }
      for (int j = 0; j < k; ++j) {
        const int64_t r = row_of(t * k + j);
        if (r >= 0) *reinterpret_cast<Codes*>(p.a_out + r * H + h0) = codes;
      }
    } else {
      const int64_t base = t * H + h0;
      uint8_t codes[V] = {};
      for (int c = 0; c < V && h0 + c < H; ++c) {
        codes[c] = p.x_is_e4m3 ? static_cast<const uint8_t*>(p.x)[base + c]
                               : e4m3_of(__fdiv_rn(bf16_to_float(static_cast<const uint16_t*>(p.x)[base + c]), a1));
      }
      for (int j = 0; j < k; ++j) {
        const int64_t r = row_of(t * k + j);
        if (r < 0) continue;
        for (int c = 0; c < V && h0 + c < H; ++c) p.a_out[r * H + h0 + c] = codes[c];
      }
    }
  }
}

}  // namespace

void local_expert_ids(const int32_t* ids, int32_t* local, int64_t slots, int64_t num_experts, int64_t offset,
                      int64_t num_local, cudaStream_t stream) {
  if (slots <= 0) return;
  const unsigned grid = grid_for((slots + kThreads - 1) / kThreads, kMaxBlocks);
  launch_kernel(local_expert_ids_kernel, grid, kThreads, 0, stream, ids, local, slots, num_experts, offset, num_local);
  check_cuda(cudaGetLastError(), "launch of fused_moe local_expert_ids");
}

void amax_bf16(const uint16_t* x, int64_t n, uint32_t* amax_bits, cudaStream_t stream) {
  if (n <= 0) return;
  const unsigned grid = grid_for((n + kThreads - 1) / kThreads, kMaxBlocks);
  launch_kernel(amax_bf16_kernel, grid, kThreads, 0, stream, x, n, amax_bits);
  check_cuda(cudaGetLastError(), "launch of fused_moe amax_bf16");
}

void gather_quantize(const RowRouting& routing, const void* x, bool x_is_e4m3, int64_t hidden, const float* x_scale,
                     bool x_scale_per_token, const uint32_t* amax_bits, const float* w1_alpha, uint8_t* a_out,
                     float* s1, cudaStream_t stream) {
  if (routing.max_rows <= 0) return;
  if (hidden <= 0) return;
  GatherArgs p{routing, x, x_is_e4m3, hidden, x_scale, x_scale_per_token, amax_bits, w1_alpha, a_out, s1};
  // x needs no alignment in this mode (fused_moe checks it for the bf16 pipeline only): test it.
  const bool vectorized = hidden % kVec == 0 && aligned_to(x, 16) && aligned_to(a_out, 8);
  if (routing.topk <= 0) return;
  const dim3 grid = rows_by_chunks(routing.max_rows / routing.topk, hidden, int64_t{kGatherThreads} * kVec);
  if (routing.own_rows) check_own_rows_fit(routing);
  if (routing.own_rows) {
    if (vectorized) launch_kernel(gather_quantize_kernel<true, true, kVec>, grid, kGatherThreads, 0, stream, p);
    else launch_kernel(gather_quantize_kernel<false, true, kVec>, grid, kGatherThreads, 0, stream, p);
  } else if (vectorized && hidden % 16 == 0 && aligned_to(a_out, 16)) {
    const dim3 grid16 = rows_by_chunks(routing.max_rows / routing.topk, hidden, int64_t{kGatherThreads} * 16);
    launch_kernel(gather_quantize_kernel<true, false, 16>, grid16, kGatherThreads, 0, stream, p);
  } else {
    if (vectorized) launch_kernel(gather_quantize_kernel<true, false, kVec>, grid, kGatherThreads, 0, stream, p);
    else launch_kernel(gather_quantize_kernel<false, false, kVec>, grid, kGatherThreads, 0, stream, p);
  }
  check_cuda(cudaGetLastError(), "launch of fused_moe gather_quantize");
}

}  // namespace qmoe::cuda::fused
