// Activation + requantization of the GPU fused MoE, between GEMM1 and GEMM2 (fused_moe_kernels.h;
// DESIGN.md 3b and 4). Both pipelines evaluate the activation with the one device function
// activation_of below, so the two agree on the gate/up layouts and the arithmetic.
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
#include <cuda_runtime.h>

#include "cuda/fused/fused_moe_common.cuh"
#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/launch.h"
#include "qmoe/formats.h"
#include "reference/activations.h"

namespace qmoe::cuda::fused {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

__device__ __forceinline__ float activation_of(const ActivationArgs& a, const float* h_row, int64_t inter, int64_t i) {
  if (a.activation == Activation::kRelu2) return activation::relu2<float>(h_row[i]);
  int64_t gate, up;
  if (a.layout == GateUpLayout::kGateUp) {
    gate = i;
    up = inter + i;
  } else {
    up = 128 * (i / 64) + i % 64;
    gate = up + 64;
  }
  const float g = h_row[gate], u = h_row[up];
  switch (a.activation) {
    case Activation::kSwiglu: return activation::swiglu<float>(g, u, a.swiglu_alpha, a.swiglu_beta, a.swiglu_limit);
    case Activation::kGegluTanh: return activation::geglu_tanh<float>(g, u);
    default:
      return activation::situ<float>(g, u, a.situ_beta, a.has_situ_linear_beta, a.situ_linear_beta);
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

// One block per row (grid-stride over rows). kAmaxOnly: reduce max |v| into amax_out, write nothing else.
template <bool kAmaxOnly>
__global__ void __launch_bounds__(kThreads) activation_requant_kernel(const RequantArgs p) {
  const RowRouting& rt = p.routing;
  const int64_t valid_rows = rt.expert_offsets[rt.num_local];
  const int64_t rows = valid_rows < rt.max_rows ? valid_rows : rt.max_rows;
  const int64_t I = p.inter;
  uint32_t m = 0;
  float a2 = 1.0f;
  if (!kAmaxOnly) a2 = p.a2_static != nullptr ? p.a2_static[0] : dynamic_fp8_scale(*p.amax_in);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* h_row = p.h + r * p.rows1;
    if (kAmaxOnly) {
      for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
        const uint32_t b = abs_bits(activation_of(p.act, h_row, I, i));
        m = b > m ? b : m;
      }
    } else {
      if (threadIdx.x == 0) {
        const int32_t slot = rt.input_permutation[r];
        const int32_t e = slot >= 0 ? rt.local_ids[slot] : 0;
        p.s2[r] = a2 * (p.w2_alpha != nullptr ? p.w2_alpha[e] : 1.0f);
      }
      uint8_t* dst = p.a_out + r * I;
      for (int64_t i = threadIdx.x; i < I; i += blockDim.x)
        dst[i] = float_to_e4m3(activation_of(p.act, h_row, I, i) / a2);
    }
  }
  if (kAmaxOnly) block_amax_commit(m, p.amax_out);  // every thread reaches this
}

// ---- bf16 intermediate (activation_requant_bf16) ------------------------------------------------
// Threads walk i = tid, tid + 256, ...; with I % 32 == 0 the loop condition is the same for all 32
// lanes of a warp, so the lanes of a warp hold features [32w, 32w + 32) of one pass: an NVFP4 block
// is a half warp and an MX block a whole warp, reduced with full-warp shuffles.

// max |v| bits over the 16 lanes of this half warp (NaN propagates as in block_amax_commit).
__device__ __forceinline__ float half_warp_amax(float v) {
  uint32_t m = abs_bits(v);
#pragma unroll
  for (int offset = 8; offset > 0; offset >>= 1) {
    const uint32_t o = __shfl_xor_sync(0xffffffffu, m, offset);
    m = o > m ? o : m;
  }
  return __uint_as_float(m);
}

// The reference's nvfp4_block for one element of a 16-lane block: md = e2m1(v * gs / sf) * sf.
__device__ __forceinline__ float nvfp4_dequant(float v, float gs) {
  const float sf = e4m3_to_float(float_to_e4m3(gs * half_warp_amax(v) / 6.0f));
  const float q = sf == 0.0f ? 0.0f : e2m1_to_float(float_to_e2m1(v * gs / sf));
  return q * sf;
}

// The reference's mxfp8_block for one element of a 32-lane block: md = e4m3(v / s) * s.
__device__ __forceinline__ float mxfp8_dequant(float v) {
  const uint32_t amax = __reduce_max_sync(0xffffffffu, abs_bits(v));
  const float s = ue8m0_to_float(ue8m0_ceil(__uint_as_float(amax) / 448.0f));
  return e4m3_to_float(float_to_e4m3(v / s)) * s;
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

// One block per row (grid-stride over rows).
template <Bf16Requant kMode>
__global__ void __launch_bounds__(kThreads) activation_requant_bf16_kernel(const RequantBf16Args p) {
  const RowRouting& rt = p.routing;
  const int64_t valid_rows = rt.expert_offsets[rt.num_local];
  const int64_t rows = valid_rows < rt.max_rows ? valid_rows : rt.max_rows;
  const int64_t I = p.inter;
  constexpr bool kNvfp4 = kMode == Bf16Requant::kNvfp4 || kMode == Bf16Requant::kNvfp4PerToken;
  const float fc2 = kNvfp4 ? p.fc2_input_scale[0] : 1.0f;
  __shared__ uint32_t warp_amax[kThreads / 32];  // kNvfp4PerToken: the row amax
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* h_row = p.h + r * p.rows1;
    uint16_t* dst = p.a_out + r * I;
    const int32_t slot = rt.input_permutation[r];
    const int32_t e = slot >= 0 ? rt.local_ids[slot] : 0;
    const float w2a = p.w2_alpha != nullptr ? p.w2_alpha[e] : 1.0f;
    if constexpr (kMode == Bf16Requant::kNvfp4PerToken) {
      // Pass 1: b = bf16(v) into A2 and its row amax. Pass 2 re-reads each thread's own elements
      // (same thread, same addresses: program order makes them visible) and writes md over them.
      uint32_t m = 0;
      for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
        const uint16_t b = float_to_bf16(activation_of(p.act, h_row, I, i));
        dst[i] = b;
        const uint32_t bits = abs_bits(bf16_to_float(b));
        m = bits > m ? bits : m;
      }
      m = __reduce_max_sync(0xffffffffu, m);
      if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x / 32] = m;
      __syncthreads();
      uint32_t row_bits = 0;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) row_bits = warp_amax[w] > row_bits ? warp_amax[w] : row_bits;
      __syncthreads();  // NOTE: warp_amax is rewritten for the block's next row
      const float row_scale = __uint_as_float(row_bits) * fc2;
      if (threadIdx.x == 0) p.s2[r] = row_scale == 0.0f ? 0.0f : w2a * row_scale;
      if (row_scale == 0.0f) {  // block-uniform: the reference's zero row (md = 0, y = 0)
        for (int64_t i = threadIdx.x; i < I; i += blockDim.x) dst[i] = 0;
        continue;
      }
      const float gs = 1.0f / row_scale;
      for (int64_t i = threadIdx.x; i < I; i += blockDim.x)
        dst[i] = float_to_bf16(nvfp4_dequant(bf16_to_float(dst[i]), gs));
    } else {
      if (threadIdx.x == 0) p.s2[r] = w2a;
      for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
        const float v = activation_of(p.act, h_row, I, i);
        float md;
        if constexpr (kMode == Bf16Requant::kBf16) md = v;
        else if constexpr (kMode == Bf16Requant::kNvfp4) md = nvfp4_dequant(v, fc2);
        else md = mxfp8_dequant(v);
        dst[i] = float_to_bf16(md);
      }
    }
  }
}

}  // namespace

