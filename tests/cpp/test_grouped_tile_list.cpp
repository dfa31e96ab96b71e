// The work list of the persistent GEMM grids (src/cuda/gemm/grouped_tile_list.cuh), checked on the host:
// the exclusive tile prefix the kernels build (build_tile_list's formula), then locate_tile + finish_tile
// for every tile number. Every (expert, feature tile, row) of a non-empty expert must be covered by
// exactly one tile, rows inside the expert's range, and nothing for empty experts. The GPU checks run
// the kernels end to end; this pins the arithmetic every kernel's loader and epilogue share, including
// the located-one-tile-ahead split (locate, then finish) and the counted K-step walk (TileStep).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cuda/gemm/grouped_tile_list.cuh"

namespace {

using qmoe::cuda::finish_tile;
using qmoe::cuda::GroupedTile;
using qmoe::cuda::locate_tile;
using qmoe::cuda::TileStep;

struct Problem {
  std::vector<int32_t> problem_sizes;   // [E][3], rows in [e][1]
  std::vector<int32_t> expert_offsets;  // [E + 1]
};

Problem make_problem(const std::vector<int>& rows) {
  Problem p;
  p.expert_offsets.push_back(0);
  for (int m : rows) {
    p.problem_sizes.insert(p.problem_sizes.end(), {256, m, 512});
    p.expert_offsets.push_back(p.expert_offsets.back() + m);
  }
  return p;
}

// build_tile_list's prefix: ceil(m / TILE_N) token tiles x n_tiles feature tiles per expert.
template <int TILE_N>
std::vector<int32_t> tile_prefix(const Problem& p, int n_tiles) {
  const int experts = static_cast<int>(p.problem_sizes.size() / 3);
  std::vector<int32_t> start(experts + 1, 0);
  for (int e = 0; e < experts; ++e) {
    const int m = p.problem_sizes[3 * e + 1] > 0 ? p.problem_sizes[3 * e + 1] : 0;
    start[e + 1] = start[e] + (m + TILE_N - 1) / TILE_N * n_tiles;
  }
  return start;
}

template <int TILE_M, int TILE_N>
void check_cover(const std::vector<int>& rows, int n) {
  const Problem p = make_problem(rows);
  const int experts = static_cast<int>(rows.size());
  const int n_tiles = (n + TILE_M - 1) / TILE_M;
  const std::vector<int32_t> start = tile_prefix<TILE_N>(p, n_tiles);
  const int total_rows = p.expert_offsets.back();
  // hits[row][feature tile]: how many tiles cover it
  std::vector<int> hits(static_cast<size_t>(total_rows) * n_tiles, 0);
  for (int tile = 0; tile < start[experts]; ++tile) {
    const auto located = locate_tile(tile, start.data(), experts, p.problem_sizes.data(), p.expert_offsets.data());
    const GroupedTile t = finish_tile<TILE_M, TILE_N>(located);
    ASSERT_GE(t.expert, 0);
    ASSERT_LT(t.expert, experts);
    const int m = rows[t.expert];
    ASSERT_GT(m, 0) << "tile " << tile << " landed on empty expert " << t.expert;
    ASSERT_GE(t.rows, 1);
    ASSERT_LE(t.rows, TILE_N);
    ASSERT_EQ(t.n0 % TILE_M, 0);
    ASSERT_LT(t.n0, n_tiles * TILE_M);
    ASSERT_GE(t.row0, p.expert_offsets[t.expert]);
    ASSERT_LE(t.row0 + t.rows, p.expert_offsets[t.expert] + m);
    for (int r = t.row0; r < t.row0 + t.rows; ++r) ++hits[static_cast<size_t>(r) * n_tiles + t.n0 / TILE_M];
  }
  for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "row " << i / n_tiles << ", feature tile " << i % n_tiles;
}

TEST(GroupedTileList, EveryRowAndFeatureTileCoveredOnceRaggedExperts) {
  // empty experts first, between and last; one row; exactly one tile; one past a tile
  check_cover<128, 8>({0, 0, 1, 0, 8, 9, 0, 17, 0}, 512);
  check_cover<128, 24>({0, 25, 24, 23, 0, 48, 1}, 4096);
  check_cover<64, 8>({3, 0, 0, 64, 0}, 192);
  check_cover<128, 128>({129, 0, 128, 1, 0, 300}, 7168);
}

TEST(GroupedTileList, AllRowsOnOneExpert) {
  std::vector<int> rows(256, 0);
  rows[255] = 1000;
  check_cover<128, 16>(rows, 1024);
  rows[255] = 0;
  rows[0] = 33;
  check_cover<128, 32>(rows, 1024);
}

TEST(GroupedTileList, RandomRoutingManyExperts) {
  std::mt19937 rng(12);
  for (int round = 0; round < 20; ++round) {
    const int experts = 1 + static_cast<int>(rng() % 1024);
    std::vector<int> rows(experts);
    for (int& m : rows) m = rng() % 3 == 0 ? 0 : static_cast<int>(rng() % 70);
    check_cover<128, 8>(rows, 256 + 128 * static_cast<int>(rng() % 4));
    check_cover<128, 64>(rows, 384);
  }
}

TEST(GroupedTileList, TileStepCountsWhatTheDivisionGave) {
  for (int steps : {1, 2, 3, 7, 56}) {
    TileStep at;
    for (int it = 0; it < 5 * steps + 3; ++it) {
      ASSERT_EQ(at.tile, it / steps) << "steps " << steps << ", it " << it;
      ASSERT_EQ(at.k, it % steps) << "steps " << steps << ", it " << it;
      at.advance(steps);
    }
  }
}

}  // namespace
