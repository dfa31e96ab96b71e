// Scratch layouts of the GPU fused MoE pipelines, shared by qmoe::fused_moe_workspace_size
// (src/api/fused_moe.cpp) and the pipelines, so the size the caller allocates and the offsets the
// kernels use cannot drift apart. Plain C++ (no CUDA types): CPU-only builds compute the same size.
//
// S = T * top_k slots bound every per-row buffer (the real row count, expert_offsets[E_l], lives on
// the device only). Sub-buffers, each starting at a multiple of kAlign bytes from the base.
//
// w4a8_int4 (sm90_fused_moe_w4a8_int4.cu), fused_moe_workspace_layout:
//   local_ids          int32 [S]        topk_ids shifted to local expert ids, -1 when not local
//   expert_offsets     int32 [E_l + 1]  routing (qmoe::cuda::moe_mm_data on local_ids)
//   problem_sizes1/2   int32 [E_l, 3]
//   input_permutation  int32 [S]        row -> flat slot
//   output_permutation int32 [S]        flat slot -> row (-1: not local)
//   a1                 e4m3  [S, H]     GEMM1 operand, rows in expert order
//   s1                 f32   [S]        GEMM1 per-row scale a1(t) * w1_alpha[e]
//   h                  f32   [S, R1]    GEMM1 output (R1 = 2I gated, I for relu2), never rounded
//   a2                 e4m3  [S, I]     GEMM2 operand e4m3(act(h) / a2)
//   s2                 f32   [S]        GEMM2 per-row scale a2 * w2_alpha[e]
//   y                  bf16  [S, H]     GEMM2 output rows
//   scalars            u32   [4]        [0] amax bits of |x|, [1] amax bits of |act| (dynamic scales)
//
// w4a16, w4a16_int4, w4a4, w4a8 (sm90_fused_moe_bf16_w4.cu), fused_moe_bf16_w4_workspace_layout:
//   local_ids .. output_permutation     as above
//   a1                 bf16  [S, H]     GEMM1 operand: x dequantized (exactly) to bf16, expert order
//   s1                 f32   [S]        GEMM1 per-row scale w1_alpha[e] * per_token_scale[t]
//   h                  f32   [S, R1]    GEMM1 output, never rounded
//   a2                 bf16  [S, I]     GEMM2 operand: the requantized intermediate md (exact in bf16)
//   s2                 f32   [S]        GEMM2 per-row scale (w2_alpha[e], times row_scale per token)
//   y                  bf16  [S, H]     GEMM2 output rows: the SAME bytes as a1 (y == a1 offset).
// NOTE: y may reuse a1 because every kernel of the pipeline runs in order on one stream: GEMM1 (the
// last reader of a1) has finished before GEMM2 (the writer of y) starts. This saves S * H * 2 bytes.
#pragma once

#include <cstdint>

#include "qmoe/fused_moe.h"

namespace qmoe::cuda {

// Sizes of one validated call as the GPU pipelines see them (also the workspace size's inputs).
struct FusedMoeDims {
  int64_t tokens, topk, slots, hidden, inter, rows1, local;
};
inline FusedMoeDims fused_moe_dims(const FusedMoeParams& p) {
  FusedMoeDims d;
  d.tokens = p.topk_ids.size(0);
  d.topk = p.topk_ids.size(1);
  d.slots = d.tokens * d.topk;
  d.hidden = p.w2.size(1);
  d.inter = 2 * p.w2.size(2);
  d.rows1 = p.activation != Activation::kRelu2 ? 2 * d.inter : d.inter;  // W1 rows: 2I gated, I for ReLU^2
  d.local = p.num_local_experts == 0 ? p.num_experts : p.num_local_experts;
  return d;
}

namespace workspace_detail {
// Hands out consecutive sub-buffers, each rounded up to `align` bytes.
struct Cursor {
  int64_t align;
  int64_t at = 0;
  int64_t take(int64_t bytes) {
    const int64_t offset = at;
    at += (bytes + align - 1) / align * align;
    return offset;
  }
};
}  // namespace workspace_detail

struct FusedMoeWorkspaceLayout {
  static constexpr int64_t kAlign = 256;  // cudaMalloc's alignment: every sub-buffer as aligned as the base
  static constexpr int64_t kScalars = 4;
  int64_t local_ids = 0, expert_offsets = 0, problem_sizes1 = 0, problem_sizes2 = 0;
  int64_t input_permutation = 0, output_permutation = 0;
  int64_t a1 = 0, s1 = 0, h = 0, a2 = 0, s2 = 0, y = 0, scalars = 0;
  int64_t total = 0;  // bytes
};

// The routing buffers, first in both layouts.
template <class Layout>
void take_routing(workspace_detail::Cursor& c, Layout& l, int64_t slots, int64_t local_experts) {
  l.local_ids = c.take(4 * slots);
  l.expert_offsets = c.take(4 * (local_experts + 1));
  l.problem_sizes1 = c.take(4 * 3 * local_experts);
  l.problem_sizes2 = c.take(4 * 3 * local_experts);
  l.input_permutation = c.take(4 * slots);
  l.output_permutation = c.take(4 * slots);
}

// slots = T * top_k, local_experts = E_l, hidden = H, inter = I, rows1 = W1 rows (2I or I).
inline FusedMoeWorkspaceLayout fused_moe_workspace_layout(int64_t slots, int64_t local_experts, int64_t hidden,
                                                          int64_t inter, int64_t rows1) {
  FusedMoeWorkspaceLayout l;
  workspace_detail::Cursor c{FusedMoeWorkspaceLayout::kAlign};
  take_routing(c, l, slots, local_experts);
  l.a1 = c.take(slots * hidden);
  l.s1 = c.take(4 * slots);
  l.h = c.take(4 * slots * rows1);
  l.a2 = c.take(slots * inter);
  l.s2 = c.take(4 * slots);
  l.y = c.take(2 * slots * hidden);
  l.scalars = c.take(4 * FusedMoeWorkspaceLayout::kScalars);
  l.total = c.at;
  return l;
}

struct FusedMoeBf16W4WorkspaceLayout {
  static constexpr int64_t kAlign = FusedMoeWorkspaceLayout::kAlign;
  int64_t local_ids = 0, expert_offsets = 0, problem_sizes1 = 0, problem_sizes2 = 0;
  int64_t input_permutation = 0, output_permutation = 0;
  int64_t a1 = 0, s1 = 0, h = 0, a2 = 0, s2 = 0;
  int64_t y = 0;      // == a1 (see the NOTE above)
  int64_t total = 0;  // bytes
};

// Same arguments as fused_moe_workspace_layout.
inline FusedMoeBf16W4WorkspaceLayout fused_moe_bf16_w4_workspace_layout(int64_t slots, int64_t local_experts,
                                                                        int64_t hidden, int64_t inter,
                                                                        int64_t rows1) {
  FusedMoeBf16W4WorkspaceLayout l;
  workspace_detail::Cursor c{FusedMoeBf16W4WorkspaceLayout::kAlign};
  take_routing(c, l, slots, local_experts);
  l.a1 = c.take(2 * slots * hidden);
  l.s1 = c.take(4 * slots);
  l.h = c.take(4 * slots * rows1);
  l.a2 = c.take(2 * slots * inter);
  l.s2 = c.take(4 * slots);
  l.y = l.a1;
  l.total = c.at;
  return l;
}

}  // namespace qmoe::cuda
