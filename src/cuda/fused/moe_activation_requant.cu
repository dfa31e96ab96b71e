// Activation + requantization of the GPU fused MoE, between GEMM1 and GEMM2 (fused_moe_kernels.h;
// DESIGN.md 3b and 4). Both pipelines evaluate the activation with the device functions of
// activation_math.cuh, which GEMM1's fused epilogue (w4a8_int4 with a static a2 and an mma.sync decode
// tactic: gemm/w4a8_act_requant.h) calls too, so all agree on the layouts and the arithmetic bit for bit.
//
//   v[r, i]  = act(h[r, gate(i)], h[r, up(i)])  for i in [0, I)   (ReLU^2: act(h[r, i]), no up)
//
// w4a8_int4 (activation_amax, activation_requant): FP8 per tensor
//   amax     = max |v| over all valid rows (dynamic a2 only; NaN propagates)
//   A2[r, i] = e4m3(v[r, i] / a2),  a2 = fc2_input_scale[0] or amax / 448 (1 when amax == 0)
//   s2[r]    = a2 * w2_alpha[e]     (w2_alpha optional, 1 if absent): GEMM2's per-row scale
// w4a16, w4a16_int4, w4a4, w4a8 (activation_requant_bf16): a bf16 GEMM2 operand A2 = bf16(md),
//   md as the reference's requantize() (src/reference/fused_moe.cpp, "Intermediate"), from fp32 v:
//   bf16(v); NVFP4 per 16 along I (gs = fc2_input_scale[0], md = e2m1(v*gs/sf)*sf); per-token NVFP4
//   of bf16(v) with gs = 1 / (amax|bf16(v)| * fc2_input_scale[0]); MXFP8 per 32 (md = e4m3(v/s)*s).
//   Every quantized md is exact in bf16 (e2m1 x e4m3, or e4m3 x a power of two), so A2 carries
//   exactly the reference's md; the same codecs (qmoe/formats.h) and operation order give the
//   same codes. s2[r] = w2_alpha[e] (times row_scale per token; 0 for a zero row, whose md is 0).
//
// h is GEMM1's fp32 output [S, R1] (already scaled by s1; never rounded to bf16, DESIGN 3b).
// gate/up rows of W1 (= columns of h): kGateUp gate = i, up = I + i; kUpGateInterleaved64
// up = 128*(i/64) + i%64, gate = up + 64. act is src/reference/activations.h evaluated in fp32
// (the reference evaluates in fp64 and rounds once: a last-bit difference can flip a bf16 / e4m3 /
// e2m1 code now and then, far inside the tolerances).
// Rows r >= expert_offsets[E_l] (read on the device) are neither read nor written.
//
// Mapping (decode has T*k = 8 rows): rows x column-chunks (fused_moe_common.cuh); at prefill (rows_batched)
// the grid is capped at ~16 CTAs per SM and a CTA loops over the rows (one row per CTA without the loop ran at
// ~1 TB/s there, H200 s17c), 1 row per pass, 2 for the plain bf16 copy (their h loads issued first; the fp8 requant
// loads the next pass's row before this row's arithmetic, s29a; a CTA's threads write the s2 of all its rows before
// the loop, s29c: one thread per row inside it made that warp the slowest; where I / 8 is not a multiple of the
// CTA's 128 threads the requants (not the per-token one) run over a flat (row, chunk) list instead, s30b); each
// thread 8 consecutive features i0..i0+7 (i0 % 8 == 0): their gate and up columns are contiguous in both
// layouts (an interleaved 64-group holds whole chunks), so h is read with 16-byte loads and A2
// written with one 8-byte (e4m3) or 16-byte (bf16) store. An NVFP4 block (16) is 2 adjacent
// lanes, an MX block (32) 4, reduced with shuffles; max is order-free, so the codes are those of
// any other reduction order. The per-token NVFP4 mode needs the row amax first: one CTA per row.
// Limits: vector path when I % 8 == 0 (all GPU modes: I % 32 or % 128); activation_requant keeps a
// one-feature-at-a-time path otherwise, activation_requant_bf16 requires I % 32 == 0 (caller checks).
// Arithmetic per feature is unchanged (same activation function, IEEE divisions, same codecs); the divisions by
// a scale shared by many features (a2, the NVFP4 block scale, the MX power of two) are done with one reciprocal
// and FMA corrections or an exact multiply, bit-identical (cuda/common/exact_rounding.cuh).
#include <cuda_runtime.h>

