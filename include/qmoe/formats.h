// Quantization formats of qmoe (DESIGN.md section 3): scalar codecs usable on host and device,
// and array-level quantize / dequantize / pack / layout helpers. CPU tensors run the reference
// (src/reference/formats.cpp); CUDA tensors run the GPU kernels of src/cuda/quant/ on `stream`, with
// bit-identical codes (same scalar codecs, same operation order).
//
// Rounding rules (tested bit for bit against numpy + ml_dtypes):
//   bf16   : round-to-nearest-even from fp32; NaN -> 0x7FC0 | sign (canonical quiet NaN), inf stays inf.
//   e4m3fn : RNE (fp32 denormals included); |x| >= 448 and +-inf saturate to +-448 (no inf in the
//            format); NaN -> 0x7F | sign.
//   e2m1   : RNE on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}; |x| > 6 saturates to +-6; NaN -> 0x7
//            (documented at float_to_e2m1: the block scale carries NaN, see below).
//   ue8m0  : value 2^(code-127); code 0xFF is NaN. MX scales from qmoe's quantizers are the smallest
//            power of two >= amax / max_code (448 for e4m3, 6 for e2m1), computed by ue8m0_ceil
//            (never rounded to nearest); an all-zero block gets code 0.
//   int4   : signed [-8, 7], two per byte, even K index in the low nibble.
// A NaN anywhere in a block gives that block the NaN scale code (e4m3 0x7F, ue8m0 0xFF).
//
// Hardware agreement (checked on an H200 over all 2^32 fp32 bit patterns): float_to_e4m3 equals
// cvt.rn.satfinite.e4m3x2.f32 (__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)) and
// float_to_bf16 equals __float2bfloat16_rn for every non-NaN input. NaNs differ only in bits: the
// hardware gives e4m3 0x7F for every NaN (sign dropped) and bf16 0x7FFF; these codecs keep the sign
// (0x7F|sign, 0x7FC0|sign, as ml_dtypes). Compare GPU and reference NaNs by isnan, not by bits.
// These functions are QMOE_HD inline so device code can use the exact same rounding.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>

#include "qmoe/tensor.h"

#if defined(__CUDACC__)
#define QMOE_HD __host__ __device__ __forceinline__
#else
#define QMOE_HD inline
#endif

