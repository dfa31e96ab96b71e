// Hopper WGMMA tiles of the bf16 x 4-bit grouped GEMM (formula, layouts, limits: sm90_grouped_gemm_bf16_w4.h):
//
//   int4  : D[r, n] = out( s[r] * sum_g S[e, n, g] * (sum_{k in g} A[r, k] * q[e, n, k]) )
//   FP4   : D[r, n] = out( s[r] * post * sum_k A[r, k] * dec[e, n, k] )
//
// dec = e2m1 x block scale, exact in bf16 (NVFP4: x 2^-8, post = 2^8; MXFP4: post = 1), as the mma.sync tiles
// (sm90_grouped_gemm_bf16_w4.cuh). int4: a fresh fp32 partial per 128-wide K group, promoted by one fp32 FMA
// with the group scale, g increasing; FP4 accumulates every group into one fp32 accumulator.
//
// Structure: the W4A8 warp-specialized WGMMA kernel's (sm90_grouped_gemm_w4a8_int4_wgmma.cu) with a bf16 MMA.
// A loading warpgroup (thread 0 issues each stage's TMA boxes, per-stage "full" / "empty" mbarriers) and
// two computing warpgroups of 64 weight rows each that run out of step. Swap-AB: weights decoded to bf16
// in registers are the wgmma A operand, the tokens' bf16 activations the B operand in shared memory. One
// stage is one K group of one 128 x TILE_N tile (TILE_N = 64, 128 or 160 tokens): two 64-K activation boxes
// (128-byte rows, 128-byte swizzle), 128 weight rows (64 bytes, 64-byte swizzle) and the group's scales. Per
// stage each computing warpgroup issues 8 wgmma m64nTILE_Nk16: bf16 runs at half the fp8 rate, so the
// 128-token tile is tensor-bound by count (~1,024 tensor cycles per stage for both warpgroups against ~250
// issue slots of decode per warp).
//
// The A fragment of m64nNk16 (as mma.sync m16n8k16): thread (gid, tig) holds rows gid and gid + 8 and K
// 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9 of each k16 step s: in a packed weight row, byte tig of the
// 32-bit words 2 s and 2 s + 1. One byte (nibbles k, k + 1) becomes one bf16x2:
// a byte permute isolates it, times 0x1001 and masked its nibbles sit at bits 0..3 and 16..19 (a nibble
// must stay inside the 7 mantissa bits of its bf16 half, so the byte cannot simply be placed twice); then
// the mma.sync tiles' decode of a nibble pair: int4 one LOP3 (exponent of 128, sign bit flipped: q + 8)
// and one bf16x2 subtract of 136; FP4 the e2m1 bits and the block-scale multiply. An NVFP4 block (16 K)
// is one k16 step, an MXFP4 block two.
// Accumulator row gid holds weight row r0 = 64 c + 16 w + 2 gid, row gid + 8 holds r0 + 1 (as the W4A8
// tiles): the epilogue stores each token's two adjacent features as one pair.
// A persistent grid walks the (expert, feature tile, token tile) list (grouped_tile_list.cuh).
// Limits (checked by the caller): as the mma.sync tiles; no scatter epilogue.
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/common/pdl.cuh"
#include "cuda/common/store_out.cuh"
#include "cuda/gemm/grouped_tile_list.cuh"
#include "cuda/gemm/resident_ctas.h"
#include "cuda/gemm/sm90_grouped_gemm_bf16_w4.cuh"
#include "cuda/gemm/sm90_grouped_gemm_bf16_w4_wgmma.h"
#include "cuda/gemm/wgmma_building_blocks.cuh"
#include "cuda/gemm/wgmma_tma.cuh"
#include "qmoe/error.h"

