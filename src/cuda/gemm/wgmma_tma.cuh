// TMA stages of the W4A8 WGMMA kernels (sm90_grouped_gemm_w4a8_int4_wgmma.cu): the kernels' parameter
// blocks with their tensor maps, where a tile's boxes start, and the one-thread stage load. The maps
// are encoded on the host (wgmma_tma_maps.cu).
#pragma once

#include <cuda.h>  // CUtensorMap (the driver function is looked up at run time: no libcuda link)

#include <cstdint>
#include <type_traits>

#include "cuda/gemm/act_requant_items.cuh"
#include "cuda/gemm/grouped_tile_list.cuh"
#include "cuda/gemm/sm90_grouped_gemm_w4a8_int4_wgmma.h"
#include "cuda/gemm/wgmma_building_blocks.cuh"

namespace qmoe::cuda {

// TMA stages (both kernels, every variant): one thread issues a stage's boxes (activations, the tile's
// weights, their scales) instead of every loading thread ~14 cp.async; one mbarrier transaction per stage
// tells the computing threads it landed. The tensor maps are encoded on the host per call (tma_params).
// The fused activation epilogue's tiles (kAct) take their gate rows and their up rows from two places
// (act_tile_rows), so their weights and scales come in two 64-row boxes each; the plain tiles' 128 rows are
// one box each (three boxes a stage, not five: the issuing thread's work is on the two-CTA kernel's critical
// path; 1.03-1.05x on the 32- and 64-token tiles, bench/results/2026-12-01_s19i_*). Rows past an expert's
// end come from the next rows of A (not zeros): their token columns are never stored; weight rows past N
// likewise (the epilogue checks the row); past the tensors' ends the boxes are zero-filled.
template <class Base>
struct WithTmaMaps : Base {
  CUtensorMap act_map;     // A as [R rows, K bytes]: boxes of TILE_N tokens x 128 bytes, 128-byte swizzle
  CUtensorMap weight_map;  // B as [E * N rows, K / 2 bytes]: boxes of kWeightBoxRows rows x 64 bytes, 64-byte swizzle
  CUtensorMap scale_map;   // scales [E * K/512 rows, N x int64 (4 bf16)] or [E * K/128, N x bf16]: kWeightBoxRows a box
};
using WgmmaTmaParams = WithTmaMaps<WgmmaGemmParams>;
using WgmmaActTmaParams = WithTmaMaps<WgmmaActGemmParams>;

namespace wgmma {

constexpr int kHalf = kTileM / 2;  // weight rows per box of the fused epilogue's tiles
// Weight rows per weight / scale box: 64 for the fused epilogue's tiles (two places), 128 for the plain ones.
// P: the parameters, with or without their tensor maps.
template <class P>
constexpr int kWeightBoxRows = std::is_base_of<WgmmaActGemmParams, P>::value ? kHalf : kTileM;

// The fused activation epilogue's arguments (ActE4m3 kernels; the plain kernels never reach the call).
__device__ __forceinline__ const ActRequantEpilogue& act_out_of(const WgmmaActGemmParams& p) { return p.act_out; }
__device__ __forceinline__ ActRequantEpilogue act_out_of(const WgmmaGemmParams&) { return {}; }

template <class OutT>
using ParamsOf = std::conditional_t<std::is_same<OutT, ActE4m3>::value, WgmmaActTmaParams, WgmmaTmaParams>;

// Where a tile's boxes start in the three maps; a stage adds its group.
struct TmaTile {
  int act_row;
  int weight_row[2];  // the two halves' first rows in B (as E * N rows)
  int scale_col[2];   // ... their first scale columns (weight rows of the expert)
  int scale_row;      // the expert's first scale row
};
template <class OutT>
__device__ __forceinline__ TmaTile tma_tile(const ParamsOf<OutT>& p, const GroupedTile& t) {
  int lo = t.n0, hi = t.n0 + kHalf;
  if constexpr (std::is_same<OutT, ActE4m3>::value) {
    const ActTileRows rows = act_tile_rows<kTileM>(p.act_out, t.n0);
    lo = rows.lo;
    hi = rows.lo + kHalf + rows.jump;
  }
  const int expert_row = t.expert * p.n;
  const int scale_rows_per_expert = p.scales_packed4 ? p.k / 512 : p.k / kGroup;
  return {t.row0, {expert_row + lo, expert_row + hi}, {lo, hi}, t.expert * scale_rows_per_expert};
}
// The bytes of one stage: the boxes are full even where they are zero-filled.
template <int TILE_N>
__device__ __forceinline__ uint32_t tma_stage_bytes(const WgmmaGemmParams& p) {
  return TILE_N * kGroup + kStageW + (p.scales_packed4 ? kTileM * 8 : kTileM * 2);
}
// Stage (tile t, group g) into shared memory at sa: TILE_N activation rows (128-byte swizzle), the
// tile's 128 weight rows (64 bytes each), their scales of group g (8 or 2 bytes a row). The bytes
// complete a transaction of bar, which the caller announced (mbar_arrive_expect_tx).
template <int TILE_N, class P>
__device__ __forceinline__ void tma_load_stage(const P& p, const TmaTile& t, int g, uint32_t sa, uint64_t* bar) {
  constexpr int kRows = kWeightBoxRows<P>;
  const uint32_t sw = sa + TILE_N * kGroup, ss = sw + kStageW;
  const int scale_bytes = p.scales_packed4 ? 8 : 2;
  const int scale_row = t.scale_row + (p.scales_packed4 ? g / 4 : g);
  tma_load_2d(sa, &p.act_map, g * kGroup, t.act_row, bar);
#pragma unroll
  for (int h = 0; h < kTileM / kRows; ++h) {
    tma_load_2d(sw + h * kRows * (kGroup / 2), &p.weight_map, g * (kGroup / 2), t.weight_row[h], bar);
    tma_load_2d(ss + h * kRows * scale_bytes, &p.scale_map, t.scale_col[h], scale_row, bar);
  }
}

}  // namespace wgmma

// A row-major matrix [rows, cols] of elem_bytes-wide elements as a 2-D tensor map with boxes of
// box_rows x box_cols elements; past the matrix's ends the boxes are zero-filled (wgmma_tma_maps.cu).
CUtensorMap tma_matrix_map(const void* base, CUtensorMapDataType type, int elem_bytes, int64_t rows, int64_t cols,
                           int box_rows, int box_cols, CUtensorMapSwizzle swizzle);

// The parameters with the three tensor maps of their TMA stages: tile_n-token boxes of A (128-byte
// swizzle), 64-row halves of B and of the scales (wgmma_tma_maps.cu; Base: WgmmaGemmParams or
// WgmmaActGemmParams). rows: the rows of A.
template <class Base>
WithTmaMaps<Base> tma_params(const Base& params, int64_t rows, int tile_n);

}  // namespace qmoe::cuda
