// Hopper WGMMA prefill kernel of the W4A8 grouped GEMM (cutlass_w4a8_moe_mm), SGLang semantics:
//
//   D[r, o] = bf16( a_scale(r) * sum_g S[e, o, g] * (sum_{k in group g} A[r, k] * q[e, o, k]) )
//
// a fresh fp32 partial per 128-wide K group (four wgmma m64n128k32 with the first one not
// accumulating), then one fp32 FMA with the bf16 group scale into the main accumulator, g increasing.
//
// Structure: swap-AB. The wgmma M side (64 rows per warpgroup, 2 warpgroups = 128 rows per CTA
// tile) holds weight rows: int4 codes are turned into e4m3 in registers (every int4 value is exact
// in e4m3) and fed as the register A operand; the N side holds 128 token rows of activations, read
// by the tensor cores from shared memory (B operand, K-major, 128-byte swizzle). One pipeline stage
// is one K group: 16 KB of activations, 8 KB of weights, the tile's scales; cp.async fills STAGES of
// them ahead, across tile boundaries. Two kernels (same math, same bits):
//   wgmma_ws       128-token tiles: warp-specialized, a loading warpgroup (cp.async, per-stage
//                  mbarriers) and two computing warpgroups that run out of step, 8 stages;
//   wgmma_prefill  64-token tiles (wgmma m64n64k32), for experts with fewer rows: all warps load
//                  and compute in step, two CTAs per SM.
// A persistent grid walks the (expert, feature tile, token tile)
// list built in shared memory from the device-side problem sizes, so empty experts cost nothing.
// Limits (checked by the caller): K % 128 == 0, N % 8 == 0, E <= 1024, 16-byte aligned pointers.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/common/int4_to_e4m3.cuh"
#include "cuda/common/int4_to_f16.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/common/store_out.cuh"
#include "cuda/gemm/act_requant_items.cuh"
#include "cuda/gemm/grouped_tile_list.cuh"
#include "cuda/gemm/resident_ctas.h"
#include "cuda/gemm/sm90_grouped_gemm_w4a8_int4_wgmma.h"
#include "qmoe/error.h"

namespace qmoe::cuda {
namespace wgmma_prefill {

constexpr int kThreads = 256;  // two warpgroups, both load and compute
constexpr int kTileM = 128;    // weight rows (64 per warpgroup: the wgmma M)
constexpr int kGroup = 128;    // K per stage: one quantization group
constexpr int kStages = 4;     // 4 x 17-25 KB: deep enough to cover HBM latency, one CTA per SM
constexpr int kMaxExperts = kTileListMaxExperts;
constexpr int kStageW = kTileM * kGroup / 2;   // weights, 128 rows x 64 bytes
constexpr int kStageS = kTileM * 8;            // scales: packed-4 rows of 8 bytes (packed-1 uses 256 bytes)
constexpr int kTileStartBytes = (kMaxExperts + 1) * 4 + 32 * 4;  // tile prefix + warp totals
// The fused epilogue's park: one token's h every kParkStride floats. A warp's park writes cover 8 rows
// (gid) x 4 token columns 2 tig apart; with a 128-float pitch the 4 columns fall in the same bank
// (4-way conflicts on every write), with 132 they land 8 banks apart (conflict-free).
constexpr int kParkStride = kTileM + 4;

// TILE_N token rows per tile (the wgmma N: 128, or 64 for experts with fewer rows). kAct: the fused
// activation epilogue's park, h of one tile (TILE_N x 128 fp32), after the work list.
template <int TILE_N, bool kAct = false>
struct Shape {
  static_assert(TILE_N == 64 || TILE_N == 128, "wgmma m64n64k32 or m64n128k32");
  static constexpr int kAcc = TILE_N / 2;                 // fp32 accumulator registers per thread
  static constexpr int kStageA = TILE_N * kGroup;         // activations, TILE_N rows x 128 bytes
  static constexpr int kStageBytes = kStageA + kStageW + kStageS;
  static_assert(kStageBytes % 1024 == 0, "every stage's activation tile stays 1024-byte aligned (128B swizzle)");
  // park: 16-byte aligned (float2 reads), after the work list; the plain kernels keep their size.
  static constexpr int kParkOffset = (kStages * kStageBytes + kTileStartBytes + 15) / 16 * 16;
  static constexpr int kParkBytes = kAct ? 16 + TILE_N * kParkStride * 4 : 0;
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kTileStartBytes + kParkBytes;  // + alignment slack
  static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of one SM");
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The first 1024-byte aligned address of the dynamic shared memory. NOTE: offset from the __shared__
// array itself, not rounded as an integer and cast back: that loses the address space, and every
// access through the pointer then compiles to a generic load (LD.E) instead of LDS.
__device__ __forceinline__ uint8_t* align_1024(uint8_t* smem_raw) {
  return smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
}
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

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
// NOTE: keeps the compiler from moving accumulator reads/writes across the asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x 128 fp32 per warpgroup) (+)= A (64 x 32 e4m3, registers) * B^T (128 x 32 e4m3, smem).
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2,
                                                 uint32_t a3, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate));
}

// d (64 x 64 fp32 per warpgroup) (+)= A (64 x 32 e4m3, registers) * B^T (64 x 32 e4m3, smem).
__device__ __forceinline__ void wgmma_m64n64k32(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate));
}

template <int TILE_N>
__device__ __forceinline__ void wgmma_k32(float (&d)[TILE_N / 2], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint64_t desc_b, int accumulate) {
  if constexpr (TILE_N == 128) wgmma_m64n128k32(d, a0, a1, a2, a3, desc_b, accumulate);
  else wgmma_m64n64k32(d, a0, a1, a2, a3, desc_b, accumulate);
}

// Four int4 (nibble i of v = K index i) -> four e4m3 bytes (byte i), exact.
__device__ __forceinline__ uint32_t int4x4_to_e4m3(uint32_t v) {
  return int4x4_to_e4m3x4(v & 0x7777u, 0x3210u | ((v >> 1) & 0x4444u));
}

