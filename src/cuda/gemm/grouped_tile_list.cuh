// The persistent grids' work list of the grouped GEMMs (mma.sync and WGMMA kernels).
//
// Expert e owns ceil(M_e / TILE_N) token tiles x ceil(N / TILE_M) feature tiles. Tiles are numbered
// expert by expert; inside an expert the token tiles of one feature tile are consecutive, so CTAs
// running at the same time share that feature tile's weights in L2. M_e is read from the device
// copy of problem_sizes (no host sync); an empty expert contributes no tile at all.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define QMOE_TILE_HD __host__ __device__ __forceinline__
#else
#define QMOE_TILE_HD inline  // the tile arithmetic is also tested on the host (tests/cpp/test_grouped_tile_list.cpp)
#endif

namespace qmoe::cuda {

constexpr int kTileListMaxExperts = 1024;

struct GroupedTile {
  int expert;
  int n0;    // first output feature
  int row0;  // first row of A / D
  int rows;  // valid rows in this token tile (1..TILE_N)
};

// A located tile whose expert row count and first row may still be in flight: locate_tile only
// issues their loads; finish_tile is the first use (the kernels' loaders keep one tile ahead, so the global
// loads' latency overlaps the current tile instead of stalling the next one's first stage).
struct LocatedTile {
  int expert;
  int local;   // tile number inside the expert
  int m;       // the expert's rows (problem_sizes[expert][1])
  int offset;  // its first row (expert_offsets[expert])
};

// Where tile number `tile` lives (0 <= tile < total).
QMOE_TILE_HD LocatedTile locate_tile(int tile, const int32_t* tile_start, int num_experts,
                                                   const int32_t* problem_sizes, const int32_t* expert_offsets) {
  int lo = 0, hi = num_experts - 1;  // last expert whose first tile is <= tile (empty experts share starts)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  return {lo, tile - tile_start[lo], problem_sizes[3 * lo + 1], expert_offsets[lo]};
}

template <int TILE_M, int TILE_N>
QMOE_TILE_HD GroupedTile finish_tile(const LocatedTile& l) {
  const int token_tiles = (l.m + TILE_N - 1) / TILE_N;
  const int ntile = l.local / token_tiles, ttile = l.local - ntile * token_tiles;
  GroupedTile t;
  t.expert = l.expert;
  t.n0 = ntile * TILE_M;
  t.row0 = l.offset + ttile * TILE_N;
  t.rows = l.m - ttile * TILE_N < TILE_N ? l.m - ttile * TILE_N : TILE_N;
  return t;
}

// A position in a CTA's walk over its tiles, K step by K step: counted, so that no step pays an integer
// division by the (runtime) number of steps per tile.
struct TileStep {
  int tile = 0;  // this CTA's tile index (0 .. count - 1)
  int k = 0;     // K step inside it
  QMOE_TILE_HD void advance(int steps_per_tile) {
    if (++k == steps_per_tile) {
      k = 0;
      ++tile;
    }
  }
};

#if defined(__CUDACC__)

// Every thread of the block calls this (THREADS = blockDim.x). tile_start: shared [E + 1], gets the
// exclusive prefix of tile counts (tile_start[E] = total); warp_total: shared scratch of THREADS / 32 ints.
// Returns the total number of tiles.
template <int THREADS, int TILE_N>
__device__ __forceinline__ int build_tile_list(const int32_t* problem_sizes, int num_experts, int n_tiles,
                                               int32_t* tile_start, int32_t* warp_total) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps");
  constexpr int kPer = (kTileListMaxExperts + THREADS - 1) / THREADS;  // THREADS * kPer >= 1024 experts
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int count[kPer];
  int local = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = tid * kPer + i;
    const int m = e < num_experts ? max(problem_sizes[3 * e + 1], 0) : 0;
    count[i] = (m + TILE_N - 1) / TILE_N * n_tiles;
    local += count[i];
  }
  // Block exclusive scan of `local`: warp shuffles, then the warp totals.
  int incl = local;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  int run = incl - local;
  for (int w = 0; w < warp; ++w) run += warp_total[w];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = tid * kPer + i;
    if (e < num_experts) tile_start[e] = run;
    run += count[i];
  }
  if (tid == THREADS - 1) tile_start[num_experts] = run;  // the last thread's running sum is the total
  __syncthreads();
  return tile_start[num_experts];
}

// This CTA's share of a persistent grid's work list: tile numbers blockIdx.x, blockIdx.x + gridDim.x,
// ... below total. count is meaningful only when the CTA has a tile (blockIdx.x < total): the kernels
// return before anything else otherwise.
template <int TILE_M, int TILE_N>
struct CtaTiles {
  const int32_t* tile_start;
  const int32_t* problem_sizes;
  const int32_t* expert_offsets;
  int num_experts;
  int total;
  int count;
  __device__ __forceinline__ bool empty() const { return static_cast<int>(blockIdx.x) >= total; }
  // The i-th tile of this CTA (0 <= i < count).
  __device__ __forceinline__ GroupedTile operator[](int i) const { return finish_tile<TILE_M, TILE_N>(locate(i)); }
  __device__ __forceinline__ LocatedTile locate(int i) const {
    return locate_tile(blockIdx.x + i * gridDim.x, tile_start, num_experts, problem_sizes, expert_offsets);
  }
  // Tile i, located earlier into `ahead`; locates tile i + 1 there for the next call (a loader keeps one
  // tile ahead this way).
  __device__ __forceinline__ GroupedTile take(LocatedTile& ahead, int i) const {
    const GroupedTile t = finish_tile<TILE_M, TILE_N>(ahead);
    if (i + 1 < count) ahead = locate(i + 1);
    return t;
  }
};

// Every thread of the block calls this: builds the work list (build_tile_list) and returns this CTA's share.
template <int THREADS, int TILE_M, int TILE_N>
__device__ __forceinline__ CtaTiles<TILE_M, TILE_N> cta_tiles(const int32_t* problem_sizes,
                                                              const int32_t* expert_offsets, int num_experts,
                                                              int n_tiles, int32_t* tile_start, int32_t* warp_total) {
  const int total = build_tile_list<THREADS, TILE_N>(problem_sizes, num_experts, n_tiles, tile_start, warp_total);
  const int count = (total - 1 - static_cast<int>(blockIdx.x)) / static_cast<int>(gridDim.x) + 1;
  return {tile_start, problem_sizes, expert_offsets, num_experts, total, count};
}

#endif  // __CUDACC__

}  // namespace qmoe::cuda
