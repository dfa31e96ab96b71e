// Block-scaled quantizers on the GPU (include/qmoe/formats.h; CPU twin in src/reference/formats.cpp,
// same operation order, so the codes are bit-identical):
//   NVFP4 (block 16): sf = e4m3((gs * amax) / 6), q = e2m1((x * gs) / e4m3(sf)), q = 0 when sf
//                     decodes to 0; a NaN block -> sf 0x7F, q 0x7. Dequant (e2m1 * e4m3(sf)) / gs.
//   MX    (block 32): sf = ue8m0_ceil(amax / max_code) (max_code 6 for MXFP4, 448 for MXFP8),
//                     q = code(x / 2^(sf-127)); a NaN block -> sf 0xFF, q 0x7 (e2m1) / 0x7F (e4m3).
//                     Dequant element * 2^(sf-127).
//   int4-g128       : s = amax / 7 (1 for an all-zero group), q = clamp(rne(w / s), -8, 7); a group
//                     with NaN or inf gets q = 0 and s = NaN / inf. Dequant q * s.
// x / w are float32 or bf16 [R, K]; 4-bit outputs hold two codes per byte, even K in the low nibble.
// Every product and quotient is __fmul_rn / __fdiv_rn so nvcc cannot contract it into an FMA.
//
// Mapping: quantizers run one thread per block (16 / 32 / 128 elements), grid-stride over blocks:
// the thread reads its block, reduces amax, and writes its scale and its bytes of q (NVFP4 / MX
// keep the block in registers; int4 reads its 128 values twice). Dequantizers run one thread per
// output element. Simple rather than fast: these prepare weights and test data.
// Limits: none beyond memory; indices are int64.
#include <cuda_runtime.h>

#include "cuda/quant/quant_common.cuh"
#include "cuda/quant/quant_launch.h"

