// FP8 e4m3 quantization on the GPU (include/qmoe/formats.h; CPU twin in src/reference/formats.cpp):
//   quantize_fp8      q[i] = e4m3(x[i] / s)              (x NaN -> 0x7F | sign of x)
//   fp8_dynamic_scale s = amax / 448 over the tensor or each row; all-zero -> 1; any NaN -> NaN
//   dequantize_fp8    out[i] = e4m3(q[i]) * s
// s is scale[0] (per tensor) or scale[i / K] (per row). x is float32 or bf16, contiguous [R, K].
//
// Mapping: the elementwise kernels are grid-stride loops, one element per thread-iteration.
// Dynamic scales, deterministic and without a host sync (CUDA-graph capturable):
//   per row    one CTA per row (grid-stride over rows), block max, thread 0 writes the scale.
//   per tensor the scale's 4 bytes are zeroed (cudaMemsetAsync), every CTA reduces a grid-stride
//              share and atomicMax-es its result into them as ordered bits, then one thread turns
//              the bits into the scale. max is order-independent, so the result does not depend on
//              scheduling (quant_common.cuh: abs_bits).
// Limits: none beyond memory; indices are int64.
#include <cuda_runtime.h>

#include "cuda/quant/quant_common.cuh"
#include "cuda/quant/quant_launch.h"

namespace qmoe::cuda {

namespace {

using quant::kThreads;

// The scale from block-max bits, as the CPU computes it: NaN stays NaN (0x7FC00000 = the CPU's
// NAN / 448), 0 -> 1, else amax / 448 rounded to nearest.
__device__ __forceinline__ float scale_from_amax_bits(uint32_t bits) {
  if (bits > 0x7f800000u) return bits_float(quant::kNanBits);
  if (bits == 0u) return 1.0f;
  return __fdiv_rn(bits_float(bits), 448.0f);
}

template <class In>
__global__ void quantize_fp8_kernel(const In* __restrict__ x, const float* __restrict__ scale, bool per_row,
                                    int64_t k, int64_t n, uint8_t* __restrict__ q) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = quant::load_real(x, i);
    const float s = scale[per_row ? i / k : 0];
    // A NaN keeps the sign of x (not of whatever x / s produces), as on the CPU.
    q[i] = isnan(v) ? static_cast<uint8_t>(0x7fu | (signbit(v) ? 0x80u : 0u)) : float_to_e4m3(quant::div_as_host(v, s));
  }
}

// One CTA per row: scale[row] = amax(x[row, :]) / 448.
template <class In>
__global__ void fp8_row_scale_kernel(const In* __restrict__ x, int64_t rows, int64_t k, float* __restrict__ scale) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    uint32_t m = 0;
    for (int64_t c = threadIdx.x; c < k; c += blockDim.x) m = max(m, quant::abs_bits(quant::load_real(x, row * k + c)));
    m = quant::block_max(m);  // all threads take part: the loop bound is uniform over the CTA
    if (threadIdx.x == 0) scale[row] = scale_from_amax_bits(m);
  }
}

// Per tensor, pass 1: atomicMax of each CTA's max bits into *amax_bits (zeroed before).
template <class In>
__global__ void fp8_tensor_amax_kernel(const In* __restrict__ x, int64_t n, uint32_t* __restrict__ amax_bits) {
  uint32_t m = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    m = max(m, quant::abs_bits(quant::load_real(x, i)));
  m = quant::block_max(m);
  if (threadIdx.x == 0) atomicMax(amax_bits, m);
}

// Per tensor, pass 2: the bits become the scale, in place.
__global__ void fp8_tensor_scale_finalize_kernel(float* scale) {
  if (blockIdx.x == 0 && threadIdx.x == 0) scale[0] = scale_from_amax_bits(float_bits(scale[0]));
}

__global__ void dequantize_fp8_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale, bool per_row,
                                      int64_t k, int64_t n, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = __fmul_rn(e4m3_to_float(q[i]), scale[per_row ? i / k : 0]);
}

int64_t rows_of(const TensorRef& t) {
  int64_t r = 1;
  for (int i = 0; i + 1 < t.ndim; ++i) r *= t.shape[i];
  return r;
}

}  // namespace

void quantize_fp8(const TensorRef& x, const TensorRef& scale, bool per_row, TensorRef q, cudaStream_t stream) {
  const int64_t n = x.numel(), k = x.size(-1);
  if (n == 0) return;
  DeviceGuard guard(x.device_index);
  const float* s = quant::data<const float>(scale);
  uint8_t* out = quant::data<uint8_t>(q);
  if (x.dtype == DType::kFloat32)
    quantize_fp8_kernel<<<quant::grid_for(n), kThreads, 0, stream>>>(quant::data<const float>(x), s, per_row, k, n, out);
  else
    quantize_fp8_kernel<<<quant::grid_for(n), kThreads, 0, stream>>>(quant::data<const uint16_t>(x), s, per_row, k, n,
                                                                      out);
  quant::check_launch("qmoe::quantize_fp8 (CUDA launch)");
}

void fp8_dynamic_scale(const TensorRef& x, bool per_row, TensorRef scale, cudaStream_t stream) {
  const int64_t n = x.numel(), k = x.size(-1), rows = rows_of(x);
  DeviceGuard guard(x.device_index);
  float* s = quant::data<float>(scale);
  const bool bf16 = x.dtype == DType::kBFloat16;
  if (per_row) {
    if (rows == 0) return;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, quant::kMaxBlocks));
    if (bf16) fp8_row_scale_kernel<<<grid, kThreads, 0, stream>>>(quant::data<const uint16_t>(x), rows, k, s);
    else fp8_row_scale_kernel<<<grid, kThreads, 0, stream>>>(quant::data<const float>(x), rows, k, s);
    quant::check_launch("qmoe::fp8_dynamic_scale (CUDA launch, per row)");
    return;
  }
  // An empty tensor still gets its scale (1), as on the CPU: the memset and the finalize run.
  check_cuda(cudaMemsetAsync(s, 0, sizeof(float), stream), "qmoe::fp8_dynamic_scale (cudaMemsetAsync)");
  if (n > 0) {
    // 16 elements per thread before the CTA reduction: fewer atomics, still enough CTAs to fill the GPU.
    const unsigned grid = quant::grid_for((n + 15) / 16);
    uint32_t* bits = reinterpret_cast<uint32_t*>(s);
    if (bf16) fp8_tensor_amax_kernel<<<grid, kThreads, 0, stream>>>(quant::data<const uint16_t>(x), n, bits);
    else fp8_tensor_amax_kernel<<<grid, kThreads, 0, stream>>>(quant::data<const float>(x), n, bits);
    quant::check_launch("qmoe::fp8_dynamic_scale (CUDA launch, amax)");
  }
  fp8_tensor_scale_finalize_kernel<<<1, 1, 0, stream>>>(s);
  quant::check_launch("qmoe::fp8_dynamic_scale (CUDA launch, finalize)");
}

void dequantize_fp8(const TensorRef& q, const TensorRef& scale, bool per_row, TensorRef out, cudaStream_t stream) {
  const int64_t n = q.numel(), k = q.size(-1);
  if (n == 0) return;
  DeviceGuard guard(q.device_index);
  dequantize_fp8_kernel<<<quant::grid_for(n), kThreads, 0, stream>>>(
      quant::data<const uint8_t>(q), quant::data<const float>(scale), per_row, k, n, quant::data<float>(out));
  quant::check_launch("qmoe::dequantize_fp8 (CUDA launch)");
}

}  // namespace qmoe::cuda