// One pipeline stage (K group g of tile t) into shared memory at sa: TILE_N activation rows (128-byte
// swizzle), the tile's 128 weight rows, their scales of group g; LOADERS threads (loader = 0..LOADERS-1)
// share the 16-byte copies. Rows past the expert's end or past N are zero-filled, nothing read.
// kAct (the fused activation epilogue): tile row r is weight row w.lo + r (+ w.jump in the second
// half: act_requant_items.cuh); else weight row n0 + r.
template <int TILE_N, int LOADERS, bool kAct = false>
__device__ __forceinline__ void load_stage(const WgmmaGemmParams& p, const GroupedTile& t, int g, uint32_t sa,
                                           int loader, ActTileRows w = {0, 0}) {
  // Offset of tile row r's weight row from expert row 0 (the plain kernels keep their exact address
  // arithmetic: if constexpr).
  auto weight_row = [&](int r) {
    if constexpr (kAct) {
      return w.lo + r + (r >= kTileM / 2 ? w.jump : 0);
    } else {
      return t.n0 + r;
    }
  };
  static_assert(LOADERS >= kTileM / 2 && LOADERS % 8 == 0, "a scale copy per row pair, whole activation rows");
  constexpr int kRowsA = LOADERS / 8, kRowsW = LOADERS / 4;  // rows per pass: 8 and 4 chunks per row
  const uint32_t sw = sa + TILE_N * kGroup, ss = sw + kStageW;  // (every kernel's stage: activations, weights, scales)
  const int a_row = loader / 8, a_chunk = loader % 8;
  const int w_row = loader / 4, w_chunk = loader % 4;
#pragma unroll
  for (int i = 0; i < TILE_N / kRowsA; ++i) {
    const int r = a_row + kRowsA * i;
    const bool valid = r < t.rows;
    const uint8_t* src = valid ? p.a + static_cast<int64_t>(t.row0 + r) * p.k + g * kGroup + a_chunk * 16 : p.a;
    cp_async_16(sa + r * kGroup + ((a_chunk ^ (r & 7)) << 4), src, valid);
  }
  const int64_t w_row_bytes = p.k / 2;
#pragma unroll
  for (int i = 0; i < kTileM / kRowsW; ++i) {
    const int r = w_row + kRowsW * i;
    const bool valid = t.n0 + r < p.n;
    const uint8_t* src = p.b;
    if constexpr (kAct) {
      if (valid) src = p.b + (static_cast<int64_t>(t.expert) * p.n + weight_row(r)) * w_row_bytes + g * (kGroup / 2) +
                       w_chunk * 16;
    } else {
      src = valid ? p.b + (static_cast<int64_t>(t.expert) * p.n + t.n0 + r) * w_row_bytes + g * (kGroup / 2) + w_chunk * 16
                  : p.b;
    }
    cp_async_16(sw + r * (kGroup / 2) + w_chunk * 16, src, valid);
  }
  if (p.scales_packed4) {
    // Row pair (2 loader, 2 loader + 1): their 8-byte blocks of the 512-wide K block holding group g.
    if (loader < kTileM / 2) {
      const bool valid = t.n0 + 2 * loader < p.n;
      const __nv_bfloat16* src =
          valid ? p.b_scales + (static_cast<int64_t>(t.expert) * (p.k / 512) + g / 4) * 4 * p.n + 4 * weight_row(2 * loader)
                : p.b_scales;
      cp_async_16(ss + loader * 16, src, valid);
    }
  } else if (loader < kTileM / 8) {
    const bool valid = t.n0 + 8 * loader < p.n;
    const __nv_bfloat16* src = p.b_scales;
    if constexpr (kAct) {
      if (valid) src = p.b_scales + (static_cast<int64_t>(t.expert) * (p.k / kGroup) + g) * p.n + weight_row(8 * loader);
    } else {
      src = valid ? p.b_scales + (static_cast<int64_t>(t.expert) * (p.k / kGroup) + g) * p.n + t.n0 + 8 * loader
                  : p.b_scales;
    }
    cp_async_16(ss + loader * 16, src, valid);
  }
}

template <class OutT>
using ParamsOf = std::conditional_t<std::is_same<OutT, ActE4m3>::value, WgmmaActGemmParams, WgmmaGemmParams>;

// The fused activation epilogue's first half (both kernels): this thread's accumulators of tile t
// (rows r0, r1; token columns 8 j + 2 tig + h) into park as h = a_scale(row) * acc, the value the fp32
// epilogue stores (__fmul_rn: one rounding, never contracted), then zeroed. Token columns past the
// tile's rows are not written (act_requant_items reads only t.rows tokens).
template <int TILE_N>
__device__ __forceinline__ void park_tile(const WgmmaGemmParams& p, const GroupedTile& t, float (&acc)[TILE_N / 2],
                                          float* park, int r0, int r1, int tig) {
#pragma unroll
  for (int j = 0; j < TILE_N / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 8 * j + 2 * tig + h;
      if (c < t.rows) {
        const float sc = p.a_scales_per_row ? p.a_scales[t.row0 + c] : p.a_scales[0];
        park[c * kParkStride + r0] = __fmul_rn(sc, acc[4 * j + h]);
        park[c * kParkStride + r1] = __fmul_rn(sc, acc[4 * j + 2 + h]);
      }
      acc[4 * j + h] = 0.f;
      acc[4 * j + 2 + h] = 0.f;
    }
  }
}

// The plain epilogue (both kernels): accumulator (row r, token column 8 j + 2 tig + h) of tile t ->
// D[token, feature] = out(a_scale(token) * acc), then zeroed.
template <class OutT, int TILE_N>
__device__ __forceinline__ void store_tile(const WgmmaGemmParams& p, const GroupedTile& t, float (&acc)[TILE_N / 2],
                                           int r0, int r1, int tig) {
  const bool ok0 = t.n0 + r0 < p.n, ok1 = t.n0 + r1 < p.n;
#pragma unroll
  for (int j = 0; j < TILE_N / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 8 * j + 2 * tig + h;
      if (c < t.rows) {
        const int64_t row = t.row0 + c;
        const float sc = p.a_scales_per_row ? p.a_scales[row] : p.a_scales[0];
        OutT* out = static_cast<OutT*>(p.d) + row * p.n + t.n0;
        if (ok0) store_out(out + r0, sc * acc[4 * j + h]);
        if (ok1) store_out(out + r1, sc * acc[4 * j + 2 + h]);
      }
      acc[4 * j + h] = 0.f;
      acc[4 * j + 2 + h] = 0.f;
    }
  }
}