namespace qmoe::cuda::bf16w4 {
namespace wgmma_bf16 {

using namespace wgmma;  // kTileM, kGroup, kStageW, descriptors, fences, mbarriers, the TMA box copy

struct Params : Bf16W4Params {
  CUtensorMap act_map;     // A [R, K] bf16: boxes of kTileN rows x 64 K (128 bytes), 128-byte swizzle
  CUtensorMap weight_map;  // B [E * N, K / 2] bytes: boxes of 128 rows x 64 bytes, 64-byte swizzle
  CUtensorMap scale_map;   // int4: [E * K/512, N] int64 (packed-4) or [E * K/128, N] bf16, 128 per box;
                           // FP4: [E * Mt * Kt, 128] uint32 (512-byte chunks of the 128x4 layout), 1 or 2 per box
};

constexpr int kConsumers = 2;                           // computing warpgroups, 64 weight rows each
constexpr int kThreads = 128 * (1 + kConsumers);        // + the loading warpgroup
constexpr int kProducerRegs = 40, kConsumerRegs = 232;  // setmaxnreg: 128 * 40 + 256 * 232 = 384 * 168
// NOTE: setmaxnreg only moves registers within the CTA's launch allocation (kThreads x the launch bound's per-thread
// maximum, 168 at 384 threads); a split above it makes setmaxnreg.inc wait forever (an A/B run hung so, session 25).
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * (65536 / kThreads / 8 * 8),
              "setmaxnreg split within the launch allocation");
constexpr int kStageS = 1024;  // int4 packed-4: 128 rows x 8 bytes; NVFP4: two 512-byte chunks

// TILE_N tokens per tile (the wgmma N): 64, 128 or 160, chosen by expected token tiles per expert (tactics.cpp).
template <int TILE_N>
struct Shape {
  static_assert(TILE_N == 64 || TILE_N == 128 || TILE_N == 160, "wgmma m64n64k16, m64n128k16 or m64n160k16");
  static constexpr int kAcc = TILE_N / 2;  // fp32 accumulator registers per thread
  static constexpr int kBox = TILE_N * 128;  // one 64-K activation box
  static constexpr int kStageA = 2 * kBox;
  static constexpr int kStageBytes = kStageA + kStageW + kStageS;  // 25 KB (64 tokens), 41 KB (128), 49 KB (160)
  static constexpr int kStages = TILE_N == 64 ? 8 : TILE_N == 128 ? 5 : 4;
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  // + 1 KB of alignment slack
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kBarrierBytes + kTileStartBytes;
  static_assert(kStageBytes % 1024 == 0 && kBox % 1024 == 0, "activation boxes stay 1024-byte aligned (128B swizzle)");
  static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of one SM");
};

// d (64 x 128 fp32 per warpgroup) (+)= A (64 x 16 bf16, registers) * B^T (128 x 16 bf16, smem, K-major).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// d (64 x 160 fp32 per warpgroup) (+)= A (64 x 16 bf16, registers) * B^T (160 x 16 bf16, smem, K-major).
__device__ __forceinline__ void wgmma_m64n160k16(float (&d)[80], const uint32_t (&a)[4], uint64_t desc_b,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %85, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, {%80, %81, %82, %83}, %84, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// d (64 x 64 fp32 per warpgroup) (+)= A (64 x 16 bf16, registers) * B^T (64 x 16 bf16, smem, K-major).
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

template <int TILE_N>
__device__ __forceinline__ void wgmma_k16(float (&d)[TILE_N / 2], const uint32_t (&a)[4], uint64_t desc_b,
                                          int accumulate) {
  if constexpr (TILE_N == 160) wgmma_m64n160k16(d, a, desc_b, accumulate);
  else if constexpr (TILE_N == 128) wgmma_m64n128k16(d, a, desc_b, accumulate);
  else wgmma_m64n64k16(d, a, desc_b, accumulate);
}

// prmt selector of byte `tig` alone (bytes 1..3 from the zero operand), one per thread.
__host__ __device__ constexpr uint32_t sel_byte(int tig) { return 0x4440u | tig; }

// Byte `tig` of w (nibbles k, k + 1) at bits 0..3 and 16..19.
__device__ __forceinline__ uint32_t nibble_pair(uint32_t w, uint32_t sel) {
  return (prmt(w, 0u, sel) * 0x1001u) & 0x000F000Fu;
}

// int4: (q_k, q_k+1) as bf16x2, exact: 0x4300 | (q + 8) is 128 + q + 8 (sm90_grouped_gemm_bf16_w4.cuh).
__device__ __forceinline__ uint32_t int4_pair(uint32_t w, uint32_t sel) {
  return bits(__hsub2(bf2(nibble_pair(w, sel) ^ 0x43084308u), bf2(0x43084308u)));
}

// FP4: (k, k + 1) as bf16x2 e2m1 * 2^-126 (sm90_grouped_gemm_bf16_w4.cuh), unscaled.
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t w, uint32_t sel) {
  return (nibble_pair(w, sel) * 0x1040u) & 0x81C081C0u;
}

// This thread's row r of a stage's scale chunk (FP4, 128x4 layout): its 4 block scales as one word.
__device__ __forceinline__ uint32_t chunk_word(const uint8_t* chunk, int r) {
  return *reinterpret_cast<const uint32_t*>(chunk + (r % 32) * 16 + (r / 32) * 4);
}

// FP4: the A operand of one stage: this thread's weight rows r0, r0 + 1 (sw: the stage's weight tile, chunk k
// of row r at k ^ ((r >> 1) & 3)) decoded to bf16 with the group's block scales from ss (blocks from `valid` on
// read as scale 0: past K, or the layout's padding), a[s] for k16 step s.
template <W4Format F, bool kPacked>
__device__ __forceinline__ void stage_a_operand(const uint8_t* sw, const uint8_t* ss, int r0, int tig, int valid,
                                                uint32_t (&a)[8][4]) {
  const int x = (r0 >> 1) & 3;
  const uint8_t* row0 = sw + r0 * (kGroup / 2);
  uint4 w0[4], w1[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    w0[k] = *reinterpret_cast<const uint4*>(row0 + 16 * (k ^ x));
    w1[k] = *reinterpret_cast<const uint4*>(row0 + kGroup / 2 + 16 * (k ^ x));
  }
  {
    static_assert(F != W4Format::kInt4G128, "int4 decodes in halves (stage_a_half_int4)");
    constexpr bool kNv = F == W4Format::kNvfp4;
    constexpr int kBlocks = kNv ? 8 : 4;  // scale blocks per group
    // Scale bytes of rows r0 and r0 + 1, blocks 0..3 (and 4..7 for NVFP4), masked past `valid`.
    uint32_t sc0[2], sc1[2];
#pragma unroll
    for (int h = 0; h < (kNv ? 2 : 1); ++h) {
      const int v = valid - 4 * h;
      const uint32_t keep = v >= 4 ? 0xFFFFFFFFu : v <= 0 ? 0u : (1u << (8 * v)) - 1u;
      sc0[h] = chunk_word(ss + 512 * h, r0) & keep;
      sc1[h] = chunk_word(ss + 512 * h, r0 + 1) & keep;
    }
    uint32_t s0[kBlocks], s1[kBlocks];
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      s0[b] = scale_splat<F>((sc0[b / 4] >> (8 * (b % 4))) & 0xFFu);
      s1[b] = scale_splat<F>((sc1[b / 4] >> (8 * (b % 4))) & 0xFFu);
    }
    const uint32_t sel = sel_byte(tig);
    // Packed words (core/fp4_weight_pack.h): byte tig by its thread's rotation, mask and multiply (bytes 0..2:
    // rotate by 3 tig, multiply by 1; byte 3: mask, multiply by 0x4108), one form for the whole warp.
    const int rot = tig < 3 ? 3 * tig : 0;
    const uint32_t pre = tig < 3 ? 0xFFFFFFFFu : fp4pack::kByte3Mask;
    const uint32_t mul = tig < 3 ? 1u : fp4pack::kByte3Mul;
    auto dec = [&](uint32_t w, uint32_t scale2) {
      const __nv_bfloat162 e =
          bf2(kPacked ? ((__funnelshift_r(w, w, rot) & pre) * mul) & fp4pack::kDecodeMask : e2m1_pair(w, sel));
      if constexpr (kNv) return bits(__hmul2(e, bf2(scale2)));
      else return bits(__hmul2(__hmul2(e, bf2(0x7E807E80u)), bf2(scale2)));  // * 2^126, * 2^(s - 127)
    };
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const uint4& c0 = w0[s / 2];
      const uint4& c1 = w1[s / 2];
      const int b = kNv ? s : s / 2;
      a[s][0] = dec(s % 2 ? c0.z : c0.x, s0[b]);
      a[s][1] = dec(s % 2 ? c1.z : c1.x, s1[b]);
      a[s][2] = dec(s % 2 ? c0.w : c0.y, s0[b]);
      a[s][3] = dec(s % 2 ? c1.w : c1.y, s1[b]);
    }
  }
}

