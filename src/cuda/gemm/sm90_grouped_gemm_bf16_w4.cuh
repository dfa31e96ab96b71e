// Device code of the bf16 x 4-bit grouped GEMM (formula, layouts and limits: sm90_grouped_gemm_bf16_w4.h).
//
// Structure: the W4A8 kernel's (sm90_grouped_gemm_w4a8_int4.cuh) with a bf16 MMA. Swap-AB: mma.sync
// m16n8k16 bf16 (fp32 accumulate), weight rows on the M side, tokens on the N side; persistent CTAs
// over the device-side work list (grouped_tile_list.cuh); a pipeline stage holds GPS K groups of 128
// (cp.async weights, bf16 activations and scales, 16-byte chunks, XOR swizzled); the load cursor runs
// STAGES-1 stages ahead across tiles. Rows past an expert's end, features past N and K past K are
// zero-filled and never stored. With p.scatter.out set (bf16 kernels: the fused MoE's GEMM2 with the
// fused finalize), the fp32 value is scatter-added into the token's output row instead of stored
// (grouped_gemm_epilogue.cuh).
//
// K order: thread `tig` (lane % 4) owns K [32 tig, 32 tig + 32) of each group: one 16-byte word of a
// weight row (4 words of 8 nibbles) and 64 bytes of an activation row. MMA step s (8 per group) uses
// word j = s / 2 and its nibble pairs (i, i + 4), (i + 1, i + 5), i = 2 (s % 2): a pair of K values
// lands in one bf16x2 register with one mask, and the activations are paired the same way with one
// byte permute each (the MMA only needs A and B to agree on which K each slot holds).
//
// Weight decode to bf16 (exact; DESIGN.md 3, "exactness facts"):
//   int4  : 0x4300 | (q + 8) is the bf16 128 + q + 8 (one mask-xor for two nibbles); one bf16x2
//           subtract of 136 gives q. One MMA
//           chain per group, promoted into the fp32 accumulator by an FMA with the group scale (as
//           SGLang's W4A8: the reference's group promotion).
//   e2m1  : sign to bit 15 and the 3 magnitude bits to bits 8..6 give the bf16 e2m1 * 2^-126
//           (codes 0 and 1 are bf16 subnormals, which bf16 multiplies keep).
//           NVFP4: one multiply by bf16(sf * 2^118) gives e2m1 * sf * 2^-8 (exact and normal for
//           every e4m3 sf); the epilogue multiplies by 2^8. MXFP4: a multiply by 2^126 (exact e2m1),
//           then by the bf16 2^(s - 127) (exact: bf16 has fp32's exponent range).
//   Packed FP4 words (p.fp4_packed, docs/design.md 3.4): step s's pairs are bytes (2 half, 2 half + 1) of word j
//           (K (2m, 2m + 1), the activations' own bf16 pairs: no byte permute), each by a mask, a funnel shift
//           and a mask, or (byte 3) a mask, a multiply and a mask, then the same scale multiply.
//   Scales of blocks past K are taken as 0 (the padding of the swizzled layout may hold anything;
//   the zero-filled weights there must contribute 0, not 0 * NaN).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "cuda/gemm/bf16_act_epilogue.cuh"
#include "cuda/gemm/bf16_act_requant.h"
#include "cuda/gemm/grouped_tile_list.cuh"
#include "cuda/gemm/k_warps.cuh"
#include "cuda/gemm/sm90_grouped_gemm_bf16_w4.h"
#include "cuda/gemm/sm90_grouped_gemm_w4a8_int4.cuh"  // cp.async helpers, store_fragments, swizzle_b
#include "cuda/common/pdl.cuh"
#include "cuda/common/prmt.cuh"
#include "core/fp4_weight_pack.h"