// BIASED: the experiment described at wgmma_ws::kernel (not in any shipped tactic).
// OutT ActE4m3: the fused activation epilogue (A2 and s2 instead of d; act_requant_items.cuh).
template <class OutT, int TILE_N, bool BIASED = false>
__global__ void __launch_bounds__(kThreads, TILE_N == 64 ? 2 : 1) kernel(const ParamsOf<OutT> p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  constexpr bool kAct = std::is_same<OutT, ActE4m3>::value;
  using S = Shape<TILE_N, kAct>;
  constexpr int kTileN = TILE_N;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_1024(smem_raw);  // the swizzled activation tiles need 1024-byte alignment
  uint8_t* stages = smem;
  int32_t* tile_start = reinterpret_cast<int32_t*>(smem + kStages * S::kStageBytes);
  int32_t* warp_total = tile_start + kMaxExperts + 1;
  [[maybe_unused]] float* park = reinterpret_cast<float*>(smem + S::kParkOffset);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int E = p.num_experts;
  const int n_tiles = (p.n + kTileM - 1) / kTileM;
  const int groups = p.k / kGroup;

  // ---- Work list (grouped_tile_list.cuh).
  const auto tiles =
      cta_tiles<kThreads, kTileM, kTileN>(p.problem_sizes, p.expert_offsets, E, n_tiles, tile_start, warp_total);
  if (tiles.empty()) return;
  const int total_iters = tiles.count * groups;

  // ---- Producer: every thread copies its share of each stage (load_stage).
  GroupedTile load_tile{0, 0, 0, 0};
  [[maybe_unused]] ActTileRows load_rows{0, 0};
  auto issue_loads = [&](int it) {
    const int g = it % groups;
    if (g == 0) {
      load_tile = tiles[it / groups];
      if constexpr (kAct) load_rows = act_tile_rows<kTileM>(p.act_out, load_tile.n0);
    }
    if constexpr (kAct) {
      load_stage<kTileN, kThreads, true>(p, load_tile, g, smem_u32(stages + (it % kStages) * S::kStageBytes), tid,
                                         load_rows);
    } else {
      load_stage<kTileN, kThreads>(p, load_tile, g, smem_u32(stages + (it % kStages) * S::kStageBytes), tid);
    }
  };

  // ---- Consumer: warp w of warpgroup wg owns weight rows wg*64 + w*16 + {gid, gid + 8}.
  const int gid = lane >> 2, tig = lane & 3;
  const int r0 = (warp >> 2) * 64 + (warp & 3) * 16 + gid, r1 = r0 + 8;
  float acc[S::kAcc], part[S::kAcc];
#pragma unroll
  for (int i = 0; i < S::kAcc; ++i) acc[i] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < total_iters) issue_loads(s);
    cp_async_commit();
  }
  for (int it = 0; it < total_iters; ++it) {
    cp_async_wait<kStages - 2>();
    // NOTE: the tensor cores read shared memory through the async proxy: make this thread's
    // cp.async writes visible to it, then the barrier publishes every thread's part of the stage
    // (and retires stage it - 1, whose wgmmas all completed before their warpgroup got here).
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (it + kStages - 1 < total_iters) issue_loads(it + kStages - 1);
    cp_async_commit();

    const uint8_t* st = stages + (it % kStages) * S::kStageBytes;
    const uint8_t* sw = st + S::kStageA;
    const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(sw + kStageW);
    const int g = it % groups;
    // Weights: the 64 bytes (128 int4) of rows r0 and r1 in this group.
    uint4 w0[4], w1[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      w0[c] = reinterpret_cast<const uint4*>(sw + r0 * (kGroup / 2))[c];
      w1[c] = reinterpret_cast<const uint4*>(sw + r1 * (kGroup / 2))[c];
    }
    // K step s (32 K = 16 bytes of a row): this thread's A registers hold K 4 tig..+3 (bytes
    // 2 tig, 2 tig + 1) and K 16 + 4 tig..+3 (bytes 8 + 2 tig, 9 + 2 tig), rows r0 then r1.
    uint32_t a[4][4];
    const int shift = (tig & 1) * 16;
    [[maybe_unused]] const uint32_t select = (tig & 1) ? 0x7362u : 0x5140u;  // BIASED: this thread's nibbles
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t lo0 = (tig & 2) ? w0[s].y : w0[s].x, hi0 = (tig & 2) ? w0[s].w : w0[s].z;
      const uint32_t lo1 = (tig & 2) ? w1[s].y : w1[s].x, hi1 = (tig & 2) ? w1[s].w : w1[s].z;
      if constexpr (BIASED) {
        a[s][0] = int4x4_to_biased_e4m3x4(lo0, select);
        a[s][1] = int4x4_to_biased_e4m3x4(lo1, select);
        a[s][2] = int4x4_to_biased_e4m3x4(hi0, select);
        a[s][3] = int4x4_to_biased_e4m3x4(hi1, select);
      } else {
        a[s][0] = int4x4_to_e4m3((lo0 >> shift) & 0xFFFFu);
        a[s][1] = int4x4_to_e4m3((lo1 >> shift) & 0xFFFFu);
        a[s][2] = int4x4_to_e4m3((hi0 >> shift) & 0xFFFFu);
        a[s][3] = int4x4_to_e4m3((hi1 >> shift) & 0xFFFFu);
      }
    }
    const uint64_t desc = make_desc_sw128(smem_u32(st));
    wgmma_fence();
    fence_operands(part);
#pragma unroll
    for (int s = 0; s < 4; ++s) wgmma_k32<kTileN>(part, a[s][0], a[s][1], a[s][2], a[s][3], desc + 2 * s, s > 0);
    if constexpr (BIASED) {
      constexpr uint32_t kMinus8 = 0x88888888u;  // four e4m3 -8 * 2^-9
#pragma unroll
      for (int s = 0; s < 4; ++s) wgmma_k32<kTileN>(part, kMinus8, kMinus8, kMinus8, kMinus8, desc + 2 * s, 1);
    }
    wgmma_commit();
    wgmma_wait_all();
    fence_operands(part);
    // Group promotion (fp32 FMA with the bf16 scale of the row, g increasing).
    constexpr float kUnit = BIASED ? 512.f : 1.f;  // biased codes count in units of 2^-9
    const float s0 = kUnit * __bfloat162float(p.scales_packed4 ? ss[r0 * 4 + (g & 3)] : ss[r0]);
    const float s1 = kUnit * __bfloat162float(p.scales_packed4 ? ss[r1 * 4 + (g & 3)] : ss[r1]);
