// GEMM1 of the w4a8_int4 fused MoE with the activation and the requantization as its epilogue
// (docs/design.md 6.3): instead of h [R, R1] fp32 the GEMM writes
//
//   A2[r, i] = e4m3(act(h[r, gate(i)], h[r, up(i)]) / a2)   (ReLU^2: e4m3(relu2(h[r, i]) / a2))
//   s2[r]    = a2 * (w2_alpha ? w2_alpha[e] : 1)             (e = the row's local expert)
//
// with h[r, n] = a_scale(r) * acc[r, n] exactly as the plain GEMM would store it, and the arithmetic of
// cuda/fused/activation_math.cuh, so A2 and s2 are bit for bit those of GEMM1 (fp32 h) followed by
// fused::activation_requant. h is never written. a2 = a2_scale[0] (static: fc2_input_scale).
//
// The mma.sync decode tactics have it (decode_m128_n8_k256, decode_m128_n16_k256, decode_m128_n24_k256, decode_m128_n32_k256,
// decode_m64_n8_k512, decode_m64_n32_k512: h parked in shared memory, act_requant_items.cuh), and the WGMMA tiles (all
// five token tiles, gated activations only: a feature's gate and up values meet in one thread's accumulators,
// act_store_tile in wgmma_building_blocks.cuh); gated activations need I % 64 == 0 (both layouts; the W4A8
// pipeline's GEMM2 already needs I % 128 == 0). act_requant_supported() says whether
// a call can take it; the caller keeps the separate kernels otherwise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/fused/fused_moe_kernels.h"  // ActivationArgs
#include "qmoe/grouped_gemm.h"
#include "qmoe/tactics.h"

namespace qmoe::cuda {

// Output tag of the GEMM kernels' fused activation epilogue (their OutT template argument).
struct ActE4m3 {};

struct ActRequantEpilogue {
  uint8_t* a2 = nullptr;             // e4m3 [R, I] (row-major, row stride I)
  float* s2 = nullptr;               // [R]
  const float* a2_scale = nullptr;   // [1] device: the static a2
  const float* w2_alpha = nullptr;   // [E] or nullptr (1)
  int inter = 0;                     // I
  fused::ActivationArgs act{};
};

// True when `tactic` is one of the mma.sync decode tactics with the fused epilogue and the sizes fit
// (gated: GEMM1 rows n == 2I, I % 64 == 0; ReLU^2: n == I, I % 2 == 0, mma.sync tiles only).
bool act_requant_supported(const Tactic& tactic, int64_t n, int64_t inter, Activation activation);

// Whether the fused epilogue is the faster path (H200, bench/results/2026-11-30_s5e_*: the layer with
// the fused epilogue vs QMOE_FUSED_EPILOGUE=0): it saves the activation kernel (2-6 us at T = 1) but
// stalls the CTA's main loop once per tile, which costs more than it saves where the n8 tile runs its
// many-tile shape (3 CTAs per SM, n8_tiles_fill_three_per_sm): DeepSeek-V3 T = 8 / 64 +2% / +3%,
// Qwen3-235B +5% / +2%. Since session 26 that shape has a fused instantiation of its own (3 stages, 3 CTAs
// per SM; before, the fused path ran the 4-stage shape there): against the separate kernels it saves 1-5% up
// to ~15 tiles per SM (Qwen3-30B T = 8-32, Qwen3-235B T = 4 / 8, DeepSeek-V3 T = 4) and costs 1-4% above
// (DeepSeek-V3 T >= 8, Mixtral T = 4 / 8, Qwen3-235B T >= 16; bench/results/2026-12-02_s26d_*). So: every
// supported tactic, the n8 tile's 3-CTA shape up to kFusedActN8MaxTilesPerSm tiles per SM. The WGMMA tiles only
// with QMOE_WGMMA_FUSED_EPILOGUE=1: bitwise right, but slower per prefill layer (sessions 7, 8, 14 with h parked in
// shared memory: 10-20%; session 29 in registers: GEMM1 +8-67%, layer +0.4-19%, bench/results/2026-12-03_s29b_*): the
// WGMMA kernels are issue-bound (int4 conversion, promotion), and the activation's ~40 instructions per value
// add to that, while the separate kernel hides them under its memory traffic.
// rows: GEMM1's rows (slots), num_experts: its experts (local), n: GEMM1's N.
constexpr int64_t kFusedActN8MaxTilesPerSm = 15;
bool act_requant_pays(const Tactic& tactic, int64_t rows, int64_t num_experts, int64_t n, int device);

// GEMM1 (args.d gives the fp32 h shape [R, n] only: nothing is written there) with the fused
// epilogue. Requires act_requant_supported(tactic, n, ep.inter, ep.act.activation).
void w4a8_moe_mm_act_requant(const W4A8MoeMmArgs& args, const Tactic& tactic, cudaStream_t stream,
                             const ActRequantEpilogue& ep);

}  // namespace qmoe::cuda