#include <string>

#include "cuda/common/exact_rounding.cuh"  // UniformDivisor, e2m1_round
#include "cuda/fused/activation_math.cuh"  // gated_value, up_column, requant_value, s2_value
#include "cuda/fused/fused_moe_common.cuh"
#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/launch.h"
#include "qmoe/error.h"
#include "qmoe/formats.h"
#include "cuda/common/pdl.cuh"
#include "cuda/gemm/resident_ctas.h"

namespace qmoe::cuda::fused {

namespace {

constexpr int kThreads = 128;  // 128 threads x 8 features = 1024 features of a row per CTA
constexpr int kVec = 8;
// activation_amax: rows per grid pass, bounding the same-address atomics (one per warp and CTA).
constexpr int64_t kAmaxMaxGridRows = 1024;

// act(h_row)[i], one feature.
__device__ __forceinline__ float activation_of(const ActivationArgs& a, const float* h_row, int64_t inter, int64_t i) {
  if (a.activation == Activation::kRelu2) return activation::relu2<float>(h_row[i]);
  int64_t gate;
  const int64_t up = up_column(a, inter, i, &gate);
  return gated_value(a, h_row[gate], h_row[up]);
}

__device__ __forceinline__ void load8(const float* p, float (&v)[kVec]) {
  const float4 lo = reinterpret_cast<const float4*>(p)[0], hi = reinterpret_cast<const float4*>(p)[1];
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

// v[j] = act(h_row)[i0 + j], j < 8: i0 % 8 == 0, I % 8 == 0, h_row 16-byte aligned. Its loads
// (load_gate_up; g unused for ReLU^2) and its arithmetic (activate8) apart: the batched kernels issue the
// loads of several rows before the arithmetic of any.
__device__ __forceinline__ void load_gate_up(const ActivationArgs& a, const float* h_row, int64_t inter, int64_t i0,
                                             float (&g)[kVec], float (&u)[kVec]) {
  if (a.activation == Activation::kRelu2) {
    load8(h_row + i0, u);
    return;
  }
  int64_t gate;
  const int64_t up = up_column(a, inter, i0, &gate);
  load8(h_row + gate, g);
  load8(h_row + up, u);
}
__device__ __forceinline__ void activate8(const ActivationArgs& a, const float (&g)[kVec], const float (&u)[kVec],
                                          float (&v)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    v[j] = a.activation == Activation::kRelu2 ? activation::relu2<float>(u[j]) : gated_value(a, g[j], u[j]);
}
__device__ __forceinline__ void activation8(const ActivationArgs& a, const float* h_row, int64_t inter, int64_t i0,
                                            float (&v)[kVec]) {
  if (a.activation == Activation::kRelu2) {
    load8(h_row + i0, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = activation::relu2<float>(v[j]);
    return;
  }
  float g[kVec], u[kVec];
  load_gate_up(a, h_row, inter, i0, g, u);
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = gated_value(a, g[j], u[j]);
}

// Calls f(r) for every row r < rows that CTA row blockIdx.y visits in the kernels' loops (r0 = (blockIdx.y + k *
// gridDim.y) * ROWS, + j < ROWS), spread over the CTA's threads, so that the per-row s2 chain (input_permutation ->
// local_ids -> w2_alpha: three dependent loads) runs once for all of them instead of in one thread per row (which
// made that warp the CTA's slowest).
template <int ROWS, class F>
__device__ __forceinline__ void for_rows_of_cta(int64_t rows, F&& f) {
  for (int64_t i = threadIdx.x;; i += blockDim.x) {
    const int64_t r = (static_cast<int64_t>(blockIdx.y) + (i / ROWS) * gridDim.y) * ROWS + i % ROWS;
    if (r >= rows) break;  // (r grows with i)
    f(r);
  }
}

struct RequantArgs {
  RowRouting routing;
  const float* h;
  int64_t rows1;
  int64_t inter;
  ActivationArgs act;
  const float* a2_static;  // nullptr: dynamic
  const uint32_t* amax_in;
  uint32_t* amax_out;      // kAmaxOnly
  const float* w2_alpha;   // nullptr: 1
  uint8_t* a_out;
  float* s2;
};

// kAmaxOnly: reduce max |v| into amax_out, write nothing else. kVectorized: I % 8 == 0, h 16-byte
// and a_out 8-byte aligned; else the thread's 8 features one at a time (those < I).
// kRowsFp8 rows per CTA pass, the vectorized path's h loads of all of them issued before the arithmetic
// of any (grid: rows_by_chunks_looped, CTAs loop over rows).
// 1 since s18g: with the looping grid one row per pass beat two (Mixtral T = 4096 381 -> 345 us, Qwen3-30B 99.5 -> 95).
constexpr int kRowsFp8 = 1;  // at prefill (rows_batched; decode and the amax pass: 1)

template <bool kAmaxOnly, bool kVectorized, int ROWS>
__global__ void __launch_bounds__(kThreads) activation_requant_kernel(const RequantArgs p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  const RowRouting& rt = p.routing;
  const int64_t valid_rows = rt.expert_offsets[rt.num_local];
  const int64_t rows = valid_rows < rt.max_rows ? valid_rows : rt.max_rows;
  const int64_t I = p.inter;
  const int64_t i0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kVec;
  uint32_t m = 0;
  float a2 = 1.0f;
  if (!kAmaxOnly) a2 = p.a2_static != nullptr ? p.a2_static[0] : dynamic_fp8_scale(*p.amax_in);
  const UniformDivisor by_a2(a2);  // v / a2 without a division per feature (exact_rounding.cuh)
  if (!kAmaxOnly && blockIdx.x == 0) {
    for_rows_of_cta<ROWS>(rows, [&](int64_t r) {
      const int32_t slot = rt.input_permutation[r];
      p.s2[r] = s2_value(a2, p.w2_alpha, slot >= 0 ? rt.local_ids[slot] : 0);
    });
  }
  [[maybe_unused]] float pg[kVec] = {}, pu[kVec] = {};  // the next row's h (software pipeline below)
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * ROWS; r0 < rows;
       r0 += static_cast<int64_t>(gridDim.y) * ROWS) {
    if (i0 >= I) continue;  // no barrier below: the commit after the loop is reached by all
    float g[ROWS][kVec] = {}, u[ROWS][kVec] = {};
    if constexpr (kVectorized && !kAmaxOnly && ROWS == 1) {
      // Software pipeline: this row's h came with the previous pass (or is loaded now, at the first), and the
      // next pass's row is loaded before this row's arithmetic, so a thread keeps loads in flight while it computes.
      const int64_t next = r0 + static_cast<int64_t>(gridDim.y);
      if (r0 == static_cast<int64_t>(blockIdx.y)) load_gate_up(p.act, p.h + r0 * p.rows1, I, i0, pg, pu);
#pragma unroll
      for (int k = 0; k < kVec; ++k) g[0][k] = pg[k], u[0][k] = pu[k];
      if (next < rows) load_gate_up(p.act, p.h + next * p.rows1, I, i0, pg, pu);
    } else if constexpr (kVectorized) {
#pragma unroll
      for (int j = 0; j < ROWS; ++j)
        if (r0 + j < rows) load_gate_up(p.act, p.h + (r0 + j) * p.rows1, I, i0, g[j], u[j]);
    }
#pragma unroll
    for (int jr = 0; jr < ROWS; ++jr) {
      const int64_t r = r0 + jr;
      if (r >= rows) break;
      const float* h_row = p.h + r * p.rows1;
      float v[kVec];
      if constexpr (kVectorized) {
        activate8(p.act, g[jr], u[jr], v);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j] = i0 + j < I ? activation_of(p.act, h_row, I, i0 + j) : 0.0f;
      }
      if constexpr (kAmaxOnly) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) m = abs_bits(v[j]) > m ? abs_bits(v[j]) : m;
      } else {
        uint8_t* dst = p.a_out + r * I + i0;
        if constexpr (kVectorized) {
          float q[kVec];
#pragma unroll
          for (int j = 0; j < kVec; ++j) q[j] = by_a2.divide(v[j]);  // = requant_value(v[j], a2), bit for bit
          *reinterpret_cast<uint2*>(dst) = make_uint2(e4m3x4(q[0], q[1], q[2], q[3]), e4m3x4(q[4], q[5], q[6], q[7]));
        } else {
          for (int j = 0; j < kVec && i0 + j < I; ++j) dst[j] = e4m3_of(requant_value(v[j], a2));
        }
      }
    }
  }
  if (kAmaxOnly) block_amax_commit(m, p.amax_out);  // every thread reaches this
}