// int4, half H of the A operand (k16 steps 4 H .. 4 H + 3, weight chunks 2 H and 2 H + 1) into a[4 H ..]: the
// int4 tiles decode a group in two halves (see kOverlap).
template <int H>
__device__ __forceinline__ void stage_a_half_int4(const uint8_t* sw, int r0, int tig, uint32_t (&a)[8][4]) {
  const int x = (r0 >> 1) & 3;
  const uint8_t* row0 = sw + r0 * (kGroup / 2);
  const uint32_t sel = sel_byte(tig);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint4 c0 = *reinterpret_cast<const uint4*>(row0 + 16 * ((2 * H + j) ^ x));
    const uint4 c1 = *reinterpret_cast<const uint4*>(row0 + kGroup / 2 + 16 * ((2 * H + j) ^ x));
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      uint32_t(&out)[4] = a[4 * H + 2 * j + e];
      out[0] = int4_pair(e ? c0.z : c0.x, sel);
      out[1] = int4_pair(e ? c1.z : c1.x, sel);
      out[2] = int4_pair(e ? c0.w : c0.y, sel);
      out[3] = int4_pair(e ? c1.w : c1.y, sel);
    }
  }
}

// Where a tile's boxes start; a stage adds its group.
struct TileBoxes {
  int act_row, weight_row, scale_col, scale_row;
};
template <W4Format F>
__device__ __forceinline__ TileBoxes tile_boxes(const Params& p, const GroupedTile& t) {
  if constexpr (F == W4Format::kInt4G128) {
    const int scale_rows = p.scales_packed4 ? p.k / 512 : p.k / kGroup;
    return {t.row0, t.expert * p.n + t.n0, t.n0, t.expert * scale_rows};
  } else {
    const int mt = (p.n + kTileM - 1) / kTileM;
    return {t.row0, t.expert * p.n + t.n0, 0, (t.expert * mt + t.n0 / kTileM) * p.scale_col_chunks};
  }
}
template <W4Format F, int TILE_N>
__device__ __forceinline__ uint32_t stage_bytes(const Params& p) {
  const int scales = F == W4Format::kInt4G128 ? (p.scales_packed4 ? kTileM * 8 : kTileM * 2)
                     : F == W4Format::kNvfp4  ? 1024
                                              : 512;
  return Shape<TILE_N>::kStageA + kStageW + scales;
}
// Stage (tile boxes b, group g) at shared address sa; the bytes complete a transaction of bar.
template <W4Format F, int TILE_N>
__device__ __forceinline__ void load_stage(const Params& p, const TileBoxes& b, int g, uint32_t sa, uint64_t* bar) {
  constexpr int kBox = Shape<TILE_N>::kBox, kStageA = Shape<TILE_N>::kStageA;
  tma_load_2d(sa, &p.act_map, g * kGroup, b.act_row, bar);
  tma_load_2d(sa + kBox, &p.act_map, g * kGroup + kGroup / 2, b.act_row, bar);
  tma_load_2d(sa + kStageA, &p.weight_map, g * (kGroup / 2), b.weight_row, bar);
  const uint32_t ss = sa + kStageA + kStageW;
  if constexpr (F == W4Format::kInt4G128) {
    tma_load_2d(ss, &p.scale_map, b.scale_col, b.scale_row + (p.scales_packed4 ? g / 4 : g), bar);
  } else {
    tma_load_2d(ss, &p.scale_map, 0, b.scale_row + g * (F == W4Format::kNvfp4 ? 2 : 1), bar);
  }
}

