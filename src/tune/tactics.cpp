// Tactics of the W4A8 grouped GEMM (sm90_grouped_gemm_w4a8_int4): the compiled list, the
// heuristic choice, names and parsing.
//
// Two families share one kernel template (src/cuda/gemm/sm90_grouped_gemm_w4a8_int4.cu), both
// swap-AB (weight rows on the MMA M side, tokens on the N side):
//   decode  : 128 (or 64, 32) weight rows x 8/16/32 tokens per CTA tile; made to stream weights, so the
//             token tile is as small as the rows of an expert allow (a 16-token tile for 1 token
//             wastes no bytes, only MMA slots).
//   prefill : 128 weight rows x 64 tokens; tensor-core bound (mma.sync), each converted weight
//             fragment serves 32 token columns.
// Names: {family}_m{weight rows}_n{tokens}_k{K per pipeline stage}.
// The per-expert row count lives on the device only, so the host estimates it as
// ceil(total_rows / num_experts) (total_rows = tokens * topk for SGLang's layout).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

#include "qmoe/error.h"
#include "qmoe/tactics.h"

namespace qmoe {

namespace {

using Family = Tactic::Family;

// tile_k: K per pipeline stage (decode: 4 groups, so each weight row is read in 256-byte runs).
Tactic make(Family family, int tile_m, int tile_n, int tile_k) {
  Tactic t;
  t.family = family;
  t.tile_m = tile_m;
  t.tile_n = tile_n;
  t.tile_k = tile_k;
  t.split_k = 1;
  return t;
}

// NOTE: this list must match the instantiations in sm90_grouped_gemm_w4a8_int4.cu one for one.
const std::vector<Tactic>& compiled() {
  static const std::vector<Tactic> list = {
      make(Family::kDecode, 128, 8, 256), make(Family::kDecode, 128, 16, 256), make(Family::kDecode, 64, 32, 512),
      // 128 weight rows x 32 tokens: one token tile for experts of 17-32 rows, where n16 needs two
      // (each reading and converting the weights again). Not chosen since the 64-token WGMMA tile loads
      // by TMA (s14); kept for forcing and tuning.
      make(Family::kDecode, 128, 32, 256),
      // 128 weight rows x 24 tokens: one token tile up to 24 rows at a lower cost per tile than n32.
      make(Family::kDecode, 128, 24, 256),
      // 64 weight rows x 8 tokens, 4 groups per stage: twice the CTAs of the n8 tile, for grids that
      // leave SMs idle.
      make(Family::kDecode, 64, 8, 512),
      // 32 weight rows x 8 tokens, 4 groups per stage, 6 stages: for grids where even the 64-row tiles fill
      // fewer than one CTA per SM along a long K (kDecodeM32MinK).
      make(Family::kDecode, 32, 8, 512),
      make(Family::kPrefill, 128, 64, 256),
      // WGMMA prefill: 128 weight rows x 128 tokens, one K group per stage.
      make(Family::kPrefill, 128, 128, 128),
      // WGMMA with 160-token tiles (the same kernel, m64n160k32): chosen above 48 rows per expert where
      // its expected tile count wins (cheapest_wgmma_tile).
      make(Family::kPrefill, 128, 160, 128),
      // WGMMA with 96-token tiles and two K groups in flight per warpgroup (m64n96k32): ~49-88 rows per expert.
      make(Family::kPrefill, 128, 96, 128),
      // WGMMA with 64-token tiles (two CTAs per SM): chosen at 27-48 rows per expert where the 48-token tile would
      // need second tiles (cheaper_n48_or_n64).
      make(Family::kPrefill, 128, 64, 128),
      // WGMMA with 32-token tiles (the 64-token kernel with 8 stages): chosen for 20-26 rows per expert.
      make(Family::kPrefill, 128, 32, 128),
      // WGMMA with 48-token tiles (the same kernel, 6 stages): 27-48 rows per expert, by expected cost.
      make(Family::kPrefill, 128, 48, 128),
  };
  return list;
}

// The bf16 x 4-bit kernel (sm90_grouped_gemm_bf16_w4.cu), mma.sync bf16: the same tile names.
// NOTE: must match the instantiations in sm90_grouped_gemm_bf16_w4_launch.cuh one for one.
const std::vector<Tactic>& compiled_bf16() {
  static const std::vector<Tactic> list = {
      make(Family::kDecode, 128, 8, 256), make(Family::kDecode, 128, 16, 256),
      // (prefill_m128_n64_k128: the WGMMA 64-token tile since session 16, see below)
      make(Family::kPrefill, 128, 64, 128), make(Family::kDecode, 128, 32, 256), make(Family::kDecode, 128, 24, 256),
      // WGMMA bf16 m64n{64,128,160}k16: 128 weight rows x 64, 128 or 160 tokens (sm90_grouped_gemm_bf16_w4_wgmma.cu).
      make(Family::kPrefill, 128, 128, 128), make(Family::kPrefill, 128, 160, 128),
      // 64 weight rows x 8 tokens where the n8 grid leaves SMs idle (the n8 tile's sums, twice the CTAs).
      make(Family::kDecode, 64, 8, 256),
  };
  return list;
}

bool log_enabled() {
  const char* v = std::getenv("QMOE_LOG_TACTICS");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace

// Estimated rows of one expert (ceil(total_rows / num_experts)) up to which each tile is chosen.
// Measured on H200 with uniform top-8 routing over 256 experts, DeepSeek-V3 GEMM1/GEMM2 shapes
// (tests/gpu/w4a8_gemm_check.cu --bench; bench/results/2026-11-30_h200_w4a8_gemm_dev.md and
// bench/results/2026-11-30_h200_w4a8_tactics.md):
//   2 rows: n8 beats n16 by 20-30%;  8 rows: n16 1894 / 1022 us, WGMMA n64 3121 us (GEMM1/GEMM2);
//   32 rows: WGMMA n64 3160 / 1672 us, n16 4538 / 2422, mma.sync n64 5425 / 2972, WGMMA n128 4619 / 2479;
//   64 rows: WGMMA n128 4644 / 2543, WGMMA n64 4673 / 2540, mma.sync n64 7936 / 4363;
//   128 rows: WGMMA n128 best. The n16 time grows with its token tiles while the WGMMA n64 tile is
//   flat up to 32 rows, so they cross between 8 and 32 rows: 16 is the switch.
// WGMMA n64 -> n128 (every model GEMM shape, scripts/device_tactic_sweep.sh, H200, bench/results/
// 2026-11-30_s7a_nvidia_h200_tactic_sweep.md): n64 is faster at 20-48 rows on all 8 shapes (12-15%
// at 40 and 48 rows); at 64 rows n128 is faster on the 128- and 8-expert shapes (Qwen3-235B GEMM1
// 775 vs 944 us, Mixtral GEMM1 452 vs 576, GEMM2 214 vs 336: with ragged routing many experts then
// pass 64 rows and need a second 64-token tile) and ties on DeepSeek-V3. So n128 above 48 rows.
// The mma.sync prefill_m128_n64_k256 tile is no longer chosen (kept for forcing and tuning).
// With fewer than 64 experts n8 up to 5 rows per expert (H200, bench/results/2026-12-03_s36g_*: Mixtral and its TP2-TP8
// shards, 16- and 32-expert shapes at 4-7 rows): at 5 rows n8 beats n16 on all 8 shapes (1.07-1.24x: Mixtral GEMM1
// 139.9 vs 172.5 us, GEMM2 79.8 vs 85.6); at 6 rows it still wins the GEMM1 shapes (1.07-1.22x) but loses the GEMM2
// ones (N 4096 over 8 experts: 1.19-1.25x), where the experts past 8 rows need a second n8 tile.
constexpr int64_t kDecodeN8MaxRows = 5;
// With many experts the n8 tile keeps winning a little further (tactic sweep, H200,
// bench/results/2026-11-30_s7a_nvidia_h200_tactic_sweep.md): DeepSeek-V3 (256 experts) at 5 and 6
// rows per expert, n8 vs n16: GEMM1 1065 vs 1428 us, 1232 vs 1416; GEMM2 589 vs 800, 629 vs 799; at 8
// rows they tie (1417 vs 1395, 780 vs 797; Qwen3 128 experts: within 1-13% for n8). n16 costs twice
// the MMAs per weight, n8 a second token tile for the experts past 8 rows; spread over many experts
// the second tiles stay few. With 8 experts (Mixtral) n16 already wins at 8 rows (GEMM2 91 vs 133 us):
// the slowest expert sets the time. Hence up to 7 rows from 64 experts on. Since the s17-s18 changes n8 also wins at
// 8 rows there (bench/results/2026-12-01_s18e_nvidia_h200_tactic_sweep2.md, n8 vs n16: Qwen3-30B GEMM2 52.4 vs
// 60.1 us, GEMM1 85.3 vs 87.3, Qwen3-235B GEMM1 296.6 vs 304.1, GEMM2 167.9 vs 179.5, DeepSeek-V3 GEMM2 727.2 vs
// 758.8; DeepSeek-V3 GEMM1 1341.3 vs 1326.5, 1% the other way): up to 8 rows.
constexpr int64_t kDecodeN8MaxRowsManyExperts = 8;
constexpr int64_t kManyExperts = 64;
// With the activations in fp16 K slots (GemmProblem::activation_slots, a pass over A instead of each warp's unpack)
// the 16-token tile is 1-7% faster, pass included (H200, forced n16 at T = 64-384, A/B alternated in one call,
// bench/results/2026-12-03_s34b_*: DeepSeek-V3 GEMM1 T = 256 1311 -> 1254 us, GEMM2 766 -> 737, Qwen3-235B GEMM1 432
// -> 421, Mixtral GEMM1 / GEMM2 1-4%), and slower on the small Qwen3-30B GEMM2 (K = 768: 59 -> 63 us, the pass's cost).
// At 8 rows per expert it then beats the 8-token tile (DeepSeek-V3 GEMM1 1254 vs 1349 us, GEMM2 737 vs 767). With the
// bias sums also in the slots (no bias MMAs in the tile, s34i) DeepSeek-V3 GEMM1 / GEMM2 T = 256 run 1211.8 / 749.1 us.
constexpr int64_t kActivationSlotsMinK = 2048;
constexpr int64_t kActivationSlotsMinN = 3072;
// n16 vs the 32-token WGMMA tile. Session 35 (bench/results/2026-12-03_s35b_*) retired n24 (the 32-token tile beats it
// at every shape from 14 rows). Session 36, with the 32-token tile on biased codes (5-10% faster; n8 / n16 / n32 / n48
// forced at 5-32 rows per expert on 15 model GEMM shapes and TP shards, bench/results/2026-12-03_s36a_*): n16 still
// wins at 12 rows where K is long and the tiles take more than one wave (DeepSeek-V3 GEMM1 K 7168: 1732 vs 1851 us, n32
// from 13 rows); where K = 4096 the two tie at 8-10 rows and n32 wins from 11 (Qwen3-235B GEMM1 1.06x, Mixtral GEMM1
// 1.06x, Qwen3-235B TP4 GEMM1 1.08x; only Mixtral TP8 GEMM1, one wave of 224 tiles, keeps n16 ahead to 12 rows by 4%);
// one- wave grids along a long K tie at 10 (Mixtral GEMM2 K 14336 89.3 vs 92.0, TP2 49.7 vs 50.1) and go to n32 at 11
// (1.2x); between 1536 and 4096 n32 wins or ties from 10 rows (Qwen3-30B GEMM1 1.03x, Mixtral TP8 GEMM2 K 1792 1.05x;
// DeepSeek-V3 GEMM2 ties at 9-11); where K <= 1536 n32 wins from 9 rows, right after the many-expert n8 range
// (Qwen3-235B GEMM2 1.07x, Qwen3-30B GEMM2 1.13x). (One wave: the 128-row tiles of all experts fit two CTAs per SM.)
constexpr int64_t kDecodeN16LongK = 4096;   // n16 up to 12 rows above this K (more than one wave), 10 at it
constexpr int64_t kDecodeN16ShortK = 1536;  // ... 9 above this K, 8 at or below it
constexpr int64_t decode_n16_max_rows(int64_t k, bool one_wave) {
  return k > kDecodeN16LongK && !one_wave ? 12 : k >= kDecodeN16LongK ? 10 : k > kDecodeN16ShortK ? 9 : 8;
}
// The 32-token tile's upper end (bench/results/2026-12-01_s14f_*, 18-28 rows on 8 shapes): at 22-26 rows it beats the
// 64-token tile (1.03-1.12x), at 28 the 64-token tile wins everywhere (DeepSeek-V3 GEMM1 2109 vs 2215 us); s35b at 26
// rows: n32 and n48 within 1.06x of each other either way. (The earlier mma.sync n16 / n24 / n32 switches that s35b
// replaced: s11b, s11f, s12b, s14c, s14d.)
constexpr int64_t kWgmmaN32MaxRows = 26;
constexpr int64_t kWgmmaN64MaxRows = 48;
// The bf16 x 4-bit GEMM's own switches (QMOE_SWEEP_KERNEL=bf16 scripts/device_tactic_sweep.sh, H200,
// int4 and NVFP4 weights, all 8 model GEMM shapes, bench/results/2026-11-30_s11a_nvidia_h200_bf16_sweep.md):
// n8 is the fastest at every point up to 6 rows per expert, any expert count (Mixtral 5 rows: 1.13-1.18x
// faster than n16; 128/256 experts at 6 rows: 1.07-1.18x); at 7 rows n16 ties or wins (Mixtral GEMM2
// 122 vs 154 us, NVFP4 DeepSeek-V3 GEMM1 1908 vs 1952). n16 beats the 64-token tile up to 24 rows on
// every shape; at 28 rows they split (Mixtral GEMM1 n16 by 1.5%, GEMM2 the 64-token tile by 11%) and
// from 32 rows the 64-token tile wins everywhere (1.03-1.14x).
constexpr int64_t kBf16N8MaxRows = 6;
// Its 128 x 24 and 128 x 32 tiles (same sweeps, bench/results/2026-11-30_s11c_* and s11f_*): n16 wins at
// 12 rows (n24 up to 1.12x slower), n24 at 14-18 rows on every shape and format (1.05-1.12x over the
// next best), n32 at 20-32 rows (1.08-1.52x over n16, 1.11-1.18x over the 64-token tile at 32 rows);
// at 40 rows the 64-token tile wins everywhere. Where the n32 tiles fit in one wave, at 32 rows about
// half the experts need a second n32 token tile (a second wave) where the 64-token tile needs one:
// Mixtral GEMM2 at 32 rows 64-token tile 252 / 268 us vs n32 302 / 312 (int4 / NVFP4), at 28 rows n32
// 236 / 243 vs 252 / 267. (The 64-token tile of these sweeps was the mma.sync one.)
constexpr int64_t kBf16N16MaxRows = 13;
constexpr int64_t kBf16N24MaxRows = 18;
// Session 16 (bench/results/2026-12-01_s16d_*, DeepSeek-V3 GEMM1 / GEMM2, int4 and NVFP4): the WGMMA 64-token
// tile beats n32 at 32 rows per expert (2849 vs 3417 us, 1565 vs 1932; half the experts need a second n32
// tile there, and n32's time per tile puts the tie near 28 rows), so n32 up to 28 rows.
constexpr int64_t kBf16N32MaxRows = 28;
// Decode grids smaller than the GPU: with at most kDecodeN8MaxRows rows per expert, at most
// min(E, total_rows) experts are hit, each with ceil(N / 128) tiles of 128 weight rows. When that
// bound is below the SM count of an H100/H200 SXM (132), half-height tiles (64 rows) put twice the
// CTAs to work (Qwen3-30B at T = 1: 8 experts x 12 tiles). The row count is known only on the
// device, so this is a bound, not the real grid. Measured (H200, bench/results/2026-11-30_s3_*):
// Qwen3-30B T = 1 GEMM1 17.8 -> 15.6 us, GEMM2 9.4 -> 8.8 us; Mixtral GEMM2 T = 1 unchanged (65.6 ->
// 64.6 us: its K = 14336 loop, not the grid, is the limit there; a bit-keeping split-K over clusters
// was built for it and measured 1.4-9x slower everywhere, then removed: design.md 6.2).
constexpr int64_t kHopperSms = 132;
// Quarter-height tiles (32 rows, 6 stages) where the 64-row tiles would still leave SMs idle (2 x the n8
// bound <= 132) and each CTA walks a long K (H200, bench/results/2026-12-03_s28d_*): Mixtral GEMM2 at T = 1
// (64 n8 tiles, K = 14336) 40.7 -> 31.2 us; where the 64-row grid already fills the GPU they lose (Qwen3-30B
// T = 1 GEMM1 11.3 -> 13.9 us, GEMM2 7.4 -> 9.3; Mixtral GEMM2 T = 2, up to 128 n8 tiles: 41.4 -> 57.6).
constexpr int64_t kDecodeM32MinK = 4096;

// 160- vs 128-token WGMMA tiles (H200, bench/results/2026-12-01_s15c_*): a 160-token tile costs ~1.18x a
// 128-token one (5.6% less per token: the weights' conversion serves 25% more tokens). Which wins is the
// expected number of token tiles per expert: with uniform routing an expert's rows are ~ normal with mean
// mu = rows / E and variance mu (1 - 1 / E), and an expert of r rows takes ceil(r / TILE_N) tiles. At
// mu = 128 the 128-token tile needs 1.5 tiles on average (half the experts pass 128 rows), the 160-token
// one 1.0: measured 1.21-1.27x faster (DeepSeek-V3 T = 4096, Qwen3 T = 2048), predicted 1.27x; at mu = 512
// the 128-token tile needs 4.5, the 160-token one 3.9 (x 1.18 = 4.63): measured 1.04-1.07x slower,
// predicted 1.03x; at mu = 64 both need 1 tile (160 measured 1.16x slower).
constexpr double kWgmmaN160TileCost = 1.18;
// The 96-token tile (two K groups in flight per computing warpgroup, s24g): ~0.84 of a 128-token tile at 64 rows per
// expert, one tile each (Qwen3-235B GEMM1 T = 1024 478 vs 572 us, Qwen3-30B GEMM1 142 vs 168, GEMM2 84 vs 101;
// bench/results/2026-12-02_s24d_*), and at 512 rows 1.08x slower (5.8 expected tiles vs 4.5; predicted 1.09x).
constexpr double kWgmmaN96TileCost = 0.84;
// The 48-token tile of the two-CTA WGMMA kernel (m64n48k32, 6 stages; H200, forced tactics alternated twice in one call,
// bench/results/2026-12-03_s34f_*): ~0.94 of a 64-token tile where both need one tile per expert (DeepSeek-V3 GEMM1 at
// 32 rows 1643-1681 vs 1773-1803 us, GEMM2 897 vs 958; Qwen3-235B GEMM1 / GEMM2 and Qwen3-30B GEMM1 at 24-32 rows
// 0.95; GLM-4.5 GEMM1 0.93-0.97), and 1.3-1.4x slower at 48 rows, where half the experts need a second 48-token
// tile. Between 27 and 48 rows per expert the expected tile cost picks 48 or 64 (cheaper_n48_or_n64).
constexpr double kWgmmaN48TileCost = 0.94;  // in 64-token tiles
// The bf16 x 4-bit GEMM's WGMMA tiles (H200, bench/results/2026-12-01_s16c_* and s16d_*): tensor-bound, a 160-token
// tile costs ~1.25 128-token ones (NVFP4 at 64 rows per expert, one tile each: 1.24-1.28; int4, whose 160-token
// tile decodes after its wgmmas for want of registers: 1.28-1.42). Measured: 1.28-1.46x faster at 128 rows per
// expert (NVFP4; int4 1.11-1.43x), 3% at 256, slower at 64 and 1024 (where the model picks 128).
constexpr double kBf16WgmmaN160TileCost = 1.25;
// FP4 weights since the epilogue's row scales load during the tile's last wgmmas (s17e; the int4 160-token
// tile has no registers for them): a 160-token tile costs ~1.12 128-token ones (64 rows per expert, one tile
// each: 1.11-1.13), and wins at 256 rows (Qwen3 T = 4096: 1.05-1.08x) and 1024 (Mixtral GEMM1 T = 4096: 1.07x).
constexpr double kBf16Fp4WgmmaN160TileCost = 1.12;
// A 64-token tile costs ~0.8 of a 128-token one (32-48 rows vs 64: 2849-3055 vs 3375-3800 us, GEMM2 1565-1626
// vs 2072-2093): it wins up to ~56 rows per expert (48 rows: 1.13-1.36x over the 128-token tile; 64 rows:
// the 128-token tile by 1.15-1.3x, also on Qwen3-30B).
constexpr double kBf16WgmmaN64TileCost = 0.8;

namespace {
// E[ceil(r / tile)] for r ~ normal(mu, sigma^2) clipped at 0: the sum over j >= 0 of P(r > j tile); the
// terms more than 8 sigma below mu are 1.
double expected_token_tiles(double mu, double sigma, int tile) {
  if (sigma <= 0) return std::ceil(mu / tile);
  const double first = std::floor(std::max(0.0, mu - 8 * sigma) / tile);
  double tiles = first;
  for (double j = first; j * tile < mu + 8 * sigma; j += 1)
    tiles += 0.5 * std::erfc((j * tile - mu) / (sigma * std::sqrt(2.0)));
  return tiles;
}
// The expected `tile`-token tiles per expert at mu rows per expert (of `experts`; uniform routing: rows ~ normal with
// variance mu (1 - 1 / E)), in 128-token tiles: one such tile costs `cost` of them.
double wgmma_tiles_cost(int tile, double cost, double mu, int64_t experts) {
  const double sigma = std::sqrt(mu * (1.0 - 1.0 / static_cast<double>(experts)));
  return cost * expected_token_tiles(mu, sigma, tile);
}
// Whether a `tile`-token WGMMA tile beats the 128-token one.
bool wgmma_tile_pays(int tile, double mu, int64_t experts, double cost) {
  return wgmma_tiles_cost(tile, cost, mu, experts) < wgmma_tiles_cost(128, 1.0, mu, experts);
}
// The W4A8 WGMMA token tile (96, 128 or 160) with the fewest expected 128-token-tile costs at mu rows per expert.
int cheapest_wgmma_tile(double mu, int64_t experts) {
  const double n96 = wgmma_tiles_cost(96, kWgmmaN96TileCost, mu, experts);
  const double n128 = wgmma_tiles_cost(128, 1.0, mu, experts);
  const double n160 = wgmma_tiles_cost(160, kWgmmaN160TileCost, mu, experts);
  return n96 < n128 && n96 < n160 ? 96 : n160 < n128 ? 160 : 128;
}
// The two-CTA WGMMA token tile (48 or 64) with the smaller expected cost at mu rows per expert (costs in 64-token tiles).
int cheaper_n48_or_n64(double mu, int64_t experts) {
  return wgmma_tiles_cost(48, kWgmmaN48TileCost, mu, experts) < wgmma_tiles_cost(64, 1.0, mu, experts) ? 48 : 64;
}
// Feature tiles of 128 weight rows per expert.
int64_t feature_tiles(int64_t n) { return (n + 127) / 128; }
// The 128-row tiles of `experts` experts fit in one wave of two CTAs per SM (the n24 / n32 tiles' occupancy).
bool one_wave_of_tiles(int64_t experts, int64_t n) { return experts * feature_tiles(n) <= 2 * kHopperSms; }
}  // namespace

std::string Tactic::name() const {
  std::string s = family == Family::kDecode ? "decode" : "prefill";
  s += "_m" + std::to_string(tile_m) + "_n" + std::to_string(tile_n) + "_k" + std::to_string(tile_k);
  if (split_k != 1) s += "_s" + std::to_string(split_k);
  return s;
}

std::vector<Tactic> valid_tactics(const GemmProblem& problem) {
  // Every compiled tactic predicates its N, K-group and row tails, so it runs any problem within
  // the op's limits (K % 128 == 0, N % 8 == 0); outside them nothing is valid.
  const int64_t k_step = problem.bf16_activations ? 32 : 128;
  if (problem.k <= 0 || problem.k % k_step != 0 || problem.n <= 0 || problem.n % 8 != 0 || problem.num_experts <= 0)
    return {};
  return problem.bf16_activations ? compiled_bf16() : compiled();
}

Tactic select_tactic(const GemmProblem& problem) {
  const int64_t experts = problem.num_experts > 0 ? problem.num_experts : 1;
  const int64_t rows = problem.total_rows > 0 ? problem.total_rows : 0;
  const int64_t rows_per_expert = (rows + experts - 1) / experts;
  const bool one_wave = one_wave_of_tiles(experts, problem.n);
  const bool slots_pay_here = activation_slots_pay(problem, make(Family::kDecode, 128, 16, 256));
  const double mu = static_cast<double>(rows) / static_cast<double>(experts);
  Tactic t;
  const int64_t hit = rows < experts ? rows : experts;
  const int64_t n8_ctas = rows > 0 ? hit * feature_tiles(problem.n) : 0;
  const bool small_grid = n8_ctas > 0 && n8_ctas < kHopperSms;  // n8: under one CTA per SM
  const bool tiny_grid = n8_ctas > 0 && 2 * n8_ctas <= kHopperSms && problem.k >= kDecodeM32MinK;  // m64 too
  // The bf16 64-row tile where the n8 grid leaves SMs idle but fills more than half of them: at 92-128 n8 CTAs
  // it is 1.1-1.4x faster; at 64 (Mixtral GEMM2, T = 1: both ~65 us, bound by the walk along K) it is not.
  const bool bf16_small_grid = small_grid && 2 * n8_ctas > kHopperSms;
  const double bf16_n160_cost = problem.fp4_weights ? kBf16Fp4WgmmaN160TileCost : kBf16WgmmaN160TileCost;
  if (problem.bf16_activations) {
    t = rows_per_expert <= kBf16N8MaxRows && bf16_small_grid         ? make(Family::kDecode, 64, 8, 256)
        : rows_per_expert <= kBf16N8MaxRows                          ? make(Family::kDecode, 128, 8, 256)
        : rows_per_expert <= kBf16N16MaxRows                         ? make(Family::kDecode, 128, 16, 256)
        : rows_per_expert <= kBf16N24MaxRows                         ? make(Family::kDecode, 128, 24, 256)
        : rows_per_expert <= kBf16N32MaxRows                         ? make(Family::kDecode, 128, 32, 256)
        : wgmma_tile_pays(64, mu, experts, kBf16WgmmaN64TileCost)    ? make(Family::kPrefill, 128, 64, 128)
        : wgmma_tile_pays(160, mu, experts, bf16_n160_cost)          ? make(Family::kPrefill, 128, 160, 128)
                                                                     : make(Family::kPrefill, 128, 128, 128);
  } else if (rows_per_expert <= (experts < kManyExperts ? kDecodeN8MaxRows
                                  : slots_pay_here        ? kDecodeN8MaxRowsManyExperts - 1
                                                          : kDecodeN8MaxRowsManyExperts)) {
    t = tiny_grid    ? make(Family::kDecode, 32, 8, 512)
        : small_grid ? make(Family::kDecode, 64, 8, 512)
                     : make(Family::kDecode, 128, 8, 256);
  } else if (rows_per_expert <= decode_n16_max_rows(problem.k, one_wave)) {
    t = make(Family::kDecode, 128, 16, 256);
  } else if (rows_per_expert <= kWgmmaN32MaxRows) {
    t = make(Family::kPrefill, 128, 32, 128);  // WGMMA, 32-token tiles, 8 stages
  } else if (rows_per_expert <= kWgmmaN64MaxRows) {
    t = make(Family::kPrefill, 128, cheaper_n48_or_n64(mu, experts), 128);  // WGMMA, 48 / 64 tokens, two CTAs per SM
  } else {
    t = make(Family::kPrefill, 128, cheapest_wgmma_tile(mu, experts), 128);  // WGMMA, 96 / 128 / 160 tokens
  }
  if (log_enabled()) {
    static std::mutex mutex;
    static std::set<std::string> logged;
    const std::string line = "n=" + std::to_string(problem.n) + " k=" + std::to_string(problem.k) +
                             " rows=" + std::to_string(problem.total_rows) +
                             " experts=" + std::to_string(problem.num_experts) + " topk=" +
                             std::to_string(problem.topk) + " -> " + t.name();
    std::lock_guard<std::mutex> lock(mutex);
    if (logged.insert(line).second) std::fprintf(stderr, "qmoe tactic: %s\n", line.c_str());
  }
  return t;
}

bool activation_slots_pay(const GemmProblem& problem, const Tactic& tactic) {
  // (K % 512 == 0: the slot rows' pitch 2K + K / 32 bytes stays 16-byte aligned)
  return problem.activation_slots && !problem.bf16_activations && tactic == make(Family::kDecode, 128, 16, 256) &&
         problem.k >= kActivationSlotsMinK && problem.k % 512 == 0 && problem.n >= kActivationSlotsMinN;
}

Tactic parse_tactic(const std::string& name) {
  for (const auto* list : {&compiled(), &compiled_bf16()})
    for (const Tactic& t : *list)
      if (t.name() == name) return t;
  std::string known;
  for (const Tactic& t : compiled()) known += (known.empty() ? "" : ", ") + t.name();
  throw Error("tactic", "one of " + known, "'" + name + "'");
}

}  // namespace qmoe
