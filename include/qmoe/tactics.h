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
// Parses Tactic::name(); throws qmoe::Error on an unknown name.
Tactic parse_tactic(const std::string& name);

}  // namespace qmoe