namespace qmoe::cuda {

namespace bf16w4 {
struct Bf16W4Params {
  const __nv_bfloat16* a;
  const uint8_t* b;
  const uint8_t* b_scales;  // bf16 (int4) or scale bytes (FP4)
  const float* row_scales;  // nullptr = 1
  void* d;
  const int32_t* expert_offsets;
  const int32_t* problem_sizes;
  int num_experts, n, k;
  int scales_packed4;     // int4: SGLang's [E, K/512, 4N] layout
  int scale_col_chunks;   // FP4: Kt = round_up(K / block, 4) / 4 (512-byte chunks per 128-row tile)
  int scale_blocks;       // FP4: K / block (blocks past it read as scale 0)
  int fp4_packed;         // FP4: B words in qmoe's packed order (core/fp4_weight_pack.h)
  RowScatterAdd scatter;  // out set: the fused finalize instead of d (bf16 kernels only)
  Bf16ActEpilogue act;    // OutT = ActBf16: GEMM1's fused activation epilogue (bf16_act_requant.h)
};

// What a launch writes: bf16 or fp32 D, or (kAct) GEMM1's fused activation epilogue (bf16_act_requant.h).
enum class OutKind { kBf16, kFp32, kAct };

using w4a8::cp_async_16;
using w4a8::cp_async_16_full;
using w4a8::cp_async_commit;
using w4a8::cp_async_wait;

constexpr int kGroup = 128;
constexpr int kTileRows = 128;  // the swizzled FP4 scale layout's row tiles (TILE_M is 128 or 64: half of one)

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 bf2(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// Nibbles i and i + 4 of w as bf16x2 (low half: nibble i).
template <W4Format F>
__device__ __forceinline__ uint32_t decode_pair(uint32_t w, int i, uint32_t scale2) {
  if constexpr (F == W4Format::kInt4G128) {
    const uint32_t t = (w >> (4 * i)) & 0x000F000Fu;
    // Two's complement nibble u: q + 8 = u ^ 8, and 0x4300 | (q + 8) is the bf16 128 + q + 8.
    return bits(__hsub2(bf2(t ^ 0x43084308u), bf2(0x43084308u)));  // (128 + q + 8) - 136
  } else {
    // Nibbles 2, 3, 6, 7 first move to 0, 1, 4, 5 by one byte permute (shared by pairs 2 and 3); a nibble
    // at bits 0..3 (4..7) of a half goes to magnitude 8..6 and sign 15 by one multiply with 0x1040
    // (0x104): two disjoint shifted copies, no carries.
    const uint32_t v = i >= 2 ? prmt(w, 0u, 0x4341u) : w;  // bytes 1, 3 of w to bytes 0, 2
    const uint32_t t = v & (0x000F000Fu << (4 * (i & 1)));
    const uint32_t e = (t * ((i & 1) ? 0x104u : 0x1040u)) & 0x81C081C0u;
    if constexpr (F == W4Format::kNvfp4) {
      return bits(__hmul2(bf2(e), bf2(scale2)));
    } else {
      return bits(__hmul2(__hmul2(bf2(e), bf2(0x7E807E80u)), bf2(scale2)));  // * 2^126, * 2^(s-127)
    }
  }
}

// Packed FP4 word (core/fp4_weight_pack.h): byte m (K 2m, 2m + 1) as bf16x2, scaled as decode_pair.
template <W4Format F>
__device__ __forceinline__ uint32_t decode_packed_byte(uint32_t v, int m, uint32_t scale2) {
  static_assert(F != W4Format::kInt4G128, "packed words are FP4 only");
  const uint32_t e = m < 3 ? __funnelshift_r(v, v, 3 * m) & fp4pack::kDecodeMask
                           : ((v & fp4pack::kByte3Mask) * fp4pack::kByte3Mul) & fp4pack::kDecodeMask;
  if constexpr (F == W4Format::kNvfp4) {
    return bits(__hmul2(bf2(e), bf2(scale2)));
  } else {
    return bits(__hmul2(__hmul2(bf2(e), bf2(0x7E807E80u)), bf2(scale2)));
  }
}

// NVFP4: the two e4m3 scale bytes of `two` (low byte first) as bf16x2 splats of sf * 2^118: one paired
// e4m3 -> f16 conversion, one bf16x2 multiply (exact: e4m3 fits f16 and bf16, 2^118 * 448 < 2^127; 0 and NaN
// stay 0 and NaN). The splats compile to half selectors of the one register in the decode's multiplies.
__device__ __forceinline__ void nvfp4_scale_splats(uint32_t two, uint32_t& s0, uint32_t& s1) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 both = __hmul2(__floats2bfloat162_rn(f.x, f.y), bf2(0x7A807A80u));  // * 2^118
  s0 = bits(__low2bfloat162(both));
  s1 = bits(__high2bfloat162(both));
}

// Splat bf16x2 of a scale byte. NVFP4: bf16(e4m3 * 2^118); MXFP4: bf16 2^(s - 127).
template <W4Format F>
__device__ __forceinline__ uint32_t scale_splat(uint32_t byte) {
  if constexpr (F == W4Format::kNvfp4) {
    __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3);
    const float f = __half2float(__half(h)) * 3.3230699894622794e+35f;  // 2^118
    return bits(__float2bfloat162_rn(f));
  } else {
    const uint32_t h = byte == 0 ? 0x0040u : byte == 255 ? 0x7FC0u : byte << 7;
    return h | (h << 16);
  }
}

// WARPS_K: warps splitting the K groups of a stage (warp k takes the groups g with g % WARPS_K == k),
// whose sums meet in shared memory at the end of a tile (kSplitBytes), as in the W4A8 kernel.
template <W4Format F, int WARPS_M, int WARPS_N, int MF, int NF, int GPS, int STAGES, int WARPS_K = 1>
struct Config {
  static constexpr int kThreads = WARPS_M * WARPS_N * WARPS_K * 32;
  static constexpr int kTileM = WARPS_M * MF * 16;
  static constexpr int kTileN = WARPS_N * NF * 8;
  static constexpr int kTileK = GPS * kGroup;
  static constexpr int kRowBytesB = GPS * kGroup / 2;
  static constexpr int kRowBytesA = GPS * kGroup * 2;
  static constexpr int kStageB = kTileM * kRowBytesB;
  static constexpr int kStageA = kTileN * kRowBytesA;
  // Scales per stage. int4: as the W4A8 kernel (packed-4: 8 bytes per row and 512-K block; else GPS
  // slices of TILE_M bf16). NVFP4: 8 blocks per group = two 512-byte chunks; MXFP4: one chunk.
  static constexpr int kScaleBlocks4 = GPS >= 4 ? GPS / 4 : 1;
  static constexpr int kStageSInt4 =
      kScaleBlocks4 * kTileM * 8 > GPS * kTileM * 2 ? kScaleBlocks4 * kTileM * 8 : GPS * kTileM * 2;
  static constexpr int kStageS = F == W4Format::kInt4G128 ? kStageSInt4 : F == W4Format::kNvfp4 ? GPS * 1024 : GPS * 512;
  static constexpr int kStageBytes = kStageB + kStageA + kStageS;
  static constexpr int kTileStartBytes = ((kTileListMaxExperts + 1) * 4 + 127) / 128 * 128;
  static constexpr int kSplitBytes = (WARPS_K - 1) * WARPS_M * WARPS_N * 32 * MF * NF * 4 * 4;
  static constexpr int kSmemBytes = kTileStartBytes + STAGES * kStageBytes + kSplitBytes;
  static_assert(GPS % WARPS_K == 0, "every K warp takes the same number of groups of a stage");
  static_assert(kTileM == kTileRows || kTileM == kTileRows / 2, "a tile is one FP4 scale tile or half of one");
  static_assert(GPS == 1 || GPS == 2 || GPS == 4, "stages cover whole packed-4 scale blocks or lie in one");
  static_assert(kStageS / 16 <= kThreads, "one scale copy per thread");
  static_assert(kStageB % 128 == 0 && kStageA % 128 == 0 && kStageS % 128 == 0, "stages keep 128-byte alignment");
};

// Activation rows (>= 256 bytes): the 8 lanes of a quarter warp (2 rows x 4 tig) read chunks
// 4 tig + c of two rows; flipping bit 1 by bit 3 and bit 0 by the row parity spreads them over the
// 8 bank groups.
__device__ __forceinline__ int swizzle_a(int chunk, int row) { return chunk ^ (((chunk >> 3) & 1) << 1) ^ (row & 1); }

template <W4Format F, class OutT, int WARPS_M, int WARPS_N, int MF, int NF, int GPS, int STAGES, int MIN_BLOCKS,
          int WARPS_K = 1>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * WARPS_K * 32, MIN_BLOCKS)
    sm90_grouped_gemm_bf16_w4_kernel(const Bf16W4Params p) {
  pdl_wait();  // first; no early release (cuda/common/pdl.cuh)
  using Cfg = Config<F, WARPS_M, WARPS_N, MF, NF, GPS, STAGES, WARPS_K>;
  constexpr int kTileM = Cfg::kTileM;
  constexpr int kTileN = Cfg::kTileN;
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kRowBytesB = Cfg::kRowBytesB;
  constexpr int kRowBytesA = Cfg::kRowBytesA;
  constexpr bool kInt4 = F == W4Format::kInt4G128;
  // The fused activation epilogue (bf16_act_epilogue.cuh) wants a warp's two fragments to be the up and
  // gate rows of the same features: fragment mf of warp w holds tile rows mf * TILE_M / 2 + 16 w + [0, 16)
  // instead of (w * MF + mf) * 16 + [0, 16). Which warp sums which rows changes no bit.
  constexpr bool kAct = std::is_same<OutT, ActBf16>::value;
  static_assert(!kAct || (MF == 2 && WARPS_M * 32 == kTileM && WARPS_N == 1 && WARPS_K == 1),
                "the fused epilogue's tiles: 4 warps of two 16-row fragments, one warp along the tokens");
  auto frag_row = [](int wm, int mf) { return kAct ? mf * (kTileM / 2) + wm * 16 : (wm * MF + mf) * 16; };
  __shared__ float act_xchg[kAct ? 2 * WARPS_M * kTileN : 1];

  extern __shared__ __align__(128) uint8_t smem[];
  int32_t* tile_start = reinterpret_cast<int32_t*>(smem);
  uint8_t* stages = smem + Cfg::kTileStartBytes;
  // 64-row tiles with FP4 scales: the stage's 512-byte scale chunks are whole 128-row scale tiles; the tile's
  // rows start at stage_scale_row[stage] (0 or 64) of them (written with the stage's copies, by thread 0).
  constexpr bool kHalfScaleTile = !kInt4 && kTileM < kTileRows;
  __shared__ int32_t stage_scale_row[kHalfScaleTile ? STAGES : 1];
  int scale_row = 0;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int E = p.num_experts;
  const int n_tiles = (p.n + kTileM - 1) / kTileM;
  const int groups = (p.k + kGroup - 1) / kGroup;  // the last one may be partial (FP4: K % 32 == 0)
  const int stages_per_tile = (groups + GPS - 1) / GPS;

  __shared__ int32_t warp_total[kThreads / 32];
  const auto tiles =
      cta_tiles<kThreads, kTileM, kTileN>(p.problem_sizes, p.expert_offsets, E, n_tiles, tile_start, warp_total);
  if (tiles.empty()) return;
  const int total_iters = tiles.count * stages_per_tile;

  const int64_t row_bytes_b = p.k / 2;
  const int64_t row_bytes_a = static_cast<int64_t>(p.k) * 2;
  const int chunks_b_total = p.k / 32;  // 16-byte weight chunks per row (K % 32 == 0)
  const int chunks_a_total = p.k / 8;   // 16-byte activation chunks per row

  // ---- Producer: fixed (row, chunk) copy slots per thread, global addresses set once per tile.
  constexpr int kChunksB = GPS * 4;
  constexpr int kRowsPerPassB = kThreads / kChunksB;
  constexpr int kPassesB = kTileM / kRowsPerPassB;
  constexpr int kChunksA = GPS * 16;
  constexpr int kRowsPerPassA = kThreads / kChunksA > 0 ? kThreads / kChunksA : 1;
  constexpr int kPassesA = (kTileN + kRowsPerPassA - 1) / kRowsPerPassA;
  static_assert(kThreads % kChunksB == 0 && kTileM % kRowsPerPassB == 0, "weight copies tile the stage");
  static_assert(kThreads % kChunksA == 0, "activation copies tile the stage");
  static_assert(kPassesB <= 32 && kPassesA <= 32, "copy masks are 32-bit");
  constexpr uint32_t kAllPassesB = kPassesB == 32 ? ~0u : (1u << kPassesB) - 1;
  // (the decode tiles of up to 16 tokens: the wider ones spill with the second copy loop)
  constexpr bool kFullCopiesB = NF <= 2;
  const int b_row = tid / kChunksB, b_chunk = tid % kChunksB;
  const int a_row = tid / kChunksA, a_chunk = tid % kChunksA;

  const uint8_t* b_src = p.b;
  const uint8_t* a_src = reinterpret_cast<const uint8_t*>(p.a);
  const uint8_t* s_src = p.b_scales;
  uint32_t b_valid = 0, a_valid = 0;
  bool s_valid = false;
  // The tile and K step the next copy fills (counters, not a division per stage), and that tile located
  // one tile ahead (grouped_tile_list.cuh: LocatedTile).
  TileStep load_at;
  LocatedTile load_ahead = tiles.locate(0);
  auto issue_loads = [&](int stage) {
    const int s = load_at.k;
    if (s == 0) {
      const GroupedTile t = tiles.take(load_ahead, load_at.tile);
      b_src = p.b + (static_cast<int64_t>(t.expert) * p.n + t.n0 + b_row) * row_bytes_b + b_chunk * 16;
      a_src = reinterpret_cast<const uint8_t*>(p.a) + static_cast<int64_t>(t.row0 + a_row) * row_bytes_a + a_chunk * 16;
      b_valid = a_valid = 0;
#pragma unroll
      for (int i = 0; i < kPassesB; ++i) b_valid |= (t.n0 + b_row + i * kRowsPerPassB < p.n ? 1u : 0u) << i;
#pragma unroll
      for (int i = 0; i < kPassesA; ++i) a_valid |= (a_row + i * kRowsPerPassA < t.rows ? 1u : 0u) << i;
      if constexpr (kInt4) {
        const int groups_per_kb = p.k / 512;
        if (p.scales_packed4) {
          const int bi = tid / (kTileM / 2), c = tid % (kTileM / 2);
          s_valid = tid < Cfg::kScaleBlocks4 * kTileM / 2 && t.n0 + 2 * c < p.n;
          s_src = p.b_scales + ((static_cast<int64_t>(t.expert) * groups_per_kb + bi) * 4 * p.n + 4 * (t.n0 + 2 * c)) * 2;
        } else {
          const int gg = tid / (kTileM / 8), c = tid % (kTileM / 8);
          s_valid = tid < GPS * kTileM / 8 && t.n0 + 8 * c < p.n;
          s_src = p.b_scales + ((static_cast<int64_t>(t.expert) * groups + gg) * p.n + t.n0 + 8 * c) * 2;
        }
      } else {
        // 512-byte chunk (128 rows x 4 blocks) c of the tile: ((e * Mt + n0 / 128) * Kt + c) * 512.
        const int64_t mt = (p.n + kTileRows - 1) / kTileRows;
        s_src = p.b_scales + ((static_cast<int64_t>(t.expert) * mt + t.n0 / kTileRows) * p.scale_col_chunks) * 512 +
                tid * 16;
        s_valid = tid < Cfg::kStageS / 16;
        scale_row = t.n0 % kTileRows;
      }
    }
    const int g0 = s * GPS;
    uint8_t* sb = stages + stage * Cfg::kStageBytes;
    uint8_t* sa = sb + Cfg::kStageB;
    uint8_t* ss = sa + Cfg::kStageA;
    const bool b_chunk_ok = g0 * 4 + b_chunk < chunks_b_total;  // K tail
    const bool a_chunk_ok = g0 * 16 + a_chunk < chunks_a_total;
    if (kFullCopiesB && b_chunk_ok && b_valid == kAllPassesB) {  // every copy reads a real row chunk
      const uint8_t* src = b_src + g0 * (kGroup / 2);
#pragma unroll
      for (int i = 0; i < kPassesB; ++i) {
        const int r = b_row + i * kRowsPerPassB;
        cp_async_16_full(sb + r * kRowBytesB + (w4a8::swizzle_b<GPS>(b_chunk, r) << 4),
                         src + i * static_cast<int64_t>(kRowsPerPassB) * row_bytes_b);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kPassesB; ++i) {
        const int r = b_row + i * kRowsPerPassB;
        const bool valid = b_chunk_ok && ((b_valid >> i) & 1u);
        const uint8_t* src = valid ? b_src + i * static_cast<int64_t>(kRowsPerPassB) * row_bytes_b + g0 * (kGroup / 2) : p.b;
        cp_async_16(sb + r * kRowBytesB + (w4a8::swizzle_b<GPS>(b_chunk, r) << 4), src, valid);
      }
    }
#pragma unroll
    for (int i = 0; i < kPassesA; ++i) {
      const int r = a_row + i * kRowsPerPassA;
      if (kPassesA * kRowsPerPassA > kTileN && r >= kTileN) break;
      const bool valid = a_chunk_ok && ((a_valid >> i) & 1u);
      const uint8_t* src = valid ? a_src + i * static_cast<int64_t>(kRowsPerPassA) * row_bytes_a + g0 * kGroup * 2
                                 : reinterpret_cast<const uint8_t*>(p.a);
      cp_async_16(sa + r * kRowBytesA + (swizzle_a(a_chunk, r) << 4), src, valid);
    }
    if constexpr (kInt4) {
      if (p.scales_packed4) {
        if (tid < Cfg::kScaleBlocks4 * kTileM / 2) {
          const bool valid = s_valid && (tid / (kTileM / 2)) * 4 < groups - g0;
          const uint8_t* src = valid ? s_src + static_cast<int64_t>(g0 / 4) * 4 * p.n * 2 : p.b_scales;
          cp_async_16(ss + tid * 16, src, valid);
        }
      } else if (tid < GPS * kTileM / 8) {
        const bool valid = s_valid && tid / (kTileM / 8) < groups - g0;
        const uint8_t* src = valid ? s_src + static_cast<int64_t>(g0) * p.n * 2 : p.b_scales;
        cp_async_16(ss + tid * 16, src, valid);
      }
    } else if (tid < Cfg::kStageS / 16) {
      constexpr int kChunksPerGroup = F == W4Format::kNvfp4 ? 2 : 1;
      const int chunk = g0 * kChunksPerGroup + tid / 32;  // 512-byte chunk of this copy
      const bool valid = s_valid && chunk < p.scale_col_chunks;
      const uint8_t* src = valid ? s_src + static_cast<int64_t>(g0) * kChunksPerGroup * 512 : p.b_scales;
      cp_async_16(ss + tid * 16, src, valid);
      if (kHalfScaleTile && tid == 0) stage_scale_row[stage] = scale_row;
    }
    load_at.advance(stages_per_tile);
  };

  // ---- Consumer.
  const int warp_m = warp % WARPS_M;
  const int warp_n = (warp / WARPS_M) % WARPS_N;
  const int warp_k = warp / (WARPS_M * WARPS_N);
  const int gid = lane >> 2;
  const int tig = lane & 3;
  float acc[MF][NF][4];
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < total_iters) issue_loads(s);
    cp_async_commit();
  }

  TileStep step_at;  // the tile and K step this iteration computes
  // That tile, located at its first K step so that its epilogue does not wait for the two global loads
  // (tiles of up to 16 tokens: the 24 / 32-token tiles have no registers left for it).
  constexpr bool kLocateEarly = NF <= 2;
  LocatedTile step_located{};
  for (int it = 0; it < total_iters; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // publishes stage `it`, retires stage `it - 1` (overwritten just below)
    {
      const int next = it + STAGES - 1;
      if (next < total_iters) issue_loads(next % STAGES);
      cp_async_commit();
    }
    // (moved on here: the epilogue below may `continue`)
    const int s = step_at.k, tile_index = step_at.tile;
    if (kLocateEarly && s == 0) step_located = tiles.locate(tile_index);  // used by the epilogue
    step_at.advance(stages_per_tile);
    const uint8_t* sb = stages + (it % STAGES) * Cfg::kStageBytes;
    const uint8_t* sa = sb + Cfg::kStageB;
    const uint8_t* ss = sa + Cfg::kStageA;

    // MXFP4: the scale bytes of all of the stage's groups of this warp first, and one vote for the stage: when
    // every scale is <= 2^1 (s <= 128: MX weight scales in practice), one multiply by the bf16 2^(s - 1) per pair
    // (the NVFP4 decode) instead of * 2^126, * 2^(s - 127); the product e2m1 * 2^(s - 127) is the same exact
    // value. A warp vote (mma.sync needs the whole warp on one path), once per stage: a vote per group put its
    // latency into every group's chain (T = 1 at long K).
    [[maybe_unused]] int mx_byte[GPS / WARPS_K][MF][2];
    bool mx_fast = false;
    if constexpr (F == W4Format::kMxfp4) {
      const int row_base = kHalfScaleTile ? stage_scale_row[it % STAGES] : 0;
      bool small = true;
#pragma unroll
      for (int gk = 0; gk < GPS / WARPS_K; ++gk) {
        const int gg = gk * WARPS_K + warp_k;
        const int g = s * GPS + gg;
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = row_base + frag_row(warp_m, mf) + gid + 8 * h;  // row of the scale tile
            const int blk = gg * 4 + tig;
            const uint8_t one = ss[(blk / 4) * 512 + (r % 32) * 16 + (r / 32) * 4 + (blk % 4)];
            // -1: past K (scale 0), including a whole group past K in the last stage
            mx_byte[gk][mf][h] = g < groups && g * 4 + tig < p.scale_blocks ? one : -1;
            small = small && mx_byte[gk][mf][h] <= 128;
          }
      }
      mx_fast = __all_sync(0xffffffffu, small);
    }