// The flat kernels' position: (row, chunk) of item row * chunks + chunk, stepped by the grid's G threads without a
// division per step.
struct FlatCursor {
  int64_t row, chunk;
  int64_t step_rows, step_chunks, chunks;
  __device__ __forceinline__ FlatCursor(int64_t item, int64_t G, int64_t n)
      : row(item / n), chunk(item % n), step_rows(G / n), step_chunks(G % n), chunks(n) {}
  __device__ __forceinline__ FlatCursor next() const {
    FlatCursor c = *this;
    c.row += step_rows, c.chunk += step_chunks;
    if (c.chunk >= chunks) c.chunk -= chunks, ++c.row;
    return c;
  }
};

// The prefill path of activation_requant (rows_batched, vectorized): the (row, 8-feature chunk) items of all rows
// as one list over a persistent grid (thread g takes items g, g + G, ...), so that no lane idles where I / 8 is not
// a multiple of the CTA's 128 threads (activation_requant_kernel at I = 768 keeps 96 of 128 lanes busy, at I = 1536
// 192 of 256); the next item's h is loaded before this item's arithmetic (as there). Same arithmetic, same bits.
__global__ void __launch_bounds__(kThreads) activation_requant_flat_kernel(const RequantArgs p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  const RowRouting& rt = p.routing;
  const int64_t valid_rows = rt.expert_offsets[rt.num_local];
  const int64_t rows = valid_rows < rt.max_rows ? valid_rows : rt.max_rows;
  const int64_t I = p.inter, chunks = I / kVec;
  const float a2 = p.a2_static != nullptr ? p.a2_static[0] : dynamic_fp8_scale(*p.amax_in);
  const UniformDivisor by_a2(a2);  // v / a2 without a division per feature (exact_rounding.cuh)
  const int64_t G = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t r = g; r < rows; r += G) {  // s2: independent loads per thread, no chain per row in one thread
    const int32_t slot = rt.input_permutation[r];
    p.s2[r] = s2_value(a2, p.w2_alpha, slot >= 0 ? rt.local_ids[slot] : 0);
  }
  if (g >= rows * chunks) return;
  FlatCursor at(g, G, chunks);
  float pg[kVec] = {}, pu[kVec] = {};
  load_gate_up(p.act, p.h + at.row * p.rows1, I, at.chunk * kVec, pg, pu);
  for (;;) {
    float gv[kVec], uv[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) gv[j] = pg[j], uv[j] = pu[j];
    const FlatCursor next = at.next();
    const bool more = next.row < rows;
    if (more) load_gate_up(p.act, p.h + next.row * p.rows1, I, next.chunk * kVec, pg, pu);
    float v[kVec], q[kVec];
    activate8(p.act, gv, uv, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) q[j] = by_a2.divide(v[j]);  // = requant_value(v[j], a2), bit for bit
    *reinterpret_cast<uint2*>(p.a_out + at.row * I + at.chunk * kVec) =
        make_uint2(e4m3x4(q[0], q[1], q[2], q[3]), e4m3x4(q[4], q[5], q[6], q[7]));
    if (!more) break;
    at = next;
  }
}

