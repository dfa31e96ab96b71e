// Hopper fp16-WGMMA decode tile of the W4A8 grouped GEMM (cutlass_w4a8_moe_mm), EXPERIMENTAL: written
// without a GPU in session 7, compiled into the build but listed among the tactics only with
// QMOE_EXPERIMENTAL_TACTICS=1 until it has run.
//
//   D[r, o] = bf16( a_scale(r) * sum_g S[e, o, g] * (sum_{k in group g} A[r, k] * q[e, o, k]) )
//
// Same math and work list as the other tiles; 128 weight rows x TILE_N (16 or 32) tokens. Why: at
// 9-48 rows per expert the mma.sync n16 tile pays one MMA chain per 8 tokens and per weight fragment
// and, with ragged routing, a second token tile for every expert past 16 rows (status.md, session 7
// ncu), while the e4m3 WGMMA tiles pay ~18 instructions per 8 weights for the exact lookup. Here the
// weights enter the tensor cores as exact fp16 q (int4_to_f16.cuh int4x8_to_magic_f16: one mask-xor
// per two weights gives 1024 + q + 8, one f16x2 subtract leaves q; 9 instructions per 8 weights, no
// bias term), the tokens as exact fp16 in the matching K slots, fp32 accumulation.
//
// K slots. Per 128-wide group and weight row, thread tig (lane % 4) reads the 16 bytes at 16 tig: four
// words of 8 int4, word b = physical K 32 tig + 8 b .. + 7, which feed k16 steps 2 b and 2 b + 1.
// int4x8_to_magic_f16 gives f16 pairs (e0, e4), (e1, e5) x16, (e2, e6), (e3, e7) x16; as the wgmma A
// fragment (a0/a1: logical K 2 tig + {0, 1}, a2/a3: 8 + 2 tig + {0, 1} of the step) they are steps
// 2b (a0,a1 <- (e0,e4), a2,a3 <- (e1,e5)) and 2b + 1 (<- (e2,e6), (e3,e7)). So logical K
// l = 32 b + 16 s + 8 h + 2 tig + e holds physical K 32 tig + 8 b + 2 s + h + 4 e, its activation
// divided by 16 where h = 1 (exact: e4m3 >= 2^-9, fp16 subnormals reach 2^-24). Each computing
// warpgroup writes the stage's TILE_N x 128 activations in that order, as fp16, into its own
// 128-byte-swizzled operand tile (two atoms of 64 K), which its wgmmas read.
// Limits: as the other tiles. Not supported: the fused activation epilogue, GEMM2's scatter.
#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "cuda/common/int4_to_f16.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/grouped_tile_list.cuh"
#include "cuda/gemm/resident_ctas.h"
#include "cuda/gemm/sm90_grouped_gemm_w4a8_int4_wgmma.h"
#include "cuda/gemm/wgmma_building_blocks.cuh"
#include "qmoe/error.h"

