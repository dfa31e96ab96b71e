// Host launchers of the small kernels the GPU fused MoE pipelines are composed of
// (sm90_fused_moe_w4a8_int4.cu; sm90_fused_moe_bf16_w4.cu for w4a16, w4a16_int4, w4a4, w4a8). Each takes device pointers, sizes and a stream, launches on the
// current device, allocates nothing, never synchronizes (CUDA-graph capturable) and throws
// qmoe::Error (kRuntime) when the launch fails. Per-row kernels read the row count
// expert_offsets[num_local] on the device and are launched over the bound S = T * top_k.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/gemm/grouped_gemm_epilogue.cuh"  // RowScatterAdd
#include "qmoe/fused_moe.h"
#include "qmoe/tactics.h"

namespace qmoe::cuda::fused {

// Routing metadata in the workspace (see fused_moe_workspace.h and include/qmoe/routing.h).
struct RowRouting {
  const int32_t* local_ids;          // [S] local expert of each flat slot kept by the routing (others: -1,
                                     // or the raw id when every expert is local)
  const int32_t* expert_offsets;     // [E_l + 1]; [E_l] = valid rows
  const int32_t* input_permutation;  // [S] row -> flat slot
  const int32_t* output_permutation; // [S] flat slot -> row, -1 for a slot the routing dropped
  int num_local;                     // E_l
  int topk;
  int64_t max_rows;                  // S
  // The gather runs before the routing kernel and finds each slot's row from local_ids itself (decode:
  // up to kOwnRowsMaxSlots slots; gather_finds_rows): expert_offsets and the permutations are not read.
  bool own_rows = false;
};

// Up to this many slots the gather finds its rows itself (each CTA ranks its token's k slots among all S
// ids in shared memory, O(k S / 32) per warp), so that it does not wait for the routing kernel, which then
// runs alongside it (PDL) instead of before it. QMOE_GATHER_OWN_ROWS=0 turns it off (A/B, tests).
constexpr int64_t kOwnRowsMaxSlots = 512;
constexpr int kMaxTopk = 16;  // fused_moe's limit on top_k
bool gather_finds_rows(int64_t slots);

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

// moe_gather_dequant.cu (bf16 x 4-bit pipeline) -------------------------------------------------
enum class ActivationInput {
  kBf16,   // x bf16 [T, H] (w4a16, w4a16_int4)
  kNvfp4,  // x e2m1 pairs [T, H/2], x_scale e4m3 [T, H/16] row-major (w4a4)
  kMxfp8,  // x e4m3 [T, H], x_scale ue8m0 [T, H/32] row-major (w4a8)
};
// For rows r < expert_offsets[E_l]: slot = input_permutation[r], t = slot / topk, e = local_ids[slot],
//   a_out[r, h] = bf16 of  x[t, h]                                (kBf16: a copy)
//                          e2m1(x[t, h]) * e4m3(x_scale[t, h/16])     (kNvfp4: exact in bf16)
//                          e4m3(x[t, h]) * 2^(x_scale[t, h/32] - 127) (kMxfp8: exact in bf16's normal range)
//   s1[r]       = (w1_alpha ? w1_alpha[e] : 1) * (per_token_scale ? per_token_scale[t] : 1)
// Limits: x 16-byte aligned, H % 8 == 0 (kBf16) or H % 32 == 0 (FP4 / FP8 inputs).
void gather_dequantize(const RowRouting& routing, ActivationInput input, const void* x, const uint8_t* x_scale,
                       int64_t hidden, const float* per_token_scale, const float* w1_alpha, uint16_t* a_out,
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

// The bf16 intermediate of the bf16 x 4-bit pipeline (src/reference/fused_moe.cpp, "Intermediate").
enum class Bf16Requant {
  kBf16,           // w4a16, w4a16_int4: md = bf16(v)
  kNvfp4,          // w4a4: NVFP4 per 16 along I with gs = fc2_input_scale[0]
  kNvfp4PerToken,  // w4a4 + per_token_scale: b = bf16(v), NVFP4 of b with gs = 1 / row_scale
  kMxfp8,          // w4a8: MXFP8 per 32 along I
};
// For valid rows r (e = local expert of the row), v[i] = act(h[r])[i] in fp32 (as activation_requant):
//   kBf16          md = v;                                          s2[r] = w2a
//   kNvfp4         sf = e4m3(gs * amax16 / 6), md = e2m1(v * gs / sf) * sf (0 when sf == 0);  s2[r] = w2a
//   kNvfp4PerToken b = bf16(v), rs = amax|b| * fc2_input_scale[0]; rs == 0: md = 0, s2[r] = 0;
//                  else md = NVFP4 of b with gs = 1 / rs (as kNvfp4);  s2[r] = w2a * rs
//   kMxfp8         s = 2^(ue8m0_ceil(amax32 / 448) - 127), md = e4m3(v / s) * s;  s2[r] = w2a
//   a_out[r, i] = bf16(md) (exact for the quantized modes); w2a = w2_alpha ? w2_alpha[e] : 1.
// Blocks (16 / 32) run along the logical I axis. Limits: I % 32 == 0.
void activation_requant_bf16(const RowRouting& routing, const float* h, int64_t rows1, int64_t inter,
                             const ActivationArgs& act, Bf16Requant requant, const float* fc2_input_scale,
                             const float* w2_alpha, uint16_t* a_out, float* s2, cudaStream_t stream);

// moe_finalize.cu --------------------------------------------------------------------------------
// Per token t and feature n, slots j in order, row_j = y[output_permutation[t*k + j]] (bf16; -1 skipped):
//   deterministic: out = round_out(rsf * sum_j (w[t,j] * row_j))          (fp32 mul, fp32 add)
//   fused:         o = 0; o = round_out(o + bf16(rsf * w[t,j] * row_j))   (the reference's fused rounding)
// out: bf16 / f16 / f32 [T, H]; every element written (0 for a token without a local slot).
void finalize(const uint16_t* y, const int32_t* output_permutation, const float* topk_weights, int64_t tokens,
              int topk, int64_t hidden, float routed_scaling_factor, bool deterministic, DType out_dtype, void* out,
              cudaStream_t stream);

// moe_pipeline_steps.cu: the first and last steps of both pipelines ------------------------------
// The routing buffers of a pipeline's workspace (fused_moe_workspace.h).
struct RoutingBuffers {
  int32_t* local_ids;           // [S]
  int32_t* offsets;             // [E_l + 1]
  int32_t* sizes1;              // [E_l, 3]
  int32_t* sizes2;              // [E_l, 3]
  int32_t* input_permutation;   // [S]
  int32_t* output_permutation;  // [S]
};
// The routing sub-buffers of a pipeline's workspace at base: both layouts of fused_moe_workspace.h
// start with them (take_routing) under the same names.
template <class Layout>
RoutingBuffers routing_buffers(const Layout& l, uint8_t* base) {
  auto at = [base](int64_t offset) { return reinterpret_cast<int32_t*>(base + offset); };
  return {at(l.local_ids),         at(l.expert_offsets),    at(l.problem_sizes1),
          at(l.problem_sizes2),    at(l.input_permutation), at(l.output_permutation)};
}
// The routing in two steps (a gather that finds its own rows runs between them): local_routing launches the
// local-ids kernel (expert parallelism only) and describes the buffers; route_rows launches moe_mm_data over
// the local experts (N = I for GEMM1's sizes, as SGLang's op; overlap_previous: alongside the kernel before
// it, which must not touch the routing buffers).
RowRouting local_routing(const FusedMoeParams& p, const RoutingBuffers& buffers, bool own_rows, cudaStream_t stream);
void route_rows(const FusedMoeParams& p, const RowRouting& routing, const RoutingBuffers& buffers, int64_t hidden,
                int64_t inter, bool overlap_previous, cudaStream_t stream);
// finalize(y) into p.output, or (slot_rows != nullptr, moe_expert_rows) scatter_slot_rows.
// Not called when GEMM2 scattered (fused_finalize_scatter(...).out != nullptr): nothing is left to do.
void finish_rows(const FusedMoeParams& p, const uint16_t* y, const int32_t* output_permutation, int64_t hidden,
                 void* slot_rows, cudaStream_t stream);

// Whether the two GEMMs of a pipeline get the PDL attribute (the glue kernels keep it whenever enable_pdl
// is on). In the w4a8_int4 pipeline the layer was 1-4% faster with it up to T = 4 but up to 7% (DeepSeek-V3,
// T = 16) and 14% (Mixtral, T = 64) slower above (bench/results/2026-11-30_s10a_nvidia_h200_split_k_pdl.md):
// a GEMM launched as a dependent holds SMs early, waiting, that its predecessor's later CTAs could use. So
// by default only up to kGemmPdlMaxTokens tokens (both pipelines; the bf16 x 4-bit one: session 23's A/B,
// bench/results/2026-12-02_s23_*). QMOE_PDL_GEMMS=0 / =1 force it off / on (A/B timing; read per call like
// QMOE_FUSED_EPILOGUE, a getenv: cheap and legal during stream capture).
constexpr int64_t kGemmPdlMaxTokens = 4;
bool gemm_pdl_wanted(int64_t tokens);

// QMOE_FUSED_EPILOGUE=0 forces the separate activation kernels in both pipelines (A/B timing, tests
// comparing both paths); =1 forces GEMM1's fused activation epilogue on the decode tiles wherever it is
// supported, also where the pipeline's rule (act_requant_pays, bf16_act_pays) would keep it off (the W4A8
// WGMMA tiles keep their own opt-in, QMOE_WGMMA_FUSED_EPILOGUE=1); unset or any other value: the rule.
// Read on every call (a getenv: cheap, and legal during stream capture), so one process can switch between calls.
bool fused_epilogue_allowed();  // QMOE_FUSED_EPILOGUE != "0"
bool fused_epilogue_forced();   // QMOE_FUSED_EPILOGUE == "1"

// The fused finalize as GEMM2's epilogue (DESIGN.md 5.2, use_fused_finalize): for fused_moe
// (slot_rows == nullptr) with p.deterministic == false in a pipeline whose decode tiles scatter
// (pipeline_scatters), the RowScatterAdd that makes GEMM2 add bf16(rsf * w[s] * v) into p.output[s / topk]
// (row_slot = input_permutation); otherwise (the deterministic finalize, moe_expert_rows, a GEMM2 tactic that
// is not a decode tile (measured slower there), an output not 4-byte aligned, which the paired 16-bit atomics
// need, or the w4a8_int4 pipeline, whose y + finalize kernel in its fused rounding order measured faster at
// decode: bench/results/2026-12-02_s27c_*) an empty one: GEMM2 writes y and finish_rows runs the finalize's
// fused mode. QMOE_DECODE_SCATTER=1 / =0 (read per call) force the scatter on / off wherever it can run (A/B,
// tests of the scatter path). Launches nothing.
RowScatterAdd fused_finalize_scatter(const FusedMoeParams& p, const int32_t* input_permutation, const void* slot_rows,
                                     const Tactic& gemm2_tactic, bool pipeline_scatters);
// Zeroing of p.output for the scatter, [T, H] contiguous (cudaMemsetAsync). p.aux_stream == nullptr:
// on `stream` now (zero_output_join does nothing). Otherwise fork/join: an event recorded on `stream`,
// aux_stream waits for it and runs the memset, and zero_output_join makes `stream` wait for the memset
// (call it before GEMM2), so the memset overlaps the kernels in between. The two events are created
// once per thread and device (cudaEventDisableTiming) and reused: no allocation per call, and event
// fork/join is legal inside a stream capture (the aux stream joins the capture). Call under the
// pipeline's DeviceGuard.
void zero_output_fork(const FusedMoeParams& p, cudaStream_t stream);
void zero_output_join(const FusedMoeParams& p, cudaStream_t stream);

// moe_expert_rows on the GPU (implemented in moe_finalize.cu): for every flat slot s with
// output_permutation[s] = r >= 0: slot_rows[s, :] = y[r, :] (bf16 copy); other slots untouched.
void scatter_slot_rows(const uint16_t* y, const int32_t* output_permutation, int64_t slots, int64_t hidden,
                       uint16_t* slot_rows, cudaStream_t stream);

}  // namespace qmoe::cuda::fused
