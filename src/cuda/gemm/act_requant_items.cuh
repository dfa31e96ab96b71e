// The second half of GEMM1's fused activation epilogue (w4a8_act_requant.h) in the mma.sync decode kernel
// (the WGMMA kernels keep h in registers: wgmma_building_blocks.cuh act_store_tile): one tile's h, parked in shared memory as
// park[token * TILE_M + tile row] (h = a_scale(row) * acc, the fp32 value the plain epilogue stores),
// (or park[token * kStride + tile row]) becomes A2 codes and s2:
//
//   gated:  A2[row, f0 + 2q + i] = e4m3(act(h[gate rows 2q + i], h[up rows F + 2q + i]) / a2)
//   ReLU^2: A2[row, n0 + 2q + i] = e4m3(relu2(h[tile row 2q + i]) / a2)          (i = 0, 1)
//   s2[row] = a2 * w2_alpha[e]   (written by the tile with n0 == 0)
//
// A gated tile of TILE_M weight rows covers F = TILE_M / 2 features from f0 = (n0 / TILE_M) * F:
// tile rows [0, F) are their gate rows, [F, 2F) their up rows (act_tile_rows gives the weight rows).
// The loop runs over (token, feature pair) items spread over the calling threads, not unrolled over
// accumulator slots: one copy of the activation code (an unrolled copy per slot made the mma.sync
// epilogue ~50 KB of code, fetched cold for every tile: +30% GEMM time on the H200).
#pragma once

#include <cstdint>

#include "cuda/fused/activation_math.cuh"
#include "cuda/gemm/grouped_tile_list.cuh"
#include "cuda/gemm/w4a8_act_requant.h"

namespace qmoe::cuda {

// Weight rows of a fused-epilogue tile: tile row r -> lo + r, plus jump when r >= TILE_M / 2 (gated:
// gate rows of F features, then their up rows; [gate; up]: gate f0 + r, up I + f0 + r - F;
// up_gate_interleaved64: up 128 (f0 / 64) + f0 % 64 + r - F, gate = up + 64). ReLU^2: n0 + r.
struct ActTileRows {
  int lo;
  int jump;
};
template <int kTileM>
__device__ __forceinline__ ActTileRows act_tile_rows(const ActRequantEpilogue& ep, int n0) {
  if (ep.act.activation == Activation::kRelu2) return {n0, 0};
  const int f0 = (n0 / kTileM) * (kTileM / 2);
  int64_t gate_row;
  const int64_t up_row = fused::up_column(ep.act, ep.inter, f0, &gate_row);
  return {static_cast<int>(gate_row), static_cast<int>(up_row - gate_row) - kTileM / 2};
}

// Threads tid = 0 .. kThreads - 1 of the caller (all of them call this, after park is complete).
// kStride: floats from one token's h to the next in park (kTileM, or more where padding spreads the
// park writes over the shared-memory banks; a multiple of 2 for the float2 reads).
template <int kTileM, int kThreads, int kStride = kTileM>
__device__ __forceinline__ void act_requant_items(const ActRequantEpilogue& ep, const GroupedTile& t,
                                                  const float* park, int tid) {
  static_assert(kTileM % 4 == 0, "feature pairs of both halves");
  static_assert(kStride >= kTileM && kStride % 2 == 0, "park rows hold a tile column, float2-aligned");
  constexpr int kHalf = kTileM / 2;  // F: features of a gated tile
  const float a2 = ep.a2_scale[0];
  if (ep.act.activation != Activation::kRelu2) {
    // Item = (token, feature pair q): gate values at tile rows 2q, 2q + 1, up values at F + 2q, F + 2q + 1.
    constexpr int kPairs = kHalf / 2;
    const int f0 = (t.n0 / kTileM) * kHalf;
#pragma unroll 1
    for (int i = tid; i < t.rows * kPairs; i += kThreads) {
      const int token = i / kPairs, q = i % kPairs;
      const float2 g = *reinterpret_cast<const float2*>(park + token * kStride + 2 * q);
      const float2 u = *reinterpret_cast<const float2*>(park + token * kStride + kHalf + 2 * q);
      const float v0 = fused::requant_value(fused::gated_value(ep.act, g.x, u.x), a2);
      const float v1 = fused::requant_value(fused::gated_value(ep.act, g.y, u.y), a2);
      const int feature = f0 + 2 * q;
      if (feature < ep.inter)
        *reinterpret_cast<uint16_t*>(ep.a2 + static_cast<int64_t>(t.row0 + token) * ep.inter + feature) =
            static_cast<uint16_t>(fused::e4m3x2(v0, v1));
    }
  } else {
    // ReLU^2: item = (token, pair of tile rows = features n0 + 2q, n0 + 2q + 1).
    constexpr int kPairs = kTileM / 2;
#pragma unroll 1
    for (int i = tid; i < t.rows * kPairs; i += kThreads) {
      const int token = i / kPairs, q = i % kPairs;
      const float2 h = *reinterpret_cast<const float2*>(park + token * kStride + 2 * q);
      const float v0 = fused::requant_value(activation::relu2<float>(h.x), a2);
      const float v1 = fused::requant_value(activation::relu2<float>(h.y), a2);
      const int feature = t.n0 + 2 * q;
      if (feature < ep.inter)
        *reinterpret_cast<uint16_t*>(ep.a2 + static_cast<int64_t>(t.row0 + token) * ep.inter + feature) =
            static_cast<uint16_t>(fused::e4m3x2(v0, v1));
    }
  }
  if (t.n0 == 0 && tid < t.rows) ep.s2[t.row0 + tid] = fused::s2_value(a2, ep.w2_alpha, t.expert);
}

}  // namespace qmoe::cuda
