// Device code of the W4A8 grouped GEMM (int4-g128 weights x e4m3 activations -> bf16 or fp32),
// SGLang's cutlass_w4a8_moe_mm semantics (DESIGN.md 3.1):
//
//   D[r, o] = out( a_scale(r) * sum_g S[e, o, g] * (sum_{k in group g} A[r, k] * q[e, o, k]) )
//
// out = bf16 round-to-nearest-even (OutT = __nv_bfloat16: the public op) or the fp32 value itself
// (OutT = float: the fused MoE's GEMM1, whose intermediate DESIGN 3b requires in fp32).
// OutT = ActE4m3 (mma.sync decode tactics, the fused MoE's GEMM1 with a static a2; w4a8_act_requant.h):
// D is not written; the epilogue applies the activation and the requantization to the fp32 values
// and writes e4m3 A2 [R, I] and s2 [R] (see "Fused activation epilogue" below).
// With p.scatter.out set (bf16 kernels only: the fused MoE's GEMM2 with the fused finalize), D is not
// written: the fp32 value v = a_scale(r) * acc goes to out[slot / topk, o] += bf16(rsf * w[slot] * v)
// atomically instead (grouped_gemm_epilogue.cuh), slot = scatter.row_slot[r].
//
// with a fresh fp32 partial sum per 128-wide K group (one mma.sync chain), promoted into the fp32
// accumulator by one FMA with the bf16 group scale, g increasing; a_scale(r) = a_scales[0] or
// a_scales[r].
//
// Layouts: A e4m3 [R, K] row-major; B int4x2 [E, N, K/2] (even k in the low nibble); scales bf16
// [E, K/512, 4N] (entry [e, kb, 4n + j] = S[e, n, 4kb + j]) when K % 512 == 0, else [E, K/128, N];
// D OutT [R, N]. Expert e owns rows [expert_offsets[e], + problem_sizes[e][1]); both tensors are
// read on the device (no host sync). Limits: K % 128 == 0, N % 8 == 0, E <= 1024, 16-byte aligned
// base pointers.
//
// Structure (swap-AB): the MMA (mma.sync m16n8k16 fp16, fp32 accumulate) M side holds weight
// rows (output features), the N side tokens, so a decode tile of 8 tokens wastes no weight bytes.
// Persistent CTAs walk the flattened work list (expert, feature tile, token tile), whose prefix
// sums every CTA computes in shared memory from problem_sizes, so empty experts produce no work.
// A pipeline stage holds GPS K groups (128 each): 16-byte cp.async copies of the weight tile
// (TILE_M x 64*GPS bytes), the activation tile (TILE_N x 128*GPS bytes) and the scale tile, XOR
// swizzled by 16-byte chunk against bank conflicts. The load cursor runs STAGES-1 stages ahead
// across tile boundaries, so a new tile does not refill the pipeline from empty. Token rows past
// an expert's end and feature rows past N are zero-filled (never read) and never stored.
//
// K order inside a group: thread `tig` (lane % 4) of every MMA owns K [32*tig, 32*tig + 32) of
// the group, i.e. one 16-byte word of the weight row and 32 bytes of each activation row; step j
// (of 4) uses 8 of them in two fp16 MMAs, whose K slots hold the pairs (0, 4), (2, 6) and (1, 5),
// (3, 7) on both operands alike, so the products pair up whatever the hardware order of K slots is.
// Why fp16 and not fp8 (Hopper has no fp8 mma.sync), and how weights become fp16 operands with a
// mask (biased subnormal codes (q + 8) * 2^-24, activations of the odd slots / 16): int4_to_f16.cuh.
// One extra MMA pair per token fragment with weights -8 (the same for all rows) cancels the bias,
// and the group scale absorbs 2^24. Every product is exact; the two fp32 sums round as fp32 sums
// do, and their difference can lose a few bits against sum A*q when the activations have a large
// mean (far inside the 1e-2 tolerance).
//
// Fused activation epilogue (ActE4m3, gated activations): a tile of TILE_M weight rows covers F =
// TILE_M / 2 features [f0, f0 + F), f0 = (n0 / TILE_M) * F: tile rows [0, F) are their gate rows, tile
// rows [F, 2F) their up rows (weight rows gate_base + r and up_base + r - F: kGateUp gate_base = f0,
// up_base = I + f0; kUpGateInterleaved64 up_base = 128 (f0 / 64) + f0 % 64, gate_base = up_base + 64).
// The producer's weight passes and scale copies each lie in one half, so the pairing costs one address
// jump per tile. The work list is unchanged (n = 2I = number of tiles x TILE_M). After the K warps
// meet, the k = 0 warps write h = a_scale(r) * acc (the fp32 value the plain epilogue stores) into the
// meeting's shared memory as h[token][tile row]; a block barrier; then all threads loop over (token,
// feature pair) items: act(gate, up) of two adjacent features, / a2, one 2-byte store of two e4m3 codes
// into A2. ReLU^2 (not gated) keeps the identity row mapping (item = two adjacent tile rows). The tile
// with n0 == 0 writes s2 for its tokens.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "cuda/common/int4_to_f16.cuh"
#include "cuda/gemm/e4m3_to_f16_slots.h"
#include "cuda/common/store_out.cuh"
#include "cuda/fused/activation_math.cuh"
#include "cuda/gemm/act_requant_items.cuh"
#include "cuda/gemm/w4a8_act_requant.h"
#include "cuda/gemm/grouped_gemm_epilogue.cuh"
#include "cuda/gemm/grouped_tile_list.cuh"
#include "cuda/gemm/k_warps.cuh"
#include "cuda/common/pdl.cuh"
#include "qmoe/grouped_gemm.h"
#include "qmoe/tactics.h"