#pragma unroll
    for (int j = 0; j < kTileN / 8; ++j) {
      acc[4 * j + 0] = fmaf(s0, part[4 * j + 0], acc[4 * j + 0]);
      acc[4 * j + 1] = fmaf(s0, part[4 * j + 1], acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(s1, part[4 * j + 2], acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(s1, part[4 * j + 3], acc[4 * j + 3]);
    }

    if (g == groups - 1) {
      const GroupedTile t = tiles[it / groups];
      if constexpr (kAct) {
        // Fused epilogue: park h, then every thread takes (token, feature pair) items. The main loop's
        // barrier at the next iteration retires park before the next tile's epilogue writes it.
        park_tile<kTileN>(p, t, acc, park, r0, r1, tig);
        __syncthreads();
        act_requant_items<kTileM, kThreads, kParkStride>(p.act_out, t, park, tid);
      } else {
        store_tile<OutT, kTileN>(p, t, acc, r0, r1, tig);
      }
    }
  }
}

}  // namespace wgmma_prefill

// Warp-specialized variant: warpgroup 0 only loads (cp.async, completion signalled on a per-stage
// "full" mbarrier), warpgroups 1 and 2 only compute (64 weight rows each) and hand a stage back on
// its "empty" mbarrier. The two compute warpgroups are not tied together by __syncthreads, so one's
// int4 -> e4m3 conversion and group promotion run while the other's wgmmas use the tensor cores, and
// each converts the next stage's weights while its own wgmmas run.
namespace wgmma_ws {

using wgmma_prefill::kGroup;
using wgmma_prefill::kStageS;
using wgmma_prefill::kStageW;
using wgmma_prefill::kTileM;
using wgmma_prefill::kParkStride;
constexpr int kConsumers = 2;                     // compute warpgroups, 64 weight rows each
constexpr int kThreads = 128 * (1 + kConsumers);  // + the loading warpgroup
constexpr int kProducerRegs = 56, kConsumerRegs = 224;  // setmaxnreg: 128 * 56 + 256 * 224 = 384 * 168
constexpr int kMaxExperts = kTileListMaxExperts;
constexpr int kTileStartBytes = (kMaxExperts + 1) * 4 + 32 * 4;

// kAct: the fused activation epilogue's park (h of one tile, TILE_N x 128 fp32) after the work list.
template <int TILE_N, bool kAct = false>
struct Shape {
  static constexpr int kAcc = TILE_N / 2;
  static constexpr int kStageA = TILE_N * kGroup;
  static constexpr int kStageBytes = kStageA + kStageW + kStageS;
  // 128-token tiles: 6 stages (H200, bench/results/2026-11-30_s5a_*: 1-4% faster than 8 at T = 4096, the
  // same at 256-1024); 64-token tiles: 12.
  static constexpr int kStages = TILE_N == 128 ? 6 : 12;
  static_assert(kStageBytes % 1024 == 0, "every stage's activation tile stays 1024-byte aligned (128B swizzle)");
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  static constexpr int kParkOffset = (kStages * kStageBytes + kBarrierBytes + kTileStartBytes + 15) / 16 * 16;
  // + the two park mbarriers (parked, free) right after h
  static constexpr int kParkFloats = TILE_N * kParkStride;
  static constexpr int kParkBytes = kAct ? 16 + kParkFloats * 4 + 16 : 0;
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kBarrierBytes + kTileStartBytes + kParkBytes;
  static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of one SM");
};

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(wgmma_prefill::smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(wgmma_prefill::smem_u32(bar)) : "memory");
}
// Arrives once this thread's earlier cp.asyncs have landed (the count was set at init: noinc).
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(wgmma_prefill::smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  const uint32_t addr = wgmma_prefill::smem_u32(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// BIASED (an experiment, not in any shipped tactic; bench/ab/w4a8_wgmma_biased.txt): the weights enter
// as biased codes q + 8 (the byte (q XOR 8) is (q + 8) * 2^-9 exactly in e4m3: 4 instructions per 4
// weights instead of ~9 for the exact lookup), and one more wgmma per K step with every weight -8 * 2^-9
// cancels the bias inside the same fp32 partial (twice the tensor work; the fp8 accumulation then also
// carries the bias term, whose rounding the A/B run must measure against the 1e-2 tolerance).
// OutT ActE4m3: the fused activation epilogue. The computing warpgroups park each tile's h (after the
// previous one was taken: mbarrier park_free) and go on; the loading warpgroup runs the items loop
// (act_requant_items.cuh) on it between its loads (mbarrier parked). Session 6 ran the items loop in the
// computing warpgroups between two named barriers: bitwise right, 6-10% slower than the separate path
// at T = 4096 (the tensor cores waited); this version was written after that run, not yet on a GPU.
template <class OutT, int TILE_N, bool BIASED = false>
__global__ void __launch_bounds__(kThreads, 1) kernel(const wgmma_prefill::ParamsOf<OutT> p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  constexpr bool kAct = std::is_same<OutT, ActE4m3>::value;
  using S = Shape<TILE_N, kAct>;
  constexpr int kStages = S::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = wgmma_prefill::align_1024(smem_raw);
  uint8_t* stages = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * S::kStageBytes);
  uint64_t* empty = full + kStages;
  int32_t* tile_start = reinterpret_cast<int32_t*>(empty + kStages);
  int32_t* warp_total = tile_start + kMaxExperts + 1;
  [[maybe_unused]] float* park = reinterpret_cast<float*>(smem + S::kParkOffset);
  [[maybe_unused]] uint64_t* parked = reinterpret_cast<uint64_t*>(park + S::kParkFloats);  // (kAct only)
  [[maybe_unused]] uint64_t* park_free = parked + 1;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 128);               // every loading thread, after its copies landed
      mbar_init(&empty[s], 128 * kConsumers);  // every computing thread, after its wgmmas read the stage
    }
    if constexpr (kAct) {
      mbar_init(parked, 128 * kConsumers);  // every computing thread, after its h is in park
      mbar_init(park_free, 128);             // every loading thread, after its items of that h
    }
  }
  const int E = p.num_experts;
  const int n_tiles = (p.n + kTileM - 1) / kTileM;
  const int groups = p.k / kGroup;
  // (its barriers also publish the mbarrier initialisation)
  const auto tiles =
      cta_tiles<kThreads, kTileM, TILE_N>(p.problem_sizes, p.expert_offsets, E, n_tiles, tile_start, warp_total);
  if (tiles.empty()) return;
  const int total_iters = tiles.count * groups;

  if (wg == 0) {
    // ---- Loading warpgroup: stage it % kStages once the computing warpgroups released it.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    GroupedTile t{0, 0, 0, 0};
    [[maybe_unused]] ActTileRows rows{0, 0};
    // Fused epilogue: this warpgroup also turns each parked h into A2 and s2, so that the computing
    // warpgroups go on with the next tile meanwhile. Tile u's h is taken once kStages - 1 stages past
    // its end are loaded (the computing warpgroups then have that much work queued); the last tiles'
    // after the loop. Deadlock-free: the computing warpgroups park tile u after tile u - 1's h was
    // taken, which happens at an earlier load; they never wait for a load past tile u's end.
    [[maybe_unused]] int pending = 0;
    [[maybe_unused]] auto take_parked = [&]() {
      if constexpr (kAct) {
        mbar_wait(parked, pending & 1);
        act_requant_items<kTileM, 128, kParkStride>(p.act_out, tiles[pending], park, tid);
        mbar_arrive(park_free);
        ++pending;
      }
    };
    for (int it = 0; it < total_iters; ++it) {
      const int g = it % groups, s = it % kStages;
      if constexpr (kAct) {
        while (pending < tiles.count && it >= (pending + 1) * groups + kStages - 1) take_parked();
      }
      if (g == 0) {
        t = tiles[it / groups];
        if constexpr (kAct) rows = act_tile_rows<kTileM>(p.act_out, t.n0);
      }
      mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
      if constexpr (kAct) {
        wgmma_prefill::load_stage<TILE_N, 128, true>(p, t, g, wgmma_prefill::smem_u32(stages + s * S::kStageBytes),
                                                     tid, rows);
      } else {
        wgmma_prefill::load_stage<TILE_N, 128>(p, t, g, wgmma_prefill::smem_u32(stages + s * S::kStageBytes), tid);
      }
      mbar_arrive_cp_async(&full[s]);
    }
    if constexpr (kAct) {
      while (pending < tiles.count) take_parked();
    }
    wgmma_prefill::cp_async_wait<0>();  // no copy outlives its thread
    return;
  }

  // ---- Computing warpgroups: warp w of warpgroup c owns weight rows 64 c + 16 (w % 4) + {gid, gid + 8}.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int gid = lane >> 2, tig = lane & 3;
  const int r0 = (wg - 1) * 64 + (warp & 3) * 16 + gid, r1 = r0 + 8;
  const int shift = (tig & 1) * 16;
  float acc[S::kAcc], part[S::kAcc];