namespace qmoe::cuda {
namespace wgmma_f16 {

using namespace wgmma;  // (wgmma_building_blocks.cuh)
constexpr int kConsumers = 2;                     // computing warpgroups, 64 weight rows each
constexpr int kThreads = 128 * (1 + kConsumers);  // + the loading warpgroup
// One CTA per SM: 128 x 40 + 256 x 232 <= 65536 registers. The computing warpgroups need every A
// register of a K group live at once (32) besides part and acc: under the 80 registers of two CTAs per
// SM ptxas serialized the wgmmas (C7512).
constexpr int kProducerRegs = 40, kConsumerRegs = 232;

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
// position c ^ (n & 7)) -> this warpgroup's fp16 operand in the K slots above. Item (n, b), one per
// thread (TILE_N * 4 <= 128): the four 8-byte runs at physical K 32 tig + 8 b (tig = 0..3) become the
// logical 16-byte chunks q = 0..3 of K 32 b + 8 q (chunk q holds the q-th f16 pair of every run).
// The offsets do not depend on the stage: computed once (OperandItem), used every K group.
struct OperandItem {
  int src[4];  // byte offsets of the runs in a stage
  int dst[4];  // byte offsets of the chunks in the operand
};
template <int TILE_N>
__device__ __forceinline__ OperandItem operand_item(int wtid) {
  OperandItem it{};
  const int n = wtid >> 2, b = wtid & 3, sw = n & 7;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    it.src[i] = n * kGroup + (((2 * i + (b >> 1)) ^ sw) << 4) + (b & 1) * 8;  // run of tig = i
    it.dst[i] = (b >> 1) * Shape<TILE_N>::kAtomBytes + n * 128 + (((4 * (b & 1) + i) ^ sw) << 4);  // chunk q = i
  }
  return it;
}
__device__ __forceinline__ void stage_operand(const OperandItem& it, const uint8_t* sa, uint8_t* opnd) {
  uint32_t slot[4][4];  // [q][tig]
#pragma unroll
  for (int tig = 0; tig < 4; ++tig) {
    const uint2 run = *reinterpret_cast<const uint2*>(sa + it.src[tig]);
    e4m3x8_to_f16_slots(run.x, run.y, slot[0][tig], slot[2][tig], slot[1][tig], slot[3][tig]);
  }
#pragma unroll
  for (int q = 0; q < 4; ++q)
    *reinterpret_cast<uint4*>(opnd + it.dst[q]) = make_uint4(slot[q][0], slot[q][1], slot[q][2], slot[q][3]);
}

template <class OutT, int TILE_N>
__global__ void __launch_bounds__(kThreads, 1) kernel(const WgmmaGemmParams p) {
  pdl_wait();  // first; no early release (cuda/common/pdl.cuh)
  using S = Shape<TILE_N>;
  constexpr int kStages = S::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = wgmma::align_1024(smem_raw);
  uint8_t* stages = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::kBarrierOffset);
  uint64_t* empty = full + kStages;
  int32_t* tile_start = reinterpret_cast<int32_t*>(empty + kStages);
  int32_t* warp_total = tile_start + kMaxExperts + 1;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      wgmma::mbar_init(&full[s], 128);
      wgmma::mbar_init(&empty[s], 128 * kConsumers);
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
      wgmma::mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
      wgmma::load_stage<TILE_N, 128>(p, t, g, wgmma::smem_u32(stages + s * S::kStageBytes), tid);
      wgmma::mbar_arrive_cp_async(&full[s]);
    }
    wgmma::cp_async_wait<0>();
    return;
  }

  // ---- Computing warpgroups: warp w of warpgroup c owns weight rows 64 c + 16 (w % 4) + {gid, gid + 8}.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int gid = lane >> 2, tig = lane & 3, c = wg - 1;
  const int r0 = c * 64 + (warp & 3) * 16 + gid, r1 = r0 + 8;
  uint8_t* opnd = smem + S::kOperandOffset + c * S::kOperandBytes;
  const int wtid = tid - 128 * wg;
  const bool stages_operand = wtid < TILE_N * 4;  // (TILE_N 16: half the threads)
  const OperandItem item = operand_item<TILE_N>(stages_operand ? wtid : 0);
  // The operand's wgmma descriptors, k16 step 2 b + s: logical K 32 b + 16 s, in atom b / 2 at byte
  // 32 (2 (b % 2) + s) of each 128-byte row (the descriptor counts 16-byte units).
  // (The +2 (j % 3) stays inside the low word: the start address field is 14 bits of an address below
  // 228 KB; built from 32-bit halves so that no 64-bit carry chain is recomputed every K group.)
  uint64_t desc[8];
  const uint64_t desc0 = wgmma::make_desc_sw128(wgmma::smem_u32(opnd));
  const uint32_t desc_hi = static_cast<uint32_t>(desc0 >> 32), desc_lo = static_cast<uint32_t>(desc0);
#pragma unroll
  for (int j = 0; j < 8; ++j)
    desc[j] = (uint64_t{desc_hi} << 32) | (desc_lo + ((j >> 2) * S::kAtomBytes >> 4) + 2 * (j & 3));
  float acc[S::kAcc], part[S::kAcc];
