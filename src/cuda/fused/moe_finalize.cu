// Finalize kernels: combine each token's per-slot bf16 rows back into token order (DESIGN.md 3b).
// rsf = routed_scaling_factor; slots j of token t in order; a slot without a row is skipped.
//
//   deterministic: out[t, n] = round_out(rsf * sum_j (w[t, j] * row_j[n]))   fp32 product, fp32 sum
//   fused:         o = 0; o = round_out(o + bf16(rsf * w[t, j] * row_j[n])); out[t, n] = o
//
// Where the row of slot s = t*k + j comes from (one kernel template, two row sources):
//   fused::finalize            (fused_moe)    row_s = y[output_permutation[s]], -1: no row
//   fused::scatter_slot_rows   (moe_expert_rows) is the copy slot_rows[s] = y[output_permutation[s]]
//   cuda::moe_finalize         (moe_finalize) row_s = rows[s] when the routing rule keeps the slot:
//                              0 <= e < num_experts and e - local_expert_offset in [0, num_local),
//                              e = topk_ids[s]; rows of other slots are never read. With a row
//                              index: row_s = rows[row_index[s]] when the rule keeps the slot and
//                              0 <= row_index[s] < R (expert parallelism's received rows, read in
//                              place instead of gathered into slot order first).
// So moe_finalize(moe_expert_rows(p)) runs the same arithmetic on the same bf16 values as
// fused_moe(p, deterministic) and the two are bit-identical; both equal the CPU reference
// (src/reference/fused_moe.cpp finalize_deterministic), whose loop is `o += w * row` in fp32 without
// fma contraction, then round_out(rsf * o).
//
// round_out = rounding to the output dtype (bf16 / f16 RNE, f32 exact). Explicit __fmul_rn /
// __fadd_rn keep the compiler from contracting into FMAs, so each step rounds as the reference's
// does. Every output element is written; a token without a kept slot gets 0.
//
// Mapping: tokens x H-chunks (fused_moe_common.cuh; a decode step has 1-64 tokens, so one CTA per
// token would leave the GPU idle): each thread owns 8 features of one token (16-byte row loads, one
// 16-byte / 32-byte store) when H % 8 == 0 and y / out are 16-byte aligned, else one feature. It
// reads its token's k permutation entries and weights itself and issues the loads of up to 8 slots'
// rows together before summing them in slot order. Limits: top_k <= 16 (kMaxTopK).
//
// NOTE: fused_moe's fused finalize (deterministic == false) runs here in the w4a8_int4 pipeline and after
// prefill tiles; the bf16 x 4-bit pipeline's decode tiles instead scatter-add into the zeroed output
// atomically (src/cuda/gemm/grouped_gemm_epilogue.cuh, moe_pipeline_steps.cu fused_finalize_scatter), with
// this kernel as the fallback for an output that is not 4-byte aligned (the paired 16-bit atomics need
// it). Its "fused" mode is a per-token gather with the reference's fused rounding order, deterministic,
// whose products use GEMM2's bf16 row where the reference uses the fp32 y (one extra bf16 rounding,
// inside the tolerance).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/device_guard.h"
#include "cuda/fused/fused_moe_common.cuh"
#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/launch.h"
#include "qmoe/routing.h"
#include "cuda/common/pdl.cuh"
#include "cuda/common/store_out.cuh"

