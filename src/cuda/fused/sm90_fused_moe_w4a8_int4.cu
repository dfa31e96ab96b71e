// GPU fused MoE for quant_mode w4a8_int4 (int4-g128 weights x FP8 activations; DESIGN.md 1, 3b,
// 4, 5.2; include/qmoe/fused_moe.h): composition of simple kernels, all on `stream`, no host
// sync, no allocation (CUDA-graph capturable). Arguments are validated by qmoe::fused_moe
// (src/api/fused_moe.cpp), which also checks the workspace (layout: fused_moe_workspace.h).
//
//   1. local ids      topk_ids -> local expert ids (-1: not local)              moe_gather_quantize.cu
//   2. routing        moe_mm_data(local ids, E_l): offsets, sizes, permutations  routing/sm90_moe_mm_data.cu
//      (steps 1-2 and the last one: moe_pipeline_steps.cu, shared by both pipelines; at decode, up to
//      kOwnRowsMaxSlots slots, step 2 runs after step 4, alongside it: the gather finds its rows itself)
//   3. (dynamic a1)   amax |x| over all tokens -> a1 = amax / 448 on the device  moe_gather_quantize.cu
//   4. gather+quant   A1[r] = e4m3(x[t] / a1(t)), s1[r] = a1(t) * w1_alpha[e]    moe_gather_quantize.cu
//   5. GEMM1          h[r] = s1[r] * W13[e] . A1[r]  (fp32 output)               gemm/sm90_grouped_gemm_w4a8_int4
//   6. (dynamic a2)   amax |act(h)| over all valid rows                          moe_activation_requant.cu
//   7. act + requant  A2[r] = e4m3(act(h[r]) / a2), s2[r] = a2 * w2_alpha[e]     moe_activation_requant.cu
//   8. GEMM2          y[r] = bf16(s2[r] * W2[e] . A2[r])                         gemm/sm90_grouped_gemm_w4a8_int4
//   9. finalize       out[t] = combine of w[t, j] * y[row(t, j)] in slot order   moe_finalize.cu
// Fused activation (static a2, GEMM1 on a tactic with the epilogue where it pays: act_requant_pays;
// QMOE_FUSED_EPILOGUE != "0"): steps 5-7 are one kernel, GEMM1's epilogue writes A2 and s2
// (gemm/w4a8_act_requant.h; bit for bit the separate path's, same arithmetic:
// fused/activation_math.cuh); h is not written. Otherwise (dynamic a2, the WGMMA tiles without
// QMOE_WGMMA_FUSED_EPILOGUE=1, the mma.sync prefill tile, the n8 tile's 3-CTA shape above 15 tiles per SM,
// QMOE_FUSED_EPILOGUE=0) the separate steps above.
// Fused finalize (deterministic == false, fused_moe): y and step 9 in its fused rounding order (per-add
// bf16 rounding, slot order). GEMM2's decode tiles can instead add bf16(rsf * w[s] * s2[r] * acc) into the
// zeroed out[t] atomically (gemm/grouped_gemm_epilogue.cuh; out zeroed on aux_stream when given), as the
// bf16 x 4-bit pipeline does, but here that measured 1-7% slower at T = 1-64 (bench/results/
// 2026-12-02_s27c_*): only with QMOE_DECODE_SCATTER=1 (fused_finalize_scatter).
//
// The only workspace zeroing is the two amax words (cudaMemsetAsync): every other workspace element a
// kernel reads was written earlier in the same call (per-row kernels stop at expert_offsets[E_l], read
// on the device; the GEMMs read only rows inside their expert's block).
// Limits: E_l <= 1024 (routing scan, GEMM work list); the GEMMs' 16-byte alignment of weights and
// scales (checked by the caller before anything runs).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/fused/fused_moe_workspace.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/sm90_grouped_gemm_w4a8_int4.cuh"  // w4a8_moe_mm with a RowScatterAdd
#include "cuda/gemm/w4a8_act_requant.h"
#include "cuda/launch.h"
#include "qmoe/error.h"

namespace qmoe::cuda {

namespace {

TensorRef device_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape, int device) {
  return make_tensor(data, dtype, shape, Device::kCUDA, device);
}

}  // namespace

