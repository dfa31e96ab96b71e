// Activation + FP8 requantization of the GPU fused MoE (w4a8_int4), between GEMM1 and GEMM2
// (fused_moe_kernels.h; DESIGN.md 3b and 4):
//
//   v[r, i]  = act(h[r, gate(i)], h[r, up(i)])  for i in [0, I)   (ReLU^2: act(h[r, i]), no up)
//   amax     = max |v| over all valid rows (dynamic a2 only; NaN propagates)
//   A2[r, i] = e4m3(v[r, i] / a2),  a2 = fc2_input_scale[0] or amax / 448 (1 when amax == 0)
//   s2[r]    = a2 * w2_alpha[e]     (w2_alpha optional, 1 if absent): GEMM2's per-row scale
//
// h is GEMM1's fp32 output [S, R1] (already scaled by s1; never rounded to bf16, DESIGN 3b).
// gate/up rows of W1 (= columns of h): kGateUp gate = i, up = I + i; kUpGateInterleaved64
// up = 128*(i/64) + i%64, gate = up + 64. act is src/reference/activations.h evaluated in fp32
// (the reference evaluates in fp64 and rounds once: a last-bit difference can flip an e4m3 code
// now and then, far inside the 1e-2 tolerance).
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

}  // namespace qmoe::cuda::fused