// ---- bf16 intermediate (activation_requant_bf16) ------------------------------------------------
// Thread x of a row holds features [8x, 8x + 8): an NVFP4 block is lanes {2b, 2b+1}, an MX block
// lanes {4b, .., 4b+3} (CTAs hold 1024 features, a multiple of 32, so blocks never straddle CTAs;
// I % 32 == 0, so a block's lanes are all inside the row or all outside it). Lanes outside the row
// still take part in the shuffles (with zeros) and store nothing.

// max of the |v| bits over the thread's 8 values and its `lanes` - 1 neighbours (lanes = 2 or 4).
template <int kLanes>
__device__ __forceinline__ float group_amax(const float (&v)[kVec]) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < kVec; ++j) m = abs_bits(v[j]) > m ? abs_bits(v[j]) : m;
#pragma unroll
  for (int offset = 1; offset < kLanes; offset <<= 1) {
    const uint32_t o = __shfl_xor_sync(0xffffffffu, m, offset);
    m = o > m ? o : m;
  }
  return __uint_as_float(m);
}

// The reference's nvfp4_block over the 16-feature block of the thread (activation_math.cuh).
__device__ __forceinline__ void nvfp4_dequant(float (&v)[kVec], float gs) {
  const float sf = nvfp4_block_sf(gs, group_amax<2>(v));
  const UniformDivisor by_sf(sf);
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = nvfp4_md(v[j], gs, by_sf, sf);
}