namespace qmoe::cuda::fused {

namespace {

constexpr int kThreads = 128;  // x 8 features: 1024 features of a token per CTA (H = 7168: 7 CTAs)
constexpr int kVec = 8;        // bf16 features per 16-byte load

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// Feature i of a loaded chunk: 8 bf16 in a uint4 (feature 2m in the low half of word m), or one.
__device__ __forceinline__ float bf16_of(const uint4& b, int i) {
  const uint32_t w = (i >> 1) == 0 ? b.x : (i >> 1) == 1 ? b.y : (i >> 1) == 2 ? b.z : b.w;
  return __uint_as_float((i & 1) != 0 ? (w & 0xffff0000u) : (w << 16));
}
__device__ __forceinline__ float bf16_of(uint16_t b, int) { return bf16_bits_to_float(b); }

// Rounding to the output type (the store: cuda/common/store_out.cuh).
__device__ __forceinline__ float round_out(float v, __nv_bfloat16*) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float round_out(float v, __half*) { return __half2float(__float2half_rn(v)); }
__device__ __forceinline__ float round_out(float v, float*) { return v; }

// kVec consecutive outputs at an aligned address, in as few stores as the type allows.
__device__ __forceinline__ void store_vec(__nv_bfloat16* p, const float (&v)[kVec]) {
  uint4 packed;
  uint32_t* words = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i]));
    const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i + 1]));
    words[i] = lo | (hi << 16);
  }
  *reinterpret_cast<uint4*>(p) = packed;
}
__device__ __forceinline__ void store_vec(__half* p, const float (&v)[kVec]) {
  uint4 packed;
  uint32_t* words = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    const uint32_t lo = __half_as_ushort(__float2half_rn(v[2 * i]));
    const uint32_t hi = __half_as_ushort(__float2half_rn(v[2 * i + 1]));
    words[i] = lo | (hi << 16);
  }
  *reinterpret_cast<uint4*>(p) = packed;
}
__device__ __forceinline__ void store_vec(float* p, const float (&v)[kVec]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// fused_moe: the row of slot s is y[output_permutation[s]] (-1: none).
struct PermutedRows {
  const uint16_t* y;
  const int32_t* output_permutation;
  __device__ __forceinline__ const uint16_t* row(int64_t s, int64_t hidden) const {
    const int32_t r = output_permutation[s];
    return r < 0 ? nullptr : y + static_cast<int64_t>(r) * hidden;
  }
};

// moe_finalize: the row of slot s is rows[s] when the routing rule keeps the slot.
struct SlotRows {
  const uint16_t* rows;
  const int32_t* topk_ids;
  int64_t num_experts, local_expert_offset, num_local;
  __device__ __forceinline__ const uint16_t* row(int64_t s, int64_t hidden) const {
    const int64_t e = topk_ids[s];
    const int64_t l = e - local_expert_offset;
    const bool kept = e >= 0 && e < num_experts && l >= 0 && l < num_local;
    return kept ? rows + s * hidden : nullptr;
  }
};

// moe_finalize with a row index: the row of slot s is rows[row_index[s]] when the routing rule keeps
// the slot and the index lies in [0, num_rows) (-1: no row).
struct IndexedSlotRows {
  SlotRows rule;  // its rows pointer is the [R, H] buffer
  const int32_t* row_index;
  int64_t num_rows;
  __device__ __forceinline__ const uint16_t* row(int64_t s, int64_t hidden) const {
    if (rule.row(s, hidden) == nullptr) return nullptr;  // only the routing rule: no row is read
    const int64_t r = row_index[s];
    return r >= 0 && r < num_rows ? rule.rows + r * hidden : nullptr;
  }
};

// blockIdx.y = token (grid-stride), blockIdx.x * kThreads + threadIdx.x = chunk of V features.
// A thread resolves its token's slots itself (no shared memory, no barrier) and loads the rows of
// kGroup slots before summing them, so those loads are in flight together; the sum still visits
// the slots in order j = 0, 1, ..., k-1 with the reference's rounding steps.
template <class OutT, bool kDeterministic, int V, class Rows>
__global__ void __launch_bounds__(kThreads) finalize_kernel(Rows source, const float* __restrict__ topk_weights,
                                                            int64_t tokens, int topk, int64_t hidden, float rsf,
                                                            OutT* __restrict__ out) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  constexpr int kGroup = 8;  // slots whose rows are loaded at once (kMaxTopK = 16: two groups at most)
  using Bits = std::conditional_t<V == kVec, uint4, uint16_t>;
  const int64_t n = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (n >= hidden) return;  // no barrier in this kernel
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y) {
    float o[V];
#pragma unroll
    for (int i = 0; i < V; ++i) o[i] = 0.0f;
    for (int j0 = 0; j0 < topk; j0 += kGroup) {
      Bits bits[kGroup];
      float weight[kGroup];
      bool has_row[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const int j = j0 + g;
        const uint16_t* r = j < topk ? source.row(t * topk + j, hidden) : nullptr;
        has_row[g] = r != nullptr;
        weight[g] = j < topk ? topk_weights[t * topk + j] : 0.0f;
        if (has_row[g]) {
          if constexpr (V == kVec) {
            bits[g] = *reinterpret_cast<const uint4*>(r + n);
          } else {
            bits[g] = r[n];
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (!has_row[g]) continue;  // a slot without a row is skipped (never added as 0)
        const float w = weight[g];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float row = bf16_of(bits[g], i);
          if (kDeterministic) {
            o[i] = __fadd_rn(o[i], __fmul_rn(w, row));
          } else {
            const float term = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(rsf, w), row)));
            o[i] = round_out(__fadd_rn(o[i], term), static_cast<OutT*>(nullptr));
          }
        }
      }
    }
    if (kDeterministic) {
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = __fmul_rn(rsf, o[i]);
    }
    OutT* out_row = out + t * hidden;
    if constexpr (V == kVec) {
      store_vec(out_row + n, o);
    } else {
      store_out(out_row + n, o[0]);
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <class OutT, class Rows>
void launch_finalize(const Rows& source, bool vectorized, const float* topk_weights, int64_t tokens, int topk, int64_t hidden,
            float rsf, bool deterministic, void* out, cudaStream_t stream) {
  const dim3 grid = rows_by_chunks(tokens, hidden, int64_t{kThreads} * (vectorized ? kVec : 1));
  OutT* o = static_cast<OutT*>(out);
  if (vectorized && deterministic) {
    launch_kernel(finalize_kernel<OutT, true, kVec, Rows>, grid, kThreads, 0, stream, source, topk_weights, tokens, topk, hidden, rsf, o);
  } else if (vectorized) {
    launch_kernel(finalize_kernel<OutT, false, kVec, Rows>, grid, kThreads, 0, stream, source, topk_weights, tokens, topk, hidden, rsf,
                                                                      o);
  } else if (deterministic) {
    launch_kernel(finalize_kernel<OutT, true, 1, Rows>, grid, kThreads, 0, stream, source, topk_weights, tokens, topk, hidden, rsf, o);
  } else {
    launch_kernel(finalize_kernel<OutT, false, 1, Rows>, grid, kThreads, 0, stream, source, topk_weights, tokens, topk, hidden, rsf, o);
  }
  check_cuda(cudaGetLastError(), "launch of the MoE finalize");
}

template <class Rows>
void launch_any(const Rows& source, bool rows_aligned, const float* topk_weights, int64_t tokens, int topk,
                int64_t hidden, float rsf, bool deterministic, DType out_dtype, void* out, cudaStream_t stream) {
  const bool vectorized = rows_aligned && hidden % kVec == 0 && aligned16(out);
  switch (out_dtype) {
    case DType::kBFloat16:
      launch_finalize<__nv_bfloat16>(source, vectorized, topk_weights, tokens, topk, hidden, rsf, deterministic, out, stream);
      break;
    case DType::kFloat16:
      launch_finalize<__half>(source, vectorized, topk_weights, tokens, topk, hidden, rsf, deterministic, out, stream);
      break;
    case DType::kFloat32:
      launch_finalize<float>(source, vectorized, topk_weights, tokens, topk, hidden, rsf, deterministic, out, stream);
      break;
    default:
      throw Error("output", "bfloat16, float16 or float32", dtype_name(out_dtype));
  }
}

// slot_rows[s, :] = y[output_permutation[s], :] for valid slots; blockIdx.y = slot (grid-stride),
// blockIdx.x * kThreads + threadIdx.x = chunk of V features.
template <int V>
__global__ void __launch_bounds__(kThreads) scatter_slot_rows_kernel(const uint16_t* __restrict__ y,
                                                                     const int32_t* __restrict__ output_permutation,
                                                                     int64_t slots, int64_t hidden,
                                                                     uint16_t* __restrict__ slot_rows) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  const int64_t n = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (n >= hidden) return;
  for (int64_t s = blockIdx.y; s < slots; s += gridDim.y) {
    const int32_t r = output_permutation[s];
    if (r < 0) continue;  // uniform over the CTA: no divergence
    const uint16_t* src = y + static_cast<int64_t>(r) * hidden;
    uint16_t* dst = slot_rows + s * hidden;
    if constexpr (V == kVec) {
      *reinterpret_cast<uint4*>(dst + n) = *reinterpret_cast<const uint4*>(src + n);
    } else {
      dst[n] = src[n];
    }
  }
}

}  // namespace

