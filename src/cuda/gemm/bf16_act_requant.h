// GEMM1 of the bf16 x 4-bit fused MoE (w4a16, w4a16_int4, w4a4, w4a8) with the activation and the bf16
// intermediate as its epilogue (docs/design.md 6.3): instead of h [R, 2I] fp32 the GEMM writes
//
//   A2[r, i] = bf16(md(act(h[r, gate(i)], h[r, up(i)])))   (ReLU^2: md(relu2(h[r, i])))
//   s2[r]    = w2_alpha[e]  (1 when absent; e = the row's local expert)
//
// with h[r, n] = s1(r) * acc[r, n] exactly as the plain GEMM stores it and md the requantization of
// activation_requant_bf16 (kBf16: v; kNvfp4: per 16 features with gs = fc2_input_scale[0]; kMxfp8: per 32),
// through the functions of cuda/fused/activation_math.cuh, so A2 and s2 are bit for bit those of the
// separate path (GEMM1 into h, then activation_requant_bf16). h is never written.
//
// Where it runs: the 128-row mma.sync decode tiles decode_m128_n8_k256 (its 4-stage, 2-CTA shape) and
// decode_m128_n16_k256. Their fused form maps each warp's two 16-row fragments to the up rows and the
// gate rows of the same 16 features (gated) or to two 16-feature blocks (ReLU^2), so the activation and an
// NVFP4 block's amax stay in registers (shuffles inside the warp); an MXFP8 block (32 features) spans two
// warps, whose amaxes meet in shared memory behind one barrier. Gated activations need the
// up_gate_interleaved64 layout (a 128-row tile is then the up and gate rows of 64 features) and I % 64 == 0;
// ReLU^2 needs n == I. Not the per-token NVFP4 mode (its amax spans the whole row).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/fused/fused_moe_kernels.h"  // ActivationArgs, Bf16Requant
#include "cuda/gemm/sm90_grouped_gemm_bf16_w4.h"
#include "qmoe/tactics.h"

namespace qmoe::cuda {

// Output tag of the bf16 x 4-bit kernel's fused activation epilogue (its OutT template argument).
struct ActBf16 {};

struct Bf16ActEpilogue {
  uint16_t* a2 = nullptr;                    // bf16 [R, I] (row stride I)
  float* s2 = nullptr;                       // [R]
  const float* fc2_input_scale = nullptr;    // [1] device: gs (kNvfp4)
  const float* w2_alpha = nullptr;           // [E] or nullptr (1)
  int inter = 0;                             // I
  fused::Bf16Requant requant = fused::Bf16Requant::kBf16;
  fused::ActivationArgs act{};
};

// True when GEMM1 (rows n, I = inter) can take the fused epilogue with this tactic, activation, layout
// and requantization (see the top comment). Pure: tested on the host (tests/cpp/test_bf16_act_requant.cpp).
inline bool bf16_act_supported(const Tactic& tactic, int64_t n, int64_t inter, const fused::ActivationArgs& act,
                               fused::Bf16Requant requant) {
  // The configurations compiled with the fused epilogue (sm90_grouped_gemm_bf16_w4_launch.cuh: WITH_ACT).
  const bool tile = tactic.family == Tactic::Family::kDecode && tactic.tile_m == 128 && tactic.tile_k == 256 &&
                    tactic.split_k == 1 && (tactic.tile_n == 8 || tactic.tile_n == 16);
  if (!tile || requant == fused::Bf16Requant::kNvfp4PerToken || inter <= 0) return false;
  if (act.activation == Activation::kRelu2) return n == inter && inter % 32 == 0;
  return act.layout == GateUpLayout::kUpGateInterleaved64 && n == 2 * inter && inter % 64 == 0;
}

// Whether the fused epilogue is the faster path (H200, bench/results/2026-12-02_s23_*: the layer with
// QMOE_FUSED_EPILOGUE=1 vs 0): it saves the activation kernel, but its latency at the end of every tile is
// not hidden where n8 runs its 3-CTA shape (3 stages; n8_tiles_fill_three_per_sm): Mixtral / gpt-oss T = 8
// 1-5% slower there, T = 1 and the 2-CTA shapes 0-3% faster. Since session 26 the 3-CTA shape has a fused
// instantiation of its own (before, the fused path ran the 4-stage shape there): against the separate kernels
// (w4a4, packed weights; bench/results/2026-12-02_s26d_*) 3.4-3.5% faster at DeepSeek-V3 / Qwen3-235B T = 4
// (<= 9 tiles per SM), 0-1% at Qwen3-30B T = 8, gpt-oss T = 4 and Mixtral T = 2, and 1-7% slower from ~12 tiles
// per SM (Qwen3-30B T = 16, Qwen3-235B T = 8, DeepSeek-V3 T >= 16). So: every supported tactic, n8's 3-CTA shape
// up to kBf16FusedActN8MaxTilesPerSm tiles per SM (the W4A8 GEMM's fused epilogue pays up to 15: its separate
// activation kernel costs more). rows: GEMM1's rows (slots), n: GEMM1's N.
constexpr int64_t kBf16FusedActN8MaxTilesPerSm = 9;
bool bf16_act_pays(const Tactic& tactic, int64_t rows, int64_t num_experts, int64_t n, int device);

// GEMM1 with the fused epilogue (args.d is not written; args.d_fp32 and args.scatter are ignored).
// Requires bf16_act_supported(tactic, args.n, ep.inter, ep.act, ep.requant).
void bf16_w4_moe_mm_act(const Bf16W4GemmArgs& args, const Tactic& tactic, cudaStream_t stream,
                        const Bf16ActEpilogue& ep);

}  // namespace qmoe::cuda
