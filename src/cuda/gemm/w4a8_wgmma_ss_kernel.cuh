// Hopper WGMMA tiles of the W4A8 grouped GEMM with both operands in shared memory: the loading warpgroups
// turn the int4 weights into an e4m3 copy of the weight tile, the computing warpgroups only wait, issue
// wgmmas and promote. Same math and same bits as the register-operand kernels
// (sm90_grouped_gemm_w4a8_int4_wgmma.cu, SGLang semantics):
//
//   D[r, o] = out( a_scale(r) * sum_g S[e, o, g] * (sum_{k in group g} A[r, k] * q[e, o, k]) )
//
// a fresh fp32 partial per 128-wide K group (four wgmma m64nNk32, the first not accumulating), then one
// fp32 FMA with the bf16 group scale into the accumulator, g increasing.
//
// Why: with the weights as the register operand, each computing thread converts the 4-weight pieces the
// wgmma A fragment wants (K 4 tig..+3 of a row: half a packed word), ~7 integer instructions per 4
// weights on the ALU pipe next to the promotion; ncu (bench/results/2026-11-30_s12d_*) shows those
// kernels instruction-bound with the tensor pipe 18-31% busy. Here whole packed words are converted
// (int4x8_to_e4m3x8: 11 instructions per 8 weights) by two loading warpgroups, whose issue slots were
// mostly idle, into rows of 128 e4m3 bytes with the 128-byte swizzle the wgmma descriptor reads.
//
// Pipeline (kStages ring, full/empty mbarriers): the loader copies stage `it` (cp.async: activations,
// int4 weights, scales), then converts stage it - kLag: only the copies it issued itself, which
// cp.async.wait_group has made visible to it, so the loaders need no barrier among themselves; it
// fences its writes for the async proxy (the tensor cores) and arrives on that stage's full barrier.
// kLag = kStages - 2 keeps it deadlock-free: before loading stage it the loader waits for stage
// it - kStages to be released, which needs stage it - kStages + 1 = (it - 1) - kLag, converted one
// iteration earlier.
// Limits (checked by the caller): K % 128 == 0, N % 8 == 0, E <= 1024, 16-byte aligned pointers.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/int4_to_e4m3.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/grouped_tile_list.cuh"
#include "cuda/gemm/wgmma_building_blocks.cuh"

