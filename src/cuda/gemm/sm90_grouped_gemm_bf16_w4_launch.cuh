// Host side of the bf16 x 4-bit grouped GEMM, per weight format: maps a Tactic to one compiled
// configuration, sizes the persistent grid and launches. Each format's instantiations live in their
// own translation unit (sm90_grouped_gemm_bf16_w4_{int4,nvfp4,mxfp4}.cu) so they compile in parallel.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "cuda/gemm/resident_ctas.h"
#include "cuda/gemm/sm90_grouped_gemm_bf16_w4.cuh"
#include "cuda/gemm/sm90_grouped_gemm_bf16_w4_wgmma.h"
#include "cuda/launch.h"
#include "qmoe/error.h"
#include "cuda/common/pdl.cuh"

namespace qmoe::cuda::bf16w4 {

template <W4Format F, class OutT, int WARPS_M, int WARPS_N, int MF, int NF, int GPS, int STAGES, int MIN_BLOCKS,
          int WARPS_K>
void launch_typed(const Bf16W4Params& params, int64_t rows, int device, cudaStream_t stream) {
  using Cfg = Config<F, WARPS_M, WARPS_N, MF, NF, GPS, STAGES, WARPS_K>;
  constexpr auto kernel =
      sm90_grouped_gemm_bf16_w4_kernel<F, OutT, WARPS_M, WARPS_N, MF, NF, GPS, STAGES, MIN_BLOCKS, WARPS_K>;
  const int fit = resident_ctas<kernel>(Cfg::kThreads, Cfg::kSmemBytes, device, "occupancy of the bf16 x 4-bit gemm");
  const int64_t n_tiles = (params.n + Cfg::kTileM - 1) / Cfg::kTileM;
  const int64_t max_tiles = (rows / Cfg::kTileN + params.num_experts) * n_tiles;
  const int64_t grid = max_tiles < fit ? (max_tiles > 0 ? max_tiles : 1) : fit;
  launch_kernel(kernel, static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmemBytes, stream, params);
  check_cuda(cudaGetLastError(), "launch of sm90_grouped_gemm_bf16_w4");
}

// WARPS_K (warps splitting the K groups of a stage) is 1 in every shipped tactic; the A/B runs of
// scripts/build_gemm_variants.sh try more (bench/ab/bf16_decode_tiles.txt). WITH_ACT: the configuration
// also has the fused-epilogue instantiation (the tactics bf16_act_supported names).
template <W4Format F, int WARPS_M, int WARPS_N, int MF, int NF, int GPS, int STAGES, int MIN_BLOCKS, int WARPS_K = 1,
          bool WITH_ACT = false>
void launch_out(const Bf16W4Params& params, OutKind out, int64_t rows, int device, cudaStream_t stream) {
  if (out == OutKind::kFp32) {
    launch_typed<F, float, WARPS_M, WARPS_N, MF, NF, GPS, STAGES, MIN_BLOCKS, WARPS_K>(params, rows, device, stream);
  } else if (out == OutKind::kBf16) {
    launch_typed<F, __nv_bfloat16, WARPS_M, WARPS_N, MF, NF, GPS, STAGES, MIN_BLOCKS, WARPS_K>(params, rows, device,
                                                                                             stream);
  } else if constexpr (WITH_ACT) {
    launch_typed<F, ActBf16, WARPS_M, WARPS_N, MF, NF, GPS, STAGES, MIN_BLOCKS, WARPS_K>(params, rows, device, stream);
  } else {
    throw Error("tactic", "a tactic with the fused activation epilogue (bf16_act_supported)", "another tactic");
  }
}

// NOTE: the instantiation list. Keep it in step with compiled_bf16() in src/tune/tactics.cpp.
// Template arguments: warps along weight rows, warps along tokens, 16-row fragments per warp, 8-token
// fragments per warp, K groups (128) per stage, stages, CTAs per SM.
//   decode n8/n16 : 128 rows, 2 groups per stage (128-byte runs of each weight row), 4 stages, 2 CTAs/SM
//                   (n8 with many tiles: 3 stages x 3 CTAs/SM, n8_tiles_fill_three_per_sm; H200,
//                   bench/results/2026-11-30_s5a_*: 5-8% faster at T = 8-64)
//   decode m64 n8 : n8 grids of 67-131 CTAs (T = 1 on small models): 64 rows, 4 warps of
//                   16 rows (twice the CTAs of n8, the same sums), 6 stages for more bytes in flight per SM
//   decode n24/n32: n16's warps with three / four token fragments, 3 stages so that two CTAs fit
//   prefill n64 / n128 / n160: the WGMMA tiles (sm90_grouped_gemm_bf16_w4_wgmma.cu), their own kernel. (The
//                   mma.sync 64-token tile that n64 named until session 16 was 1.2-1.4x slower at 32-48 rows
//                   per expert, bench/results/2026-12-01_s16d_*.)
template <W4Format F>
void launch_format(const Bf16W4Params& params, const Tactic& tactic, OutKind out, int64_t rows, int device,
                   cudaStream_t stream) {
  using Family = Tactic::Family;
  auto is = [&](Family f, int m, int n, int k) {
    return tactic.family == f && tactic.tile_m == m && tactic.tile_n == n && tactic.tile_k == k &&
           tactic.split_k == 1;
  };
  if (is(Family::kDecode, 128, 8, 256)) {
    // (both shapes with the fused activation epilogue; bf16_act_pays says where it pays)
    if (n8_tiles_fill_three_per_sm(rows, params.num_experts, params.n, device))
      launch_out<F, 4, 1, 2, 1, 2, 3, 3, 1, true>(params, out, rows, device, stream);
    else
      launch_out<F, 4, 1, 2, 1, 2, 4, 2, 1, true>(params, out, rows, device, stream);
  } else if (is(Family::kDecode, 64, 8, 256)) {
    launch_out<F, 4, 1, 1, 1, 2, 6, 2>(params, out, rows, device, stream);
  } else if (is(Family::kDecode, 128, 16, 256)) {
    launch_out<F, 4, 1, 2, 2, 2, 4, 2, 1, true>(params, out, rows, device, stream);
  } else if (is(Family::kDecode, 128, 24, 256)) {
    launch_out<F, 4, 1, 2, 3, 2, 3, 2>(params, out, rows, device, stream);
  } else if (is(Family::kDecode, 128, 32, 256)) {
    launch_out<F, 4, 1, 2, 4, 2, 3, 2>(params, out, rows, device, stream);  // 3 stages: two CTAs fit
  } else if (is(Family::kPrefill, 128, 64, 128) || is(Family::kPrefill, 128, 128, 128) ||
             is(Family::kPrefill, 128, 160, 128)) {
    if (out == OutKind::kAct)
      throw Error("tactic", "a tactic with the fused activation epilogue (bf16_act_supported)", tactic.name());
    launch_wgmma<F>(params, tactic.tile_n, out == OutKind::kFp32, rows, stream);
  } else {
    throw Error("tactic", "a tactic of the bf16 x 4-bit GEMM (valid_tactics with bf16 activations)", tactic.name());
  }
}

}  // namespace qmoe::cuda::bf16w4