void finalize(const uint16_t* y, const int32_t* output_permutation, const float* topk_weights, int64_t tokens,
              int topk, int64_t hidden, float routed_scaling_factor, bool deterministic, DType out_dtype, void* out,
              cudaStream_t stream) {
  if (tokens <= 0 || hidden <= 0) return;
  launch_any(PermutedRows{y, output_permutation}, aligned16(y), topk_weights, tokens, topk, hidden,
             routed_scaling_factor, deterministic, out_dtype, out, stream);
}

void scatter_slot_rows(const uint16_t* y, const int32_t* output_permutation, int64_t slots, int64_t hidden,
                       uint16_t* slot_rows, cudaStream_t stream) {
  if (slots <= 0 || hidden <= 0) return;
  const bool vectorized = hidden % kVec == 0 && aligned16(y) && aligned16(slot_rows);
  const dim3 grid = rows_by_chunks(slots, hidden, int64_t{kThreads} * (vectorized ? kVec : 1));
  if (vectorized) {
    launch_kernel(scatter_slot_rows_kernel<kVec>, grid, kThreads, 0, stream, y, output_permutation, slots, hidden, slot_rows);
  } else {
    launch_kernel(scatter_slot_rows_kernel<1>, grid, kThreads, 0, stream, y, output_permutation, slots, hidden, slot_rows);
  }
  check_cuda(cudaGetLastError(), "launch of moe_expert_rows' scatter to slot rows");
}

}  // namespace qmoe::cuda::fused