namespace qmoe::cuda {

struct W4A8GemmParams {
  const uint8_t* a;               // e4m3 [R, K]
  const uint8_t* b;               // int4x2 [E, N, K/2]
  const __nv_bfloat16* b_scales;  // see layouts above
  const float* a_scales;          // [1] or [R]
  void* d;                        // OutT [R, N] (bf16 or fp32, the kernel's template argument)
  const int32_t* expert_offsets;  // [E]
  const int32_t* problem_sizes;   // [E, 3] (N, M_e, K)
  int num_experts;
  int n;
  int k;
  int a_scales_per_row;  // 1: a_scales[r], 0: a_scales[0]
  int scales_packed4;    // 1: [E, K/512, 4N], 0: [E, K/128, N]
  RowScatterAdd scatter; // out set: the fused finalize instead of d (bf16 kernels only)
};

// Kernel parameters of the fused activation epilogue (output tag ActE4m3, w4a8_act_requant.h).
// NOTE: a separate struct, not a field of W4A8GemmParams: a larger parameter struct changed ptxas'
// register allocation of the plain kernels (n8 137 -> 168 registers), so they keep theirs.
struct W4A8ActGemmParams : W4A8GemmParams {
  ActRequantEpilogue act_out;  // A2 and s2 instead of d
};
template <class OutT>
using W4A8ParamsOf = std::conditional_t<std::is_same<OutT, ActE4m3>::value, W4A8ActGemmParams, W4A8GemmParams>;

// The launcher (sm90_grouped_gemm_w4a8_int4.cu) with the fused finalize as the epilogue: d bf16,
// scatter.out set (or empty: the plain w4a8_moe_mm of cuda/launch.h). Every tactic honours it.
void w4a8_moe_mm(const W4A8MoeMmArgs& args, const Tactic& tactic, cudaStream_t stream, const RowScatterAdd& scatter);

namespace w4a8 {

constexpr int kGroup = 128;           // K per quantization group = K per pipeline stage
constexpr int kGroupBytesB = kGroup / 2;  // bytes of one weight row per group
constexpr int kMaxExperts = kTileListMaxExperts;

__device__ __forceinline__ void cp_async_16(void* smem, const void* global, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global), "r"(bytes));
}
// The same copy without the zero-fill operand: the producers' stages whose every weight copy reads a real
// row chunk (all but an expert's last feature tile when N % TILE_M != 0 and the K tail) take it, so
// such a stage costs an address and a copy per weight chunk, no predicate or fallback address.
__device__ __forceinline__ void cp_async_16_full(void* smem, const void* global) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global));
}
__device__ __forceinline__ void cp_async_4(void* smem, const void* global, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(global), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// WARPS_K: warps splitting the K groups of a stage (warp k takes the groups g with g % WARPS_K == k);
// their sums meet in shared memory at the end of a tile (kSplitBytes).
// A_BYTES: 1 = e4m3 activations (unpacked to fp16 K slots by every warp), 2 = activations already in
// those fp16 K slots, each row followed by its bias sums per K group (e4m3_to_f16_slots.h: 16 bytes per 8 K, the
// MMAs' B registers as they are; the bias MMAs' fp32 results), so the tile runs neither the unpack nor the bias MMAs.
template <int WARPS_M, int WARPS_N, int MF, int NF, int GPS, int STAGES, int WARPS_K, int A_BYTES = 1>
struct Config {
  static constexpr int kThreads = WARPS_M * WARPS_N * WARPS_K * 32;
  static constexpr int kTileM = WARPS_M * MF * 16;  // weight rows (output features)
  static constexpr int kTileN = WARPS_N * NF * 8;   // tokens
  static constexpr int kTileK = GPS * kGroup;       // K per pipeline stage
  static constexpr int kRowBytesB = GPS * kGroupBytesB;  // bytes of one weight row per stage
  static constexpr int kStageB = kTileM * kRowBytesB;
  static constexpr int kRowBytesA = kTileK * A_BYTES;  // bytes of one activation row per stage
  static constexpr int kStageA = kTileN * kRowBytesA;
  static constexpr int kStageBias = A_BYTES == 2 ? kTileN * GPS * 4 : 0;  // fp32 bias sums [token][group]
  // Scales per stage: packed-4 keeps one 8-byte block (4 groups) per row and 512-K block, packed-1
  // GPS slices of TILE_M bf16.
  static constexpr int kScaleBlocks = GPS >= 4 ? GPS / 4 : 1;
  static constexpr int kStageS =
      kScaleBlocks * kTileM * 8 > GPS * kTileM * 2 ? kScaleBlocks * kTileM * 8 : GPS * kTileM * 2;
  static constexpr int kStageBytes = kStageB + kStageA + kStageS + kStageBias;
  static constexpr int kTileStartBytes = ((kMaxExperts + 1) * 4 + 127) / 128 * 128;  // keeps stages aligned
  static constexpr int kSplitBytes = (WARPS_K - 1) * WARPS_M * WARPS_N * 32 * MF * NF * 4 * 4;
  static constexpr int kSmemBytes = kTileStartBytes + STAGES * kStageBytes + kSplitBytes;
  static_assert(GPS % WARPS_K == 0, "every K warp takes the same number of groups of a stage");
  static_assert(GPS == 1 || GPS == 2 || GPS == 4 || GPS == 8, "stages cover whole packed-4 scale blocks or lie in one");
  static_assert(kScaleBlocks * kTileM / 2 <= kThreads && GPS * kTileM / 8 <= kThreads, "one scale copy per thread");
  static_assert(STAGES >= 2, "a pipeline needs two stages");
  static_assert(kStageB % 128 == 0 && kStageA % 128 == 0 && kStageS % 128 == 0 && kStageBias % 128 == 0,
                "stages keep 128-byte alignment");
  static_assert(kStageBias / 4 <= kThreads, "one bias copy per thread");
};

// Epilogue of the swap-AB mma.sync tiles (this kernel and the bf16 x 4-bit one): one warp's MF x NF
// fragments (16 weight rows x 8 tokens each) of tile t go to D[row, n] = scaled(row, pre * acc) for
// the valid (token, n), then acc is zeroed. Lanes gid, gid ^ 1 swap values so that each stores two
// adjacent features of one token (4-byte bf16 / 8-byte fp32 stores); bf16 outputs scatter into the
// token rows instead when p.scatter.out is set (the fused finalize; GEMM1's fp32 h never scatters).
// scale(row, lo, hi, out_lo, out_hi) applies the row's scaling.
template <typename OutT, int MF, int NF, typename Params, typename Scale>
__device__ __forceinline__ void store_fragments(float (&acc)[MF][NF][4], const GroupedTile& t, const Params& p,
                                                int warp_m, int warp_n, int gid, int tig, float pre, Scale scale) {
  const bool even = (gid & 1) == 0;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int nf = 0; nf < NF; ++nf) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // h = 1: rows gid + 8
        const float v0 = acc[mf][nf][2 * h] * pre, v1 = acc[mf][nf][2 * h + 1] * pre;
        const float recv = __shfl_xor_sync(0xffffffffu, even ? v1 : v0, 4);
        const float lo = even ? v0 : recv;
        const float hi = even ? recv : v1;
        const int token = (warp_n * NF + nf) * 8 + tig * 2 + (even ? 0 : 1);
        const int n = t.n0 + (warp_m * MF + mf) * 16 + h * 8 + (gid & ~1);
        if (token < t.rows && n < p.n) {
          const int row = t.row0 + token;
          float out_lo, out_hi;
          scale(row, lo, hi, out_lo, out_hi);
          bool scattered = false;
          if constexpr (std::is_same<OutT, __nv_bfloat16>::value) {
            if (p.scatter.out != nullptr) {
              scatter_add_pair(p.scatter, row, n, out_lo, out_hi);
              scattered = true;
            }
          }
          if (!scattered)
            // two adjacent output features of one row (n even, so the 4- or 8-byte store is aligned)
            store_out_pair(static_cast<OutT*>(p.d) + static_cast<int64_t>(row) * p.n + n, out_lo, out_hi);
        }
      }
      acc[mf][nf][0] = acc[mf][nf][1] = acc[mf][nf][2] = acc[mf][nf][3] = 0.f;
    }
  }
}

