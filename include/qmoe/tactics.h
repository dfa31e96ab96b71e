// Tactics of the W4A8 grouped GEMM: a pure function of the problem picks one; users may force
// one (tactic=), and an impossible forced tactic is an error, never a silent fallback.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qmoe {

struct GemmProblem {
  int64_t n = 0;            // output features (weight rows)
  int64_t k = 0;            // reduction
  int64_t total_rows = 0;   // rows of A (all experts)
  int64_t num_experts = 0;  // groups
  int64_t topk = 8;
  // false: the W4A8 grouped GEMM (int4 x e4m3: cutlass_w4a8_moe_mm, fused w4a8_int4);
  // true: the bf16 x 4-bit grouped GEMM of the fused w4a16, w4a16_int4, w4a4 and w4a8 modes
  // (src/cuda/gemm/sm90_grouped_gemm_bf16_w4.h), whose FP4 weights allow K % 32 == 0.
  bool bf16_activations = false;
  // With bf16_activations: the weights are FP4 (NVFP4 / MXFP4), not int4-g128. Only the choice between
  // the 128- and 160-token WGMMA tiles depends on it (their relative cost differs by format).
  bool fp4_weights = false;
  // W4A8 only: the caller gave a scratch for the activations in the decode tiles' fp16 K slots (W4A8MoeMmArgs::a_slots),
  // so the 16-token tile runs without its per-warp unpack where activation_slots_pay, and then also takes 8 rows
  // per expert from the 8-token tile.
  bool activation_slots = false;
};

struct Tactic {
  enum class Family { kDecode, kPrefill };
  Family family = Family::kDecode;
  int tile_m = 128;  // weight rows (output features) per CTA tile: the MMA M side (swap-AB)
  int tile_n = 16;   // token rows per CTA tile: the MMA N side
  int tile_k = 256;  // K per pipeline stage (a multiple of the 128-wide scale group)
  int split_k = 1;   // no compiled tactic splits K yet

  std::string name() const;  // e.g. "decode_m128_n16_k256"
  bool operator==(const Tactic& o) const {
    return family == o.family && tile_m == o.tile_m && tile_n == o.tile_n && tile_k == o.tile_k &&
           split_k == o.split_k;
  }
};

// Every tactic compiled into the library that can run this problem.
std::vector<Tactic> valid_tactics(const GemmProblem& problem);
// The heuristic choice (pure; logs it once when QMOE_LOG_TACTICS=1).
Tactic select_tactic(const GemmProblem& problem);
// Whether the W4A8 GEMM converts the activations once into fp16 K slots for this tactic (given a scratch): only the
// 16-token decode tile, on shapes where the tile's gain outweighs the conversion pass (K >= 2048, N >= 3072) and
// K % 512 == 0.
bool activation_slots_pay(const GemmProblem& problem, const Tactic& tactic);
// Parses Tactic::name() (a tactic of either kernel); throws qmoe::Error on an unknown name.
Tactic parse_tactic(const std::string& name);

}  // namespace qmoe