namespace qmoe::cuda {

namespace {

using quant::kThreads;

constexpr int kNvfp4Block = 16;
constexpr int kMxBlock = 32;
constexpr int kInt4Group = 128;

#define QMOE_GRID_STRIDE(i, n)                                                                \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// Loads block b of `Block` elements; returns amax over non-NaN |v| and whether a NaN was seen
// (the CPU's block_amax; fmaxf ignores no operand here since NaNs are skipped).
template <int Block, class In>
__device__ __forceinline__ float load_block(const In* x, int64_t b, float (&v)[Block], bool* has_nan) {
  float amax = 0.0f;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < Block; ++i) {
    v[i] = quant::load_real(x, b * Block + i);
    if (isnan(v[i])) nan = true;
    else amax = fmaxf(amax, fabsf(v[i]));
  }
  *has_nan = nan;
  return amax;
}

template <class In>
__global__ void quantize_nvfp4_kernel(const In* __restrict__ x, float gs, int64_t blocks, uint8_t* __restrict__ q,
                                      uint8_t* __restrict__ sf) {
  QMOE_GRID_STRIDE(b, blocks) {
    float v[kNvfp4Block];
    bool has_nan;
    const float amax = load_block<kNvfp4Block>(x, b, v, &has_nan);
    const uint8_t code = has_nan ? 0x7f : float_to_e4m3(__fdiv_rn(__fmul_rn(gs, amax), 6.0f));
    sf[b] = code;
    const float sf_value = e4m3_to_float(code);
#pragma unroll
    for (int i = 0; i < kNvfp4Block; i += 2) {
      uint8_t c[2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
        c[j] = has_nan ? 0x7 : sf_value == 0.0f ? 0 : float_to_e2m1(__fdiv_rn(__fmul_rn(v[i + j], gs), sf_value));
      q[(b * kNvfp4Block + i) / 2] = static_cast<uint8_t>(c[0] | (c[1] << 4));
    }
  }
}

__global__ void dequantize_nvfp4_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ sf, float gs,
                                        int64_t n, float* __restrict__ out) {
  QMOE_GRID_STRIDE(i, n) {
    const uint8_t byte = q[i / 2];
    const float element = e2m1_to_float(i % 2 == 0 ? byte & 0xf : byte >> 4);
    out[i] = __fdiv_rn(__fmul_rn(element, e4m3_to_float(sf[i / kNvfp4Block])), gs);
  }
}

template <bool Fp4, class In>
__global__ void quantize_mx_kernel(const In* __restrict__ x, int64_t blocks, uint8_t* __restrict__ q,
                                   uint8_t* __restrict__ sf) {
  QMOE_GRID_STRIDE(b, blocks) {
    float v[kMxBlock];
    bool has_nan;
    const float amax = load_block<kMxBlock>(x, b, v, &has_nan);
    const uint8_t code = has_nan ? 0xff : ue8m0_ceil(__fdiv_rn(amax, Fp4 ? 6.0f : 448.0f));
    sf[b] = code;
    const float scale = ue8m0_to_float(code);
    if (Fp4) {
#pragma unroll
      for (int i = 0; i < kMxBlock; i += 2) {
        // A NaN block: float_to_e2m1(NaN) = 0x7 for every element, as on the CPU.
        const uint8_t lo = has_nan ? 0x7 : float_to_e2m1(__fdiv_rn(v[i], scale));
        const uint8_t hi = has_nan ? 0x7 : float_to_e2m1(__fdiv_rn(v[i + 1], scale));
        q[(b * kMxBlock + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
      }
    } else {
#pragma unroll
      for (int i = 0; i < kMxBlock; ++i) q[b * kMxBlock + i] = has_nan ? 0x7f : float_to_e4m3(__fdiv_rn(v[i], scale));
    }
  }
}

template <bool Fp4>
__global__ void dequantize_mx_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ sf, int64_t n,
                                     float* __restrict__ out) {
  QMOE_GRID_STRIDE(i, n) {
    const float scale = ue8m0_to_float(sf[i / kMxBlock]);
    float element;
    if (Fp4) {
      const uint8_t byte = q[i / 2];
      element = e2m1_to_float(i % 2 == 0 ? byte & 0xf : byte >> 4);
    } else {
      element = e4m3_to_float(q[i]);
    }
    out[i] = __fmul_rn(element, scale);
  }
}

template <class In>
__global__ void quantize_int4_g128_kernel(const In* __restrict__ w, int64_t groups, uint8_t* __restrict__ q,
                                          float* __restrict__ scales) {
  QMOE_GRID_STRIDE(g, groups) {
    const int64_t i0 = g * kInt4Group;
    float amax = 0.0f;
    bool has_nan = false;
    for (int i = 0; i < kInt4Group; ++i) {
      const float v = quant::load_real(w, i0 + i);
      if (isnan(v)) has_nan = true;
      else amax = fmaxf(amax, fabsf(v));
    }
    // CPU: amax = NAN (0x7FC00000) for a NaN group, then amax / 7 keeps those bits.
    const float s = has_nan ? bits_float(quant::kNanBits) : amax == 0.0f ? 1.0f : __fdiv_rn(amax, 7.0f);
    scales[g] = s;
    const bool finite = isfinite(s);
    for (int i = 0; i < kInt4Group; i += 2) {
      int v[2] = {0, 0};
      for (int j = 0; j < 2 && finite; ++j) {
        const float r = rintf(__fdiv_rn(quant::load_real(w, i0 + i + j), s));  // rint: ties to even
        v[j] = static_cast<int>(fminf(fmaxf(r, -8.0f), 7.0f));
      }
      q[(i0 + i) / 2] = pack_int4_pair(v[0], v[1]);
    }
  }
}

template <class Scale>
__global__ void dequantize_int4_g128_kernel(const uint8_t* __restrict__ q, const Scale* __restrict__ scales, int64_t n,
                                            float* __restrict__ out) {
  QMOE_GRID_STRIDE(i, n) {
    const uint8_t byte = q[i / 2];
    const int value = i % 2 == 0 ? int4_low(byte) : int4_high(byte);
    out[i] = __fmul_rn(static_cast<float>(value), quant::load_real(scales, i / kInt4Group));
  }
}

#undef QMOE_GRID_STRIDE

}  // namespace

void quantize_nvfp4(const TensorRef& x, float global_scale, TensorRef q, TensorRef sf, cudaStream_t stream) {
  const int64_t blocks = x.numel() / kNvfp4Block;
  if (blocks == 0) return;
  DeviceGuard guard(x.device_index);
  uint8_t* qp = quant::data<uint8_t>(q);
  uint8_t* sp = quant::data<uint8_t>(sf);
  const unsigned grid = quant::grid_for(blocks);
  if (x.dtype == DType::kBFloat16)
    quantize_nvfp4_kernel<<<grid, kThreads, 0, stream>>>(quant::data<const uint16_t>(x), global_scale, blocks, qp, sp);
  else
    quantize_nvfp4_kernel<<<grid, kThreads, 0, stream>>>(quant::data<const float>(x), global_scale, blocks, qp, sp);
  quant::check_launch("qmoe::quantize_nvfp4 (CUDA launch)");
}

void dequantize_nvfp4(const TensorRef& q, const TensorRef& sf, float global_scale, TensorRef out,
                      cudaStream_t stream) {
  const int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(q.device_index);
  dequantize_nvfp4_kernel<<<quant::grid_for(n), kThreads, 0, stream>>>(
      quant::data<const uint8_t>(q), quant::data<const uint8_t>(sf), global_scale, n, quant::data<float>(out));
  quant::check_launch("qmoe::dequantize_nvfp4 (CUDA launch)");
}

void quantize_mx(const TensorRef& x, TensorRef q, TensorRef sf, bool fp4, cudaStream_t stream) {
  const int64_t blocks = x.numel() / kMxBlock;
  if (blocks == 0) return;
  DeviceGuard guard(x.device_index);
  uint8_t* qp = quant::data<uint8_t>(q);
  uint8_t* sp = quant::data<uint8_t>(sf);
  const unsigned grid = quant::grid_for(blocks);
  const bool bf16 = x.dtype == DType::kBFloat16;
  const float* xf = quant::data<const float>(x);
  const uint16_t* xb = quant::data<const uint16_t>(x);
  if (fp4 && bf16) quantize_mx_kernel<true><<<grid, kThreads, 0, stream>>>(xb, blocks, qp, sp);
  else if (fp4) quantize_mx_kernel<true><<<grid, kThreads, 0, stream>>>(xf, blocks, qp, sp);
  else if (bf16) quantize_mx_kernel<false><<<grid, kThreads, 0, stream>>>(xb, blocks, qp, sp);
  else quantize_mx_kernel<false><<<grid, kThreads, 0, stream>>>(xf, blocks, qp, sp);
  quant::check_launch(fp4 ? "qmoe::quantize_mxfp4 (CUDA launch)" : "qmoe::quantize_mxfp8 (CUDA launch)");
}

void dequantize_mx(const TensorRef& q, const TensorRef& sf, TensorRef out, bool fp4, cudaStream_t stream) {
  const int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(q.device_index);
  const uint8_t* qp = quant::data<const uint8_t>(q);
  const uint8_t* sp = quant::data<const uint8_t>(sf);
  float* op = quant::data<float>(out);
  if (fp4) dequantize_mx_kernel<true><<<quant::grid_for(n), kThreads, 0, stream>>>(qp, sp, n, op);
  else dequantize_mx_kernel<false><<<quant::grid_for(n), kThreads, 0, stream>>>(qp, sp, n, op);
  quant::check_launch(fp4 ? "qmoe::dequantize_mxfp4 (CUDA launch)" : "qmoe::dequantize_mxfp8 (CUDA launch)");
}

void quantize_int4_g128(const TensorRef& w, TensorRef q, TensorRef scales, cudaStream_t stream) {
  const int64_t groups = w.numel() / kInt4Group;
  if (groups == 0) return;
  DeviceGuard guard(w.device_index);
  uint8_t* qp = quant::data<uint8_t>(q);
  float* sp = quant::data<float>(scales);
  const unsigned grid = quant::grid_for(groups);
  if (w.dtype == DType::kBFloat16)
    quantize_int4_g128_kernel<<<grid, kThreads, 0, stream>>>(quant::data<const uint16_t>(w), groups, qp, sp);
  else
    quantize_int4_g128_kernel<<<grid, kThreads, 0, stream>>>(quant::data<const float>(w), groups, qp, sp);
  quant::check_launch("qmoe::quantize_int4_g128 (CUDA launch)");
}

void dequantize_int4_g128(const TensorRef& q, const TensorRef& scales, TensorRef out, cudaStream_t stream) {
  const int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(q.device_index);
  const uint8_t* qp = quant::data<const uint8_t>(q);
  float* op = quant::data<float>(out);
  if (scales.dtype == DType::kBFloat16)
    dequantize_int4_g128_kernel<<<quant::grid_for(n), kThreads, 0, stream>>>(qp, quant::data<const uint16_t>(scales),
                                                                             n, op);
  else
    dequantize_int4_g128_kernel<<<quant::grid_for(n), kThreads, 0, stream>>>(qp, quant::data<const float>(scales), n,
                                                                             op);
  quant::check_launch("qmoe::dequantize_int4_g128 (CUDA launch)");
}

}  // namespace qmoe::cuda