// 16-byte chunk swizzles (XOR), chosen so that the 8 lanes of a quarter warp (2 rows x 4 `tig`)
// read 8 different bank groups: activation rows are >= 128 bytes, weight rows are 64 * GPS bytes.
__device__ __forceinline__ int swizzle_a(int chunk, int row) { return chunk ^ (row & 7); }
// fp16-slot activations (A_BYTES 2): lane (row, tig) reads chunk 4 tig + j (+ 16 per group) at K step j; bit 3 of
// the chunk (tig >= 2) also flips bit 1, so that 2 rows x 4 tig meet 8 bank groups.
__device__ __forceinline__ int swizzle_a16(int chunk, int row) { return chunk ^ (row & 7) ^ ((chunk >> 2) & 2); }
template <int GPS>
__device__ __forceinline__ int swizzle_b(int chunk, int row) {
  return GPS >= 2 ? chunk ^ ((row & 1) << 2) : chunk;
}

// The fused activation epilogue of one tile (ActE4m3; the top comment describes the row mapping),
// run by every thread of the block right after the K warps met (meet_k_warps: k0 = this thread's warp
// holds the tile's sums). `park`: the meeting's shared memory, TILE_M x TILE_N floats, reused here as
// h[token][tile row]; the caller's next block-wide barrier retires it. Then the items loop of all
// threads (act_requant_items.cuh).
template <int WARPS_M, int WARPS_N, int MF, int NF, int kTileM, int kTileN, int kThreads>
__device__ __forceinline__ void act_requant_epilogue(const W4A8ActGemmParams& p, const GroupedTile& t,
                                                     float (&acc)[MF][NF][4], float* park, bool k0, int warp_m,
                                                     int warp_n, int lane, int tid) {
  const ActRequantEpilogue& ep = p.act_out;
  __syncthreads();  // every k0 thread has read its own park column (meet_k_warps): park is free
  if (k0) {
    // h = a_scale(row) * acc, the value the fp32 epilogue stores (one rounding: __fmul_rn is never
    // contracted into a later add). Token columns past the tile's rows hold zeros and are not read.
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int nf = 0; nf < NF; ++nf) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int token = (warp_n * NF + nf) * 8 + tig * 2 + cc;
        const float as = token < t.rows ? p.a_scales[p.a_scales_per_row ? t.row0 + token : 0] : 0.f;
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = (warp_m * MF + mf) * 16 + hh * 8 + gid;
            park[token * kTileM + r] = __fmul_rn(as, acc[mf][nf][2 * hh + cc]);
          }
      }
    }
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mf][nf][c] = 0.f;
  }
  __syncthreads();
  act_requant_items<kTileM, kThreads>(ep, t, park, tid);
}