namespace qmoe::cuda::wgmma_ss {

using namespace wgmma;  // (wgmma_building_blocks.cuh)
constexpr int kConsumers = 2;  // computing warpgroups, 64 weight rows each
// LOADER_GROUPS loading warpgroups share the copies and the conversion: one alone converts too slowly (a
// single warp per scheduler; H200, s13c: 1.3x slower than the register-operand kernels at T = 4096).
// setmaxnreg moves registers inside the CTA's pool (launched at kThreads x the per-thread count the
// launch bounds allow): the computing warpgroups' increase waits until the loaders' decrease has freed
// enough, so the sum must stay within the pool (else they wait forever). ptxas fits the loaders' code,
// conversion included, in 56 registers; the computing threads use ~150.
template <int LOADER_GROUPS>
struct Roles {
  static constexpr int kLoaders = 128 * LOADER_GROUPS;
  static constexpr int kThreads = kLoaders + 128 * kConsumers;
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = (kThreads * kLaunchRegs - kLoaders * kProducerRegs) / (128 * kConsumers) / 8 * 8 > 240
                                           ? 240
                                           : (kThreads * kLaunchRegs - kLoaders * kProducerRegs) / (128 * kConsumers) / 8 * 8;
  static_assert(kConsumerRegs >= 152, "the computing threads' ~150 registers");
};

template <int TILE_N>
struct Shape {
  static constexpr int kAcc = TILE_N / 2;                             // fp32 accumulators per thread
  static constexpr int kStageA = TILE_N * kGroup;                     // activations (load_stage's layout:
  static constexpr int kLoaded = kStageA + kStageW + kStageS;         //   then int4 weights, then scales)
  static constexpr int kWeightsE4m3 = (kLoaded + 1023) / 1024 * 1024;  // e4m3 weights, 128 rows x 128 bytes
  static constexpr int kStageBytes = kWeightsE4m3 + kTileM * kGroup;
  static constexpr int kStages = TILE_N == 128 ? 5 : 6;
  static constexpr int kLag = kStages - 2;
  static_assert(kStageBytes % 1024 == 0, "both operand tiles of every stage 1024-byte aligned (128B swizzle)");
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kBarrierBytes + kTileStartBytes;
  static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of one SM");
};

// d (64 x N fp32 per warpgroup) (+)= A (64 x 32 e4m3, smem) * B^T (N x 32 e4m3, smem).
__device__ __forceinline__ void wgmma_ss_m64n128k32(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                   int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_ss_m64n64k32(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                   int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

template <int TILE_N>
__device__ __forceinline__ void wgmma_ss_k32(float (&d)[TILE_N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (TILE_N == 128) wgmma_ss_m64n128k32(d, desc_a, desc_b, accumulate);
  else wgmma_ss_m64n64k32(d, desc_a, desc_b, accumulate);
}

// The weights this loader copied into the stage at `st` (load_stage: tile rows w_row + LOADERS / 4 * i, 16 bytes at
// w_chunk = K 32 w_chunk..+31) as e4m3: row r of the e4m3 tile is 128 bytes, its 16-byte chunk c stored
// at chunk c ^ (r % 8) (128-byte swizzle). Rows past N were zero-filled: they become e4m3 zeros.
template <int TILE_N, int LOADERS>
__device__ __forceinline__ void convert_weights(uint8_t* st, int loader) {
  using S = Shape<TILE_N>;
  const int w_row = loader / 4, w_chunk = loader % 4;
  const uint8_t* q_rows = st + S::kStageA;  // int4, 64 bytes per row
  uint8_t* e_rows = st + S::kWeightsE4m3;
  constexpr int kRowsPerPass = LOADERS / 4;
#pragma unroll
  for (int i = 0; i < kTileM / kRowsPerPass; ++i) {
    const int r = w_row + kRowsPerPass * i;
    const uint4 q = *reinterpret_cast<const uint4*>(q_rows + r * (kGroup / 2) + w_chunk * 16);
    uint4 lo, hi;  // K 32 w_chunk + 0..15 and + 16..31
    int4x8_to_e4m3x8(q.x, lo.x, lo.y);
    int4x8_to_e4m3x8(q.y, lo.z, lo.w);
    int4x8_to_e4m3x8(q.z, hi.x, hi.y);
    int4x8_to_e4m3x8(q.w, hi.z, hi.w);
    *reinterpret_cast<uint4*>(e_rows + r * kGroup + (((2 * w_chunk) ^ (r & 7)) << 4)) = lo;
    *reinterpret_cast<uint4*>(e_rows + r * kGroup + (((2 * w_chunk + 1) ^ (r & 7)) << 4)) = hi;
  }
}

// OutT: __nv_bfloat16 or float (the fused activation epilogue keeps the register-operand kernels).
// kLoaderFences: the proxy fence after the e4m3 stores by the loader that wrote them (else by the
// computing threads after their wait on full[], as the register-operand kernels do for the copies).
template <class OutT, int TILE_N, int LOADER_GROUPS = 2, bool kLoaderFences = true>
__global__ void __launch_bounds__(Roles<LOADER_GROUPS>::kThreads, 1) kernel(const WgmmaGemmParams p) {
  using R = Roles<LOADER_GROUPS>;
  constexpr int kLoaders = R::kLoaders, kThreads = R::kThreads, kLoaderGroups = LOADER_GROUPS;
  pdl_wait();  // first; no early release (cuda/common/pdl.cuh)
  using S = Shape<TILE_N>;
  constexpr int kStages = S::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_1024(smem_raw);
  uint8_t* stages = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * S::kStageBytes);
  uint64_t* empty = full + kStages;
  int32_t* tile_start = reinterpret_cast<int32_t*>(empty + kStages);
  int32_t* warp_total = tile_start + kMaxExperts + 1;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], kLoaders);           // every loading thread, after its converted weights are written
      mbar_init(&empty[s], 128 * kConsumers);  // every computing thread, after its wgmmas read the stage
    }
  }
  const int n_tiles = (p.n + kTileM - 1) / kTileM;
  const int groups = p.k / kGroup;
  // (its barriers also publish the mbarrier initialisation)
  const auto tiles =
      cta_tiles<kThreads, kTileM, TILE_N>(p.problem_sizes, p.expert_offsets, p.num_experts, n_tiles, tile_start, warp_total);
  if (tiles.empty()) return;
  const int total_iters = tiles.count * groups;

  if (tid < kLoaders) {
    // ---- Loading warpgroups: copies, then converts kLag stages behind.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R::kProducerRegs));
    StageCopies<TILE_N, kLoaders> copies{};
    auto publish = [&](int it) {
      const int s = it % kStages;
      convert_weights<TILE_N, kLoaders>(stages + s * S::kStageBytes, tid);
      if constexpr (kLoaderFences) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      mbar_arrive(&full[s]);
    };
    TileStep at;  // the group and tile of the next load (counted; the next tile located one tile ahead)
    LocatedTile ahead = tiles.locate(0);
    for (int it = 0; it < total_iters; ++it) {
      const int g = at.k, s = it % kStages;
      if (g == 0) copies = stage_copies<TILE_N, kLoaders>(p, tiles.take(ahead, at.tile), tid);
      mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
      load_stage<TILE_N, kLoaders>(p, copies, g, smem_u32(stages + s * S::kStageBytes), tid);
      cp_async_commit();
      at.advance(groups);
      if (it >= S::kLag) {
        cp_async_wait<S::kLag>();  // this thread's copies of stage it - kLag have landed
        publish(it - S::kLag);
      }
    }
    cp_async_wait<0>();
    for (int it = total_iters > S::kLag ? total_iters - S::kLag : 0; it < total_iters; ++it) publish(it);
    return;
  }

  // ---- Computing warpgroups: warp w of computing warpgroup c owns weight rows 64 c + 16 (w % 4) + {gid, gid + 8}.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R::kConsumerRegs));
  const int gid = lane >> 2, tig = lane & 3;
  const int c = wg - kLoaderGroups;
  const int r0 = c * 64 + (warp & 3) * 16 + gid, r1 = r0 + 8;
  const int a_rows = c * 64 * kGroup;  // this warpgroup's 64 rows of the e4m3 weight tile
  float acc[S::kAcc], part[S::kAcc];