#pragma unroll
  for (int i = 0; i < S::kAcc; ++i) acc[i] = 0.f;

  GroupedTile t{0, 0, 0, 0};
  for (int it = 0; it < total_iters; ++it) {
    const int g = it % groups, s = it % kStages;
    if (g == 0) t = tiles[it / groups];
    wgmma::mbar_wait(&full[s], (it / kStages) & 1);
    const uint8_t* st = stages + s * S::kStageBytes;
    // Everything this warpgroup needs from stage s: its weights (16 bytes of each of its two rows),
    // their scales, and the activations as its fp16 operand; then the stage goes back to the loader.
    const uint8_t* sw = st + S::kStageA;
    const uint4 w0 = *reinterpret_cast<const uint4*>(sw + r0 * (kGroup / 2) + 16 * tig);
    const uint4 w1 = *reinterpret_cast<const uint4*>(sw + r1 * (kGroup / 2) + 16 * tig);
    const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(sw + kStageW);
    const float s0 = __bfloat162float(p.scales_packed4 ? ss[r0 * 4 + (g & 3)] : ss[r0]);
    const float s1 = __bfloat162float(p.scales_packed4 ? ss[r1 * 4 + (g & 3)] : ss[r1]);
    // The operand is rewritten only after every warp of this warpgroup has waited for the previous
    // group's wgmmas (which read it): the warpgroup's named barrier (1 + c), once before, once after.
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
    if (stages_operand) stage_operand(item, st, opnd);
    wgmma::mbar_arrive(&empty[s]);
    // The operand's generic-proxy stores must be visible to the tensor cores (async proxy) of the
    // whole warpgroup before its first wgmma: fence, then the barrier.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
    // Every A register is written before the first wgmma and none is reused while they run (the
    // tensor cores read register operands asynchronously: reuse would serialize them).
    const uint32_t words0[4] = {w0.x, w0.y, w0.z, w0.w}, words1[4] = {w1.x, w1.y, w1.z, w1.w};
    uint32_t a[4][8];  // [b][(e0,e4), (e2,e6), (e1,e5) x16, (e3,e7) x16 of row r0, then of row r1]
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      int4x8_to_magic_f16(words0[b], a[b][0], a[b][1], a[b][2], a[b][3]);
      int4x8_to_magic_f16(words1[b], a[b][4], a[b][5], a[b][6], a[b][7]);
#pragma unroll
      for (int i = 0; i < 8; ++i) a[b][i] = hsub2(a[b][i], (i & 2) ? kF16MagicX16 : kF16Magic);
    }
    wgmma::wgmma_fence();
    wgmma::fence_operands(part);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      wgmma_f16_k16(part, a[b][0], a[b][4], a[b][2], a[b][6], desc[2 * b], b > 0);
      wgmma_f16_k16(part, a[b][1], a[b][5], a[b][3], a[b][7], desc[2 * b + 1], 1);
    }
    wgmma::wgmma_commit();
    wgmma::wgmma_wait_all();  // (also frees the operand tile for the next stage's writes)
    wgmma::fence_operands(part);
#pragma unroll
    for (int j = 0; j < TILE_N / 8; ++j) {
      acc[4 * j + 0] = fmaf(s0, part[4 * j + 0], acc[4 * j + 0]);
      acc[4 * j + 1] = fmaf(s0, part[4 * j + 1], acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(s1, part[4 * j + 2], acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(s1, part[4 * j + 3], acc[4 * j + 3]);
    }
    if (g == groups - 1) wgmma::store_tile<OutT, TILE_N>(p, t, acc, r0, r1, tig);
  }
}

}  // namespace wgmma_f16

namespace {
template <class OutT, int TILE_N>
void launch_f16(const WgmmaGemmParams& params, cudaStream_t stream) {
  launch_persistent<wgmma_f16::kernel<OutT, TILE_N>>(wgmma_f16::kThreads, wgmma_f16::Shape<TILE_N>::kSmemBytes, stream,
                                                     params, "w4a8 fp16 wgmma decode tile");
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

}  // namespace qmoe::cuda
