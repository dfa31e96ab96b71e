// First kernels of the GPU fused MoE (w4a8_int4): local expert ids, the dynamic activation amax,
// and the gather + FP8 quantization of GEMM1's operand in expert order (fused_moe_kernels.h):
//
//   local[s]   = id - local_expert_offset  if 0 <= id < num_experts and the result is in [0, E_l), else -1
//   amax       = max |x| over all T*H values (dynamic a1 only; NaN propagates)
//   A1[r, h]   = e4m3(x[t, h] / a1(t))  (bf16 x; e4m3 x is copied),  slot = input_permutation[r], t = slot / k
//   s1[r]      = a1(t) * w1_alpha[e]    (w1_alpha optional, 1 if absent; e = local[slot])
//
// a1(t) = x_scale[0], x_scale[t] or amax / 448 (1 when amax == 0), read on the device. The
// reference scales GEMM1 as (acc * a1) * w1_alpha; the GEMM's epilogue applies the folded s1 in
// one product, which differs by at most one fp32 rounding (identical when w1_alpha is absent).
// Division and conversion are the reference's (qmoe::float_to_e4m3, an IEEE fp32 division), so
// A1 is bit-identical to the CPU reference's operand.
// Rows r >= expert_offsets[E_l] (read on the device) are neither read nor written.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/fused/fused_moe_common.cuh"
#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/launch.h"
#include "qmoe/formats.h"

namespace qmoe::cuda::fused {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond: enough to fill 132 SMs many times over

__global__ void __launch_bounds__(kThreads) local_expert_ids_kernel(const int32_t* __restrict__ ids,
                                                                    int32_t* __restrict__ local, int64_t slots,
                                                                    int64_t num_experts, int64_t offset,
                                                                    int64_t num_local) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < slots;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[s];
    const int64_t l = id - offset;  // int64: no overflow for any int32 id
    local[s] = (id >= 0 && id < num_experts && l >= 0 && l < num_local) ? static_cast<int32_t>(l) : -1;
  }
}

__global__ void __launch_bounds__(kThreads) amax_bf16_kernel(const uint16_t* __restrict__ x, int64_t n,
                                                             uint32_t* amax_bits) {
  uint32_t m = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t b = (static_cast<uint32_t>(x[i]) << 16) & 0x7fffffffu;  // |bf16| as fp32 bits
    m = b > m ? b : m;
  }
  block_amax_commit(m, amax_bits);  // every thread reaches this: no early return above
}

struct GatherArgs {
  RowRouting routing;
  const void* x;
  bool x_is_e4m3;
  int64_t hidden;
  const float* x_scale;  // nullptr: dynamic
  bool x_scale_per_token;
  const uint32_t* amax_bits;
  const float* w1_alpha;  // nullptr: 1
  uint8_t* a_out;
  float* s1;
};

// One block per row (grid-stride over rows); threads walk the row's H features.
__global__ void __launch_bounds__(kThreads) gather_quantize_kernel(const GatherArgs p) {
  const RowRouting& rt = p.routing;
  const int64_t valid_rows = rt.expert_offsets[rt.num_local];
  const int64_t rows = valid_rows < rt.max_rows ? valid_rows : rt.max_rows;
  const int64_t H = p.hidden;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t slot = rt.input_permutation[r];
    if (slot < 0) continue;  // cannot happen for r < valid rows; guards a corrupted routing
    const int64_t t = slot / rt.topk;
    const float a1 = p.x_scale != nullptr ? p.x_scale[p.x_scale_per_token ? t : 0] : dynamic_fp8_scale(*p.amax_bits);
    if (threadIdx.x == 0) {
      const int32_t e = rt.local_ids[slot];
      p.s1[r] = a1 * (p.w1_alpha != nullptr ? p.w1_alpha[e] : 1.0f);
    }
    uint8_t* dst = p.a_out + r * H;
    if (p.x_is_e4m3) {
      const uint8_t* src = static_cast<const uint8_t*>(p.x) + t * H;
      for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dst[h] = src[h];
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(p.x) + t * H;
      for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dst[h] = float_to_e4m3(bf16_to_float(src[h]) / a1);
    }
  }
}

}  // namespace

void local_expert_ids(const int32_t* ids, int32_t* local, int64_t slots, int64_t num_experts, int64_t offset,
                      int64_t num_local, cudaStream_t stream) {
  if (slots <= 0) return;
  const unsigned grid = grid_for((slots + kThreads - 1) / kThreads, kMaxBlocks);
  local_expert_ids_kernel<<<grid, kThreads, 0, stream>>>(ids, local, slots, num_experts, offset, num_local);
  check_cuda(cudaGetLastError(), "launch of fused_moe local_expert_ids");
}

void amax_bf16(const uint16_t* x, int64_t n, uint32_t* amax_bits, cudaStream_t stream) {
  if (n <= 0) return;
  const unsigned grid = grid_for((n + kThreads - 1) / kThreads, kMaxBlocks);
  amax_bf16_kernel<<<grid, kThreads, 0, stream>>>(x, n, amax_bits);
  check_cuda(cudaGetLastError(), "launch of fused_moe amax_bf16");
}

void gather_quantize(const RowRouting& routing, const void* x, bool x_is_e4m3, int64_t hidden, const float* x_scale,
                     bool x_scale_per_token, const uint32_t* amax_bits, const float* w1_alpha, uint8_t* a_out,
                     float* s1, cudaStream_t stream) {
  if (routing.max_rows <= 0) return;
  GatherArgs p{routing, x, x_is_e4m3, hidden, x_scale, x_scale_per_token, amax_bits, w1_alpha, a_out, s1};
  gather_quantize_kernel<<<grid_for(routing.max_rows, kMaxBlocks), kThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "launch of fused_moe gather_quantize");
}

}  // namespace qmoe::cuda::fused