// The reference's mxfp8_block over the 32-feature block of the thread (activation_math.cuh).
__device__ __forceinline__ void mxfp8_dequant(float (&v)[kVec]) {
  const float s = mxfp8_block_s(group_amax<4>(v));
  const float inv = __frcp_rn(s);
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = mxfp8_md(v[j], inv, s);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return static_cast<uint32_t>(float_to_bf16(lo)) | (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
}
__device__ __forceinline__ void store_bf16x8(uint16_t* dst, const float (&v)[kVec]) {
  *reinterpret_cast<uint4*>(dst) =
      make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
}
__device__ __forceinline__ void load_bf16x8(const uint16_t* src, float (&v)[kVec]) {
  const uint4 in = *reinterpret_cast<const uint4*>(src);
  const uint32_t w[4] = {in.x, in.y, in.z, in.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v[2 * j] = __uint_as_float(w[j] << 16);
    v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}

struct RequantBf16Args {
  RowRouting routing;
  const float* h;
  int64_t rows1;
  int64_t inter;
  ActivationArgs act;
  const float* fc2_input_scale;  // NVFP4 modes
  const float* w2_alpha;         // nullptr: 1
  uint16_t* a_out;
  float* s2;
};

__device__ __forceinline__ float w2_alpha_of(const RequantBf16Args& p, int64_t r) {
  const int32_t slot = p.routing.input_permutation[r];
  const int32_t e = slot >= 0 ? p.routing.local_ids[slot] : 0;
  return p.w2_alpha != nullptr ? p.w2_alpha[e] : 1.0f;
}

// kBf16, kNvfp4, kMxfp8: rows x column-chunks, rows_per_pass(kMode) rows per CTA pass (their h loads issued
// before the arithmetic of any; at prefill the grid is capped so that CTAs loop over rows: rows_by_chunks_looped;
// one row per CTA without the loop ran at ~1 TB/s, H200 s17c). With the loop (H200 s18g, bench/profile_layer.py):
// the plain bf16 copy is faster with 2 rows per pass (Qwen3-30B T = 4096 87 vs 93 us), the block-quantizing modes,
// ALU-bound, with 1 (NVFP4: Mixtral 601 -> 495 us, DeepSeek-V3 378 -> 304-314, Qwen3-30B 155 -> 120; MXFP8: s18h).
constexpr int kRowsBf16Plain = 2;
constexpr int kRowsMxfp8 = 1;
constexpr int rows_per_pass(Bf16Requant mode) {
  return mode == Bf16Requant::kBf16 ? kRowsBf16Plain : mode == Bf16Requant::kMxfp8 ? kRowsMxfp8 : 1;
}

template <Bf16Requant kMode, int ROWS>
__global__ void __launch_bounds__(kThreads) activation_requant_bf16_kernel(const RequantBf16Args p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  const RowRouting& rt = p.routing;
  const int64_t valid_rows = rt.expert_offsets[rt.num_local];
  const int64_t rows = valid_rows < rt.max_rows ? valid_rows : rt.max_rows;
  const int64_t I = p.inter;
  const int64_t i0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kVec;
  const bool active = i0 < I;
  const float fc2 = kMode == Bf16Requant::kNvfp4 ? p.fc2_input_scale[0] : 1.0f;
  if (blockIdx.x == 0) for_rows_of_cta<ROWS>(rows, [&](int64_t r) { p.s2[r] = w2_alpha_of(p, r); });
  // r0 is uniform over the CTA, and so is `r0 + j < rows`: the shuffles below are safe.
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * ROWS; r0 < rows;
       r0 += static_cast<int64_t>(gridDim.y) * ROWS) {
    float g[ROWS][kVec] = {}, u[ROWS][kVec] = {};
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
      if (active && r0 + j < rows) load_gate_up(p.act, p.h + (r0 + j) * p.rows1, I, i0, g[j], u[j]);
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      if (r0 + j >= rows) break;
      float v[kVec] = {};
      if (active) activate8(p.act, g[j], u[j], v);
      if constexpr (kMode == Bf16Requant::kNvfp4) nvfp4_dequant(v, fc2);
      if constexpr (kMode == Bf16Requant::kMxfp8) mxfp8_dequant(v);
      if (active) store_bf16x8(p.a_out + (r0 + j) * I + i0, v);
    }
  }
}