#pragma unroll
  for (int i = 0; i < S::kAcc; ++i) acc[i] = 0.f;

  // Stage `it` has landed: the cp.async writes reached this thread through the mbarrier; the tensor
  // cores read the activations through the async proxy, so make them visible to it too.
  auto wait_full = [&](int it) {
    mbar_wait(&full[it % kStages], (it / kStages) & 1);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  };
  // The A operand: this thread's int4 weights of stage `it` as e4m3.
  auto convert = [&](int it, uint32_t (&out)[4][4]) {
    const uint8_t* sw = stages + (it % kStages) * S::kStageBytes + S::kStageA;
    uint4 w0[4], w1[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      w0[c] = reinterpret_cast<const uint4*>(sw + r0 * (kGroup / 2))[c];
      w1[c] = reinterpret_cast<const uint4*>(sw + r1 * (kGroup / 2))[c];
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t lo0 = (tig & 2) ? w0[k].y : w0[k].x, hi0 = (tig & 2) ? w0[k].w : w0[k].z;
      const uint32_t lo1 = (tig & 2) ? w1[k].y : w1[k].x, hi1 = (tig & 2) ? w1[k].w : w1[k].z;
      if constexpr (BIASED) {
        const uint32_t select = (tig & 1) ? 0x7362u : 0x5140u;  // this thread's nibbles: 0-3 or 4-7
        out[k][0] = int4x4_to_biased_e4m3x4(lo0, select);
        out[k][1] = int4x4_to_biased_e4m3x4(lo1, select);
        out[k][2] = int4x4_to_biased_e4m3x4(hi0, select);
        out[k][3] = int4x4_to_biased_e4m3x4(hi1, select);
      } else {
        out[k][0] = wgmma_prefill::int4x4_to_e4m3((lo0 >> shift) & 0xFFFFu);
        out[k][1] = wgmma_prefill::int4x4_to_e4m3((lo1 >> shift) & 0xFFFFu);
        out[k][2] = wgmma_prefill::int4x4_to_e4m3((hi0 >> shift) & 0xFFFFu);
        out[k][3] = wgmma_prefill::int4x4_to_e4m3((hi1 >> shift) & 0xFFFFu);
      }
    }
  };

  uint32_t a[4][4];
  GroupedTile t{0, 0, 0, 0};
  if (total_iters > 0) {
    wait_full(0);
    convert(0, a);
  }
  for (int it = 0; it < total_iters; ++it) {
    const int g = it % groups, s = it % kStages;
    if (g == 0) t = tiles[it / groups];
    const uint8_t* st = stages + s * S::kStageBytes;
    const uint64_t desc = wgmma_prefill::make_desc_sw128(wgmma_prefill::smem_u32(st));
    const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(st + S::kStageA + kStageW);
    constexpr float kUnit = BIASED ? 512.f : 1.f;  // biased codes count in units of 2^-9
    const float s0 = kUnit * __bfloat162float(p.scales_packed4 ? ss[r0 * 4 + (g & 3)] : ss[r0]);
    const float s1 = kUnit * __bfloat162float(p.scales_packed4 ? ss[r1 * 4 + (g & 3)] : ss[r1]);
    wgmma_prefill::wgmma_fence();
    wgmma_prefill::fence_operands(part);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      wgmma_prefill::wgmma_k32<TILE_N>(part, a[k][0], a[k][1], a[k][2], a[k][3], desc + 2 * k, k > 0);
    if constexpr (BIASED) {
      constexpr uint32_t kMinus8 = 0x88888888u;  // four e4m3 -8 * 2^-9
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_prefill::wgmma_k32<TILE_N>(part, kMinus8, kMinus8, kMinus8, kMinus8, desc + 2 * k, 1);
    }
    wgmma_prefill::wgmma_commit();
    wgmma_prefill::wgmma_wait_all();
    wgmma_prefill::fence_operands(part);
    mbar_arrive(&empty[s]);  // this thread is done with stage s (weights and scales in registers)
    // NOTE: converting the next stage between the wgmmas' issue and their wait (so the tensor cores
    // and this warpgroup's ALUs overlap) measured 7-10% slower on the H200, and gave wrong results
    // when the conversion waited on the mbarrier inside that window. The other computing warpgroup
    // supplies the overlap instead.
    if (it + 1 < total_iters) {
      wait_full(it + 1);
      convert(it + 1, a);
    }
#pragma unroll
    for (int j = 0; j < TILE_N / 8; ++j) {
      acc[4 * j + 0] = fmaf(s0, part[4 * j + 0], acc[4 * j + 0]);
      acc[4 * j + 1] = fmaf(s0, part[4 * j + 1], acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(s1, part[4 * j + 2], acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(s1, part[4 * j + 3], acc[4 * j + 3]);
    }
    if (g == groups - 1) {
      if constexpr (kAct) {
        // Fused epilogue: park h (once the loading warpgroup has taken the previous tile's), signal,
        // and go on with the next tile; the loading warpgroup writes A2 and s2 from park.
        const int u = it / groups;
        if (u > 0) mbar_wait(park_free, (u - 1) & 1);
        wgmma_prefill::park_tile<TILE_N>(p, t, acc, park, r0, r1, tig);
        mbar_arrive(parked);
      } else {
        wgmma_prefill::store_tile<OutT, TILE_N>(p, t, acc, r0, r1, tig);
      }
    }
  }
}

}  // namespace wgmma_ws

