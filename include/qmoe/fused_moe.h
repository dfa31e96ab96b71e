// Fused MoE forward (DESIGN.md sections 1, 3b, 4, 5.2):
//
//   out[t] = rsf * sum over slots j whose expert e = topk_ids[t, j] is local:
//            topk_weights[t, j] * alpha2[e] * W2[e] . requant( act( alpha1[e] * W13[e] . x[t] ) )
//
// Quant modes (weights are LOCAL experts only, E_l = num_local_experts; I = intermediate size,
// W13 rows = 2I for gated activations, I for ReLU^2):
//   kW4A8Int4  x bf16 [T,H] (quantized inside as e4m3(x / a1)) or e4m3 [T,H]; x_scale = a1: f32 [1]
//              or [T] or none (dynamic amax/448 per tensor); w1 int4x2 [E_l, 2I, H/2], w1_scale bf16
//              SGLang stored layout; w2 int4x2 [E_l, H, I/2], w2_scale likewise; fc2_input_scale = a2:
//              f32 [1] or none (dynamic). Default gate/up layout: kGateUp (SGLang).
//   kW4A4      x fp4x2 [T,H/2], x_scale e4m3 [T,H/16] (row-major); weights fp4x2 with e4m3 scales in
//              the 128x4 swizzle ([E_l, rows_pad128, cols_pad4] bytes); w1_alpha, w2_alpha f32 [E_l];
//              fc2_input_scale f32 [1] (encode scale of the intermediate), required; optional
//              per_token_scale f32 [T].
//   kW4A8Mx    x e4m3 [T,H], x_scale ue8m0 [T,H/32]; weights fp4x2 with ue8m0 swizzled scales.
//   kW4A16     x bf16 [T,H]; weights NVFP4 (fp4x2 + e4m3 swizzled scales); bf16 intermediate.
//   kW4A16Int4 x bf16 [T,H]; weights int4-g128 as kW4A8Int4; bf16 intermediate.
// topk_ids int32 [T, k] (global expert ids), topk_weights f32 [T, k]; output bf16/f16/f32 [T, H],
// written (never accumulated into).
// Finalize (deterministic == false, the default): on the GPU, when GEMM2 runs a decode tile, the
// output is zeroed and GEMM2's epilogue adds every slot's bf16(rsf * w * row) into its token's row
// atomically (no per-slot buffer, no finalize pass; summation order, hence the last bits, vary run
// to run); with a prefill tile a finalize kernel does the same adds in slot order (measured faster
// there). deterministic == true: fixed-order fp32 sum per token, bitwise reproducible (DESIGN.md 3b).
#pragma once

#include <cuda_runtime_api.h>

#include <limits>
#include <optional>
#include <string>

#include "qmoe/tensor.h"

namespace qmoe {

enum class QuantMode { kW4A4, kW4A8Mx, kW4A16, kW4A8Int4, kW4A16Int4 };
enum class Activation { kSwiglu, kGegluTanh, kRelu2, kSitu };
enum class GateUpLayout {
  kGateUp,               // SGLang: rows [gate; up]
  kUpGateInterleaved64,  // FlashInfer: [up; gate] interleaved in 64-row groups
};

const char* quant_mode_name(QuantMode m);  // "w4a4", "w4a8", "w4a16", "w4a8_int4", "w4a16_int4"
bool quant_mode_from_name(const std::string& name, QuantMode* out);
const char* activation_name(Activation a);  // "swiglu", "geglu_tanh", "relu2", "situ"

struct FusedMoeParams {
  QuantMode quant_mode = QuantMode::kW4A8Int4;
  TensorRef x;
  std::optional<TensorRef> x_scale;
  TensorRef topk_ids, topk_weights;
  TensorRef w1, w1_scale;
  std::optional<TensorRef> w1_alpha;
  std::optional<TensorRef> fc2_input_scale;
  TensorRef w2, w2_scale;
  std::optional<TensorRef> w2_alpha;
  std::optional<TensorRef> per_token_scale;
  TensorRef output;

  int64_t num_experts = 0;        // global expert count
  int64_t num_local_experts = 0;  // 0 means num_experts
  int64_t local_expert_offset = 0;

  Activation activation = Activation::kSwiglu;
  float swiglu_alpha = 1.0f, swiglu_beta = 0.0f, swiglu_limit = std::numeric_limits<float>::max();
  float situ_beta = 1.0f;                   // SiTU only
  std::optional<float> situ_linear_beta;    // SiTU only
  GateUpLayout gate_up_layout = GateUpLayout::kGateUp;
  // FP4 weight modes (w4a4, w4a8, w4a16): w1 and w2 in qmoe's packed word order (pack_fp4_weights,
  // formats.h), which the GPU GEMMs decode with fewer instructions; same results. A qmoe extension.
  bool fp4_weights_packed = false;