// The prefill path of kBf16 / kNvfp4 / kMxfp8 where a row's chunks leave lanes of a CTA idle (as
// activation_requant_flat_kernel): the (row, chunk) items of all rows as one list over a persistent grid, the next
// item's h loaded before this item's arithmetic. A warp's 32 items are consecutive and its trip count uniform (lanes
// past the end join the shuffles with zeros); I % 32 == 0 and G % 32 == 0 keep a block's 2 or 4 lanes in one row and
// lane % 4 == chunk % 4, so the block reductions see the same lanes as in the row kernel. Same bits.
template <Bf16Requant kMode>
__global__ void __launch_bounds__(kThreads) activation_requant_bf16_flat_kernel(const RequantBf16Args p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  const RowRouting& rt = p.routing;
  const int64_t valid_rows = rt.expert_offsets[rt.num_local];
  const int64_t rows = valid_rows < rt.max_rows ? valid_rows : rt.max_rows;
  const int64_t I = p.inter, chunks = I / kVec, items = rows * chunks;
  const float fc2 = kMode == Bf16Requant::kNvfp4 ? p.fc2_input_scale[0] : 1.0f;
  const int64_t G = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t r = g; r < rows; r += G) p.s2[r] = w2_alpha_of(p, r);
  const int64_t lane = threadIdx.x & 31;
  FlatCursor at(g, G, chunks);
  float pg[kVec] = {}, pu[kVec] = {};
  if (g < items) load_gate_up(p.act, p.h + at.row * p.rows1, I, at.chunk * kVec, pg, pu);
  for (int64_t item = g; item - lane < items; item += G) {  // uniform over the warp
    const bool active = item < items;
    float gv[kVec], uv[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) gv[j] = pg[j], uv[j] = pu[j];
    const FlatCursor next = at.next();
    if (item + G < items) load_gate_up(p.act, p.h + next.row * p.rows1, I, next.chunk * kVec, pg, pu);
    float v[kVec] = {};
    if (active) activate8(p.act, gv, uv, v);
    if constexpr (kMode == Bf16Requant::kNvfp4) nvfp4_dequant(v, fc2);
    if constexpr (kMode == Bf16Requant::kMxfp8) mxfp8_dequant(v);
    if (active) store_bf16x8(p.a_out + at.row * I + at.chunk * kVec, v);
    at = next;
  }
}