// ------------------------------------------------------------------------------------------------
// wgmma_f16: a decode tile on fp16 WGMMA (EXPERIMENTAL, written without a GPU in session 7: compiled
// into the build but listed among the tactics only with QMOE_EXPERIMENTAL_TACTICS=1, until it has run).
//
// Same math and work list as the other tiles; 128 weight rows x TILE_N (16 or 32) tokens. Why: at
// 9-48 rows per expert the mma.sync n16 tile pays one MMA chain per 8 tokens and per weight fragment
// and, with ragged routing, a second token tile for every expert past 16 rows (status.md, session 7
// ncu), while the e4m3 WGMMA tiles pay ~18 instructions per 8 weights for the exact lookup. Here the
// weights enter the tensor cores as biased fp16 subnormals (int4_to_f16.cuh: 5 instructions per 8
// weights), the tokens as exact fp16 in the matching K slots, fp32 accumulation, and one more wgmma
// per K step with every weight -8 cancels the bias in fp32 (as the mma.sync decode tiles do).
//
// K slots. Per 128-wide group and weight row, thread tig (lane % 4) reads the 16 bytes at 16 tig: four
// words of 8 int4, word b = physical K 32 tig + 8 b .. + 7, which feed k16 steps 2 b and 2 b + 1.
// int4x8_to_biased_f16 gives f16 pairs (e0, e4), (e1, e5) x16, (e2, e6), (e3, e7) x16; as the wgmma A
// fragment (a0/a1: logical K 2 tig + {0, 1}, a2/a3: 8 + 2 tig + {0, 1} of the step) they are steps
// 2b (a0,a1 <- (e0,e4), a2,a3 <- (e1,e5)) and 2b + 1 (<- (e2,e6), (e3,e7)). So logical K
// l = 32 b + 16 s + 8 h + 2 tig + e holds physical K 32 tig + 8 b + 2 s + h + 4 e, its activation
// divided by 16 where h = 1 (exact: e4m3 >= 2^-9, fp16 subnormals reach 2^-24). Each computing
// warpgroup writes the stage's TILE_N x 128 activations in that order, as fp16, into its own
// 128-byte-swizzled operand tile (two atoms of 64 K), which its wgmmas read.
// Limits: as the other tiles. Not supported: the fused activation epilogue, GEMM2's scatter.
// ------------------------------------------------------------------------------------------------
namespace wgmma_f16 {

using wgmma_prefill::kGroup;
using wgmma_prefill::kStageS;
using wgmma_prefill::kStageW;
using wgmma_prefill::kTileM;
constexpr int kConsumers = 2;                     // computing warpgroups, 64 weight rows each
constexpr int kThreads = 128 * (1 + kConsumers);  // + the loading warpgroup
// One CTA per SM: 128 x 40 + 256 x 232 <= 65536 registers. The computing warpgroups need every A
// register of a K group live at once (32) besides part and acc: under the 80 registers of two CTAs per
// SM ptxas serialized the wgmmas (C7512).
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
constexpr int kMaxExperts = kTileListMaxExperts;
constexpr int kTileStartBytes = (kMaxExperts + 1) * 4 + 32 * 4;

template <int TILE_N>
struct Shape {
  static_assert(TILE_N == 16 || TILE_N == 32, "wgmma m64n16k16 or m64n32k16");
  static constexpr int kAcc = TILE_N / 2;
  static constexpr int kStageA = TILE_N * kGroup;  // e4m3 as loaded (load_stage's layout)
  static constexpr int kStageBytes = kStageA + kStageW + kStageS;
  static_assert(kStageBytes % 1024 == 0, "stages keep the 1024-byte alignment of the swizzled tiles");
  static constexpr int kStages = 12;                      // 12 x 11-13 KB: deep enough to cover HBM latency
  static constexpr int kAtomBytes = TILE_N * 128;         // fp16 operand: 64 K of TILE_N tokens
  static constexpr int kOperandBytes = 2 * kAtomBytes;    // one warpgroup's 128 K
  static constexpr int kOperandOffset = kStages * kStageBytes;
  static constexpr int kBarrierOffset = kOperandOffset + kConsumers * kOperandBytes;
  static constexpr int kSmemBytes = 1024 + kBarrierOffset + 2 * kStages * 8 + kTileStartBytes;
  static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of one SM");
};

// d (64 x TILE_N fp32 per warpgroup) (+)= A (64 x 16 fp16, registers) * B^T (TILE_N x 16 fp16, smem, K-major).
__device__ __forceinline__ void wgmma_f16_k16(float (&d)[8], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_f16_k16(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate));
}