void fused_moe_w4a8_int4(const FusedMoeParams& p, const Tactic& gemm1_tactic, const Tactic& gemm2_tactic,
                         void* workspace, void* slot_rows, cudaStream_t stream) {
  const FusedMoeDims dims = fused_moe_dims(p);
  if (dims.tokens == 0) return;  // an empty [0, H] output: nothing to write
  const int device = p.x.device_index;
  DeviceGuard current(device);
  PdlScope pdl(p.enable_pdl);  // every launch of this call (cuda/common/pdl.cuh)
  const bool gemm_pdl = p.enable_pdl && fused::gemm_pdl_wanted(dims.tokens);

  const FusedMoeWorkspaceLayout layout =
      fused_moe_workspace_layout(dims.slots, dims.local, dims.hidden, dims.inter, dims.rows1);
  uint8_t* base = static_cast<uint8_t*>(workspace);
  auto at = [base](int64_t offset) { return base + offset; };
  const fused::RoutingBuffers rb = fused::routing_buffers(layout, base);
  uint8_t* a1 = at(layout.a1);
  float* s1 = reinterpret_cast<float*>(at(layout.s1));
  float* h = reinterpret_cast<float*>(at(layout.h));
  uint8_t* a2 = at(layout.a2);
  float* s2 = reinterpret_cast<float*>(at(layout.s2));
  uint16_t* y = reinterpret_cast<uint16_t*>(at(layout.y));
  uint32_t* scalars = reinterpret_cast<uint32_t*>(at(layout.scalars));
  uint32_t* amax_x = scalars;
  uint32_t* amax_act = scalars + 1;

  const bool dynamic_a1 = !p.x_scale.has_value();
  const bool dynamic_a2 = !p.fc2_input_scale.has_value();
  if (dynamic_a1 || dynamic_a2)
    check_cuda(cudaMemsetAsync(scalars, 0, 4 * FusedMoeWorkspaceLayout::kScalars, stream),
               "cudaMemsetAsync(fused_moe amax)");
  // The fused finalize: GEMM2 adds into the zeroed output (memset forked onto aux_stream, if any).
  const RowScatterAdd scatter = fused::fused_finalize_scatter(p, rb.input_permutation, slot_rows, gemm2_tactic,
                                                                /*pipeline_scatters=*/false);
  if (scatter.out != nullptr) fused::zero_output_fork(p, stream);

  // 1-2. Routing over the local experts. At decode (gather_finds_rows) the gather finds its rows itself and
  // runs first; the routing kernel then runs alongside it (PDL) and waits for it at its end.
  // (H > 0: the gather then launches, and the routing kernel, which does not wait at its start, follows it.)
  const bool own_rows = fused::gather_finds_rows(dims.slots) && dims.hidden > 0;
  const fused::RowRouting routing = fused::local_routing(p, rb, own_rows, stream);
  if (!own_rows) fused::route_rows(p, routing, rb, dims.hidden, dims.inter, /*overlap_previous=*/false, stream);

  // 3-4. GEMM1's operand and per-row scale.
  const bool x_is_e4m3 = p.x.dtype == DType::kFloat8E4M3;
  if (dynamic_a1) fused::amax_bf16(p.x.ptr<const uint16_t>(), p.x.numel(), amax_x, stream);
  fused::gather_quantize(routing, p.x.data, x_is_e4m3, dims.hidden,
                         dynamic_a1 ? nullptr : p.x_scale->ptr<const float>(), !dynamic_a1 && p.x_scale->numel() > 1,
                         amax_x, p.w1_alpha ? p.w1_alpha->ptr<const float>() : nullptr, a1, s1, stream);
  if (own_rows) fused::route_rows(p, routing, rb, dims.hidden, dims.inter, /*overlap_previous=*/true, stream);

  // One grouped GEMM of the pipeline: d [slots, d_cols] = a [slots, a_cols] x w, per-row scale s; the
  // expert blocks come from the routing buffers on the device.
  auto grouped_gemm = [&](void* d, DType d_dtype, int64_t d_cols, void* a, int64_t a_cols, const TensorRef& w,
                          const TensorRef& w_scale, float* s, int32_t* sizes, const Tactic& tactic,
                          const RowScatterAdd& sc) {
    W4A8MoeMmArgs g;
    g.d = device_tensor(d, d_dtype, {dims.slots, d_cols}, device);
    g.a = device_tensor(a, DType::kFloat8E4M3, {dims.slots, a_cols}, device);
    g.b = w;
    g.a_scales = device_tensor(s, DType::kFloat32, {dims.slots}, device);
    g.b_scales = w_scale;
    g.expert_offsets = device_tensor(rb.offsets, DType::kInt32, {dims.local}, device);
    g.problem_sizes = device_tensor(sizes, DType::kInt32, {dims.local, 3}, device);
    g.topk = dims.topk;
    PdlScope gemm_scope(gemm_pdl);
    w4a8_moe_mm(g, tactic, stream, sc);
  };

  const fused::ActivationArgs act{p.activation,  p.gate_up_layout, p.swiglu_alpha,
                                  p.swiglu_beta, p.swiglu_limit,   p.situ_beta,
                                  p.situ_linear_beta.has_value(),  p.situ_linear_beta.value_or(1.0f)};
  const bool fuse_activation = !dynamic_a2 && fused::fused_epilogue_allowed() &&
                               act_requant_supported(gemm1_tactic, dims.rows1, dims.inter, p.activation) &&
                               (act_requant_pays(gemm1_tactic, dims.slots, dims.local, dims.rows1, device) ||
                                // =1 overrides the 3-CTA rule, not the WGMMA tiles' own opt-in
                                (fused::fused_epilogue_forced() && gemm1_tactic.family == Tactic::Family::kDecode));
  if (fuse_activation) {
    // 5-7. GEMM1 with the activation and the requantization as its epilogue: A2 and s2, no h.
    W4A8MoeMmArgs g;
    g.d = device_tensor(h, DType::kFloat32, {dims.slots, dims.rows1}, device);  // shape only: not written
    g.a = device_tensor(a1, DType::kFloat8E4M3, {dims.slots, dims.hidden}, device);
    g.b = p.w1;
    g.a_scales = device_tensor(s1, DType::kFloat32, {dims.slots}, device);
    g.b_scales = p.w1_scale;
    g.expert_offsets = device_tensor(rb.offsets, DType::kInt32, {dims.local}, device);
    g.problem_sizes = device_tensor(rb.sizes1, DType::kInt32, {dims.local, 3}, device);
    g.topk = dims.topk;
    ActRequantEpilogue ep;
    ep.a2 = a2;
    ep.s2 = s2;
    ep.a2_scale = p.fc2_input_scale->ptr<const float>();
    ep.w2_alpha = p.w2_alpha ? p.w2_alpha->ptr<const float>() : nullptr;
    ep.inter = static_cast<int>(dims.inter);
    ep.act = act;
    PdlScope gemm_scope(gemm_pdl);
    w4a8_moe_mm_act_requant(g, gemm1_tactic, stream, ep);
  } else {
    // 5. GEMM1 into fp32 h.
    grouped_gemm(h, DType::kFloat32, dims.rows1, a1, dims.hidden, p.w1, p.w1_scale, s1, rb.sizes1, gemm1_tactic,
                 RowScatterAdd{});

    // 6-7. Activation and requantization.
    if (dynamic_a2) fused::activation_amax(routing, h, dims.rows1, dims.inter, act, amax_act, stream);
    fused::activation_requant(routing, h, dims.rows1, dims.inter, act,
                              dynamic_a2 ? nullptr : p.fc2_input_scale->ptr<const float>(), amax_act,
                              p.w2_alpha ? p.w2_alpha->ptr<const float>() : nullptr, a2, s2, stream);
  }

  // 8. GEMM2 into bf16 rows, or (fused finalize) added into the zeroed output.
  if (scatter.out != nullptr) fused::zero_output_join(p, stream);
  grouped_gemm(y, DType::kBFloat16, dims.hidden, a2, dims.inter, p.w2, p.w2_scale, s2, rb.sizes2, gemm2_tactic,
               scatter);

  // 9. Back to token order (or, for moe_expert_rows, to flat slot order without combining).
  if (scatter.out == nullptr) fused::finish_rows(p, y, rb.output_permutation, dims.hidden, slot_rows, stream);
}

}  // namespace qmoe::cuda
