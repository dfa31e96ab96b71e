// The per-feature arithmetic of the w4a8_int4 intermediate (DESIGN.md 3b and 4), shared by the two
// places that compute it: the separate activation + requant kernel (moe_activation_requant.cu) and
// GEMM1's fused epilogue (gemm/sm90_grouped_gemm_w4a8_int4.cuh, ActE4m3 output). Both must give the
// same bits (the fused epilogue is checked against the separate path bit for bit), so both call these
// functions and nothing else:
//
//   v        = gated_value(act, g, u)     (ReLU^2, not gated: activation::relu2<float>(h))
//   q        = requant_value(v, a2)       = v / a2, IEEE round-to-nearest division (as the reference;
//                                            the separate kernel forms it as UniformDivisor(a2).divide(v),
//                                            the same bits: cuda/common/exact_rounding.cuh)
//   A2 code  = e4m3x2 / e4m3x4 of q       (fused_moe_common.cuh)
//   s2[r]    = s2_value(a2, w2_alpha, e)  = a2 * (w2_alpha ? w2_alpha[e] : 1)
//
// g and u must be the fp32 values GEMM1 stores into h (a_scale(r) * acc rounded once): the fused
// epilogue forms them with __fmul_rn so that the compiler cannot contract the product into a later
// add (the separate kernel reads them from memory, where no contraction is possible either).
// The bf16 intermediate of the FP4 / bf16-activation modes (activation_requant_bf16, and GEMM1's fused
// epilogue in the bf16 x 4-bit GEMM: gemm/bf16_act_requant.h) quantizes blocks of v with these, from the
// block's amax (the max of abs_bits over its values: order-free, NaN propagates):
//   NVFP4 (16)  sf = nvfp4_block_sf(gs, amax),  md = nvfp4_md(v, gs, UniformDivisor(sf), sf)
//   MXFP8 (32)  s  = mxfp8_block_s(amax),       md = mxfp8_md(v, 1 / s, s)
// Column of h (= row of W13) of a feature i: kGateUp gate = i, up = I + i; kUpGateInterleaved64
// up = 128 * (i / 64) + i % 64, gate = up + 64 (up_column).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/exact_rounding.cuh"  // UniformDivisor, e2m1_round
#include "cuda/fused/fused_moe_common.cuh"
#include "cuda/fused/fused_moe_kernels.h"  // ActivationArgs
#include "reference/activations.h"

namespace qmoe::cuda::fused {

// The gated activation of one feature from its gate and up values, the activation known at compile time
// (kSwiglu, kGegluTanh or kSitu): for epilogues that unroll over many values and branch once per tile.
template <Activation kAct>
__device__ __forceinline__ float gated_value_of(const ActivationArgs& a, float g, float u) {
  static_assert(kAct != Activation::kRelu2, "ReLU^2 is not gated");
  if constexpr (kAct == Activation::kSwiglu)
    return activation::swiglu<float>(g, u, a.swiglu_alpha, a.swiglu_beta, a.swiglu_limit);
  else if constexpr (kAct == Activation::kGegluTanh)
    return activation::geglu_tanh<float>(g, u);
  else
    return activation::situ<float>(g, u, a.situ_beta, a.has_situ_linear_beta, a.situ_linear_beta);
}

// The gated activation of one feature from its gate and up values (every activation but ReLU^2).
__device__ __forceinline__ float gated_value(const ActivationArgs& a, float g, float u) {
  switch (a.activation) {
    case Activation::kSwiglu: return gated_value_of<Activation::kSwiglu>(a, g, u);
    case Activation::kGegluTanh: return gated_value_of<Activation::kGegluTanh>(a, g, u);
    default: return gated_value_of<Activation::kSitu>(a, g, u);
  }
}

// Column of h holding the up value of feature i (gate = up + gate_offset).
__host__ __device__ __forceinline__ int64_t up_column(const ActivationArgs& a, int64_t inter, int64_t i,
                                                      int64_t* gate) {
  if (a.layout == GateUpLayout::kGateUp) {
    *gate = i;
    return inter + i;
  }
  const int64_t up = 128 * (i / 64) + i % 64;
  *gate = up + 64;
  return up;
}

// The value that becomes the e4m3 code: IEEE division, as the reference.
__device__ __forceinline__ float requant_value(float v, float a2) { return __fdiv_rn(v, a2); }

// GEMM2's per-row scale of a row of local expert e.
__device__ __forceinline__ float s2_value(float a2, const float* w2_alpha, int32_t e) {
  return a2 * (w2_alpha != nullptr ? w2_alpha[e] : 1.0f);
}

// NVFP4 block scale of the reference's nvfp4_block: e4m3(gs * amax / 6) as fp32.
__device__ __forceinline__ float nvfp4_block_sf(float gs, float amax) {
  return e4m3_to_float(e4m3_of(gs * amax / 6.0f));
}
// md = e2m1(v * gs / sf) * sf (0 when sf == 0); x / sf by one reciprocal and FMA corrections (bit-identical
// to the IEEE division, exact_rounding.cuh).
__device__ __forceinline__ float nvfp4_md(float v, float gs, const UniformDivisor& by_sf, float sf) {
  const float q = sf == 0.0f ? 0.0f : e2m1_round(by_sf.divide(__fmul_rn(v, gs)));
  return q * sf;
}
// MXFP8 block scale of the reference's mxfp8_block: the power of two ue8m0_ceil(amax / 448) (or NaN).
__device__ __forceinline__ float mxfp8_block_s(float amax) { return ue8m0_to_float(ue8m0_ceil(amax / 448.0f)); }
// md = e4m3(v / s) * s; inv = 1 / s (__frcp_rn: exact for a power of two, 2^-127 a subnormal), so v * inv
// is v / s rounded once.
__device__ __forceinline__ float mxfp8_md(float v, float inv, float s) {
  return e4m3_to_float(e4m3_of(__fmul_rn(v, inv))) * s;
}

}  // namespace qmoe::cuda::fused
