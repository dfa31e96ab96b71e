// The fused activation epilogue of the bf16 x 4-bit mma.sync decode tiles (bf16_act_requant.h): one tile's
// accumulators become A2 (bf16) and s2 in registers.
//
// Fragment map of the fused tiles (MF = 2, TILE_M = 32 WARPS_M): warp w's fragment mf holds tile rows
// mf * TILE_M / 2 + 16 w + [0, 16); a thread holds rows gid (c = 0, 1) and gid + 8 (c = 2, 3) for tokens
// 2 tig + (c & 1) of each 8-token fragment nf. Gated (up_gate_interleaved64: tile rows [0, TILE_M / 2) are
// the up rows of features f0 + [0, TILE_M / 2), the rest their gate rows): mf 0 = up, mf 1 = gate of the
// features f0 + 16 w + gid (+ 8), one 16-feature block per warp and token. ReLU^2: fragment mf is the
// block of features n0 + mf * TILE_M / 2 + 16 w + [0, 16). An NVFP4 block's amax is a shuffle over the 8
// gid lanes; an MXFP8 block (32) joins warps w and w ^ 1 (same mf) through `xchg` and one barrier.
#pragma once

#include <cstdint>

#include "cuda/fused/activation_math.cuh"
#include "cuda/gemm/bf16_act_requant.h"
#include "cuda/gemm/grouped_tile_list.cuh"

