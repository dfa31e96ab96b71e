// Building blocks of the W4A8 WGMMA kernels (sm90_grouped_gemm_w4a8_int4_wgmma.cu). A pipeline stage is one K group
// (128) of one tile: TILE_N activation rows (e4m3, 128-byte swizzle), 128 weight rows (int4, 64 bytes
// each), their bf16 scales, filled by TMA boxes (the kernel file's tma_load_stage). Here: shared-memory
// addressing, the wgmma descriptor and fences, mbarriers and the TMA box copy, and the two epilogue
// stores (plain, and the fused activation epilogue's in registers).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/store_out.cuh"
#include "cuda/gemm/act_requant_items.cuh"
#include "cuda/gemm/grouped_tile_list.cuh"
#include "cuda/gemm/sm90_grouped_gemm_w4a8_int4_wgmma.h"

namespace qmoe::cuda::wgmma {

constexpr int kTileM = 128;    // weight rows (64 per warpgroup: the wgmma M)
constexpr int kGroup = 128;    // K per stage: one quantization group
constexpr int kMaxExperts = kTileListMaxExperts;
constexpr int kStageW = kTileM * kGroup / 2;   // weights, 128 rows x 64 bytes
constexpr int kStageS = kTileM * 8;            // scales: packed-4 rows of 8 bytes (packed-1 uses 256 bytes)
constexpr int kTileStartBytes = (kMaxExperts + 1) * 4 + 32 * 4;  // tile prefix + warp totals

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The first 1024-byte aligned address of the dynamic shared memory. NOTE: offset from the __shared__
// array itself, not rounded as an integer and cast back: that loses the address space, and every
// access through the pointer then compiles to a generic load (LD.E) instead of LDS.
__device__ __forceinline__ uint8_t* align_1024(uint8_t* smem_raw) {
  return smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
}
// wgmma descriptor of a K-major operand tile with 128-byte swizzle: rows of 128 bytes, 8-row
// atoms 1024 bytes apart (stride byte offset); the leading byte offset is unused with swizzling.
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t smem_addr) {
  uint64_t desc = (smem_addr & 0x3FFFF) >> 4;
  desc |= uint64_t{1} << 16;            // leading byte offset (unused, 1 by convention)
  desc |= uint64_t{1024 >> 4} << 32;    // stride byte offset
  desc |= uint64_t{1} << 62;            // 128-byte swizzle
  return desc;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// NOTE: keeps the compiler from moving accumulator reads/writes across the asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// int4 group scale (bf16 -> fp32) of weight row r for group g in a stage's scale tile: packed-4 rows of 4 bf16
// (SGLang's K % 512 == 0 layout) or one bf16 per row.
__device__ __forceinline__ float group_scale(const __nv_bfloat16* ss, bool packed4, int r, int g) {
  return __bfloat162float(packed4 ? ss[r * 4 + (g & 3)] : ss[r]);
}

// Group promotion (SGLang's order): acc += S * part, one fp32 FMA per value, g increasing. part is one
// wgmma accumulator (4 values per 8 token columns: rows r0, r0, r0 + 1, r0 + 1), s0 / s1 the scales of r0 / r0 + 1.
template <int N>
__device__ __forceinline__ void promote_group(float (&acc)[N], const float (&part)[N], float s0, float s1) {
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    acc[4 * j + 0] = fmaf(s0, part[4 * j + 0], acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(s0, part[4 * j + 1], acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(s1, part[4 * j + 2], acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(s1, part[4 * j + 3], acc[4 * j + 3]);
  }
}

// The a_scale of each of this thread's token columns c = 8 j + 2 tig + h of tile t (sc[2 j + h]; 1 past the
// tile's rows). A kernel may load them while the tile's last wgmmas run (their latency otherwise comes once
// per tile on top of the epilogue: 15-37% of a small-K GEMM on the bf16 kernel, s17e).
template <int TILE_N>
__device__ __forceinline__ void load_tile_scales(const WgmmaGemmParams& p, const GroupedTile& t, int tig,
                                                 float (&sc)[TILE_N / 4]) {
  if (!p.a_scales_per_row) {  // one scale (SGLang's a_scales [1]): one load, the same register everywhere
    const float s = p.a_scales[0];
#pragma unroll
    for (int i = 0; i < TILE_N / 4; ++i) sc[i] = s;
    return;
  }
#pragma unroll
  for (int i = 0; i < TILE_N / 4; ++i) {
    const int c = 8 * (i / 2) + 2 * tig + (i % 2);
    sc[i] = c >= t.rows ? 1.0f : p.a_scales[t.row0 + c];
  }
}

// Visits this thread's accumulators of tile t once: f(token column c, a_scale of its row (sc), accumulator
// of row r0, accumulator of row r1) for the token columns c = 8 j + 2 tig + h inside the tile's rows,
// then zeroes every accumulator (also past the rows) for the next tile.
template <int TILE_N, class F>
__device__ __forceinline__ void for_each_tile_value(const GroupedTile& t, float (&acc)[TILE_N / 2], int tig,
                                                    const float (&sc)[TILE_N / 4], F&& f) {
#pragma unroll
  for (int j = 0; j < TILE_N / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 8 * j + 2 * tig + h;
      if (c < t.rows) f(c, sc[2 * j + h], acc[4 * j + h], acc[4 * j + 2 + h]);
      acc[4 * j + h] = 0.f;
      acc[4 * j + 2 + h] = 0.f;
    }
  }
}

// The plain epilogue (both kernels): accumulators (features r0, r0 + 1; r0 even) of token column c of
// tile t -> D[token, feature] = out(a_scale(token) * acc), one paired store per token. The op's limits
// (N % 8 == 0, 16-byte aligned D) keep the pair inside N and aligned.
// sc: the tile's a_scales (load_tile_scales).
template <class OutT, int TILE_N>
__device__ __forceinline__ void store_tile(const WgmmaGemmParams& p, const GroupedTile& t, float (&acc)[TILE_N / 2],
                                           const float (&sc)[TILE_N / 4], int r0, int tig) {
  const bool ok = t.n0 + r0 < p.n;
  for_each_tile_value<TILE_N>(t, acc, tig, sc, [&](int c, float s, float a0, float a1) {
    OutT* out = static_cast<OutT*>(p.d) + (t.row0 + c) * int64_t{p.n} + t.n0 + r0;
    if (ok) store_out_pair(out, s * a0, s * a1);
  });
}

// The fused activation epilogue in registers (ActE4m3 tiles of both kernels; w4a8_act_requant.h). A gated tile's
// 128 weight rows are the gate rows of F = 64 features, then their up rows (act_tile_rows). The thread that owns
// tile feature f (f = 32 c + 8 w + gid: computing warpgroup c, warp w of it) converts gate row f into its
// accumulator row gid and up row 64 + f into row gid + 8, so both values of a feature meet in one thread:
//
//   A2[token, f0 + f] = e4m3(act(s * acc_gate, s * acc_up) / a2)   s = a_scale(token), f0 = 64 (n0 / 128)
//   s2[token]         = a2 * w2_alpha[e]                            (the tile with n0 == 0)
//
// with s * acc rounded once (__fmul_rn: the fp32 h the plain epilogue stores) and the arithmetic of
// activation_math.cuh, so the codes are those of the separate activation kernel bit for bit; h is never
// written. Gated activations only (ReLU^2 keeps the separate kernel at prefill: act_requant_supported), so
// that the row pair's distance is a compile-time constant (a runtime one spilled the 32-token kernel).
// The thread's weight row pair (accumulator rows gid, gid + 8) of computing warpgroup c, warp w of it:
// kGated r0 = the tile feature, r1 = its up row; else r0, r0 + 1 (adjacent features, stored as a pair).
template <bool kGated>
__device__ __forceinline__ int operand_row0(int c, int w, int gid) {
  return kGated ? 32 * c + 8 * w + gid : 64 * c + 16 * w + 2 * gid;
}
template <bool kGated>
constexpr int kOperandRowStep = kGated ? 64 : 1;  // r1 - r0

// Gated: lanes gid and gid ^ 1 (features f and f ^ 1, the same tokens) swap one code, so that each thread stores
// one 2-byte pair: even f token c (features f, f + 1), odd f token c + 1 (features f - 1, f).
template <int TILE_N, Activation kAct>
__device__ __forceinline__ void act_gated_tile(const ActRequantEpilogue& ep, const GroupedTile& t,
                                               const float (&acc)[TILE_N / 2], const float (&sc)[TILE_N / 4], int f,
                                               int lane, float a2) {
  const int tig = lane & 3, odd = f & 1;
  const int feature = (t.n0 / kTileM) * (kTileM / 2) + f - odd;  // the stored pair's first feature
  const bool in_range = feature < ep.inter;
  uint8_t* base = ep.a2 + feature;
#pragma unroll
  for (int j = 0; j < TILE_N / 8; ++j) {
    float v[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float s = sc[2 * j + h];
      v[h] = fused::requant_value(
          fused::gated_value_of<kAct>(ep.act, __fmul_rn(s, acc[4 * j + h]), __fmul_rn(s, acc[4 * j + 2 + h])), a2);
    }
    const uint32_t mine = fused::e4m3x2(v[0], v[1]);  // tokens c (low byte), c + 1
    const uint32_t other = __shfl_xor_sync(0xffffffffu, mine, 4);
    const uint32_t pair = odd ? ((other >> 8) & 0xffu) | (mine & 0xff00u) : (mine & 0xffu) | ((other & 0xffu) << 8);
    const int token = 8 * j + 2 * tig + odd;
    if (token < t.rows && in_range)
      *reinterpret_cast<uint16_t*>(base + static_cast<int64_t>(t.row0 + token) * ep.inter) = static_cast<uint16_t>(pair);
  }
}

// Tile t's A2 codes and s2 from this thread's accumulators (r0 = operand_row0<true>), then zeroes them for the
// next tile. One branch per tile on the activation: each case is unrolled over the accumulators with its own
// arithmetic only. Every lane of the warp calls it (shuffles).
template <int TILE_N>
__device__ __forceinline__ void act_store_tile(const ActRequantEpilogue& ep, const GroupedTile& t,
                                               float (&acc)[TILE_N / 2], const float (&sc)[TILE_N / 4], int r0,
                                               int lane) {
  const float a2 = ep.a2_scale[0];
  switch (ep.act.activation) {
    case Activation::kSwiglu: act_gated_tile<TILE_N, Activation::kSwiglu>(ep, t, acc, sc, r0, lane, a2); break;
    case Activation::kGegluTanh: act_gated_tile<TILE_N, Activation::kGegluTanh>(ep, t, acc, sc, r0, lane, a2); break;
    default: act_gated_tile<TILE_N, Activation::kSitu>(ep, t, acc, sc, r0, lane, a2); break;
  }
  if (t.n0 == 0 && r0 == 0) {  // lanes 0-3 of the first warp hold every token column
    const float s2 = fused::s2_value(a2, ep.w2_alpha, t.expert);
#pragma unroll
    for (int j = 0; j < TILE_N / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = 8 * j + 2 * (lane & 3) + h;
        if (c < t.rows) ep.s2[t.row0 + c] = s2;
      }
  }
#pragma unroll
  for (int i = 0; i < TILE_N / 2; ++i) acc[i] = 0.f;
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Arrives on bar (one of its count) and adds the transaction bytes its current phase waits for (TMA copies
// issued by this thread after it).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// One TMA box of a 2-D tensor map (a __grid_constant__ kernel parameter) into shared memory at dst; its
// bytes complete a transaction of bar. c0: the inner (contiguous) coordinate, c1: the row.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  const uint32_t addr = smem_u32(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

}  // namespace qmoe::cuda::wgmma