#pragma unroll
  for (int i = 0; i < S::kAcc; ++i) acc[i] = 0.f;
  GroupedTile t{0, 0, 0, 0};
  TileStep step_at;  // the group and tile this step computes
  for (int it = 0; it < total_iters; ++it) {
    const int g = step_at.k, tile_index = step_at.tile, s = it % kStages;
    if (g == 0) t = tiles[tile_index];  // (first used by the epilogue)
    step_at.advance(groups);
    const uint8_t* st = stages + s * S::kStageBytes;
    mbar_wait(&full[s], (it / kStages) & 1);
    if constexpr (!kLoaderFences) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(st + S::kStageA + kStageW);
    const float s0 = __bfloat162float(p.scales_packed4 ? ss[r0 * 4 + (g & 3)] : ss[r0]);
    const float s1 = __bfloat162float(p.scales_packed4 ? ss[r1 * 4 + (g & 3)] : ss[r1]);
    const uint64_t desc_b = make_desc_sw128(smem_u32(st));
    const uint64_t desc_a = make_desc_sw128(smem_u32(st + S::kWeightsE4m3 + a_rows));
    wgmma_fence();
    fence_operands(part);
#pragma unroll
    for (int k = 0; k < 4; ++k) wgmma_ss_k32<TILE_N>(part, desc_a + 2 * k, desc_b + 2 * k, k > 0);
    wgmma_commit();
    wgmma_wait_all();
    fence_operands(part);
    mbar_arrive(&empty[s]);  // this thread is done with stage s (its scales are in registers)
#pragma unroll
    for (int j = 0; j < TILE_N / 8; ++j) {
      acc[4 * j + 0] = fmaf(s0, part[4 * j + 0], acc[4 * j + 0]);
      acc[4 * j + 1] = fmaf(s0, part[4 * j + 1], acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(s1, part[4 * j + 2], acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(s1, part[4 * j + 3], acc[4 * j + 3]);
    }
    if (g == groups - 1) store_tile<OutT, TILE_N>(p, t, acc, r0, r1, tig);
  }
}

}  // namespace qmoe::cuda::wgmma_ss