namespace qmoe::cuda::bf16w4 {

// max of the abs bits over the 8 gid lanes that share this lane's tig (lanes tig + 4 j).
__device__ __forceinline__ uint32_t gid_lanes_max(uint32_t m) {
#pragma unroll
  for (int offset = 4; offset < 32; offset <<= 1) {
    const uint32_t o = __shfl_xor_sync(0xffffffffu, m, offset);
    m = o > m ? o : m;
  }
  return m;
}

__device__ __forceinline__ uint32_t max_abs_bits(float a, float b) {
  return fused::abs_bits(a) > fused::abs_bits(b) ? fused::abs_bits(a) : fused::abs_bits(b);
}

// The per-value arithmetic as out-of-line functions: one copy of the code however many accumulator slots
// call it. Inlined per slot, the activations' and the requantizations' code made the kernel ~60% larger,
// and the epilogue, run once per tile, was fetched cold from L2 every time (the layer measured slower).
// Same operations, so the same bits as the separate kernel's inlined copies (checked by the GPU tests).
static __device__ __noinline__ float act_value(const fused::ActivationArgs a, float g, float u) {
  return a.activation == Activation::kRelu2 ? activation::relu2<float>(u) : fused::gated_value(a, g, u);
}
// The two values of an NVFP4 block (16 features) held by this thread, amax_bits the block's.
static __device__ __noinline__ float2 nvfp4_pair(float x, float y, float gs, uint32_t amax_bits) {
  const float sf = fused::nvfp4_block_sf(gs, __uint_as_float(amax_bits));
  const UniformDivisor by_sf(sf);
  return make_float2(fused::nvfp4_md(x, gs, by_sf, sf), fused::nvfp4_md(y, gs, by_sf, sf));
}
// The same for an MXFP8 block (32 features).
static __device__ __noinline__ float2 mxfp8_pair(float x, float y, uint32_t amax_bits) {
  const float s = fused::mxfp8_block_s(__uint_as_float(amax_bits));
  const float inv = __frcp_rn(s);
  return make_float2(fused::mxfp8_md(x, inv, s), fused::mxfp8_md(y, inv, s));
}

// Every thread of the CTA calls this for its tile (it may hold a barrier). h = rs * (post * acc) is the
// value the plain epilogue stores (store_fragments: acc * post, then the row scale); acc is zeroed after.
// xchg: shared scratch of 2 * WARPS_M * TILE_N floats (MXFP8 only).
template <int WARPS_M, int MF, int NF, int kTileM, int kTileN, class Params>
__device__ __forceinline__ void act_bf16_epilogue(float (&acc)[MF][NF][4], const GroupedTile& t, const Params& p,
                                                  const Bf16ActEpilogue& ep, int warp_m, int gid, int tig,
                                                  float post, float* xchg) {
  static_assert(MF == 2 && kTileM == 32 * WARPS_M, "fused tiles: two 16-row fragments per warp, 128 rows");
  static_assert(kTileN == NF * 8, "one warp along the tokens");
  constexpr int kHalf = kTileM / 2;
  const bool gated = ep.act.activation != Activation::kRelu2;
  const int blocks = gated ? 1 : MF;  // 16-feature blocks per warp and token: v[mf] for mf < blocks
  const int inter = ep.inter;
  const fused::ActivationArgs act = ep.act;

  float v[MF][NF][4];
#pragma unroll
  for (int nf = 0; nf < NF; ++nf)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int token = nf * 8 + 2 * tig + (c & 1);
      const bool scaled = p.row_scales != nullptr;
      const float rs = scaled && token < t.rows ? p.row_scales[t.row0 + token] : 1.0f;
      float hv[MF];
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        const float x = __fmul_rn(acc[mf][nf][c], post);
        hv[mf] = scaled ? __fmul_rn(rs, x) : x;
        acc[mf][nf][c] = 0.f;
      }
      // gated: v = act(gate = mf 1, up = mf 0); ReLU^2: v[mf] = relu2(h[mf])
      v[0][nf][c] = act_value(act, hv[1], hv[0]);
      v[1][nf][c] = gated ? 0.f : act_value(act, 0.f, hv[1]);
    }

  if (ep.requant == fused::Bf16Requant::kNvfp4) {
    const float gs = ep.fc2_input_scale[0];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
      if (mf >= blocks) break;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 2; ++c) {  // token 2 tig + c: rows gid (c) and gid + 8 (c + 2)
          const uint32_t amax = gid_lanes_max(max_abs_bits(v[mf][nf][c], v[mf][nf][c + 2]));
          const float2 md = nvfp4_pair(v[mf][nf][c], v[mf][nf][c + 2], gs, amax);
          v[mf][nf][c] = md.x;
          v[mf][nf][c + 2] = md.y;
        }
    }
  } else if (ep.requant == fused::Bf16Requant::kMxfp8) {
    // Warp-local amax of each (block, token), parked by the gid == 0 lanes: xchg[(mf * WARPS_M + w) * TILE_N + token].
    uint32_t own[MF][NF][2];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          own[mf][nf][c] = gid_lanes_max(max_abs_bits(v[mf][nf][c], v[mf][nf][c + 2]));
          if (gid == 0 && mf < blocks)
            reinterpret_cast<uint32_t*>(xchg)[(mf * WARPS_M + warp_m) * kTileN + nf * 8 + 2 * tig + c] = own[mf][nf][c];
        }
    __syncthreads();
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
      if (mf >= blocks) break;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const uint32_t other =
              reinterpret_cast<const uint32_t*>(xchg)[(mf * WARPS_M + (warp_m ^ 1)) * kTileN + nf * 8 + 2 * tig + c];
          const float2 md = mxfp8_pair(v[mf][nf][c], v[mf][nf][c + 2], own[mf][nf][c] > other ? own[mf][nf][c] : other);
          v[mf][nf][c] = md.x;
          v[mf][nf][c + 2] = md.y;
        }
    }
  }

  // Stores: feature of (mf, row half) and the token's row.
  const int f0 = gated ? (t.n0 / kTileM) * kHalf : t.n0;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
    if (mf >= blocks) break;
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int token = nf * 8 + 2 * tig + (c & 1);
        const int feature = f0 + mf * kHalf + 16 * warp_m + gid + 8 * (c >> 1);
        if (token < t.rows && feature < inter)
          ep.a2[static_cast<int64_t>(t.row0 + token) * inter + feature] = float_to_bf16(v[mf][nf][c]);
      }
  }
  if (t.n0 == 0 && warp_m == 0 && gid == 0) {
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int token = nf * 8 + 2 * tig + c;
        if (token < t.rows) ep.s2[t.row0 + token] = ep.w2_alpha != nullptr ? ep.w2_alpha[t.expert] : 1.0f;
      }
  }
}

}  // namespace qmoe::cuda::bf16w4