namespace qmoe {

// ---------------------------------------------------------------------------------------------
// Scalar codecs
// ---------------------------------------------------------------------------------------------
QMOE_HD uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
QMOE_HD float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

QMOE_HD uint16_t float_to_bf16(float x) {
  uint32_t u = float_bits(x);
  // NaN -> the canonical quiet NaN with the sign kept (0x7FC0 / 0xFFC0), as ml_dtypes does.
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
QMOE_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
QMOE_HD float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

QMOE_HD float e4m3_to_float(uint8_t code) {
  const uint32_t sign = (code & 0x80u) << 24;
  const uint32_t exp = (code >> 3) & 0xfu;
  const uint32_t man = code & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_float(sign | 0x7fc00000u);  // NaN
  float mag;
  if (exp == 0) {
    mag = static_cast<float>(man) * (1.0f / 512.0f);  // subnormal: man * 2^-9
  } else {
    mag = bits_float(((exp + 120u) << 23) | (man << 20));  // bias 7 -> 127
  }
  return sign ? -mag : mag;
}

// RNE, saturating to +-448 (inf included), NaN -> 0x7F | sign. Exact for fp32 subnormals too.
QMOE_HD uint8_t float_to_e4m3(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;   // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;  // |x| >= 448: saturate to the largest finite code
  if (a >= 0x3c800000u) {
    // Normal range [2^-6, 448): keep 3 of the 23 mantissa bits, RNE on the 20 dropped bits.
    // A carry out of the mantissa rolls into the exponent, which is the right result.
    const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    const uint32_t code = (r >> 20) - (120u << 3);  // rebias exponent 127 -> 7
    return sign | static_cast<uint8_t>(code > 0x7eu ? 0x7eu : code);
  }
  // Subnormal range: code = rne(|x| * 2^9) in [0, 8] (8 is the smallest normal, code 0x08).
  // |x| <= 2^-10 (half the smallest subnormal; the tie goes to the even code 0) gives 0.
  if (a <= 0x3a800000u) return sign;
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;  // |x| = mant * 2^(exp - 150)
  const uint32_t shift = 141u - (a >> 23);           // |x| * 2^9 = mant >> shift, shift in [21, 24]
  const uint32_t q = (mant + (1u << (shift - 1)) - 1u + ((mant >> shift) & 1u)) >> shift;
  return sign | static_cast<uint8_t>(q);
}

QMOE_HD float e2m1_to_float(uint8_t nibble) {
  constexpr float kGrid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float mag = kGrid[nibble & 7];
  return (nibble & 8) ? -mag : mag;
}
// RNE on the e2m1 grid, saturating to +-6; the sign is kept on zero (-0.1 -> 0x8).
// NaN -> 0x7 (+6, the largest finite code, as saturating conversions to NaN-less formats do).
// The element code of a NaN does not matter to qmoe's quantizers: the block scale carries the NaN.
// Ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
QMOE_HD uint8_t float_to_e2m1(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7;
  const uint8_t sign = static_cast<uint8_t>((u >> 28) & 0x8u);
  const float a = bits_float(u & 0x7fffffffu);
  uint8_t code;
  if (a <= 0.25f) code = 0;
  else if (a < 0.75f) code = 1;
  else if (a <= 1.25f) code = 2;
  else if (a < 1.75f) code = 3;
  else if (a <= 2.5f) code = 4;
  else if (a < 3.5f) code = 5;
  else if (a <= 5.0f) code = 6;
  else code = 7;
  return sign | code;
}

QMOE_HD float ue8m0_to_float(uint8_t code) {
  if (code == 0xff) return bits_float(0x7fc00000u);
  if (code == 0) return bits_float(0x00400000u);  // 2^-127 (subnormal fp32)
  return bits_float(static_cast<uint32_t>(code) << 23);
}
// Smallest power of two >= |v|, as a ue8m0 code, clamped to [0, 254] (inf -> 254, |v| <= 2^-127 -> 0);
// NaN -> 0xFF. ue8m0 and fp32 share the exponent bias 127, so the code is the fp32 exponent field
// (+1 when any mantissa bit is set).
QMOE_HD uint8_t ue8m0_ceil(float v) {
  const uint32_t a = float_bits(v) & 0x7fffffffu;
  if (a > 0x7f800000u) return 0xff;
  const uint32_t exp = a >> 23;
  if (exp == 0) return a > 0x00400000u ? 1 : 0;  // fp32 subnormal: 2^-127 is 0x00400000
  const uint32_t code = exp + ((a & 0x7fffffu) != 0u ? 1u : 0u);
  return static_cast<uint8_t>(code > 254u ? 254u : code);
}

QMOE_HD int int4_low(uint8_t byte) { return static_cast<int>(static_cast<int8_t>(byte << 4) >> 4); }
QMOE_HD int int4_high(uint8_t byte) { return static_cast<int>(static_cast<int8_t>(byte) >> 4); }
QMOE_HD uint8_t pack_int4_pair(int even, int odd) {
  return static_cast<uint8_t>((even & 0xf) | ((odd & 0xf) << 4));
}

// ---------------------------------------------------------------------------------------------
// Array-level formats (contiguous row-major tensors; K = last axis). A tensor written [..., K]
// may have any number of leading axes (R = their product); outputs keep the same leading axes.
// Inputs marked "real" accept float32 or bfloat16; math is fp32 in the order written below.
// Storage dtypes accepted: int4 -> int4x2, int8 or uint8; fp4 -> float4_e2m1fn_x2 or uint8;
// e4m3 -> float8_e4m3fn or uint8; ue8m0 -> float8_e8m0fnu or uint8.
// Every function validates all arguments (dtype, shape, device, contiguity, no aliasing, divisibility)
// before it writes anything, and throws qmoe::Error naming the argument.
// Devices: a function taking `stream` runs on the CPU when its tensors are CPU tensors and on the GPU
// (asynchronously on `stream`, no host sync, CUDA-graph capturable, deterministic) when they are
// CUDA tensors; every input must be on the device of the outputs (a mismatch names the input).
// The GPU gives the same codes and scales bit for bit (NaN codes included; float outputs equal, NaN
// where NaN). Functions without `stream` (pack/unpack, elementwise codecs) accept CPU tensors only.
// ---------------------------------------------------------------------------------------------

// int4-g128 weights. w real [..., K] (K % 128 == 0) -> q int4 [..., K/2], scales float32 [..., K/128].
// Symmetric: s = amax(group) / 7 (s = 1 for an all-zero group), q = clamp(rne(w / s), -8, 7).
// A group holding NaN or inf gets s = amax / 7 (NaN or inf) and q = 0, so dequantization gives NaN.
void quantize_int4_g128(const TensorRef& w, TensorRef q, TensorRef scales, cudaStream_t stream = nullptr);
// q int4 [..., K/2], scales float32/bfloat16 [..., K/128] -> out float32 [..., K] = q * s.
void dequantize_int4_g128(const TensorRef& q, const TensorRef& scales, TensorRef out, cudaStream_t stream = nullptr);
// values int8 [..., K] in [-8, 7] (checked) <-> int4 [..., K/2] (K even).
void pack_int4(const TensorRef& values, TensorRef packed);
void unpack_int4(const TensorRef& packed, TensorRef values);

// SGLang's stored scale layout (DESIGN.md 3.1). scales [E, N, G] (bf16 or f32, same dtype out):
//   G % 4 == 0: out [E, G/4, 4N], out[e, kb, 4n + j] = S[e, n, 4kb + j]
//   else      : out [E, G, N],    out[e, g, n] = S[e, n, g]
void interleave_int4_scales(const TensorRef& scales, TensorRef out, cudaStream_t stream = nullptr);
void deinterleave_int4_scales(const TensorRef& stored, TensorRef scales, cudaStream_t stream = nullptr);
// Shape of the stored layout for (E, N, K); K % 128 == 0.
void int4_scale_layout_shape(int64_t experts, int64_t n, int64_t k, int64_t out_shape[3]);

// FP8 e4m3: q = e4m3(x / scale). x real [..., K]; scale float32 with one element (per tensor) or R
// elements (per token: shape [R] or x's leading axes). Scale values are not checked: a zero scale
// saturates, a NaN scale gives NaN codes. q e4m3 [..., K].
void quantize_fp8(const TensorRef& x, const TensorRef& scale, TensorRef q, cudaStream_t stream = nullptr);
// Dynamic scales: amax / 448 over the tensor (scale of one element) or each row (R elements);
// an all-zero tensor/row gets 1; a NaN gives a NaN scale, an inf an inf scale (never hidden).
// GPU: one CTA per row; per tensor, a deterministic multi-CTA max (the scale's own 4 bytes are the
// accumulator, so `scale` holds intermediate bits until the call's last kernel has run).
void fp8_dynamic_scale(const TensorRef& x, TensorRef scale, cudaStream_t stream = nullptr);
// out float32 [..., K] = e4m3(q) * scale (per tensor or per row).
void dequantize_fp8(const TensorRef& q, const TensorRef& scale, TensorRef out, cudaStream_t stream = nullptr);

// NVFP4 with encode scale gs (finite, > 0) (DESIGN.md 3.2). x real [..., K], K % 16 == 0 ->
// q fp4 [..., K/2], sf e4m3 [..., K/16]. Per 16-block: sf = e4m3((gs * amax) / 6),
// q = e2m1((x * gs) / e4m3_to_float(sf)); q = 0 when sf decodes to 0. A block holding NaN gets
// sf = 0x7F (NaN) and q = 0x7 elements (see float_to_e2m1).
void quantize_nvfp4(const TensorRef& x, float global_scale, TensorRef q, TensorRef sf, cudaStream_t stream = nullptr);
// out float32 [..., K] = (e2m1(q) * e4m3(sf)) / gs.
void dequantize_nvfp4(const TensorRef& q, const TensorRef& sf, float global_scale, TensorRef out,
                      cudaStream_t stream = nullptr);

// MXFP4 / MXFP8 (ue8m0 per 32). x real [..., K], K % 32 == 0 -> q (fp4 [..., K/2] | e4m3 [..., K]),
// sf ue8m0 [..., K/32]. Per block: sf = ue8m0_ceil(amax / max_code) (fp32 division; max_code 6 or
// 448; all-zero block -> 0), q = code(x / 2^(sf-127)). A NaN block gets sf 0xFF and NaN element codes
// (e4m3 0x7F, e2m1 0x7). An inf saturates (scale clamped to 2^127, element to the largest code).
// Dequantization: out float32 = element * 2^(sf-127) (NaN for sf 0xFF).
void quantize_mxfp4(const TensorRef& x, TensorRef q, TensorRef sf, cudaStream_t stream = nullptr);
void dequantize_mxfp4(const TensorRef& q, const TensorRef& sf, TensorRef out, cudaStream_t stream = nullptr);
void quantize_mxfp8(const TensorRef& x, TensorRef q, TensorRef sf, cudaStream_t stream = nullptr);
void dequantize_mxfp8(const TensorRef& q, const TensorRef& sf, TensorRef out, cudaStream_t stream = nullptr);

// FlashInfer 128x4 weight-scale swizzle (DESIGN.md 3.3). sf 1-byte dtype [E, rows, cols] or
// [rows, cols] (E = 1) -> out (same dtype, or uint8 on either side) [E, round_up(rows,128),
// round_up(cols,4)] (same ndim) whose bytes are in swizzled order (padding = 0).
int64_t swizzled_offset(int64_t expert, int64_t row, int64_t col, int64_t row_tiles, int64_t col_tiles);
void swizzle_scales_128x4(const TensorRef& sf, TensorRef out, cudaStream_t stream = nullptr);
void unswizzle_scales_128x4(const TensorRef& swizzled, TensorRef sf,  // sf gives rows/cols
                            cudaStream_t stream = nullptr);

// qmoe's packed FP4 weight words (docs/design.md 3.4): w fp4x2 (uint8 or float4_e2m1x2) [..., K/2], K % 8 == 0 ->
// out (same dtype and shape) with the bits of every little-endian 32-bit word of each row permuted so that
// the bf16 x 4-bit GEMMs decode a K pair in fewer instructions (src/core/fp4_weight_pack.h; the decode-tile
// GEMMs 1.1x faster at T <= 256). The fused MoE's FP4 weight modes take packed weights with
// FusedMoeParams::fp4_weights_packed. A one-time weight preparation; unpack is its inverse.
void pack_fp4_weights(const TensorRef& w, TensorRef out, cudaStream_t stream = nullptr);
void unpack_fp4_weights(const TensorRef& packed, TensorRef out, cudaStream_t stream = nullptr);

// Gate/up conventions for W13 [E, 2I, C] or [2I, C] (any dtype, same dtype out, C = packed columns):
//   SGLang     : rows [gate(0..I); up(0..I)]
//   FlashInfer : [up; gate] interleaved in 64-row groups: [up 0:64, gate 0:64, up 64:128, ...]
// Also applies to row-major per-row scales [E, 2I, K/16|K/32]. Needs I % 64 == 0.
void gate_up_sglang_to_flashinfer(const TensorRef& w, TensorRef out, cudaStream_t stream = nullptr);
void gate_up_flashinfer_to_sglang(const TensorRef& w, TensorRef out, cudaStream_t stream = nullptr);

// Elementwise scalar codecs over arrays (tests and tools), one code per byte (e2m1 in the low nibble):
//   encode: x float32 -> codes uint8 (kE4M3, kE2M1, kUE8M0Ceil) or uint16/bfloat16 (kBF16)
//   decode: codes -> out float32
enum class ScalarCodec { kBF16, kE4M3, kE2M1, kUE8M0Ceil };
void encode_elementwise(const TensorRef& x, ScalarCodec codec, TensorRef codes);
void decode_elementwise(const TensorRef& codes, ScalarCodec codec, TensorRef out);

}  // namespace qmoe