// The stage's e4m3 activations (load_stage: token n's 128 bytes at n * 128, 16-byte chunk c at
// position c ^ (n & 7)) -> this warpgroup's fp16 operand in the K slots above. Item (n, b): the four
// 8-byte runs at physical K 32 tig + 8 b (tig = 0..3) become the logical 16-byte chunks q = 0..3 of
// K 32 b + 8 q (chunk q holds the q-th f16 pair of every run). wtid: 0..127 in the warpgroup.
template <int TILE_N>
__device__ __forceinline__ void stage_operand(const uint8_t* sa, uint8_t* opnd, int wtid) {
#pragma unroll
  for (int item = wtid; item < TILE_N * 4; item += 128) {
    const int n = item >> 2, b = item & 3, sw = n & 7;
    uint32_t slot[4][4];  // [q][tig]
#pragma unroll
    for (int tig = 0; tig < 4; ++tig) {
      const int chunk = 2 * tig + (b >> 1);
      const uint2 run = *reinterpret_cast<const uint2*>(sa + n * kGroup + ((chunk ^ sw) << 4) + (b & 1) * 8);
      e4m3x8_to_f16_slots(run.x, run.y, slot[0][tig], slot[2][tig], slot[1][tig], slot[3][tig]);
    }
    uint8_t* atom = opnd + (b >> 1) * Shape<TILE_N>::kAtomBytes + n * 128;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int c = 4 * (b & 1) + q;  // 16-byte chunk of the 128-byte row (64 K per atom)
      *reinterpret_cast<uint4*>(atom + ((c ^ sw) << 4)) = make_uint4(slot[q][0], slot[q][1], slot[q][2], slot[q][3]);
    }
  }
}

template <class OutT, int TILE_N>
__global__ void __launch_bounds__(kThreads, 1) kernel(const WgmmaGemmParams p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  using S = Shape<TILE_N>;
  constexpr int kStages = S::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = wgmma_prefill::align_1024(smem_raw);
  uint8_t* stages = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::kBarrierOffset);
  uint64_t* empty = full + kStages;
  int32_t* tile_start = reinterpret_cast<int32_t*>(empty + kStages);
  int32_t* warp_total = tile_start + kMaxExperts + 1;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      wgmma_ws::mbar_init(&full[s], 128);
      wgmma_ws::mbar_init(&empty[s], 128 * kConsumers);
    }
  }
  const int E = p.num_experts;
  const int n_tiles = (p.n + kTileM - 1) / kTileM;
  const int groups = p.k / kGroup;
  const auto tiles =
      cta_tiles<kThreads, kTileM, TILE_N>(p.problem_sizes, p.expert_offsets, E, n_tiles, tile_start, warp_total);
  if (tiles.empty()) return;
  const int total_iters = tiles.count * groups;

  if (wg == 0) {
    // ---- Loading warpgroup (as wgmma_ws): stage it % kStages once both computing warpgroups released it.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    GroupedTile t{0, 0, 0, 0};
    for (int it = 0; it < total_iters; ++it) {
      const int g = it % groups, s = it % kStages;
      if (g == 0) t = tiles[it / groups];
      wgmma_ws::mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
      wgmma_prefill::load_stage<TILE_N, 128>(p, t, g, wgmma_prefill::smem_u32(stages + s * S::kStageBytes), tid);
      wgmma_ws::mbar_arrive_cp_async(&full[s]);
    }
    wgmma_prefill::cp_async_wait<0>();
    return;
  }

  // ---- Computing warpgroups: warp w of warpgroup c owns weight rows 64 c + 16 (w % 4) + {gid, gid + 8}.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int gid = lane >> 2, tig = lane & 3, c = wg - 1;
  const int r0 = c * 64 + (warp & 3) * 16 + gid, r1 = r0 + 8;
  uint8_t* opnd = smem + S::kOperandOffset + c * S::kOperandBytes;
  const uint32_t opnd_u32 = wgmma_prefill::smem_u32(opnd);
  float acc[S::kAcc], part[S::kAcc];
#pragma unroll
  for (int i = 0; i < S::kAcc; ++i) acc[i] = 0.f;
  // The bias wgmma's A: every weight -8 (x16 in the slots whose activations are divided by 16).
  const uint32_t bias[2] = {kF16MinusEight, kF16MinusEightX16};

  GroupedTile t{0, 0, 0, 0};
  for (int it = 0; it < total_iters; ++it) {
    const int g = it % groups, s = it % kStages;
    if (g == 0) t = tiles[it / groups];
    wgmma_ws::mbar_wait(&full[s], (it / kStages) & 1);
    const uint8_t* st = stages + s * S::kStageBytes;
    // Everything this warpgroup needs from stage s: its weights (16 bytes of each of its two rows),
    // their scales, and the activations as its fp16 operand; then the stage goes back to the loader.
    const uint8_t* sw = st + S::kStageA;
    const uint4 w0 = *reinterpret_cast<const uint4*>(sw + r0 * (kGroup / 2) + 16 * tig);
    const uint4 w1 = *reinterpret_cast<const uint4*>(sw + r1 * (kGroup / 2) + 16 * tig);
    const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(sw + kStageW);
    const float s0 = kF16BiasedUnit * __bfloat162float(p.scales_packed4 ? ss[r0 * 4 + (g & 3)] : ss[r0]);
    const float s1 = kF16BiasedUnit * __bfloat162float(p.scales_packed4 ? ss[r1 * 4 + (g & 3)] : ss[r1]);
    // The operand is rewritten only after every warp of this warpgroup has waited for the previous
    // group's wgmmas (which read it): the warpgroup's named barrier (1 + c), once before, once after.
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
    stage_operand<TILE_N>(st, opnd, tid - 128 * wg);
    wgmma_ws::mbar_arrive(&empty[s]);
    // The operand's generic-proxy stores must be visible to the tensor cores (async proxy) of the
    // whole warpgroup before its first wgmma: fence, then the barrier.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
    // Every A register is written before the first wgmma and none is reused while they run (the
    // tensor cores read register operands asynchronously: reuse would serialize them).
    const uint32_t words0[4] = {w0.x, w0.y, w0.z, w0.w}, words1[4] = {w1.x, w1.y, w1.z, w1.w};
    uint32_t a[4][8];  // [b][u04, u26, u15, u37 of row r0, then of row r1]
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      int4x8_to_biased_f16(words0[b], a[b][0], a[b][1], a[b][2], a[b][3]);
      int4x8_to_biased_f16(words1[b], a[b][4], a[b][5], a[b][6], a[b][7]);
    }
    wgmma_prefill::wgmma_fence();
    wgmma_prefill::fence_operands(part);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      // k16 steps 2 b and 2 b + 1: logical K 32 b + 16 s, in atom b / 2 at byte 32 (2 (b % 2) + s).
      const uint64_t desc = wgmma_prefill::make_desc_sw128(opnd_u32 + (b >> 1) * S::kAtomBytes);
      const uint64_t d0 = desc + 2 * (2 * (b & 1)), d1 = d0 + 2;
      wgmma_f16_k16(part, a[b][0], a[b][4], a[b][2], a[b][6], d0, b > 0);
      wgmma_f16_k16(part, bias[0], bias[0], bias[1], bias[1], d0, 1);
      wgmma_f16_k16(part, a[b][1], a[b][5], a[b][3], a[b][7], d1, 1);
      wgmma_f16_k16(part, bias[0], bias[0], bias[1], bias[1], d1, 1);
    }
    wgmma_prefill::wgmma_commit();
    wgmma_prefill::wgmma_wait_all();  // (also frees the operand tile for the next stage's writes)
    wgmma_prefill::fence_operands(part);