template <W4Format F, class OutT, int TILE_N, bool kPacked = false>  // kPacked: FP4 words in packed order
__global__ void __launch_bounds__(kThreads, 1) kernel(const __grid_constant__ Params p) {
  pdl_wait();  // first; no early release (cuda/common/pdl.cuh)
  using S = Shape<TILE_N>;
  constexpr int kTileN = TILE_N, kAcc = S::kAcc, kBox = S::kBox, kStageA = S::kStageA;
  constexpr int kStageBytes = S::kStageBytes, kStages = S::kStages;
  constexpr bool kInt4 = F == W4Format::kInt4G128;
  // FP4: decode the next stage while this one's wgmmas run (two A operands of 32 registers). int4 decodes a
  // group in halves into one A operand: the second half while the first half's wgmmas run, the next group's
  // first half while the second's run. Measured (H200, bench/results/2026-12-01_s16f_*): 5-10% faster than two
  // full operands at 64 and 128 tokens, 16-23% at 160, where acc + part (2 x 80) + two operands had spilled.
  constexpr bool kOverlap = !kInt4;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* stages = align_1024(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  int32_t* tile_start = reinterpret_cast<int32_t*>(empty + kStages);
  int32_t* warp_total = tile_start + kMaxExperts + 1;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);                  // thread 0's arrival + the boxes' bytes
      mbar_init(&empty[s], 128 * kConsumers);  // every computing thread, after its wgmmas read the stage
    }
  }
  const int n_tiles = (p.n + kTileM - 1) / kTileM;
  const int groups = (p.k + kGroup - 1) / kGroup;  // FP4: the last one may be partial (K % 32 == 0)
  // (its barriers also publish the mbarrier initialisation)
  const auto tiles = cta_tiles<kThreads, kTileM, kTileN>(p.problem_sizes, p.expert_offsets, p.num_experts, n_tiles,
                                                         tile_start, warp_total);
  if (tiles.empty()) return;
  const int total_iters = tiles.count * groups;

  if (wg == 0) {
    // ---- Loading warpgroup: thread 0 fills stage it % kStages once the computing warpgroups released it.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (tid != 0) return;
    TileStep at;
    LocatedTile ahead = tiles.locate(0);
    TileBoxes boxes{};
    for (int it = 0; it < total_iters; ++it) {
      const int g = at.k, s = it % kStages;
      if (g == 0) boxes = tile_boxes<F>(p, tiles.take(ahead, at.tile));
      mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
      mbar_arrive_expect_tx(&full[s], stage_bytes<F, TILE_N>(p));
      load_stage<F, TILE_N>(p, boxes, g, smem_u32(stages + s * kStageBytes), &full[s]);
      at.advance(groups);
    }
    return;
  }

  // ---- Computing warpgroups: warp w of warpgroup c owns weight rows 64 (c - 1) + 16 (w % 4) + {2 gid, 2 gid + 1}.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int gid = lane >> 2, tig = lane & 3;
  const int r0 = (wg - 1) * 64 + (warp & 3) * 16 + 2 * gid, r1 = r0 + 1;
  constexpr int kBlocksPerGroup = F == W4Format::kNvfp4 ? 8 : 4;
  float acc[kAcc];
  [[maybe_unused]] float part[kInt4 ? kAcc : 1];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;

  auto wait_full = [&](int it) { mbar_wait(&full[it % kStages], (it / kStages) & 1); };
  TileStep convert_at;  // the group the next conversion decodes
  auto convert = [&](int it, uint32_t(&out)[8][4]) {  // (FP4)
    if constexpr (!kInt4) {
      const uint8_t* sw = stages + (it % kStages) * kStageBytes + kStageA;
      const int valid = p.scale_blocks - convert_at.k * kBlocksPerGroup;
      convert_at.advance(groups);
      stage_a_operand<F, kPacked>(sw, sw + kStageW, r0, tig, valid, out);
    }
  };

  GroupedTile t{0, 0, 0, 0};
  TileStep step_at;  // the group and tile the next step computes
  // One K group: its 8 wgmmas on the A operand `a` (decoded earlier); while they run, the next stage's
  // weights become `a_next` (int4: in halves, see kOverlap); then (int4) the promotion, and the epilogue
  // after the tile's last group.
  auto step = [&](int it, uint32_t(&a)[8][4], uint32_t(&a_next)[8][4]) {
    const int g = step_at.k, tile_index = step_at.tile, s = it % kStages;
    if (g == 0) t = tiles[tile_index];
    step_at.advance(groups);
    const uint8_t* st = stages + s * kStageBytes;
    const uint64_t desc0 = make_desc_sw128(smem_u32(st)), desc1 = make_desc_sw128(smem_u32(st + kBox));
    float s0 = 0.f, s1 = 0.f;
    if constexpr (kInt4) {
      const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(st + kStageA + kStageW);
      s0 = group_scale(ss, p.scales_packed4, r0, g);
      s1 = group_scale(ss, p.scales_packed4, r1, g);
    }
    const bool more = it + 1 < total_iters;
    if (kOverlap && more) wait_full(it + 1);
    wgmma_fence();
    if constexpr (!kOverlap) {  // int4
      fence_operands(part);
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_k16<TILE_N>(part, a[k], desc0 + 2 * k, k > 0);
      wgmma_commit();
      stage_a_half_int4<1>(st + kStageA, r0, tig, a);
      wgmma_fence();
#pragma unroll
      for (int k = 4; k < 8; ++k) wgmma_k16<TILE_N>(part, a[k], desc1 + 2 * (k - 4), 1);
    } else {
      fence_operands(acc);
#pragma unroll
      for (int k = 0; k < 8; ++k) wgmma_k16<TILE_N>(acc, a[k], k < 4 ? desc0 + 2 * k : desc1 + 2 * (k - 4), 1);
    }
    wgmma_commit();
    // The epilogue's row scales (tokens 8 j + 2 tig + h), loaded while the tile's last wgmmas run: loaded in
    // the epilogue, their latency came once per tile on top of it (small K: Qwen3-30B's GEMM2 has 6 groups).
    // (Not for int4's 160-token tile: acc + part + a left no registers for them.)
    constexpr bool kEarlyScales = !(kInt4 && TILE_N == 160);
    const bool last = g == groups - 1;
    float rs[kTileN / 4];
    if (kEarlyScales && last) {
#pragma unroll
      for (int i = 0; i < kTileN / 4; ++i) {
        const int c = 8 * (i / 2) + 2 * tig + (i % 2);
        rs[i] = p.row_scales != nullptr && c < t.rows ? p.row_scales[t.row0 + c] : 1.0f;
      }
    }
    if constexpr (kOverlap) {
      if (more) convert(it + 1, a_next);
    } else {
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // the first half's wgmmas are done
      if (more) {
        wait_full(it + 1);
        stage_a_half_int4<0>(stages + ((it + 1) % kStages) * kStageBytes + kStageA, r0, tig, a_next);  // == a
      }
    }
    wgmma_wait_all();
    if constexpr (kInt4) fence_operands(part);
    fence_operands(acc);
    mbar_arrive(&empty[s]);  // this thread is done with stage s (weights and scales in registers)
    if constexpr (kInt4) promote_group(acc, part, s0, s1);
    if (last) {
      // Epilogue: D[row, r0 + {0, 1}] = out(s[row] * (post * acc)), one paired store per token; then zero.
      constexpr float kPost = F == W4Format::kNvfp4 ? 256.0f : 1.0f;  // undoes the 2^-8 of the NVFP4 decode
      const bool ok = t.n0 + r0 < p.n;
#pragma unroll
      for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = 8 * j + 2 * tig + h;
          if (ok && c < t.rows) {
            const int row = t.row0 + c;
            const float v0 = acc[4 * j + h] * kPost, v1 = acc[4 * j + 2 + h] * kPost;
            const bool scaled = p.row_scales != nullptr;
            const float sc = !scaled ? 1.0f : kEarlyScales ? rs[2 * j + h] : p.row_scales[row];
            store_out_pair(static_cast<OutT*>(p.d) + static_cast<int64_t>(row) * p.n + t.n0 + r0,
                           scaled ? sc * v0 : v0, scaled ? sc * v1 : v1);
          }
          acc[4 * j + h] = 0.f;
          acc[4 * j + 2 + h] = 0.f;
        }
      }
    }
  };
  wait_full(0);
  if constexpr (kOverlap) {
    // Two A buffers, swapped by unrolling two steps (a runtime index would put them in local memory).
    uint32_t a_even[8][4], a_odd[8][4];
    convert(0, a_even);
    for (int it = 0; it < total_iters; it += 2) {
      step(it, a_even, a_odd);
      if (it + 1 < total_iters) step(it + 1, a_odd, a_even);
    }
  } else {
    uint32_t a[8][4];  // one buffer, refilled half by half
    stage_a_half_int4<0>(stages + kStageA, r0, tig, a);
    for (int it = 0; it < total_iters; ++it) step(it, a, a);
  }
}

}  // namespace wgmma_bf16