void activation_amax(const RowRouting& routing, const float* h, int64_t rows1, int64_t inter,
                     const ActivationArgs& act, uint32_t* amax_bits, cudaStream_t stream) {
  if (routing.max_rows <= 0) return;
  RequantArgs p{routing, h, rows1, inter, act, nullptr, nullptr, amax_bits, nullptr, nullptr, nullptr};
  activation_requant_kernel<true><<<grid_for(routing.max_rows, kMaxBlocks), kThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "launch of fused_moe activation_amax");
}

void activation_requant(const RowRouting& routing, const float* h, int64_t rows1, int64_t inter,
                        const ActivationArgs& act, const float* a2_static, const uint32_t* amax_bits,
                        const float* w2_alpha, uint8_t* a_out, float* s2, cudaStream_t stream) {
  if (routing.max_rows <= 0) return;
  RequantArgs p{routing, h, rows1, inter, act, a2_static, amax_bits, nullptr, w2_alpha, a_out, s2};
  activation_requant_kernel<false><<<grid_for(routing.max_rows, kMaxBlocks), kThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "launch of fused_moe activation_requant");
}

void activation_requant_bf16(const RowRouting& routing, const float* h, int64_t rows1, int64_t inter,
                             const ActivationArgs& act, Bf16Requant requant, const float* fc2_input_scale,
                             const float* w2_alpha, uint16_t* a_out, float* s2, cudaStream_t stream) {
  if (routing.max_rows <= 0) return;
  const RequantBf16Args p{routing, h, rows1, inter, act, fc2_input_scale, w2_alpha, a_out, s2};
  const unsigned grid = grid_for(routing.max_rows, kMaxBlocks);
  switch (requant) {
    case Bf16Requant::kBf16:
      activation_requant_bf16_kernel<Bf16Requant::kBf16><<<grid, kThreads, 0, stream>>>(p);
      break;
    case Bf16Requant::kNvfp4:
      activation_requant_bf16_kernel<Bf16Requant::kNvfp4><<<grid, kThreads, 0, stream>>>(p);
      break;
    case Bf16Requant::kNvfp4PerToken:
      activation_requant_bf16_kernel<Bf16Requant::kNvfp4PerToken><<<grid, kThreads, 0, stream>>>(p);
      break;
    case Bf16Requant::kMxfp8:
      activation_requant_bf16_kernel<Bf16Requant::kMxfp8><<<grid, kThreads, 0, stream>>>(p);
      break;
  }
  check_cuda(cudaGetLastError(), "launch of fused_moe activation_requant_bf16");
}

}  // namespace qmoe::cuda::fused
