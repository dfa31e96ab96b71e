// W4A8 grouped GEMM with SGLang's semantics (DESIGN.md 3.1, 5.1):
//
//   D[r, o] = bf16( a_scale(r) * sum_g S[e, o, g] * sum_{k in group g} A[r, k] * q[e, o, k] )
//
// for every row r in expert e's block [expert_offsets[e], expert_offsets[e] + problem_sizes[e][1]),
// fp32 accumulation, g increasing. a_scale(r) = a_scales[0] (per tensor, SGLang) or a_scales[r]
// (per row, a qmoe extension: a_scales of shape [R]). Rows outside every group are neither read
// nor written.
//
// Tensors: d bf16 [R, N]; a e4m3 [R, K]; b int4x2 (int8 storage) [E, N, K/2]; a_scales f32 [1] or [R];
// b_scales bf16 [E, K/512, 4N] (K % 512 == 0) or [E, K/128, N]; expert_offsets int32 [E] (start rows);
// problem_sizes int32 [E, 3] rows (N, M_e, K); a/b/d/s_strides int64 [E, 3] (accepted for
// compatibility; every entry must equal the leading dimension: K, K, N, N).
// Limits: K % 128 == 0, chunk_size == 128, N % 8 == 0, E <= 1024.
// a_slots (optional, a qmoe extension): uint8 [R, 2K + K/32] scratch on a's device, 16-byte aligned. Given it, the
// 16-token decode tile (where activation_slots_pay, qmoe/tactics.h) first writes the activations there as the
// fp16 operands of its MMAs with their bias sums, once per call instead of once per warp and feature tile, and then
// runs faster; the results are bitwise the same. Its contents are scratch (overwritten, never read back by the caller).
// The pass reads every row of a, also rows outside the groups (whose slots no tile reads).
// The Python wrappers pass one when it pays (qmoe._C.w4a8_activation_slots).
#pragma once

#include <cuda_runtime_api.h>

#include <optional>

#include "qmoe/tactics.h"
#include "qmoe/tensor.h"

namespace qmoe {

struct W4A8MoeMmArgs {
  TensorRef d, a, b, a_scales, b_scales, expert_offsets, problem_sizes;
  std::optional<TensorRef> a_strides, b_strides, d_strides, s_strides;
  std::optional<TensorRef> a_slots;
  int64_t chunk_size = 128;
  int64_t topk = 8;
};

// Validates everything (throws qmoe::Error before any work) then runs on the tensors' device.
void cutlass_w4a8_moe_mm(const W4A8MoeMmArgs& args, cudaStream_t stream = nullptr,
                         std::optional<Tactic> tactic = std::nullopt);

// Validation alone (used by tests and by the fused pipeline).
void validate_w4a8_moe_mm(const W4A8MoeMmArgs& args);

namespace reference {
void w4a8_moe_mm(const W4A8MoeMmArgs& args);
}  // namespace reference

}  // namespace qmoe
