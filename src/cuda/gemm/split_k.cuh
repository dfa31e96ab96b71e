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
// [rank * slice, (rank + 1) * slice), slice = ceil(groups / SPLIT) (its stages may start inside a 512-K
// block of packed-4 scales: they copy two blocks), and keeps Q_g and the group scales of its rows (fp32,
// exactly the unsplit kernel's value) in its shared memory: no promotion. At the end of the tile the
// cluster synchronizes; every thread of every CTA then takes output elements (token, row), reads their
// Q_g and scales from the owning CTAs through distributed shared memory (16 groups' loads issued
// together) and runs exactly the chains above (same FMAs, same order), and writes the sum into the
// leader's `park`; a second cluster barrier frees the slices, the leader's k = 0 warps load their
// fragments from `park` and run the usual epilogue. No global workspace, no counters.
// Costs: per CTA kSplitMaxGroups x (TILE_N x (TILE_M + 4) + TILE_M) fp32 of shared memory (the 4-float
// pad keeps the fragment stores free of bank conflicts) plus 2 scale blocks per stage; two cluster
// barriers per tile (each also a GPU-scope fence); ceil(groups / 16) distributed-shared-memory round
// trips per output element.
// Limit: slice <= kSplitMaxGroups (so K <= SPLIT * 2048).
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "cuda/gemm/grouped_tile_list.cuh"

namespace qmoe::cuda {

constexpr int kSplitMaxGroups = 16;  // K groups of one CTA's slice: sizes its buffers
// NOTE: src/tune/tactics.cpp offers a split tactic only for K <= split_k * kSplitMaxGroups * 128.

// The buffers after the K warps' park: q[g - g_begin][token][row] (token stride TILE_M + 4 floats), then
// s[g - g_begin][row] (the fp32 group scales x 2^24 of the tile's rows).
template <int TILE_M>
constexpr int split_q_token_stride() { return TILE_M + 4; }
template <int TILE_M, int TILE_N>
constexpr int split_q_floats() { return kSplitMaxGroups * TILE_N * split_q_token_stride<TILE_M>(); }
template <int TILE_M, int TILE_N>
constexpr int split_buffer_bytes() { return (split_q_floats<TILE_M, TILE_N>() + kSplitMaxGroups * TILE_M) * 4; }
// Then, per pipeline stage, the packed-4 scales of two 512-K blocks (a stage of 4 groups may start
// inside a block): 2 x TILE_M x 4 bf16.
template <int TILE_M>
constexpr int split_scale_stage_bytes() { return 2 * TILE_M * 8; }
template <int TILE_M, int TILE_N, int STAGES>
constexpr int split_smem_bytes() {
  return split_buffer_bytes<TILE_M, TILE_N>() + STAGES * split_scale_stage_bytes<TILE_M>();
}

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

// f(mf, nf, c, r, token) for every accumulator element of a warp's mma.sync fragments: element c of
// fragment (mf, nf) holds tile row r and token (m16n8 C layout: rows gid, gid + 8; tokens 2 tig, + 1).
template <int MF, int NF, class F>
__device__ __forceinline__ void for_each_fragment_element(int warp_m, int warp_n, int gid, int tig, F f) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        f(mf, nf, c, (warp_m * MF + mf) * 16 + gid + 8 * (c >> 1), (warp_n * NF + nf) * 8 + tig * 2 + (c & 1));
}

// Distributed shared memory: `local` (a shared address of this CTA) in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_address(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ float load_cluster(uint32_t address) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(address) : "memory");
  return v;
}
__device__ __forceinline__ void store_cluster(uint32_t address, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(address), "f"(v) : "memory");
}

// Every thread of every CTA of the cluster calls it at the end of each tile (two cluster barriers).
// q_local: this CTA's buffers (split_smem_bytes); park_local: its TILE_M x TILE_N floats of park (the
// same offset in every CTA). On the leader (returns true) the k = 0 warps get in acc exactly what the
// unsplit kernel's K warps meet with; the caller then runs the epilogue there. WARPS_K = 2: warp k of
// the unsplit kernel sums the groups g = k (mod 2), from +0, g increasing; then acc0 + acc1.
template <int SPLIT, int WARPS_K, int MF, int NF, int TILE_M, int TILE_N, int THREADS>
__device__ __forceinline__ bool split_k_promote(float (&acc)[MF][NF][4], const float* q_local, float* park_local,
                                                const SplitSlice& slice, int groups, const GroupedTile& t, int n,
                                                int warp_m, int warp_n, int warp_k, int gid, int tig, int tid) {
  static_assert(WARPS_K == 2, "the promotion keeps the two K warps' chains (even and odd groups)");
  namespace cg = cooperative_groups;
  constexpr int kStride = split_q_token_stride<TILE_M>();
  constexpr int kBatch = kSplitMaxGroups;  // loads in flight per thread
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA's Q and scales of this tile are written (release / acquire, cluster scope)
  const int rank = static_cast<int>(cluster.block_rank());
  const uint32_t q_base = static_cast<uint32_t>(__cvta_generic_to_shared(q_local));
  const uint32_t s_base = q_base + split_q_floats<TILE_M, TILE_N>() * 4;
  const uint32_t park_base = static_cast<uint32_t>(__cvta_generic_to_shared(park_local));
  for (int e = rank * THREADS + tid; e < TILE_M * TILE_N; e += SPLIT * THREADS) {
    const int token = e / TILE_M, r = e % TILE_M;  // consecutive threads: consecutive rows
    float even = 0.f, odd = 0.f;                   // the k = 0 and k = 1 warps' chains
    if (token < t.rows && t.n0 + r < n) {
      int owner = 0, j = 0;  // group g = owner * slice.groups + j
      for (int base = 0; base < groups; base += kBatch) {
        float qv[kBatch], sv[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const bool ok = base + b < groups;  // past the end: a harmless load of slot 0 here, unused
          const uint32_t jq = ok ? static_cast<uint32_t>((j * TILE_N + token) * kStride + r) : 0u;
          const uint32_t js = ok ? static_cast<uint32_t>(j * TILE_M + r) : 0u;
          const uint32_t who = static_cast<uint32_t>(ok ? owner : rank);  // past the end: this CTA
          qv[b] = load_cluster(cluster_address(q_base + 4 * jq, who));
          sv[b] = load_cluster(cluster_address(s_base + 4 * js, who));
          if (++j == slice.groups) {
            j = 0;
            ++owner;
          }
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          if (base + b < groups) {
            if (((base + b) & 1) == 0) {
              even = fmaf(sv[b], qv[b], even);
            } else {
              odd = fmaf(sv[b], qv[b], odd);
            }
          }
        }
      }
    }
    store_cluster(cluster_address(park_base + 4 * static_cast<uint32_t>(token * TILE_M + r), 0u), even + odd);
  }
  cluster.sync();  // every sum is in the leader's park; the CTAs may overwrite their buffers or exit
  const bool leader = rank == 0;
  if (leader && warp_k == 0) {
    for_each_fragment_element<MF, NF>(warp_m, warp_n, gid, tig, [&](int mf, int nf, int c, int r, int token) {
      acc[mf][nf][c] = park_local[token * TILE_M + r];
    });
  }
  return leader;
}

}  // namespace qmoe::cuda