template <W4Format F>
void launch_wgmma(const Bf16W4Params& params, int tile_n, bool fp32_out, int64_t rows, cudaStream_t stream) {
  using namespace wgmma_bf16;
  QMOE_CHECK_ARG(params.scatter.out == nullptr, "scatter",
                 "a decode tile for the fused finalize (the WGMMA tiles store)", "a WGMMA tile");
  QMOE_CHECK_ARG(tile_n == 64 || tile_n == 128 || tile_n == 160, "tactic", "a WGMMA token tile of 64, 128 or 160",
                 std::to_string(tile_n));
  Params tp;
  static_cast<Bf16W4Params&>(tp) = params;
  const int64_t experts = params.num_experts, n = params.n, k = params.k;
  tp.act_map = tma_matrix_map(params.a, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, rows, k, tile_n, kGroup / 2,
                              CU_TENSOR_MAP_SWIZZLE_128B);
  tp.weight_map = tma_matrix_map(params.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, experts * n, k / 2, kTileM, kGroup / 2,
                                 CU_TENSOR_MAP_SWIZZLE_64B);
  if (F == W4Format::kInt4G128) {
    tp.scale_map = params.scales_packed4
                       ? tma_matrix_map(params.b_scales, CU_TENSOR_MAP_DATA_TYPE_INT64, 8, experts * (k / 512), n, 1,
                                        kTileM, CU_TENSOR_MAP_SWIZZLE_NONE)
                       : tma_matrix_map(params.b_scales, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, experts * (k / kGroup), n,
                                        1, kTileM, CU_TENSOR_MAP_SWIZZLE_NONE);
  } else {
    const int64_t mt = (n + kTileM - 1) / kTileM;
    tp.scale_map = tma_matrix_map(params.b_scales, CU_TENSOR_MAP_DATA_TYPE_UINT32, 4,
                                  experts * mt * params.scale_col_chunks, 128, F == W4Format::kNvfp4 ? 2 : 1, 128,
                                  CU_TENSOR_MAP_SWIZZLE_NONE);
  }
  auto launch = [&](auto tile) {
    constexpr int kTileN = decltype(tile)::value;
    constexpr int kSmem = Shape<kTileN>::kSmemBytes;
    auto go = [&](auto packed) {
      constexpr bool kPacked = decltype(packed)::value;
      if (fp32_out) launch_persistent<kernel<F, float, kTileN, kPacked>>(kThreads, kSmem, stream, tp, "bf16 x 4-bit wgmma");
      else launch_persistent<kernel<F, __nv_bfloat16, kTileN, kPacked>>(kThreads, kSmem, stream, tp, "bf16 x 4-bit wgmma");
    };
    if constexpr (F == W4Format::kInt4G128) go(std::false_type{});
    else if (params.fp4_packed) go(std::true_type{});
    else go(std::false_type{});
  };
  if (tile_n == 160) launch(std::integral_constant<int, 160>{});
  else if (tile_n == 128) launch(std::integral_constant<int, 128>{});
  else launch(std::integral_constant<int, 64>{});
}

template void launch_wgmma<W4Format::kInt4G128>(const Bf16W4Params&, int, bool, int64_t, cudaStream_t);
template void launch_wgmma<W4Format::kNvfp4>(const Bf16W4Params&, int, bool, int64_t, cudaStream_t);
template void launch_wgmma<W4Format::kMxfp4>(const Bf16W4Params&, int, bool, int64_t, cudaStream_t);

}  // namespace qmoe::cuda::bf16w4
