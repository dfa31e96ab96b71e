// GPU fused MoE for quant_modes w4a16, w4a16_int4, w4a4 (NVFP4) and w4a8 (MXFP8 x MXFP4)
// (DESIGN.md 1, 3, 3b, 4, 5.2; include/qmoe/fused_moe.h): Hopper has no FP4 tensor cores, so both
// GEMMs take bf16 activations (exact dequantizations of the quantized operands) against 4-bit
// weights decoded in the GEMM (src/cuda/gemm/sm90_grouped_gemm_bf16_w4.h). Composition of simple
// kernels, all on `stream`, no host sync, no allocation (CUDA-graph capturable). Arguments are
// validated by qmoe::fused_moe (src/api/fused_moe.cpp), which also checks the GPU limits and the
// workspace (layout: fused_moe_workspace.h, fused_moe_bf16_w4_workspace_layout).
//
//   1. local ids      topk_ids -> local expert ids (-1: not local)               moe_gather_quantize.cu
//   2. routing        moe_mm_data(local ids, E_l): offsets, sizes, permutations   routing/sm90_moe_mm_data.cu
//      (steps 1-2 and the last one: moe_pipeline_steps.cu, shared by both pipelines; at decode, up to
//      kOwnRowsMaxSlots slots, step 2 runs after step 3, alongside it: the gather finds its rows itself)
//   3. gather+dequant A1[r] = bf16 of x[t] (copy | e2m1*e4m3 | e4m3*2^s)          moe_gather_dequant.cu
//                     s1[r] = w1_alpha[e] * per_token_scale[t] (each optional)
//   4. GEMM1          h[r] = s1[r] * W13[e] . A1[r]  (fp32 output)                gemm/sm90_grouped_gemm_bf16_w4
//   5. act + requant  A2[r] = bf16(md(act(h[r]))), s2[r] = w2_alpha[e] (* row_scale) moe_activation_requant.cu
//      (4-5 as one kernel, GEMM1's fused epilogue, with a 128-row decode tactic and the sizes and modes of
//      gemm/bf16_act_requant.h, where bf16_act_pays; QMOE_FUSED_EPILOGUE=0 keeps them apart, =1 fuses
//      wherever supported)
//   6. GEMM2          y[r] = bf16(s2[r] * W2[e] . A2[r])                          gemm/sm90_grouped_gemm_bf16_w4
//   7. finalize       out[t] = combine of w[t, j] * y[row(t, j)] in slot order    moe_finalize.cu
//                     (or, for moe_expert_rows, slot_rows[s] = y[row(s)])
// Fused finalize (deterministic == false, fused_moe) when GEMM2 runs a decode tile: out is zeroed
// first (on aux_stream when given, joined back before GEMM2) and GEMM2's epilogue adds
// bf16(rsf * w[s] * s2[r] * acc) into out[t] atomically (gemm/grouped_gemm_epilogue.cuh): no y
// write, no step 7. Prefill tiles keep y and step 7 (its fused rounding order; faster there).
//
// Weights: int4-g128 (w4a16_int4, SGLang's stored scale layout), NVFP4 (w4a4, w4a16: e4m3 scales,
// 128x4 swizzle) or MXFP4 (w4a8: ue8m0 scales, 128x4 swizzle), passed to the GEMM exactly as the
// fused API receives them. Scales as in the reference (src/reference/fused_moe.cpp): GEMM1
// h = acc * (w1_alpha * s1(t)); GEMM2 y = (s2 * w2_alpha) * acc. The GEMM's fp32 accumulation
// replaces the reference's fp64 dot products (the tolerance of DESIGN.md 7 covers it).
// No workspace byte is zeroed: every workspace element a kernel reads was written earlier in the same call
// (per-row kernels stop at expert_offsets[E_l], read on the device; the GEMMs read only rows inside
// their expert's block). y reuses a1's bytes (a1 is dead once GEMM1 has run on this stream).
// Limits (checked by the caller before anything runs): E_l <= 1024; H % 32 == 0 and I % 32 == 0
// (FP4 weights: the GEMM's K step; int4: 128 already); x, weights and scales 16-byte aligned.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_guard.h"
#include "cuda/common/pdl.cuh"
#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/fused/fused_moe_workspace.h"
#include "cuda/gemm/bf16_act_requant.h"
#include "cuda/gemm/sm90_grouped_gemm_bf16_w4.h"
#include "cuda/launch.h"
#include "qmoe/error.h"

