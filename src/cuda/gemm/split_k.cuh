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
// [rank * slice, (rank + 1) * slice), slice = ceil(groups / SPLIT), and keeps them in its shared memory
// (no promotion; its stages need not start at a multiple of GPS). At the end of the tile the cluster
// synchronizes; every thread of every CTA then takes output elements (token, row) of the tile, reads
// their Q_g from the owning CTAs through distributed shared memory and runs exactly the chains above
// (same FMAs, same order, the scales from global memory / L2), and writes the sum into the leader's
// `park`; a second cluster barrier frees the slices, the leader's k = 0 warps load their fragments
// from `park` and run the usual epilogue. No global workspace, no counters.
// Costs: the Q buffer (kSplitMaxGroups x TILE_N x (TILE_M + 4) fp32 per CTA; the 4-float pad keeps the
// fragment stores free of bank conflicts) and the promotion (groups FMAs per output element).
// Limit: slice <= kSplitMaxGroups (so K <= SPLIT * 2048).
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/int4_to_f16.cuh"  // kF16BiasedUnit
#include "cuda/gemm/grouped_tile_list.cuh"

namespace qmoe::cuda {

constexpr int kSplitMaxGroups = 16;  // K groups of one CTA's slice: sizes its Q buffer
// NOTE: src/tune/tactics.cpp offers a split tactic only for K <= split_k * kSplitMaxGroups * 128.

// Q buffer layout: q[g - g_begin][token][row], token stride TILE_M + 4 floats.
template <int TILE_M>
constexpr int split_q_token_stride() { return TILE_M + 4; }
template <int TILE_M, int TILE_N>
constexpr int split_q_bytes() { return kSplitMaxGroups * TILE_N * split_q_token_stride<TILE_M>() * 4; }

// K groups of one CTA's slice.
template <int SPLIT>
__host__ __device__ __forceinline__ int split_slice_groups(int groups) {
  return (groups + SPLIT - 1) / SPLIT;
}

// This CTA's share of a split grid (unused when SPLIT == 1).
struct SplitSlice {
  int g_begin = 0;      // first K group of this CTA's slice
  int g_end = 0;        // one past its last (<= the K groups; g_begin >= g_end: an empty slice)
  int groups = 0;       // K groups per slice (every CTA's slice starts at rank * groups)
  int first_tile = 0;   // this cluster's index = its first tile
  int tile_stride = 1;  // clusters in the grid
  int tile_count = 0;   // tiles of this cluster
};

template <int SPLIT>
__device__ __forceinline__ SplitSlice split_slice(int groups, int total_tiles) {
  SplitSlice s;
  if constexpr (SPLIT > 1) {
    s.groups = split_slice_groups<SPLIT>(groups);
    // 1-D grid of 1-D clusters: cluster = SPLIT consecutive CTAs, rank = blockIdx.x % SPLIT.
    s.g_begin = static_cast<int>(cooperative_groups::this_cluster().block_rank()) * s.groups;
    s.g_end = min(groups, s.g_begin + s.groups);
    s.first_tile = static_cast<int>(blockIdx.x) / SPLIT;
    s.tile_stride = static_cast<int>(gridDim.x) / SPLIT;
    s.tile_count = s.first_tile < total_tiles ? (total_tiles - 1 - s.first_tile) / s.tile_stride + 1 : 0;
  }
  return s;
}

// Every thread of every CTA of the cluster calls it at the end of each tile (two cluster barriers).
// q_local: this CTA's Q buffer; park_local: its TILE_M x TILE_N floats of park (the same offset in
// every CTA). On the leader (returns true) the k = 0 warps get in acc exactly what the unsplit
// kernel's K warps meet with; the caller then runs the epilogue there. scale_row(r): the weight row
// whose group scales tile row r uses. WARPS_K = 2: warp k of the unsplit kernel sums the groups g = k
// (mod 2).
template <int SPLIT, int WARPS_K, int MF, int NF, int TILE_M, int TILE_N, int THREADS, class Params, class ScaleRow>
__device__ __forceinline__ bool split_k_promote(float (&acc)[MF][NF][4], const float* q_local, float* park_local,
                                                const SplitSlice& slice, int groups, const GroupedTile& t,
                                                const Params& p, ScaleRow scale_row, int warp_m, int warp_n,
                                                int warp_k, int gid, int tig, int tid) {
  static_assert(WARPS_K == 2, "the promotion keeps the two K warps' chains (even and odd groups)");
  namespace cg = cooperative_groups;
  constexpr int kStride = split_q_token_stride<TILE_M>();
  constexpr int kGroupFloats = TILE_N * kStride;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA's Q of this tile is written (release / acquire at cluster scope)
  const int rank = static_cast<int>(cluster.block_rank());
  float* leader_park = cluster.map_shared_rank(park_local, 0);
  const int groups_per_kb = p.k / 512;
  for (int e = rank * THREADS + tid; e < TILE_M * TILE_N; e += SPLIT * THREADS) {
    const int token = e / TILE_M, r = e % TILE_M;  // consecutive threads: consecutive rows
    float even = 0.f, odd = 0.f;                   // the k = 0 and k = 1 warps' chains
    if (token < t.rows && t.n0 + r < p.n) {
      const int64_t wrow = scale_row(r);
      const __nv_bfloat16* srow =
          p.scales_packed4 ? p.b_scales + static_cast<int64_t>(t.expert) * groups_per_kb * 4 * p.n + 4 * wrow
                           : p.b_scales + static_cast<int64_t>(t.expert) * groups * p.n + wrow;
#pragma unroll 1
      for (int owner = 0; owner < SPLIT; ++owner) {
        const int g_lo = owner * slice.groups;
        const int n = min(groups - g_lo, slice.groups);
        if (n <= 0) break;
        const float* q = cluster.map_shared_rank(q_local, owner) + token * kStride + r;
        // All of a slice's loads first (independent), then the chains in g order.
        float qv[kSplitMaxGroups], sv[kSplitMaxGroups];
#pragma unroll
        for (int j = 0; j < kSplitMaxGroups; ++j) {
          if (j < n) {
            const int g = g_lo + j;
            qv[j] = q[j * kGroupFloats];
            const __nv_bfloat16 sb = p.scales_packed4 ? srow[static_cast<int64_t>(g >> 2) * 4 * p.n + (g & 3)]
                                                      : srow[static_cast<int64_t>(g) * p.n];
            sv[j] = __bfloat162float(sb) * kF16BiasedUnit;
          }
        }
#pragma unroll
        for (int j = 0; j < kSplitMaxGroups; ++j) {
          if (j < n) {
            if (((g_lo + j) & 1) == 0) {
              even = fmaf(sv[j], qv[j], even);
            } else {
              odd = fmaf(sv[j], qv[j], odd);
            }
          }
        }
      }
    }
    leader_park[token * TILE_M + r] = even + odd;  // the K warps' meeting: acc(k = 0) += acc(k = 1)
  }
  cluster.sync();  // every sum is in the leader's park; the CTAs may overwrite their Q (next tile) or exit
  const bool leader = rank == 0;
  if (leader && warp_k == 0) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int r = (warp_m * MF + mf) * 16 + gid + 8 * (c >> 1);
          const int token = (warp_n * NF + nf) * 8 + tig * 2 + (c & 1);
          acc[mf][nf][c] = park_local[token * TILE_M + r];
        }
  }
  return leader;
}

}  // namespace qmoe::cuda
