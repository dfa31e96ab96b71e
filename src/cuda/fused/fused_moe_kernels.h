// Host launchers of the small kernels the GPU fused MoE (w4a8_int4) is composed of
// (sm90_fused_moe_w4a8_int4.cu). Each takes device pointers, sizes and a stream, launches on the
// current device, allocates nothing, never synchronizes (CUDA-graph capturable) and throws
// qmoe::Error (kRuntime) when the launch fails. Per-row kernels read the row count
// expert_offsets[num_local] on the device and are launched over the bound S = T * top_k.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "qmoe/fused_moe.h"

namespace qmoe::cuda::fused {

// Routing metadata in the workspace (see fused_moe_workspace.h and include/qmoe/routing.h).
struct RowRouting {
  const int32_t* local_ids;          // [S] local expert of each flat slot, -1 if none
  const int32_t* expert_offsets;     // [E_l + 1]; [E_l] = valid rows
  const int32_t* input_permutation;  // [S] row -> flat slot
  int num_local;                     // E_l
  int topk;
  int64_t max_rows;                  // S
};

// moe_gather_quantize.cu -------------------------------------------------------------------------
// local[s] = ids[s] - offset when 0 <= ids[s] < num_experts and 0 <= ids[s] - offset < num_local, else -1.
void local_expert_ids(const int32_t* ids, int32_t* local, int64_t slots, int64_t num_experts, int64_t offset,
                      int64_t num_local, cudaStream_t stream);
// amax_bits = max(amax_bits, bits of |x[i]|) over n bf16 values (NaN propagates: as unsigned,
// a NaN's magnitude bits exceed every number's). amax_bits must be zeroed first.
void amax_bf16(const uint16_t* x, int64_t n, uint32_t* amax_bits, cudaStream_t stream);
// For rows r < expert_offsets[E_l]: slot = input_permutation[r], t = slot / topk, e = local_ids[slot],
//   a1 = x_scale[0] | x_scale[t] (x_scale_per_token) | dynamic(amax_bits) (x_scale == nullptr)
//   a_out[r, :] = e4m3(x[t, :] / a1) (bf16 x) or x[t, :] (e4m3 x, byte copy)
//   s1[r] = a1 * (w1_alpha ? w1_alpha[e] : 1)
void gather_quantize(const RowRouting& routing, const void* x, bool x_is_e4m3, int64_t hidden, const float* x_scale,
                     bool x_scale_per_token, const uint32_t* amax_bits, const float* w1_alpha, uint8_t* a_out,
                     float* s1, cudaStream_t stream);

// moe_activation_requant.cu ----------------------------------------------------------------------
struct ActivationArgs {
  Activation activation;
  GateUpLayout layout;
  float swiglu_alpha, swiglu_beta, swiglu_limit;
  float situ_beta;
  bool has_situ_linear_beta;
  float situ_linear_beta;
};
// amax_bits = max over valid rows r and i in [0, I) of the bits of |act(h[r])[i]|.
void activation_amax(const RowRouting& routing, const float* h, int64_t rows1, int64_t inter,
                     const ActivationArgs& act, uint32_t* amax_bits, cudaStream_t stream);
// a2 = a2_static[0] or dynamic(amax_bits) (a2_static == nullptr); for valid rows r:
//   a_out[r, i] = e4m3(act(h[r])[i] / a2), s2[r] = a2 * (w2_alpha ? w2_alpha[e] : 1)
void activation_requant(const RowRouting& routing, const float* h, int64_t rows1, int64_t inter,
                        const ActivationArgs& act, const float* a2_static, const uint32_t* amax_bits,
                        const float* w2_alpha, uint8_t* a_out, float* s2, cudaStream_t stream);

// moe_finalize.cu --------------------------------------------------------------------------------
// Per token t and feature n, slots j in order, row_j = y[output_permutation[t*k + j]] (bf16; -1 skipped):
//   deterministic: out = round_out(rsf * sum_j (w[t,j] * row_j))          (fp32 mul, fp32 add)
//   fused:         o = 0; o = round_out(o + bf16(rsf * w[t,j] * row_j))   (the reference's fused rounding)
// out: bf16 / f16 / f32 [T, H]; every element written (0 for a token without a local slot).
void finalize(const uint16_t* y, const int32_t* output_permutation, const float* topk_weights, int64_t tokens,
              int topk, int64_t hidden, float routed_scaling_factor, bool deterministic, DType out_dtype, void* out,
              cudaStream_t stream);

}  // namespace qmoe::cuda::fused
