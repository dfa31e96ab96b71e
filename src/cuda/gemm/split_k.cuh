// Split-K for the mma.sync decode tiles that keeps the unsplit result bit for bit
// (sm90_grouped_gemm_w4a8_int4.cuh, SPLIT > 1).
//
// Why: at decode a grid of few tiles leaves each CTA a long serial K loop with a few stages in
// flight (Qwen3-30B T = 1: 192 tiles of 16 K groups; Mixtral GEMM2: 14336-long K), so the GEMM is
// bound by memory latency, not bandwidth. Splitting K over more CTAs puts more loads in flight.
//
// Why not the usual split-K: the unsplit kernel's warp k sums its groups g = k (mod WARPS_K) as
//   acc_k = fma(S_g, Q_g, acc_k), g increasing,   Q_g = fp32 sum of the group's MMA chain,
// and the K warps then add acc_0 + acc_1 + ... (k_warps.cuh). Every mma.sync tactic shares that order,
// so they all give the same bits (the deterministic finalize and the autotuner rely on it). Adding
// partial sums of K slices would change the rounding.
//
// How: a thread-block cluster of SPLIT CTAs shares each tile; CTA `rank` computes Q_g of the groups
// [rank * slice, (rank + 1) * slice) and keeps them in its shared memory (no promotion). At the end
// of the tile the cluster synchronizes, the leader's k = 0 warps read every Q_g through distributed
// shared memory and run exactly the chains above (same FMAs, same order), a second cluster barrier
// frees the slices, and the leader runs the usual epilogue. No global workspace, no counters.
// Costs: the Q buffer (kSplitMaxGroups x TILE_M x TILE_N fp32 per CTA) and the leader's serial
// promotion (groups FMAs per output element, the scales read from global memory / L2).
// Limit: slice = ceil(ceil(groups / SPLIT) / GPS) * GPS <= kSplitMaxGroups.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/int4_to_f16.cuh"  // kF16BiasedUnit
#include "cuda/gemm/grouped_tile_list.cuh"

namespace qmoe::cuda {

constexpr int kSplitMaxGroups = 16;  // K groups of one CTA's slice: sizes its Q buffer

// This CTA's share of a split grid (all zeros / one tile stride when SPLIT == 1: unused).
struct SplitSlice {
  int g_begin = 0;      // first K group of this CTA's slice
  int groups = 0;       // K groups per slice (a multiple of GPS; the last slices may run past K)
  int first_tile = 0;   // this cluster's index = its first tile
  int tile_stride = 1;  // clusters in the grid
  int tile_count = 0;   // tiles of this cluster
};

// K groups per CTA of a split tile (a multiple of GPS).
template <int SPLIT, int GPS>
__host__ __device__ __forceinline__ int split_slice_groups(int groups) {
  const int per_cta = (groups + SPLIT - 1) / SPLIT;
  return (per_cta + GPS - 1) / GPS * GPS;
}

template <int SPLIT, int GPS>
__device__ __forceinline__ SplitSlice split_slice(int groups, int total_tiles) {
  SplitSlice s;
  if constexpr (SPLIT > 1) {
    s.groups = split_slice_groups<SPLIT, GPS>(groups);
    // 1-D grid of 1-D clusters: cluster = SPLIT consecutive CTAs, rank = blockIdx.x % SPLIT.
    s.g_begin = static_cast<int>(cooperative_groups::this_cluster().block_rank()) * s.groups;
    s.first_tile = static_cast<int>(blockIdx.x) / SPLIT;
    s.tile_stride = static_cast<int>(gridDim.x) / SPLIT;
    s.tile_count = s.first_tile < total_tiles ? (total_tiles - 1 - s.first_tile) / s.tile_stride + 1 : 0;
  }
  return s;
}

// Every thread of every CTA of the cluster calls it at the end of each tile (two cluster barriers).
// q_local: this CTA's Q buffer, q[g - g_begin][token][row]. On the leader (returns true), the k = 0
// warps get in acc exactly what the unsplit kernel's K warps meet with; the caller then runs the
// epilogue there. scale_row(r): the weight row whose group scales tile row r uses.
template <int WARPS_K, int MF, int NF, int TILE_M, int TILE_N, class Params, class ScaleRow>
__device__ __forceinline__ bool split_k_promote(float (&acc)[MF][NF][4], float* q_local, const SplitSlice& slice,
                                                int groups, const GroupedTile& t, const Params& p, ScaleRow scale_row,
                                                int warp_m, int warp_n, int warp_k, int gid, int tig) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA's Q of this tile is written (release / acquire at cluster scope)
  const bool leader = cluster.block_rank() == 0;
  if (leader && warp_k == 0) {
    const int groups_per_kb = p.k / 512;
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int r = (warp_m * MF + mf) * 16 + gid + 8 * (c >> 1);
          const int token = (warp_n * NF + nf) * 8 + tig * 2 + (c & 1);
          float chain[WARPS_K];
#pragma unroll
          for (int k = 0; k < WARPS_K; ++k) chain[k] = 0.f;
          if (token < t.rows && t.n0 + r < p.n) {
            const int64_t wrow = scale_row(r);
            const __nv_bfloat16* srow =
                p.scales_packed4 ? p.b_scales + static_cast<int64_t>(t.expert) * groups_per_kb * 4 * p.n + 4 * wrow
                                 : p.b_scales + static_cast<int64_t>(t.expert) * groups * p.n + wrow;
            for (int g0 = 0; g0 < groups; g0 += WARPS_K) {
#pragma unroll
              for (int k = 0; k < WARPS_K; ++k) {
                const int g = g0 + k;
                if (g < groups) {
                  const int owner = g / slice.groups;
                  const float* q = cluster.map_shared_rank(q_local, owner);
                  const float qv = q[(g - owner * slice.groups) * (TILE_M * TILE_N) + token * TILE_M + r];
                  const __nv_bfloat16 sb = p.scales_packed4 ? srow[static_cast<int64_t>(g / 4) * 4 * p.n + (g & 3)]
                                                            : srow[static_cast<int64_t>(g) * p.n];
                  const float scale = __bfloat162float(sb) * kF16BiasedUnit;
                  chain[k] = fmaf(scale, qv, chain[k]);
                }
              }
            }
          }
          float v = chain[0];
#pragma unroll
          for (int k = 1; k < WARPS_K; ++k) v += chain[k];  // the K warps' meeting order
          acc[mf][nf][c] = v;
        }
  }
  cluster.sync();  // the leader has read every slice: the CTAs may overwrite theirs (next tile) or exit
  return leader;
}

}  // namespace qmoe::cuda