#pragma unroll
    for (int gk = 0; gk < GPS / WARPS_K; ++gk) {
      const int gg = gk * WARPS_K + warp_k;  // this warp's groups of the stage
      const int g = s * GPS + gg;
      if (GPS > 1 && g >= groups) break;  // K tail of the last stage (uniform branch)
      uint4 w[MF][2];
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        const int r = frag_row(warp_m, mf) + gid;
        w[mf][0] = *reinterpret_cast<const uint4*>(sb + r * kRowBytesB + (w4a8::swizzle_b<GPS>(gg * 4 + tig, r) << 4));
        w[mf][1] = *reinterpret_cast<const uint4*>(sb + (r + 8) * kRowBytesB +
                                                   (w4a8::swizzle_b<GPS>(gg * 4 + tig, r + 8) << 4));
      }
      // FP4 scales of this thread's blocks, per row half: [mf][h][word / 2 (NVFP4) or 0 (MX)].
      uint32_t sc[MF][2][2];
      if constexpr (F == W4Format::kNvfp4) {
        const int row_base = kHalfScaleTile ? stage_scale_row[it % STAGES] : 0;
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = row_base + frag_row(warp_m, mf) + gid + 8 * h;  // row of the scale tile
            const int row_off = (r % 32) * 16 + (r / 32) * 4;
            const int blk = gg * 8 + 2 * tig;  // stage-local block of words 0, 1 (+1 for words 2, 3)
            const int gblk = g * 8 + 2 * tig;
            // Blocks past K read as scale 0 (e4m3 0): a mask on the bytes, the same for every row.
            const uint32_t keep = gblk + 1 < p.scale_blocks ? 0xffffu : gblk < p.scale_blocks ? 0xffu : 0u;
            const uint32_t two = *reinterpret_cast<const uint16_t*>(ss + (blk / 4) * 512 + row_off + (blk % 4)) & keep;
            nvfp4_scale_splats(two, sc[mf][h][0], sc[mf][h][1]);
          }
      }
      if constexpr (F == W4Format::kMxfp4) {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int b = mx_byte[gk][mf][h];
            const uint32_t fast = static_cast<uint32_t>(b + 126) << 7;
            sc[mf][h][0] = sc[mf][h][1] = b < 0 ? 0u : mx_fast ? (fast | (fast << 16)) : scale_splat<F>(b);
          }
      }
      float part[MF][NF][4];
      if constexpr (kInt4) {
#pragma unroll
        for (int i = 0; i < MF; ++i)
#pragma unroll
          for (int j = 0; j < NF; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) part[i][j][c] = 0.f;
      }
      float(*target)[NF][4] = kInt4 ? part : acc;  // int4: a fresh chain per group; FP4: straight into acc

      // Plain words pair K (i, i + 4) (one mask each, activations paired by a byte permute); packed words pair
      // K (2m, 2m + 1), the activations' own bf16 pairs.
      auto mma_group = [&](auto fast_tag, auto packed_tag) {
        constexpr bool kPacked = decltype(packed_tag)::value;
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // weight word j = activation chunk j of this thread
          uint4 x[NF];
#pragma unroll
          for (int nf = 0; nf < NF; ++nf) {
            const int t = (warp_n * NF + nf) * 8 + gid;
            x[nf] = *reinterpret_cast<const uint4*>(sa + t * kRowBytesA + (swizzle_a(gg * 16 + tig * 4 + j, t) << 4));
          }
#pragma unroll
          for (int half = 0; half < 2; ++half) {  // MMA step 2 j + half: pairs (2 half, +4), (2 half + 1, +4)
            uint32_t b0[NF], b1[NF];
#pragma unroll
            for (int nf = 0; nf < NF; ++nf) {
              if constexpr (kPacked) {  // K (4 half, + 1), (4 half + 2, + 3)
                b0[nf] = half == 0 ? x[nf].x : x[nf].z;
                b1[nf] = half == 0 ? x[nf].y : x[nf].w;
              } else {
                const uint32_t lo = half == 0 ? x[nf].x : x[nf].y;  // K 2 half, 2 half + 1
                const uint32_t hi = half == 0 ? x[nf].z : x[nf].w;  // K 2 half + 4, 2 half + 5
                b0[nf] = prmt(lo, hi, 0x5410);
                b1[nf] = prmt(lo, hi, 0x7632);
              }
            }
#pragma unroll
            for (int mf = 0; mf < MF; ++mf) {
              const uint32_t w0 = j == 0 ? w[mf][0].x : j == 1 ? w[mf][0].y : j == 2 ? w[mf][0].z : w[mf][0].w;
              const uint32_t w1 = j == 0 ? w[mf][1].x : j == 1 ? w[mf][1].y : j == 2 ? w[mf][1].z : w[mf][1].w;
              uint32_t s0 = 0, s1 = 0;
              if constexpr (!kInt4) {
                s0 = sc[mf][0][j / 2];
                s1 = sc[mf][1][j / 2];
              }
              constexpr W4Format kDecode = decltype(fast_tag)::value ? W4Format::kNvfp4 : F;  // MX fast: one multiply
              uint32_t a0, a1, a2, a3;
              if constexpr (kPacked) {
                a0 = decode_packed_byte<kDecode>(w0, 2 * half, s0);
                a2 = decode_packed_byte<kDecode>(w0, 2 * half + 1, s0);
                a1 = decode_packed_byte<kDecode>(w1, 2 * half, s1);
                a3 = decode_packed_byte<kDecode>(w1, 2 * half + 1, s1);
              } else {
                a0 = decode_pair<kDecode>(w0, 2 * half, s0);
                a2 = decode_pair<kDecode>(w0, 2 * half + 1, s0);
                a1 = decode_pair<kDecode>(w1, 2 * half, s1);
                a3 = decode_pair<kDecode>(w1, 2 * half + 1, s1);
              }
#pragma unroll
              for (int nf = 0; nf < NF; ++nf) mma_bf16(target[mf][nf], a0, a1, a2, a3, b0[nf], b1[nf]);
            }
          }
        }
      };
      if (kInt4 || !p.fp4_packed) {
        if (mx_fast) {
          mma_group(std::true_type{}, std::false_type{});
        } else {
          mma_group(std::false_type{}, std::false_type{});
        }
      } else if constexpr (!kInt4) {
        if (mx_fast) {
          mma_group(std::true_type{}, std::true_type{});
        } else {
          mma_group(std::false_type{}, std::true_type{});
        }
      }
      if constexpr (kInt4) {
        // Group promotion: acc += S[row, g] * part (fp32, g increasing).
        const __nv_bfloat16* sbf = reinterpret_cast<const __nv_bfloat16*>(ss);
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
          const int r = frag_row(warp_m, mf) + gid;
          const int i0 = p.scales_packed4 ? (gg / 4) * kTileM * 4 + r * 4 + (g & 3) : gg * kTileM + r;
          const int i1 = p.scales_packed4 ? (gg / 4) * kTileM * 4 + (r + 8) * 4 + (g & 3) : gg * kTileM + r + 8;
          const float scale0 = __bfloat162float(sbf[i0]);
          const float scale1 = __bfloat162float(sbf[i1]);
#pragma unroll
          for (int nf = 0; nf < NF; ++nf) {
            acc[mf][nf][0] = fmaf(scale0, part[mf][nf][0], acc[mf][nf][0]);
            acc[mf][nf][1] = fmaf(scale0, part[mf][nf][1], acc[mf][nf][1]);
            acc[mf][nf][2] = fmaf(scale1, part[mf][nf][2], acc[mf][nf][2]);
            acc[mf][nf][3] = fmaf(scale1, part[mf][nf][3], acc[mf][nf][3]);
          }
        }
      }
    }

    if (s == stages_per_tile - 1) {
      if constexpr (WARPS_K > 1) {  // ---- K warps meet (k_warps.cuh); the next iteration's barrier retires `park`
        float* park = reinterpret_cast<float*>(stages + STAGES * Cfg::kStageBytes);
        constexpr int kMnThreads = WARPS_M * WARPS_N * 32;
        if (!meet_k_warps<WARPS_K, MF, NF, kMnThreads>(acc, park, warp_k, tid % kMnThreads)) continue;
      }
      // ---- Epilogue: D[row, n] = out(s[row] * (post * acc)).
      constexpr float kPost = F == W4Format::kNvfp4 ? 256.0f : 1.0f;  // undoes the 2^-8 of the NVFP4 decode
      const GroupedTile tile = kLocateEarly ? finish_tile<kTileM, kTileN>(step_located) : tiles[tile_index];
      if constexpr (kAct) {
        act_bf16_epilogue<WARPS_M, MF, NF, kTileM, kTileN>(acc, tile, p, p.act, warp_m, gid, tig, kPost, act_xchg);
      } else {
        w4a8::store_fragments<OutT>(acc, tile, p, warp_m, warp_n, gid, tig, kPost,
                                    [&](int row, float lo, float hi, float& out_lo, float& out_hi) {
                                      const bool scaled = p.row_scales != nullptr;
                                      const float rs = scaled ? p.row_scales[row] : 1.0f;
                                      out_lo = scaled ? rs * lo : lo;
                                      out_hi = scaled ? rs * hi : hi;
                                    });
      }
    }
  }
  cp_async_wait<0>();
}

}  // namespace bf16w4
}  // namespace qmoe::cuda
