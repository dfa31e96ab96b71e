// Tests of the W4A8 grouped-GEMM tactics (src/tune/tactics.cpp): the heuristic at each threshold
// (estimated rows per expert = ceil(total_rows / num_experts): 5, or 8 from 64 experts on | 8-12 by K | 26 | 48),
// the compiled
// list, name round trips and errors.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "qmoe/error.h"
#include "qmoe/tactics.h"

namespace {

qmoe::GemmProblem problem(int64_t rows, int64_t experts = 256, int64_t n = 4096, int64_t k = 7168) {
  qmoe::GemmProblem p;
  p.n = n;
  p.k = k;
  p.total_rows = rows;
  p.num_experts = experts;
  p.topk = 8;
  return p;
}

std::string chosen(int64_t rows, int64_t experts = 256) { return qmoe::select_tactic(problem(rows, experts)).name(); }

TEST(Tactics, DecodeN8UpToFourRowsPerExpertOrEightWithManyExperts) {
  EXPECT_EQ(chosen(0), "decode_m128_n8_k256");
  EXPECT_EQ(chosen(8), "decode_m128_n8_k256");  // T=1, topk 8: 8 experts x 32 tiles >= 132 SMs
  EXPECT_EQ(chosen(4 * 256), "decode_m128_n8_k256");
  EXPECT_EQ(qmoe::select_tactic(problem(4 * 256)).family, qmoe::Tactic::Family::kDecode);
  EXPECT_EQ(chosen(5 * 256), "decode_m128_n8_k256");  // DeepSeek-V3 T=160: n8 1.34x faster than n16
  EXPECT_EQ(chosen(7 * 256), "decode_m128_n8_k256");
  EXPECT_EQ(chosen(7 * 64, 64), "decode_m128_n8_k256");
  EXPECT_EQ(chosen(8 * 256), "decode_m128_n8_k256");  // DeepSeek-V3 T=256 (s18e sweep)
  EXPECT_EQ(chosen(8 * 128, 128), "decode_m128_n8_k256");  // Qwen3 T=128
  EXPECT_EQ(chosen(4 * 63), "decode_m128_n8_k256");
  EXPECT_EQ(chosen(5 * 63, 63), "decode_m128_n8_k256");       // fewer than 64 experts: 5 rows
  EXPECT_EQ(chosen(5 * 63 + 1, 63), "decode_m128_n16_k256");
  EXPECT_EQ(chosen(5 * 8, 8), "decode_m128_n8_k256");          // Mixtral T = 20 (s36g: 139.9 vs n16 172.5 us)
  EXPECT_EQ(chosen(5 * 8 + 1, 8), "decode_m128_n16_k256");    // Mixtral: n16 from 6 rows
}

// With an a_slots scratch (activations in fp16 K slots) the 16-token tile takes 8 rows per expert from n8 where the
// slots pay (K >= 2048, N >= 3072), and only that tile uses them.
TEST(Tactics, ActivationSlotsMoveEightRowsToN16WhereTheyPay) {
  qmoe::GemmProblem p = problem(8 * 256);  // DeepSeek-V3 GEMM1, T = 256
  p.activation_slots = true;
  EXPECT_EQ(qmoe::select_tactic(p).name(), "decode_m128_n16_k256");
  EXPECT_TRUE(qmoe::activation_slots_pay(p, qmoe::select_tactic(p)));
  EXPECT_EQ(qmoe::select_tactic(problem(8 * 256)).name(), "decode_m128_n8_k256");  // without: as before
  EXPECT_FALSE(qmoe::activation_slots_pay(problem(8 * 256), qmoe::parse_tactic("decode_m128_n16_k256")));
  p.total_rows = 7 * 256;  // 7 rows: n8 either way
  EXPECT_EQ(qmoe::select_tactic(p).name(), "decode_m128_n8_k256");
  EXPECT_FALSE(qmoe::activation_slots_pay(p, qmoe::select_tactic(p)));
  qmoe::GemmProblem g2 = problem(8 * 256, 256, 7168, 2048);  // DeepSeek-V3 GEMM2: K = 2048 pays
  g2.activation_slots = true;
  EXPECT_EQ(qmoe::select_tactic(g2).name(), "decode_m128_n16_k256");
  qmoe::GemmProblem small = problem(8 * 128, 128, 1536, 2048);  // Qwen3-30B GEMM1: N < 3072
  small.activation_slots = true;
  EXPECT_EQ(qmoe::select_tactic(small).name(), "decode_m128_n8_k256");
  EXPECT_FALSE(qmoe::activation_slots_pay(small, qmoe::parse_tactic("decode_m128_n16_k256")));
  qmoe::GemmProblem short_k = problem(12 * 128, 128, 4096, 1536);  // Qwen3-235B GEMM2: K < 2048
  short_k.activation_slots = true;
  EXPECT_FALSE(qmoe::activation_slots_pay(short_k, qmoe::select_tactic(short_k)));
  p.total_rows = 12 * 256;  // n16 anyway: the slots pay there too; no other tile takes them
  EXPECT_TRUE(qmoe::activation_slots_pay(p, qmoe::select_tactic(p)));
  for (const char* other : {"decode_m128_n8_k256", "decode_m128_n24_k256", "prefill_m128_n32_k128"})
    EXPECT_FALSE(qmoe::activation_slots_pay(p, qmoe::parse_tactic(other))) << other;
}

TEST(Tactics, HalfHeightDecodeTilesWhenTheGridIsSmallerThanTheGpu) {
  auto pick = [](int64_t rows, int64_t experts, int64_t n) {
    return qmoe::select_tactic(problem(rows, experts, n)).name();
  };
  EXPECT_EQ(pick(1, 256, 4096), "decode_m32_n8_k512");      // one row: 32 tiles of 128, K = 7168
  EXPECT_EQ(pick(2, 8, 4096), "decode_m32_n8_k512");        // Mixtral GEMM2, T = 1: 2 x 32 tiles
  EXPECT_EQ(pick(8, 128, 1536), "decode_m64_n8_k512");      // Qwen3-30B GEMM1, T = 1: 8 x 12 tiles
  EXPECT_EQ(pick(8, 128, 2048), "decode_m64_n8_k512");      // Qwen3-30B GEMM2: 8 x 16 = 128 < 132
  EXPECT_EQ(pick(8, 256, 4096), "decode_m128_n8_k256");     // DeepSeek-V3 GEMM1, T = 1: 256 tiles
  EXPECT_EQ(pick(16, 8, 28672), "decode_m128_n8_k256");     // Mixtral GEMM1, T = 8: 8 x 224 tiles
  EXPECT_EQ(pick(0, 8, 4096), "decode_m128_n8_k256");       // no rows: nothing runs
  EXPECT_EQ(pick(48, 8, 4096), "decode_m128_n16_k256");     // 6 rows per expert: the n16 rule first
}

TEST(Tactics, QuarterHeightDecodeTilesOnlyForTinyGridsAlongALongK) {
  auto pick = [](int64_t rows, int64_t experts, int64_t n, int64_t k) {
    return qmoe::select_tactic(problem(rows, experts, n, k)).name();
  };
  EXPECT_EQ(pick(2, 8, 4096, 14336), "decode_m32_n8_k512");   // Mixtral GEMM2, T = 1: 64 n8 tiles
  EXPECT_EQ(pick(2, 8, 4224, 14336), "decode_m32_n8_k512");   // 2 x 33 = 66 n8 tiles: 132 of 64 rows
  EXPECT_EQ(pick(2, 8, 4352, 14336), "decode_m64_n8_k512");   // 2 x 34 = 68: the 64-row grid fills the GPU
  EXPECT_EQ(pick(4, 8, 4096, 14336), "decode_m64_n8_k512");   // Mixtral GEMM2, T = 2: up to 128 n8 tiles
  EXPECT_EQ(pick(2, 8, 4096, 2048), "decode_m64_n8_k512");    // a short K: no gain measured
  EXPECT_EQ(pick(8, 128, 1536, 2048), "decode_m64_n8_k512");  // Qwen3-30B GEMM1, T = 1
}

TEST(Tactics, DecodeN16Boundaries) {
  EXPECT_EQ(chosen(8 * 256 + 1), "decode_m128_n16_k256");
  EXPECT_EQ(chosen(8 * 64 + 1, 64), "decode_m128_n16_k256");
  EXPECT_EQ(chosen(9 * 256), "decode_m128_n16_k256");
  EXPECT_EQ(chosen(12 * 256), "decode_m128_n16_k256");  // DeepSeek-V3 T = 384 (s36a: 1732 vs n32 1851 us)
}

// s35b, s36a: the 32-token WGMMA tile from 13 rows per expert up to 26 (n24 is no longer chosen); from fewer rows where
// K is shorter or all tiles fit one wave (decode_n16_max_rows).
TEST(Tactics, WgmmaN32From13To26Rows) {
  EXPECT_EQ(chosen(12 * 256 + 1), "prefill_m128_n32_k128");
  EXPECT_EQ(qmoe::select_tactic(problem(12 * 256 + 1)).family, qmoe::Tactic::Family::kPrefill);
  EXPECT_EQ(chosen(14 * 256), "prefill_m128_n32_k128");     // DeepSeek-V3 T = 448 (1394 vs n16 1640)
  EXPECT_EQ(chosen(16 * 256), "prefill_m128_n32_k128");     // DeepSeek-V3 T = 512 (1576 vs n24 1703)
  EXPECT_EQ(chosen(19 * 256), "prefill_m128_n32_k128");
  EXPECT_EQ(chosen(26 * 256), "prefill_m128_n32_k128");     // DeepSeek-V3 T = 832, top-8
  EXPECT_EQ(chosen(96 * 2, 8), "prefill_m128_n32_k128");     // Mixtral T = 96: 24 rows per expert
  for (int64_t rows = 13; rows <= 26; ++rows)
    for (const auto& [experts, n, k] : {std::tuple<int64_t, int64_t, int64_t>{256, 4096, 7168}, {128, 3072, 4096},
                                        {128, 2048, 768}, {8, 28672, 4096}, {8, 4096, 14336}, {384, 4096, 7168}})
      EXPECT_EQ(qmoe::select_tactic(problem(rows * experts, experts, n, k)).name(), "prefill_m128_n32_k128")
          << rows << " rows, E " << experts << " N " << n << " K " << k;
}

// Where n16 hands over to the 32-token tile below 13 rows: the last n16 row count per K (and wave count).
TEST(Tactics, WgmmaN32BelowThirteenRowsByK) {
  auto pick = [](int64_t rows, int64_t experts, int64_t n, int64_t k) {
    return qmoe::select_tactic(problem(rows, experts, n, k)).name();
  };
  struct Case {
    int64_t experts, n, k, last_n16_rows;
    const char* what;
  };
  for (const auto& c : {Case{256, 4096, 7168, 12, "DeepSeek-V3 GEMM1 (long K, 2048 tiles)"},
                        Case{384, 4096, 7168, 12, "Kimi-K2 GEMM1"},
                        Case{128, 3072, 4096, 10, "Qwen3-235B GEMM1 (n32 1.06x at 11 rows)"},
                        Case{8, 28672, 4096, 10, "Mixtral GEMM1 (n32 1.06x at 11 rows)"},
                        Case{8, 4096, 14336, 10, "Mixtral GEMM2 (one wave: 8 x 32 tiles)"},
                        Case{8, 4096, 7168, 10, "Mixtral TP2 GEMM2 (one wave)"},
                        Case{128, 768, 4096, 10, "Qwen3-235B TP4 GEMM1 (n32 1.08x at 11)"},
                        Case{128, 1536, 2048, 9, "Qwen3-30B GEMM1 (n32 1.03x at 10)"},
                        Case{8, 4096, 1792, 9, "Mixtral TP8 GEMM2 (n32 1.05x at 10)"},
                        Case{8, 4096, 1536, 8, "K = 1536, few experts"}}) {
    EXPECT_EQ(pick(c.last_n16_rows * c.experts, c.experts, c.n, c.k), "decode_m128_n16_k256") << c.what;
    EXPECT_EQ(pick((c.last_n16_rows + 1) * c.experts, c.experts, c.n, c.k), "prefill_m128_n32_k128") << c.what;
  }
  // Many experts, K <= 1536: the n8 range (8 rows) hands over to the 32-token tile directly.
  EXPECT_EQ(pick(8 * 128, 128, 4096, 1536), "decode_m128_n8_k256");    // Qwen3-235B GEMM2, T = 128
  EXPECT_EQ(pick(9 * 128, 128, 4096, 1536), "prefill_m128_n32_k128");  // T = 144 (170 vs n16 181 us)
  EXPECT_EQ(pick(9 * 128, 128, 2048, 768), "prefill_m128_n32_k128");   // Qwen3-30B GEMM2 (54.5 vs 61.6)
  // One wave (33 x 8 = 264 tiles of 128 rows) against two (34 x 8) along K = 7168.
  EXPECT_EQ(pick(11 * 33, 33, 1024, 7168), "prefill_m128_n32_k128");
  EXPECT_EQ(pick(11 * 34, 34, 1024, 7168), "decode_m128_n16_k256");
}

// 27-48 rows: the 48-token tile while few experts pass 48 rows (its cost ~0.94 of the 64-token one), then 64.
TEST(Tactics, WgmmaN48ThenN64From27To48Rows) {
  EXPECT_EQ(chosen(26 * 256 + 1), "prefill_m128_n48_k128");
  EXPECT_EQ(chosen(28 * 256), "prefill_m128_n48_k128");  // DeepSeek-V3 T=896, top-8
  EXPECT_EQ(chosen(32 * 256), "prefill_m128_n48_k128");  // DeepSeek-V3 T=1024 (s34f: 0.93 of n64)
  EXPECT_EQ(chosen(36 * 256), "prefill_m128_n48_k128");
  EXPECT_EQ(chosen(40 * 256), "prefill_m128_n64_k128");  // ~10% of the experts would need a second 48-token tile
  EXPECT_EQ(chosen(48 * 256), "prefill_m128_n64_k128");  // DeepSeek-V3 T=1536 (s34f: n48 1.3x slower)
  EXPECT_EQ(chosen(48, 1), "prefill_m128_n48_k128");     // one expert: exactly 48 rows, one tile
  EXPECT_EQ(chosen(32 * 128, 128), "prefill_m128_n48_k128");  // Qwen3 T=512
}

// The 96-token tile (two K groups in flight, 0.84 of a 128-token tile) while one of it covers most experts (s24g).
TEST(Tactics, WgmmaN96From49Rows) {
  EXPECT_EQ(chosen(48 * 256 + 1), "prefill_m128_n96_k128");
  EXPECT_EQ(chosen(64 * 256), "prefill_m128_n96_k128");
  EXPECT_EQ(chosen(1024 * 8, 128), "prefill_m128_n96_k128");  // Qwen3-235B T=1024: 64 rows per expert
  EXPECT_EQ(chosen(256 * 2, 8), "prefill_m128_n96_k128");      // Mixtral T=256: 64 rows per expert
  EXPECT_EQ(chosen(80 * 256), "prefill_m128_n96_k128");        // 80 rows: 1.04 x 0.84 vs 1.0 expected tiles
}

TEST(Tactics, WgmmaN128Between) {
  EXPECT_EQ(chosen(100 * 256), "prefill_m128_n128_k128");       // 100 rows: 1.65 x 0.84 vs 1.0 expected tiles
  EXPECT_EQ(chosen(512 * 128, 128), "prefill_m128_n128_k128");  // Qwen3 T=8192: 5.8 x 0.84, 4.5, 3.9 x 1.18 tiles
  EXPECT_EQ(qmoe::select_tactic(problem(32768)).family, qmoe::Tactic::Family::kPrefill);
}

// The 160-token tile where its expected token tiles per expert (x its 1.18 cost) are fewer (s15c).
TEST(Tactics, WgmmaN160ByExpectedTiles) {
  EXPECT_EQ(chosen(32768), "prefill_m128_n160_k128");           // DeepSeek-V3 T=4096: 128 rows, 1.5 vs 1.0
  EXPECT_EQ(chosen(2048 * 8, 128), "prefill_m128_n160_k128");   // Qwen3 T=2048: 128 rows per expert
  EXPECT_EQ(chosen(256 * 256), "prefill_m128_n160_k128");       // 256 rows: 2.5 vs 2.0
  EXPECT_EQ(chosen(4096 * 2, 8), "prefill_m128_n160_k128");     // Mixtral T=4096: 1024 rows, 8.5 vs 7.0
  EXPECT_EQ(chosen(192 * 256), "prefill_m128_n128_k128");       // 192 rows: 2.0 vs 2.0
  EXPECT_EQ(chosen(100000, 1), "prefill_m128_n160_k128");       // one expert, no spread: 782 vs 625 tiles
  EXPECT_EQ(chosen(1 << 30, 1), "prefill_m128_n160_k128");      // huge counts stay cheap to decide
}

TEST(Tactics, EstimateUsesExpertCount) {
  // 40 rows over 8 experts is 5 per expert (decode n8); over 4 experts it is 10 (n16); 41 rows over
  // 8 experts rounds up to 6 (n16).
  EXPECT_EQ(chosen(40, 8), "decode_m128_n8_k256");
  EXPECT_EQ(chosen(40, 4), "decode_m128_n16_k256");
  EXPECT_EQ(chosen(41, 8), "decode_m128_n16_k256");
}

// More rows per expert never pick a smaller token tile (for a fixed model shape), in both GEMMs: the
// thresholds stay ordered whatever the expert count and N (one-wave rules included). The one exception:
// above 48 rows the 96-, 128- and 160-token WGMMA tiles alternate with the expected token-tile count.
TEST(Tactics, TokenTileGrowsWithRows) {
  for (bool bf16 : {false, true}) {
    for (int64_t experts : {1, 8, 16, 33, 34, 64, 128, 256, 1024}) {
      for (int64_t n : {256, 1024, 2048, 4096, 7168, 28672}) {
        int last = 0;
        for (int64_t rows_per_expert = 1; rows_per_expert <= 200; ++rows_per_expert) {
          auto p = problem(rows_per_expert * experts, experts, n);
          p.bf16_activations = bf16;
          const qmoe::Tactic t = qmoe::select_tactic(p);
          EXPECT_GE(t.tile_n, last) << (bf16 ? "bf16 " : "w4a8 ") << experts << " experts, N " << n << ", "
                                    << rows_per_expert << " rows: " << t.name();
          last = t.tile_n >= 96 ? (bf16 ? 128 : 96) : t.tile_n;
        }
      }
    }
  }
}

TEST(Tactics, SelectIsPure) {
  for (int64_t rows : {1, 9, 4097, 70000}) EXPECT_EQ(qmoe::select_tactic(problem(rows)), qmoe::select_tactic(problem(rows)));
}

TEST(Tactics, ValidContainsSelection) {
  for (int64_t rows : {0, 1, 8, 9, 1024, 1025, 4096, 8192, 8193, 16384, 32768}) {
    for (int64_t k : {128, 384, 2048, 7168}) {
      auto p = problem(rows, 256, 7168, k);
      auto valid = qmoe::valid_tactics(p);
      ASSERT_FALSE(valid.empty());
      bool found = false;
      for (const auto& t : valid) found = found || t == qmoe::select_tactic(p);
      EXPECT_TRUE(found) << rows << " " << k;
    }
  }
}

TEST(Tactics, NoValidTacticOutsideLimits) {
  EXPECT_TRUE(qmoe::valid_tactics(problem(8, 256, 4096, 2880)).empty());  // K % 128 != 0
  EXPECT_TRUE(qmoe::valid_tactics(problem(8, 256, 4100, 7168)).empty());  // N % 8 != 0
}

TEST(Tactics, NameRoundTrip) {
  auto valid = qmoe::valid_tactics(problem(8));
  EXPECT_EQ(valid.size(), 14u);
  for (const auto& t : valid) {
    EXPECT_EQ(qmoe::parse_tactic(t.name()), t);
    EXPECT_EQ(qmoe::parse_tactic(t.name()).name(), t.name());
  }
  auto decode = qmoe::parse_tactic("decode_m128_n16_k256");
  EXPECT_EQ(decode.family, qmoe::Tactic::Family::kDecode);
  EXPECT_EQ(decode.tile_m, 128);
  EXPECT_EQ(decode.tile_n, 16);
  EXPECT_EQ(decode.tile_k, 256);
  EXPECT_EQ(decode.split_k, 1);
}

TEST(Tactics, UnknownNameThrows) {
  for (const char* bad : {"", "decode", "decode_m128_n16_k128", "prefill_m128_n256_k128", "decode_m128_n8_k256_s2", "fast"}) {
    try {
      qmoe::parse_tactic(bad);
      FAIL() << "no error for '" << bad << "'";
    } catch (const qmoe::Error& e) {
      EXPECT_EQ(e.argument(), "tactic");
      EXPECT_NE(std::string(e.what()).find("decode_m128_n8_k256"), std::string::npos);
    }
  }
}

// The bf16 x 4-bit GEMM (fused w4a16 / w4a16_int4 / w4a4 / w4a8) has its own compiled list, accepts
// K % 32 == 0 (FP4 weights: gpt-oss's 2880) and never picks a WGMMA W4A8 tactic.
TEST(Tactics, Bf16KernelList) {
  qmoe::GemmProblem p;
  p.n = 4096;
  p.k = 2880;
  p.num_experts = 128;
  p.topk = 4;
  p.total_rows = 4;
  EXPECT_TRUE(qmoe::valid_tactics(p).empty());  // the W4A8 GEMM needs K % 128 == 0
  p.bf16_activations = true;
  std::vector<std::string> names;
  for (const auto& t : qmoe::valid_tactics(p)) names.push_back(t.name());
  EXPECT_EQ(names, (std::vector<std::string>{"decode_m128_n8_k256", "decode_m128_n16_k256", "prefill_m128_n64_k128",
                                              "decode_m128_n32_k256", "decode_m128_n24_k256", "prefill_m128_n128_k128",
                                              "prefill_m128_n160_k128", "decode_m64_n8_k256"}));
  // 4 rows on 4 experts x 32 feature tiles: under one CTA per SM, the 64-row tile (twice the CTAs).
  EXPECT_EQ(qmoe::select_tactic(p).name(), "decode_m64_n8_k256");
  for (const auto& [experts, rows, n, name] : std::vector<std::tuple<int64_t, int64_t, int64_t, std::string>>{
           {128, 8, 1536, "decode_m64_n8_k256"},    // Qwen3-30B GEMM1, T = 1: 8 x 12 tiles
           {128, 8, 2048, "decode_m64_n8_k256"},    // Qwen3-30B GEMM2: 8 x 16 = 128 < 132
           {8, 2, 4096, "decode_m128_n8_k256"},     // Mixtral GEMM2, T = 1: 2 x 32 tiles (m64: no faster)
           {128, 4, 2880, "decode_m64_n8_k256"},    // gpt-oss GEMM2, T = 1: 4 x 23 tiles
           {256, 8, 4096, "decode_m128_n8_k256"},   // DeepSeek-V3 GEMM1, T = 1: 256 tiles
           {8, 2, 28672, "decode_m128_n8_k256"},    // Mixtral GEMM1, T = 1: 2 x 224 tiles
           {128, 64, 1536, "decode_m128_n8_k256"}}) {  // Qwen3-30B GEMM1, T = 8: up to 64 experts hit
    qmoe::GemmProblem q = p;
    q.num_experts = experts, q.total_rows = rows, q.n = n;
    EXPECT_EQ(qmoe::select_tactic(q).name(), name) << experts << " experts, " << rows << " rows, N " << n;
  }
  // The measured switches (tactics.cpp, kBf16*): n8 up to 6 rows per expert, n16 up to 13, n24 up to
  // 18, n32 up to 28, then the WGMMA tiles by their expected tile counts: 64 tokens up to ~56 rows, 128,
  // and 160 around 128 rows.
  for (const auto& [rows, name] : std::vector<std::pair<int64_t, std::string>>{
           {6, "decode_m128_n8_k256"}, {7, "decode_m128_n16_k256"}, {13, "decode_m128_n16_k256"},
           {14, "decode_m128_n24_k256"}, {18, "decode_m128_n24_k256"}, {19, "decode_m128_n32_k256"},
           {28, "decode_m128_n32_k256"}, {29, "prefill_m128_n64_k128"}, {48, "prefill_m128_n64_k128"},
           {56, "prefill_m128_n64_k128"}, {64, "prefill_m128_n128_k128"}, {128, "prefill_m128_n160_k128"},
           {1024, "prefill_m128_n128_k128"}}) {
    p.total_rows = 128 * rows;
    EXPECT_EQ(qmoe::select_tactic(p).name(), name) << rows << " rows";
  }
  // FP4 weights: a 160-token tile costs 1.12 128-token ones, not 1.25 (its epilogue's row scales load early):
  // at 256 rows per expert (2.5 expected 128-token tiles vs 2 x 1.12) and 1024 on 8 experts (8.5 vs 7 x
  // 1.12) it is the 160-token tile; at 64 rows (one tile each) still the 128-token tile.
  {
    qmoe::GemmProblem q = p;
    q.fp4_weights = true;
    for (const auto& [experts, rows, name] : std::vector<std::tuple<int64_t, int64_t, std::string>>{
             {128, 256, "prefill_m128_n160_k128"}, {8, 1024, "prefill_m128_n160_k128"},
             {128, 64, "prefill_m128_n128_k128"}, {256, 128, "prefill_m128_n160_k128"}}) {
      q.num_experts = experts, q.total_rows = experts * rows;
      EXPECT_EQ(qmoe::select_tactic(q).name(), name) << experts << " experts, " << rows << " rows";
      q.fp4_weights = false;
      if (rows == 256) EXPECT_EQ(qmoe::select_tactic(q).name(), "prefill_m128_n128_k128") << "int4, 256 rows";
      q.fp4_weights = true;
    }
  }
  p.num_experts = 8;  // 8 experts x 32 tiles: one wave
  for (const auto& [rows, name] : std::vector<std::pair<int64_t, std::string>>{
           {6, "decode_m128_n8_k256"}, {7, "decode_m128_n16_k256"}, {14, "decode_m128_n24_k256"},
           {28, "decode_m128_n32_k256"}, {29, "prefill_m128_n64_k128"}}) {
    p.total_rows = 8 * rows;
    EXPECT_EQ(qmoe::select_tactic(p).name(), name) << rows << " rows, one wave";
  }
  p.n = 28672;  // Mixtral GEMM1: 8 x 224 tiles, many waves
  p.total_rows = 8 * 28;
  EXPECT_EQ(qmoe::select_tactic(p).name(), "decode_m128_n32_k256");
  p.total_rows = 8 * 32;
  EXPECT_EQ(qmoe::select_tactic(p).name(), "prefill_m128_n64_k128");
  p.n = 4096;
  p.num_experts = 128;
  p.total_rows = 128 * 200;
  EXPECT_EQ(qmoe::select_tactic(p).name(), "prefill_m128_n128_k128");  // the WGMMA tile
  p.k = 2880 + 16;  // not a multiple of 32
  EXPECT_TRUE(qmoe::valid_tactics(p).empty());
}

}  // namespace