  bool deterministic = false;  // false: fused (atomic) finalize; true: fixed-order fp32 sum
  float routed_scaling_factor = 1.0f;
  std::string tactic;          // empty: heuristic
  bool enable_pdl = true;      // CUDA: programmatic dependent launch between the pipeline's kernels
                               // (same results; FlashInfer's default)
  // CUDA, fused finalize (deterministic == false) only: a side stream for the zeroing of `output`,
  // forked from and joined back into the call's stream through events, so the memset overlaps the
  // kernels before GEMM2 (FlashInfer's aux_stream). nullptr: the memset runs on the call's stream.
  // Same device as the tensors. Ignored on CPU tensors, by moe_expert_rows and when deterministic.
  cudaStream_t aux_stream = nullptr;
};

// Throws qmoe::Error naming the first bad argument; no work is done.
void validate_fused_moe(const FusedMoeParams& p);
// Bytes of scratch the GPU path needs for this problem (0 on CPU).
int64_t fused_moe_workspace_size(const FusedMoeParams& p);
// Scratch bytes that suffice for every GPU call of one layer with at most max_tokens tokens (the size
// grows with T): what a caller allocates once so that calls of any smaller T can be graph-captured
// with the same buffer (FlashInfer's CuteDslMoEWrapper with use_cuda_graph). local_experts = E_l,
// inter = I; the activation decides whether W1 has 2I or I rows.
int64_t fused_moe_workspace_bound(QuantMode mode, int64_t max_tokens, int64_t topk, int64_t local_experts,
                                  int64_t hidden, int64_t inter, Activation activation);
// Runs on the tensors' device. workspace: CUDA buffer of fused_moe_workspace_size bytes (ignored on CPU).
void fused_moe(const FusedMoeParams& p, void* workspace = nullptr, int64_t workspace_bytes = 0,
               cudaStream_t stream = nullptr);

// ---- The two halves of the deterministic layer (expert parallelism, docs/expert-parallel.md) ----
//
//   moe_finalize(moe_expert_rows(p)) == fused_moe(p with deterministic = true), bit for bit.
//
// moe_expert_rows: rows bf16 [T*k, H]; for every valid local slot s = t*k + j (the routing rule
// of fused_moe) rows[s] = bf16(alpha2 * GEMM2 row), the routing weight NOT applied. Rows of other
// slots are left unwritten. p.output, p.deterministic and p.routed_scaling_factor are not used
// (topk_weights is checked but not read). CPU tensors run the reference (workspace and stream
// ignored); CUDA tensors run the GPU pipeline of the quant mode up to GEMM2 on `stream`, with the
// same checks as fused_moe and a caller-owned workspace of moe_expert_rows_workspace_size bytes
// (256-byte aligned, as cudaMalloc returns; it equals fused_moe_workspace_size of the same layer):
// no allocation, no host sync, CUDA-graph capturable.
void validate_moe_expert_rows(const FusedMoeParams& p, const TensorRef& rows);
int64_t moe_expert_rows_workspace_size(const FusedMoeParams& p, const TensorRef& rows);  // 0 on CPU
void moe_expert_rows(const FusedMoeParams& p, const TensorRef& rows, void* workspace = nullptr,
                     int64_t workspace_bytes = 0, cudaStream_t stream = nullptr);

// moe_finalize: out[t] = round_out(rsf * sum_j fp32(w[t,j] * row(t*k + j))), fp32 sum in slot order
// over the slots the routing rule keeps (0 <= e < num_experts, e in the local range); other rows are
// never read. row(s) = rows[s] with rows bf16 [T*k, H]; or, with row_index (int32 [T*k] or [T, k]),
// row(s) = rows[row_index[s]] with rows bf16 [R, H] (any R >= 0; a slot whose index is outside
// [0, R), e.g. -1, is skipped like a dropped slot): expert parallelism finalizes the received rows
// in place, without gathering them into slot order first (same arithmetic, same bits).
// topk_ids int32 [T, k]; topk_weights f32 [T, k]; output bf16/f16/f32 [T, H], written. CPU tensors
// run the reference; CUDA tensors a GPU kernel on `stream` with the same arithmetic (bit-identical),
// no allocation, no host sync (CUDA-graph capturable).
struct MoeFinalizeParams {
  TensorRef rows, topk_ids, topk_weights, output;
  std::optional<TensorRef> row_index;  // None: rows are in slot order
  int64_t num_experts = 0;
  int64_t num_local_experts = 0;  // 0 means num_experts
  int64_t local_expert_offset = 0;
  float routed_scaling_factor = 1.0f;
};
void validate_moe_finalize(const MoeFinalizeParams& p);
void moe_finalize(const MoeFinalizeParams& p, cudaStream_t stream = nullptr);

namespace reference {
void fused_moe(const FusedMoeParams& p);
void moe_expert_rows(const FusedMoeParams& p, const TensorRef& rows);
void moe_finalize(const MoeFinalizeParams& p);
}  // namespace reference

}  // namespace qmoe