template <class OutT, int WARPS_M, int WARPS_N, int MF, int NF, int GPS, int STAGES, int WARPS_K, int MIN_BLOCKS,
          int A_BYTES = 1>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * WARPS_K * 32, MIN_BLOCKS)
    sm90_grouped_gemm_w4a8_int4_kernel(const W4A8ParamsOf<OutT> p) {
  pdl_wait();  // first; no early release (cuda/common/pdl.cuh)
  constexpr bool kAct = std::is_same<OutT, ActE4m3>::value;  // the fused activation epilogue
  static_assert(std::is_same<OutT, __nv_bfloat16>::value || std::is_same<OutT, float>::value || kAct,
                "the epilogue stores bf16 (the public op), fp32 or e4m3 A2 (the fused MoE's GEMM1)");
  using Cfg = Config<WARPS_M, WARPS_N, MF, NF, GPS, STAGES, WARPS_K, A_BYTES>;
  static_assert(A_BYTES == 1 || A_BYTES == 2, "e4m3 activations or their fp16 K slots");
  constexpr int kRowBytesA = Cfg::kRowBytesA;
  constexpr int kTileM = Cfg::kTileM;
  constexpr int kTileN = Cfg::kTileN;
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kRowBytesB = Cfg::kRowBytesB;
  constexpr int kTileK = Cfg::kTileK;

  extern __shared__ __align__(128) uint8_t smem[];
  int32_t* tile_start = reinterpret_cast<int32_t*>(smem);  // [E + 1] exclusive prefix of tiles
  uint8_t* stages = smem + Cfg::kTileStartBytes;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int E = p.num_experts;
  const int n_tiles = (p.n + kTileM - 1) / kTileM;
  const int groups = p.k / kGroup;
  const int stages_per_tile = (groups + GPS - 1) / GPS;

  // ---- Work list (grouped_tile_list.cuh): exclusive prefix of tiles per expert in smem.
  __shared__ int32_t warp_total[kThreads / 32];
  const auto tiles =
      cta_tiles<kThreads, kTileM, kTileN>(p.problem_sizes, p.expert_offsets, E, n_tiles, tile_start, warp_total);
  if (tiles.empty()) return;
  const int total_iters = tiles.count * stages_per_tile;

  const int64_t row_bytes_b = p.k / 2;
  const int groups_per_kb = p.k / 512;  // packed-4 scale blocks

  // ---- Producer. Each thread copies fixed (row, 16-byte chunk) slots of every stage; the global
  // addresses are set up once per tile so a stage costs a few instructions per copy.
  constexpr int kChunksB = GPS * 4;  // 16-byte chunks of one weight row per stage
  constexpr int kRowsPerPassB = kThreads / kChunksB;
  constexpr int kPassesB = kTileM / kRowsPerPassB;
  constexpr int kChunksA = GPS * 8 * A_BYTES;  // 16-byte chunks of one activation row per stage
  constexpr int kRowsPerPassA = kThreads / kChunksA;
  constexpr int kPassesA = (kTileN + kRowsPerPassA - 1) / kRowsPerPassA;
  static_assert(kThreads % kChunksB == 0 && kTileM % kRowsPerPassB == 0, "weight copies tile the stage");
  static_assert(kThreads % kChunksA == 0 && kPassesB <= 32 && kPassesA <= 32, "copy masks are 32-bit");
  constexpr uint32_t kAllPassesB = kPassesB == 32 ? ~0u : (1u << kPassesB) - 1;
  // (the decode tiles of up to 16 tokens: the wider ones spill with the second copy loop)
  constexpr bool kFullCopiesB = NF <= 2;
  static_assert(!kAct || (kPassesB % 2 == 0 && (kTileM / 2) % 8 == 0), "passes and scale copies lie in one half");
  const int b_row = tid / kChunksB, b_chunk = tid % kChunksB;
  const int a_row = tid / kChunksA, a_chunk = tid % kChunksA;
  const int64_t b_pass_stride = kRowsPerPassB * row_bytes_b;
  // A_BYTES 2: a row is 2K bytes of slots, then the fp32 bias sums of its K / 128 groups (row pitch 2K + K / 32).
  const int64_t a_row_pitch = A_BYTES == 1 ? int64_t{p.k} : f16_slots_row_bytes(p.k);
  const int64_t a_pass_stride = kRowsPerPassA * a_row_pitch;

  const uint8_t* b_src = p.b;  // row n0 + b_row, chunk b_chunk, group 0 of the current load tile
  int64_t b_jump = 0;          // kAct, gated: extra offset of the passes in the up half (tile rows >= F)
  const uint8_t* a_src = p.a;  // row row0 + a_row, chunk a_chunk, group 0
  const uint8_t* bias_src = p.a;  // A_BYTES 2: bias of row row0 + tid / GPS, group tid % GPS (threads < kStageBias / 4)
  bool bias_valid = false;
  const __nv_bfloat16* s_src = p.b_scales;
  uint32_t b_valid = 0, a_valid = 0;  // bit i: pass i copies a real row
  bool s_valid = false;
  // The tile and K step the next copy fills (counters, not a division per stage), and that tile located
  // one tile ahead: its expert's row count and first row are loaded while the previous tile streams.
  TileStep load_at;
  LocatedTile load_ahead = tiles.locate(0);
  auto issue_loads = [&](int stage) {
    const int s = load_at.k;
    if (s == 0) {
      const GroupedTile t = tiles.take(load_ahead, load_at.tile);
      // Weight row of tile row r: row_lo + r, plus row_jump when r >= TILE_M / 2 (only in the fused
      // gated epilogue: gate rows of F features, then their up rows; see the top comment).
      // (The plain kernels keep their exact address arithmetic: if constexpr.)
      int row_lo = t.n0, row_jump = 0;
      if constexpr (kAct) {
        const ActTileRows rows_of = act_tile_rows<kTileM>(p.act_out, t.n0);
        row_lo = rows_of.lo;
        row_jump = rows_of.jump;
        b_jump = static_cast<int64_t>(row_jump) * row_bytes_b;
      }
      auto weight_row = [&](int r) {
        if constexpr (kAct) {
          return row_lo + r + (r >= kTileM / 2 ? row_jump : 0);
        } else {
          return t.n0 + r;
        }
      };
      b_src = p.b + (static_cast<int64_t>(t.expert) * p.n + weight_row(0) + b_row) * row_bytes_b + b_chunk * 16;
      a_src = p.a + static_cast<int64_t>(t.row0 + a_row) * a_row_pitch + a_chunk * 16;
      if constexpr (A_BYTES == 2) {
        const int bias_row = tid / GPS;
        bias_valid = tid < Cfg::kStageBias / 4 && bias_row < t.rows;
        bias_src = p.a + static_cast<int64_t>(t.row0 + bias_row) * a_row_pitch + 2 * int64_t{p.k} + (tid % GPS) * 4;
      }
      b_valid = a_valid = 0;
#pragma unroll
      for (int i = 0; i < kPassesB; ++i) b_valid |= (t.n0 + b_row + i * kRowsPerPassB < p.n ? 1u : 0u) << i;
#pragma unroll
      for (int i = 0; i < kPassesA; ++i) a_valid |= (a_row + i * kRowsPerPassA < t.rows ? 1u : 0u) << i;
      if (p.scales_packed4) {
        // 8 bytes (the 4 groups of a 512 block) per feature row: one 16-byte copy = 2 rows of
        // block `bi` of the stage.
        const int bi = tid / (kTileM / 2), c = tid % (kTileM / 2);
        s_valid = tid < Cfg::kScaleBlocks * kTileM / 2 && t.n0 + 2 * c < p.n;
        s_src = p.b_scales + (static_cast<int64_t>(t.expert) * groups_per_kb + bi) * 4 * p.n + 4 * weight_row(2 * c);
      } else {
        // GPS slices of TILE_M scales (one per group): one 16-byte copy = 8 rows of one group.
        const int gg = tid / (kTileM / 8), c = tid % (kTileM / 8);
        s_valid = tid < GPS * kTileM / 8 && t.n0 + 8 * c < p.n;
        if constexpr (kAct) {
          s_src = p.b_scales + (static_cast<int64_t>(t.expert) * groups + gg) * p.n + weight_row(8 * c);
        } else {
          s_src = p.b_scales + (static_cast<int64_t>(t.expert) * groups + gg) * p.n + t.n0 + 8 * c;
        }
      }
    }
    const int g0 = s * GPS;
    const int valid_groups = min(GPS, groups - g0);
    uint8_t* sb = stages + stage * Cfg::kStageBytes;
    uint8_t* sa = sb + Cfg::kStageB;
    uint8_t* ss = sa + Cfg::kStageA;
    const bool b_chunk_ok = b_chunk < valid_groups * 4;  // K tail of the last stage
    const bool a_chunk_ok = a_chunk < valid_groups * 8 * A_BYTES;
    if (kFullCopiesB && b_chunk_ok && b_valid == kAllPassesB) {  // every copy reads a real row chunk
      const uint8_t* src = b_src + g0 * kGroupBytesB;
#pragma unroll
      for (int i = 0; i < kPassesB; ++i) {
        const int r = b_row + i * kRowsPerPassB;
        const int64_t jump = kAct && i >= kPassesB / 2 ? b_jump : 0;
        cp_async_16_full(sb + r * kRowBytesB + (swizzle_b<GPS>(b_chunk, r) << 4), src + i * b_pass_stride + jump);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kPassesB; ++i) {
        const int r = b_row + i * kRowsPerPassB;
        const bool valid = b_chunk_ok && ((b_valid >> i) & 1u);
        // (a pass lies in one half: kRowsPerPassB divides TILE_M / 2, static_assert below)
        const uint8_t* src;
        if constexpr (kAct) {
          src = valid ? b_src + i * b_pass_stride + (i >= kPassesB / 2 ? b_jump : 0) + g0 * kGroupBytesB : p.b;
        } else {
          src = valid ? b_src + i * b_pass_stride + g0 * kGroupBytesB : p.b;
        }
        cp_async_16(sb + r * kRowBytesB + (swizzle_b<GPS>(b_chunk, r) << 4), src, valid);
      }
    }
#pragma unroll
    for (int i = 0; i < kPassesA; ++i) {
      const int r = a_row + i * kRowsPerPassA;
      if (kPassesA * kRowsPerPassA > kTileN && r >= kTileN) break;
      const bool valid = a_chunk_ok && ((a_valid >> i) & 1u);
      const uint8_t* src = valid ? a_src + i * a_pass_stride + g0 * kGroup * A_BYTES : p.a;
      const int chunk = A_BYTES == 1 ? swizzle_a(a_chunk, r) : swizzle_a16(a_chunk, r);
      cp_async_16(sa + r * kRowBytesA + (chunk << 4), src, valid);
    }
    if constexpr (A_BYTES == 2) {  // the stage's bias sums: [token][group], one 4-byte copy each
      if (tid < Cfg::kStageBias / 4) {
        const bool valid = bias_valid && tid % GPS < valid_groups;
        cp_async_4(ss + Cfg::kStageS + tid * 4, valid ? bias_src + g0 * 4 : p.a, valid);
      }
    }
    if (p.scales_packed4) {
      if (tid < Cfg::kScaleBlocks * kTileM / 2) {
        const bool valid = s_valid && (tid / (kTileM / 2)) * 4 < valid_groups;
        const __nv_bfloat16* src = valid ? s_src + static_cast<int64_t>(g0 / 4) * 4 * p.n : p.b_scales;
        cp_async_16(ss + tid * 16, src, valid);
      }
    } else if (tid < GPS * kTileM / 8) {
      const bool valid = s_valid && tid / (kTileM / 8) < valid_groups;
      const __nv_bfloat16* src = valid ? s_src + static_cast<int64_t>(g0) * p.n : p.b_scales;
      cp_async_16(ss + tid * 16, src, valid);
    }
    load_at.advance(stages_per_tile);
  };

  // ---- Consumer state.
  const int warp_m = warp % WARPS_M;
  const int warp_n = (warp / WARPS_M) % WARPS_N;
  const int warp_k = warp / (WARPS_M * WARPS_N);
  const int gid = lane >> 2;  // MMA groupID: weight row (and row + 8), token column
  const int tig = lane & 3;   // MMA thread-in-group: owns K [32 tig, 32 tig + 32) of a group
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
    // NOTE: this barrier both publishes stage `it` and retires stage `it - 1`, which the copy
    // issued just below overwrites.
    __syncthreads();
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
    const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(sa + Cfg::kStageA);

#pragma unroll
    for (int gk = 0; gk < GPS / WARPS_K; ++gk) {
      const int gg = gk * WARPS_K + warp_k;  // this warp's groups of the stage
      const int g = s * GPS + gg;
      if (GPS > 1 && g >= groups) break;  // K tail of the last stage (uniform branch)
      // Weights: one 16-byte word (32 int4) of rows gid and gid + 8 of every M fragment.
      uint4 w[MF][2];
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        const int r = (warp_m * MF + mf) * 16 + gid;
        w[mf][0] = *reinterpret_cast<const uint4*>(sb + r * kRowBytesB + (swizzle_b<GPS>(gg * 4 + tig, r) << 4));
        w[mf][1] = *reinterpret_cast<const uint4*>(sb + (r + 8) * kRowBytesB +
                                                   (swizzle_b<GPS>(gg * 4 + tig, r + 8) << 4));
      }
      // part: sum A * (q + 8) * 2^-24 per weight row; bias: sum A * (-8) * 2^-24 (same for all rows).
      float part[MF][NF][4];
      float bias[NF][4];
#pragma unroll
      for (int j = 0; j < NF; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) bias[j][c] = 0.f;
#pragma unroll
        for (int i = 0; i < MF; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) part[i][j][c] = 0.f;
      }