namespace qmoe::cuda {

namespace {

W4Format weight_format(QuantMode mode) {
  switch (mode) {
    case QuantMode::kW4A16Int4: return W4Format::kInt4G128;
    case QuantMode::kW4A8Mx: return W4Format::kMxfp4;
    default: return W4Format::kNvfp4;  // w4a4, w4a16
  }
}

fused::ActivationInput activation_input(QuantMode mode) {
  switch (mode) {
    case QuantMode::kW4A4: return fused::ActivationInput::kNvfp4;
    case QuantMode::kW4A8Mx: return fused::ActivationInput::kMxfp8;
    default: return fused::ActivationInput::kBf16;  // w4a16, w4a16_int4
  }
}

fused::Bf16Requant requant_of(const FusedMoeParams& p) {
  switch (p.quant_mode) {
    case QuantMode::kW4A4:
      return p.per_token_scale.has_value() ? fused::Bf16Requant::kNvfp4PerToken : fused::Bf16Requant::kNvfp4;
    case QuantMode::kW4A8Mx: return fused::Bf16Requant::kMxfp8;
    default: return fused::Bf16Requant::kBf16;  // w4a16, w4a16_int4
  }
}

const float* optional_f32(const std::optional<TensorRef>& t) { return t ? t->ptr<const float>() : nullptr; }

}  // namespace

void fused_moe_bf16_w4(const FusedMoeParams& p, const Tactic& gemm1_tactic, const Tactic& gemm2_tactic,
                       void* workspace, void* slot_rows, cudaStream_t stream) {
  const QuantMode mode = p.quant_mode;
  if (mode == QuantMode::kW4A8Int4)  // a caller bug, not a user error: that mode has its own pipeline
    throw Error("quant_mode", "w4a16, w4a16_int4, w4a4 or w4a8 (fused_moe_bf16_w4)", "w4a8_int4",
                ErrorKind::kRuntime);
  const FusedMoeDims dims = fused_moe_dims(p);
  if (dims.tokens == 0) return;  // an empty [0, H] output: nothing to write
  const int device = p.x.device_index;
  DeviceGuard current(device);
  PdlScope pdl(p.enable_pdl);  // every launch of this call (cuda/common/pdl.cuh)
  const bool gemm_pdl = p.enable_pdl && fused::gemm_pdl_wanted(dims.tokens);  // the GEMMs' own (fused_moe_kernels.h)

  const FusedMoeBf16W4WorkspaceLayout layout =
      fused_moe_bf16_w4_workspace_layout(dims.slots, dims.local, dims.hidden, dims.inter, dims.rows1);
  uint8_t* base = static_cast<uint8_t*>(workspace);
  auto at = [base](int64_t offset) { return base + offset; };
  const fused::RoutingBuffers rb = fused::routing_buffers(layout, base);
  uint16_t* a1 = reinterpret_cast<uint16_t*>(at(layout.a1));
  float* s1 = reinterpret_cast<float*>(at(layout.s1));
  float* h = reinterpret_cast<float*>(at(layout.h));
  uint16_t* a2 = reinterpret_cast<uint16_t*>(at(layout.a2));
  float* s2 = reinterpret_cast<float*>(at(layout.s2));
  uint16_t* y = reinterpret_cast<uint16_t*>(at(layout.y));  // == a1 (fused_moe_workspace.h)

  // The fused finalize: GEMM2 adds into the zeroed output (memset forked onto aux_stream, if any).
  const RowScatterAdd scatter = fused::fused_finalize_scatter(p, rb.input_permutation, slot_rows, gemm2_tactic,
                                                                /*pipeline_scatters=*/true);
  if (scatter.out != nullptr) fused::zero_output_fork(p, stream);

  // 1-2. Routing over the local experts (as the w4a8_int4 pipeline: at decode the gather finds its own rows
  // and runs first, the routing kernel alongside it).
  // (H > 0: the gather then launches, and the routing kernel, which does not wait at its start, follows it.)
  const bool own_rows = fused::gather_finds_rows(dims.slots) && dims.hidden > 0;
  const fused::RowRouting routing = fused::local_routing(p, rb, own_rows, stream);
  if (!own_rows) fused::route_rows(p, routing, rb, dims.hidden, dims.inter, /*overlap_previous=*/false, stream);

  // 3. GEMM1's bf16 operand and per-row scale.
  fused::gather_dequantize(routing, activation_input(mode), p.x.data,
                           p.x_scale ? p.x_scale->ptr<const uint8_t>() : nullptr, dims.hidden,
                           optional_f32(p.per_token_scale), optional_f32(p.w1_alpha), a1, s1, stream);
  if (own_rows) fused::route_rows(p, routing, rb, dims.hidden, dims.inter, /*overlap_previous=*/true, stream);

  // One grouped GEMM of the pipeline: d [slots, n] = a [slots, k] x w^T, per-row scale s; the expert
  // blocks come from the routing buffers on the device. ep: GEMM1's fused activation epilogue instead of d.
  const W4Format format = weight_format(mode);
  auto grouped_gemm = [&](void* d, bool d_fp32, int64_t n, const uint16_t* a, int64_t k, const TensorRef& w,
                          const TensorRef& w_scale, const float* s, const int32_t* sizes, const Tactic& tactic,
                          const RowScatterAdd& sc, const Bf16ActEpilogue* ep = nullptr) {
    Bf16W4GemmArgs g;
    g.a = a;
    g.b = w.ptr<const uint8_t>();
    g.b_scales = w_scale.data;
    g.format = format;
    g.b_packed = p.fp4_weights_packed;
    g.row_scales = s;
    g.d = d;
    g.d_fp32 = d_fp32;
    g.expert_offsets = rb.offsets;
    g.problem_sizes = sizes;
    g.num_experts = static_cast<int>(dims.local);
    g.n = static_cast<int>(n);
    g.k = static_cast<int>(k);
    g.max_rows = dims.slots;
    g.scatter = sc;
    PdlScope gemm_scope(gemm_pdl);
    if (ep != nullptr)
      bf16_w4_moe_mm_act(g, tactic, stream, *ep);
    else
      bf16_w4_moe_mm(g, tactic, stream);
  };

  const fused::ActivationArgs act{p.activation,  p.gate_up_layout, p.swiglu_alpha,
                                  p.swiglu_beta, p.swiglu_limit,   p.situ_beta,
                                  p.situ_linear_beta.has_value(),  p.situ_linear_beta.value_or(1.0f)};
  const fused::Bf16Requant requant = requant_of(p);
  if (fused::fused_epilogue_allowed() && bf16_act_supported(gemm1_tactic, dims.rows1, dims.inter, act, requant) &&
      (fused::fused_epilogue_forced() || bf16_act_pays(gemm1_tactic, dims.slots, dims.local, dims.rows1, device))) {
    // 4-5. GEMM1 with the activation and the bf16 intermediate as its epilogue: A2 and s2, no h.
    Bf16ActEpilogue ep;
    ep.a2 = a2;
    ep.s2 = s2;
    ep.fc2_input_scale = optional_f32(p.fc2_input_scale);
    ep.w2_alpha = optional_f32(p.w2_alpha);
    ep.inter = static_cast<int>(dims.inter);
    ep.requant = requant;
    ep.act = act;
    grouped_gemm(h, true, dims.rows1, a1, dims.hidden, p.w1, p.w1_scale, s1, rb.sizes1, gemm1_tactic, RowScatterAdd{},
                 &ep);
  } else {
    // 4. GEMM1 into fp32 h.
    grouped_gemm(h, true, dims.rows1, a1, dims.hidden, p.w1, p.w1_scale, s1, rb.sizes1, gemm1_tactic, RowScatterAdd{});
    // 5. Activation and the bf16 intermediate.
    fused::activation_requant_bf16(routing, h, dims.rows1, dims.inter, act, requant, optional_f32(p.fc2_input_scale),
                                   optional_f32(p.w2_alpha), a2, s2, stream);
  }

  // 6. GEMM2 into bf16 rows (over a1's bytes: GEMM1 has run), or (fused finalize) added into the
  // zeroed output.
  if (scatter.out != nullptr) fused::zero_output_join(p, stream);
  grouped_gemm(y, false, dims.hidden, a2, dims.inter, p.w2, p.w2_scale, s2, rb.sizes2, gemm2_tactic, scatter);

  // 7. Back to token order (or, for moe_expert_rows, to flat slot order without combining).
  if (scatter.out == nullptr) fused::finish_rows(p, y, rb.output_permutation, dims.hidden, slot_rows, stream);
}

}  // namespace qmoe::cuda