namespace qmoe::cuda {

void moe_finalize(const MoeFinalizeParams& p, cudaStream_t stream) {
  const int64_t tokens = p.topk_ids.size(0), topk = p.topk_ids.size(1), hidden = p.rows.size(1);
  if (tokens == 0) return;  // an empty [0, H] output: nothing to write
  DeviceGuard current(p.rows.device_index);
  const int64_t local = p.num_local_experts == 0 ? p.num_experts : p.num_local_experts;
  const fused::SlotRows source{p.rows.ptr<const uint16_t>(), p.topk_ids.ptr<const int32_t>(), p.num_experts,
                               p.local_expert_offset, local};
  if (p.row_index) {
    const fused::IndexedSlotRows indexed{source, p.row_index->ptr<const int32_t>(), p.rows.size(0)};
    fused::launch_any(indexed, fused::aligned16(p.rows.data), p.topk_weights.ptr<const float>(), tokens,
                      static_cast<int>(topk), hidden, p.routed_scaling_factor, /*deterministic=*/true,
                      p.output.dtype, p.output.data, stream);
    return;
  }
  fused::launch_any(source, fused::aligned16(p.rows.data), p.topk_weights.ptr<const float>(), tokens,
                    static_cast<int>(topk), hidden, p.routed_scaling_factor, /*deterministic=*/true, p.output.dtype,
                    p.output.data, stream);
}

}  // namespace qmoe::cuda