#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // Activations: 16 bytes (K steps 2*half, 2*half + 1) of token column gid of each N fragment.
        uint4 x[NF];
#pragma unroll
        for (int nf = 0; nf < NF; ++nf) {
          const int t = (warp_n * NF + nf) * 8 + gid;
          if constexpr (A_BYTES == 1)
            x[nf] = *reinterpret_cast<const uint4*>(sa + t * kRowBytesA + (swizzle_a(gg * 8 + tig * 2 + half, t) << 4));
        }
#pragma unroll
        for (int step = 0; step < 2; ++step) {
          const int j = half * 2 + step;
          // Activations of K 8j + 0..7 in the K slots of the biased weights (int4_to_f16.cuh).
          uint32_t b04[NF], b26[NF], b15[NF], b37[NF];
#pragma unroll
          for (int nf = 0; nf < NF; ++nf) {
            if constexpr (A_BYTES == 1) {
              const uint32_t lo = step == 0 ? x[nf].x : x[nf].z;  // K 8j + 0..3
              const uint32_t hi = step == 0 ? x[nf].y : x[nf].w;  // K 8j + 4..7
              e4m3x8_to_f16_slots(lo, hi, b04[nf], b26[nf], b15[nf], b37[nf]);
              bias_mma_step(bias[nf], b04[nf], b26[nf], b15[nf], b37[nf]);
            } else {  // the slots of K 8j + 0..7 as they are (one 16-byte load); the bias sums come with the stage
              const int t = (warp_n * NF + nf) * 8 + gid;
              const uint4 xs =
                  *reinterpret_cast<const uint4*>(sa + t * kRowBytesA + (swizzle_a16(gg * 16 + tig * 4 + j, t) << 4));
              b04[nf] = xs.x;
              b26[nf] = xs.y;
              b15[nf] = xs.z;
              b37[nf] = xs.w;
            }
          }
#pragma unroll
          for (int mf = 0; mf < MF; ++mf) {
            const uint32_t wr0 = j == 0 ? w[mf][0].x : j == 1 ? w[mf][0].y : j == 2 ? w[mf][0].z : w[mf][0].w;
            const uint32_t wr1 = j == 0 ? w[mf][1].x : j == 1 ? w[mf][1].y : j == 2 ? w[mf][1].z : w[mf][1].w;
            uint32_t u04r0, u26r0, u15r0, u37r0, u04r1, u26r1, u15r1, u37r1;
            int4x8_to_biased_f16(wr0, u04r0, u26r0, u15r0, u37r0);  // row gid
            int4x8_to_biased_f16(wr1, u04r1, u26r1, u15r1, u37r1);  // row gid + 8
#pragma unroll
            for (int nf = 0; nf < NF; ++nf) {
              mma_f16(part[mf][nf], u04r0, u04r1, u26r0, u26r1, b04[nf], b26[nf]);
              mma_f16(part[mf][nf], u15r0, u15r1, u37r0, u37r1, b15[nf], b37[nf]);
            }
          }
        }
      }
      if constexpr (A_BYTES == 2) {  // this lane's token columns 2 tig, 2 tig + 1 of each fragment (all rows alike)
        const float* sbias = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(ss) + Cfg::kStageS);