// kNvfp4PerToken: one CTA per row (blockIdx.y), the CTA walks the row 1024 features per pass.
// Pass 1: b = bf16(v) into A2 and the row amax of |b|. Pass 2 re-reads each thread's own chunks
// (same thread, same addresses: program order makes them visible) and writes md over them.
__global__ void __launch_bounds__(kThreads) activation_requant_per_token_kernel(const RequantBf16Args p) {
  pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  const RowRouting& rt = p.routing;
  const int64_t valid_rows = rt.expert_offsets[rt.num_local];
  const int64_t rows = valid_rows < rt.max_rows ? valid_rows : rt.max_rows;
  const int64_t I = p.inter;
  const float fc2 = p.fc2_input_scale[0];
  __shared__ uint32_t warp_amax[kThreads / 32];
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float* h_row = p.h + r * p.rows1;
    uint16_t* dst = p.a_out + r * I;
    uint32_t m = 0;
    for (int64_t i0 = threadIdx.x * kVec; i0 < I; i0 += kThreads * kVec) {
      float v[kVec];
      activation8(p.act, h_row, I, i0, v);
      store_bf16x8(dst + i0, v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const uint32_t bits = abs_bits(round_bf16(v[j]));
        m = bits > m ? bits : m;
      }
    }
    m = __reduce_max_sync(0xffffffffu, m);
    if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x / 32] = m;
    __syncthreads();
    uint32_t row_bits = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) row_bits = warp_amax[w] > row_bits ? warp_amax[w] : row_bits;
    __syncthreads();  // NOTE: warp_amax is rewritten for the block's next row
    const float row_scale = __uint_as_float(row_bits) * fc2;
    if (threadIdx.x == 0) p.s2[r] = row_scale == 0.0f ? 0.0f : w2_alpha_of(p, r) * row_scale;
    if (row_scale == 0.0f) {  // block-uniform: the reference's zero row (md = 0, y = 0)
      for (int64_t i0 = threadIdx.x * kVec; i0 < I; i0 += kThreads * kVec)
        *reinterpret_cast<uint4*>(dst + i0) = make_uint4(0, 0, 0, 0);
      continue;
    }
    const float gs = 1.0f / row_scale;
    // Uniform trip count (lanes past the row join the shuffles with zeros).
    for (int64_t base = 0; base < I; base += kThreads * kVec) {
      const int64_t i0 = base + threadIdx.x * kVec;
      float v[kVec] = {};
      if (i0 < I) load_bf16x8(dst + i0, v);
      nvfp4_dequant(v, gs);
      if (i0 < I) store_bf16x8(dst + i0, v);
    }
  }
}

// A flat kernel's grid: one item (row, 8-feature chunk) per thread, at most the CTAs that fit at once.
template <auto kKernel, class Args>
void launch_flat(const Args& p, cudaStream_t stream) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const int64_t fit = resident_ctas<kKernel>(kThreads, 0, device, "fused_moe activation_requant");
  const int64_t need = (p.routing.max_rows * (p.inter / kVec) + kThreads - 1) / kThreads;
  launch_kernel(kKernel, dim3(static_cast<unsigned>(need < fit ? need : fit)), kThreads, 0, stream, p);
}

}  // namespace

void activation_amax(const RowRouting& routing, const float* h, int64_t rows1, int64_t inter,
                     const ActivationArgs& act, uint32_t* amax_bits, cudaStream_t stream) {
  if (routing.max_rows <= 0 || inter <= 0) return;
  RequantArgs p{routing, h, rows1, inter, act, nullptr, nullptr, amax_bits, nullptr, nullptr, nullptr};
  const int64_t grid_rows = routing.max_rows < kAmaxMaxGridRows ? routing.max_rows : kAmaxMaxGridRows;
  const dim3 grid = rows_by_chunks(grid_rows, inter, int64_t{kThreads} * kVec);
  if (inter % kVec == 0 && aligned_to(h, 16) && rows1 % 4 == 0) {
    launch_kernel(activation_requant_kernel<true, true, 1>, grid, kThreads, 0, stream, p);
  } else {
    launch_kernel(activation_requant_kernel<true, false, 1>, grid, kThreads, 0, stream, p);
  }
  check_cuda(cudaGetLastError(), "launch of fused_moe activation_amax");
}

void activation_requant(const RowRouting& routing, const float* h, int64_t rows1, int64_t inter,
                        const ActivationArgs& act, const float* a2_static, const uint32_t* amax_bits,
                        const float* w2_alpha, uint8_t* a_out, float* s2, cudaStream_t stream) {
  if (routing.max_rows <= 0 || inter <= 0) return;
  RequantArgs p{routing, h, rows1, inter, act, a2_static, amax_bits, nullptr, w2_alpha, a_out, s2};
  const bool batched = rows_batched(routing.max_rows, inter, int64_t{kThreads} * kVec);
  const dim3 grid = rows_by_chunks_looped(routing.max_rows, inter, int64_t{kThreads} * kVec, batched ? kRowsFp8 : 1);
  if (inter % kVec == 0 && aligned_to(h, 16) && rows1 % 4 == 0 && aligned_to(a_out, 8)) {
    // The flat kernel where a row's chunks leave lanes of a CTA idle (I / 8 not a multiple of 128: Qwen3's
    // I = 768 / 1536, 7-13% faster, H200 s30b); elsewhere the row kernel (DeepSeek-V3 I = 2048: flat 2% slower).
    if (batched && (inter / kVec) % kThreads != 0) {
      launch_flat<activation_requant_flat_kernel>(p, stream);
    } else {
      launch_kernel(batched ? activation_requant_kernel<false, true, kRowsFp8> : activation_requant_kernel<false, true, 1>,
                    grid, kThreads, 0, stream, p);
    }
  } else {
    launch_kernel(batched ? activation_requant_kernel<false, false, kRowsFp8> : activation_requant_kernel<false, false, 1>,
                  grid, kThreads, 0, stream, p);
  }
  check_cuda(cudaGetLastError(), "launch of fused_moe activation_requant");
}