#pragma unroll
    for (int j = 0; j < TILE_N / 8; ++j) {
      acc[4 * j + 0] = fmaf(s0, part[4 * j + 0], acc[4 * j + 0]);
      acc[4 * j + 1] = fmaf(s0, part[4 * j + 1], acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(s1, part[4 * j + 2], acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(s1, part[4 * j + 3], acc[4 * j + 3]);
    }
    if (g == groups - 1) wgmma_prefill::store_tile<OutT, TILE_N>(p, t, acc, r0, r1, tig);
  }
}

}  // namespace wgmma_f16

namespace {
template <class OutT>
constexpr bool kActOut = std::is_same<OutT, ActE4m3>::value;

template <class OutT, int TILE_N, bool BIASED = false>
void launch_ws(const wgmma_prefill::ParamsOf<OutT>& params, cudaStream_t stream) {
  constexpr int kSmem = wgmma_ws::Shape<TILE_N, kActOut<OutT>>::kSmemBytes;
  constexpr auto kernel = wgmma_ws::kernel<OutT, TILE_N, BIASED>;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const int fit = resident_ctas<kernel>(wgmma_ws::kThreads, kSmem, device, "occupancy of the w4a8 wgmma prefill");
  launch_kernel(kernel, dim3(fit), dim3(wgmma_ws::kThreads), kSmem, stream, params);
  check_cuda(cudaGetLastError(), "w4a8 wgmma prefill launch");
}

// 128-token tiles: the warp-specialized kernel (1.1-1.25x faster on the H200 at DeepSeek-V3,
// Mixtral and Qwen3-235B prefill shapes, bench/results/2026-11-30_h200_wgmma_ws.md); 64-token tiles
// keep the two-CTAs-per-SM kernel, which measured 1-5% faster there.
template <class OutT, int TILE_N, bool BIASED = false>
void launch_typed(const wgmma_prefill::ParamsOf<OutT>& params, cudaStream_t stream) {
  if constexpr (TILE_N == 128) {
    launch_ws<OutT, TILE_N, BIASED>(params, stream);
  } else {
    constexpr int kSmem = wgmma_prefill::Shape<TILE_N, kActOut<OutT>>::kSmemBytes;
    constexpr auto kernel = wgmma_prefill::kernel<OutT, TILE_N, BIASED>;
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    // The 64-token tile needs ~120 registers and 75 KB: two CTAs fit on an SM, and both are used.
    const int fit = resident_ctas<kernel>(wgmma_prefill::kThreads, kSmem, device, "occupancy of the w4a8 wgmma prefill");
    launch_kernel(kernel, dim3(fit), dim3(wgmma_prefill::kThreads), kSmem, stream, params);
    check_cuda(cudaGetLastError(), "w4a8 wgmma prefill launch");
  }
}

template <class OutT, int TILE_N>
void launch_f16(const WgmmaGemmParams& params, cudaStream_t stream) {
  constexpr int kSmem = wgmma_f16::Shape<TILE_N>::kSmemBytes;
  constexpr auto kernel = wgmma_f16::kernel<OutT, TILE_N>;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const int fit = resident_ctas<kernel>(wgmma_f16::kThreads, kSmem, device, "occupancy of the w4a8 fp16 wgmma decode tile");
  launch_kernel(kernel, dim3(fit), dim3(wgmma_f16::kThreads), kSmem, stream, params);
  check_cuda(cudaGetLastError(), "w4a8 fp16 wgmma decode launch");
}
}  // namespace

void launch_w4a8_wgmma_f16_decode(const WgmmaGemmParams& params, int tile_n, bool fp32_out, cudaStream_t stream) {
  QMOE_CHECK_ARG(tile_n == 16 || tile_n == 32, "tactic", "an fp16 WGMMA token tile of 16 or 32", std::to_string(tile_n));
  if (tile_n == 16) {
    if (fp32_out) launch_f16<float, 16>(params, stream);
    else launch_f16<__nv_bfloat16, 16>(params, stream);
  } else {
    if (fp32_out) launch_f16<float, 32>(params, stream);
    else launch_f16<__nv_bfloat16, 32>(params, stream);
  }
}

void launch_w4a8_wgmma_prefill(const WgmmaGemmParams& params, int tile_n, bool fp32_out, cudaStream_t stream) {
  QMOE_CHECK_ARG(tile_n == 64 || tile_n == 128, "tactic", "a WGMMA token tile of 64 or 128", std::to_string(tile_n));
  if (tile_n == 128) {
    if (fp32_out) launch_typed<float, 128>(params, stream);
    else launch_typed<__nv_bfloat16, 128>(params, stream);
  } else {
    if (fp32_out) launch_typed<float, 64>(params, stream);
    else launch_typed<__nv_bfloat16, 64>(params, stream);
  }
}

void launch_w4a8_wgmma_act_requant(const WgmmaActGemmParams& params, int tile_n, cudaStream_t stream) {
  QMOE_CHECK_ARG(tile_n == 64 || tile_n == 128, "tactic", "a WGMMA token tile of 64 or 128", std::to_string(tile_n));
  if (tile_n == 128) launch_typed<ActE4m3, 128>(params, stream);
  else launch_typed<ActE4m3, 64>(params, stream);
}

}  // namespace qmoe::cuda