#pragma unroll
        for (int nf = 0; nf < NF; ++nf) {
          const int t = (warp_n * NF + nf) * 8 + 2 * tig;
          bias[nf][0] = bias[nf][2] = sbias[t * GPS + gg];
          bias[nf][1] = bias[nf][3] = sbias[(t + 1) * GPS + gg];
        }
      }
      // Group promotion: acc += S[row, g] * P, P = 2^24 * (part + bias) (fp32, g increasing).
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        const int r = (warp_m * MF + mf) * 16 + gid;
        const int s0 = p.scales_packed4 ? (gg / 4) * kTileM * 4 + r * 4 + (g & 3) : gg * kTileM + r;
        const int s1 = p.scales_packed4 ? (gg / 4) * kTileM * 4 + (r + 8) * 4 + (g & 3) : gg * kTileM + r + 8;
        const float scale0 = __bfloat162float(ss[s0]) * kF16BiasedUnit;
        const float scale1 = __bfloat162float(ss[s1]) * kF16BiasedUnit;
#pragma unroll
        for (int nf = 0; nf < NF; ++nf) {
          acc[mf][nf][0] = fmaf(scale0, part[mf][nf][0] + bias[nf][0], acc[mf][nf][0]);
          acc[mf][nf][1] = fmaf(scale0, part[mf][nf][1] + bias[nf][1], acc[mf][nf][1]);
          acc[mf][nf][2] = fmaf(scale1, part[mf][nf][2] + bias[nf][2], acc[mf][nf][2]);
          acc[mf][nf][3] = fmaf(scale1, part[mf][nf][3] + bias[nf][3], acc[mf][nf][3]);
        }
      }
    }

    if (s == stages_per_tile - 1) {
      if constexpr (WARPS_K > 1) {  // ---- K warps meet (k_warps.cuh); the next iteration's barrier retires `park`
        float* park = reinterpret_cast<float*>(stages + STAGES * Cfg::kStageBytes);
        constexpr int kMnThreads = WARPS_M * WARPS_N * 32;
        const bool k0 = meet_k_warps<WARPS_K, MF, NF, kMnThreads>(acc, park, warp_k, tid % kMnThreads);
        if constexpr (kAct) {  // ---- Fused epilogue: A2 and s2 (all threads; see the top comment)
          static_assert(Cfg::kSplitBytes >= kTileM * kTileN * 4, "park holds the tile's h");
          act_requant_epilogue<WARPS_M, WARPS_N, MF, NF, kTileM, kTileN, kThreads>(
              p, kLocateEarly ? finish_tile<kTileM, kTileN>(step_located) : tiles[tile_index], acc, park, k0, warp_m,
              warp_n, lane, tid);
          continue;
        }
        if (!k0) continue;
      }
      if constexpr (kAct) {
        static_assert(WARPS_K > 1, "the fused epilogue uses the K warps' meeting memory");
      } else {
        // ---- Epilogue: D[row, n] = out(a_scale(row) * acc).
        store_fragments<OutT>(acc, kLocateEarly ? finish_tile<kTileM, kTileN>(step_located) : tiles[tile_index], p,
                              warp_m, warp_n, gid, tig, 1.0f,
                              [&](int row, float lo, float hi, float& out_lo, float& out_hi) {
                                const float as = p.a_scales[p.a_scales_per_row ? row : 0];
                                out_lo = as * lo;
                                out_hi = as * hi;
                              });
      }
    }
  }
  cp_async_wait<0>();
}

}  // namespace w4a8
}  // namespace qmoe::cuda