void activation_requant_bf16(const RowRouting& routing, const float* h, int64_t rows1, int64_t inter,
                             const ActivationArgs& act, Bf16Requant requant, const float* fc2_input_scale,
                             const float* w2_alpha, uint16_t* a_out, float* s2, cudaStream_t stream) {
  if (routing.max_rows <= 0 || inter <= 0) return;
  // A caller bug, not a user error: fused_moe checks I % 32 == 0 for the GPU before anything runs.
  if (inter % 32 != 0 || !aligned_to(h, 16) || rows1 % 4 != 0 || !aligned_to(a_out, 16))
    throw Error("inter", "I % 32 == 0 and 16-byte aligned h / a_out (activation_requant_bf16)",
                "I = " + std::to_string(inter), ErrorKind::kRuntime);
  const RequantBf16Args p{routing, h, rows1, inter, act, fc2_input_scale, w2_alpha, a_out, s2};
  const bool batched = rows_batched(routing.max_rows, inter, int64_t{kThreads} * kVec);
  auto grid = [&](Bf16Requant mode) {
    return rows_by_chunks_looped(routing.max_rows, inter, int64_t{kThreads} * kVec, batched ? rows_per_pass(mode) : 1);
  };
  constexpr int kRowsPlain = rows_per_pass(Bf16Requant::kBf16), kRowsNvfp4 = rows_per_pass(Bf16Requant::kNvfp4),
                kRowsMx = rows_per_pass(Bf16Requant::kMxfp8);
  const dim3 grid_per_token = rows_by_chunks(routing.max_rows, inter, int64_t{kThreads} * kVec);
  if (batched && (inter / kVec) % kThreads != 0 && requant != Bf16Requant::kNvfp4PerToken) {
    // As activation_requant: the flat kernel where the row kernel leaves lanes idle (Qwen3's I = 768 / 1536).
    if (requant == Bf16Requant::kBf16) launch_flat<activation_requant_bf16_flat_kernel<Bf16Requant::kBf16>>(p, stream);
    if (requant == Bf16Requant::kNvfp4) launch_flat<activation_requant_bf16_flat_kernel<Bf16Requant::kNvfp4>>(p, stream);
    if (requant == Bf16Requant::kMxfp8) launch_flat<activation_requant_bf16_flat_kernel<Bf16Requant::kMxfp8>>(p, stream);
    check_cuda(cudaGetLastError(), "launch of fused_moe activation_requant_bf16");
    return;
  }
  switch (requant) {
    case Bf16Requant::kBf16:
      launch_kernel(batched ? activation_requant_bf16_kernel<Bf16Requant::kBf16, kRowsPlain>
                            : activation_requant_bf16_kernel<Bf16Requant::kBf16, 1>,
                    grid(requant), kThreads, 0, stream, p);
      break;
    case Bf16Requant::kNvfp4:
      launch_kernel(batched ? activation_requant_bf16_kernel<Bf16Requant::kNvfp4, kRowsNvfp4>
                            : activation_requant_bf16_kernel<Bf16Requant::kNvfp4, 1>,
                    grid(requant), kThreads, 0, stream, p);
      break;
    case Bf16Requant::kNvfp4PerToken:
      launch_kernel(activation_requant_per_token_kernel, dim3(1, grid_per_token.y), kThreads, 0, stream, p);
      break;
    case Bf16Requant::kMxfp8:
      launch_kernel(batched ? activation_requant_bf16_kernel<Bf16Requant::kMxfp8, kRowsMx>
                            : activation_requant_bf16_kernel<Bf16Requant::kMxfp8, 1>,
                    grid(requant), kThreads, 0, stream, p);
      break;
  }
  check_cuda(cudaGetLastError(), "launch of fused_moe activation_requant_bf16");
}

}  // namespace qmoe::cuda::fused
