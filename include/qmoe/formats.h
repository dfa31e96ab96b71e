// Quantization formats of qmoe (DESIGN.md section 3): scalar codecs usable on host and device,
// and array-level quantize / dequantize / pack / layout helpers (CPU; GPU versions in quant_gpu.h).
//
// Rounding rules (tested bit for bit against numpy + ml_dtypes):
//   bf16   : round-to-nearest-even from fp32; NaN stays NaN (quiet), inf stays inf.
//   e4m3fn : RNE; |x| > 448 saturates to +-448 (no inf in the format); NaN -> 0x7F (sign kept).
//   e2m1   : RNE on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}; |x| > 6 saturates to +-6; NaN -> code
//            documented at float_to_e2m1 (the block scale carries NaN, see below).
//   ue8m0  : value 2^(code-127); code 0xFF is NaN. MX scales from qmoe's quantizers are the smallest
//            power of two >= amax / max_code (448 for e4m3, 6 for e2m1); an all-zero block gets code 0.
//   int4   : signed [-8, 7], two per byte, even K index in the low nibble.
// A NaN anywhere in a block gives that block the NaN scale code (e4m3 0x7F, ue8m0 0xFF).
#pragma once

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
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
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

// RNE, saturating to +-448, NaN -> 0x7F | sign.
uint8_t float_to_e4m3(float x);

QMOE_HD float e2m1_to_float(uint8_t nibble) {
  constexpr float kGrid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float mag = kGrid[nibble & 7];
  return (nibble & 8) ? -mag : mag;
}
// RNE on the e2m1 grid, saturating to +-6.
uint8_t float_to_e2m1(float x);

QMOE_HD float ue8m0_to_float(uint8_t code) {
  if (code == 0xff) return bits_float(0x7fc00000u);
  if (code == 0) return bits_float(0x00400000u);  // 2^-127 (subnormal fp32)
  return bits_float(static_cast<uint32_t>(code) << 23);
}
// Smallest power of two >= v (v >= 0), as a ue8m0 code, clamped to [0, 254]; NaN -> 0xFF; v == 0 -> 0.
uint8_t ue8m0_ceil(float v);

QMOE_HD int int4_low(uint8_t byte) { return static_cast<int>(static_cast<int8_t>(byte << 4) >> 4); }
QMOE_HD int int4_high(uint8_t byte) { return static_cast<int>(static_cast<int8_t>(byte) >> 4); }
QMOE_HD uint8_t pack_int4_pair(int even, int odd) {
  return static_cast<uint8_t>((even & 0xf) | ((odd & 0xf) << 4));
}

// ---------------------------------------------------------------------------------------------
// Array-level formats (CPU tensors; all shapes row-major, K = last logical axis).
// Inputs marked "real" accept float32 or bfloat16.
// ---------------------------------------------------------------------------------------------

// int4-g128 weights. w real [E, N, K] -> q int4x2 [E, N, K/2], scales float32 [E, N, K/128],
// symmetric: s = amax(group) / 7 (s = 1 for an all-zero group), q = clamp(rne(w / s), -8, 7).
void quantize_int4_g128(const TensorRef& w, TensorRef q, TensorRef scales);
// q int4x2 [E, N, K/2], scales float32/bfloat16 [E, N, K/128] -> out float32 [E, N, K] = q * s.
void dequantize_int4_g128(const TensorRef& q, const TensorRef& scales, TensorRef out);
// values int8 [..., K] in [-8, 7] <-> int4x2 [..., K/2].
void pack_int4(const TensorRef& values, TensorRef packed);
void unpack_int4(const TensorRef& packed, TensorRef values);

// SGLang's stored scale layout (DESIGN.md 3.1). scales [E, N, G] (bf16 or f32, same dtype out):
//   G % 4 == 0: out [E, G/4, 4N], out[e, kb, 4n + j] = S[e, n, 4kb + j]
//   else      : out [E, G, N],    out[e, g, n] = S[e, n, g]
void interleave_int4_scales(const TensorRef& scales, TensorRef out);
void deinterleave_int4_scales(const TensorRef& stored, TensorRef scales);
// Shape of the stored layout for (E, N, K).
void int4_scale_layout_shape(int64_t experts, int64_t n, int64_t k, int64_t out_shape[3]);

// FP8 e4m3: q = e4m3(x / scale). Per-tensor: scale float32 [1]. Per-token: scale float32 [R].
void quantize_fp8(const TensorRef& x, const TensorRef& scale, TensorRef q);
// Dynamic scales: amax / 448 over the tensor ([1]) or each row ([R]); an all-zero row gets 1.
void fp8_dynamic_scale(const TensorRef& x, TensorRef scale);
// out float32 [R, K] = e4m3(q) * scale (per tensor or per row).
void dequantize_fp8(const TensorRef& q, const TensorRef& scale, TensorRef out);

// NVFP4 with encode scale gs (DESIGN.md 3.2): per 16-block sf = e4m3(gs * amax / 6),
// q = e2m1(x * gs / sf) (0 when sf == 0). x real [R, K] -> q fp4x2 [R, K/2], sf e4m3 [R, K/16].
void quantize_nvfp4(const TensorRef& x, float global_scale, TensorRef q, TensorRef sf);
// out float32 [R, K] = e2m1(q) * e4m3(sf) / gs.
void dequantize_nvfp4(const TensorRef& q, const TensorRef& sf, float global_scale, TensorRef out);

// MXFP4 / MXFP8 (ue8m0 per 32). x real [R, K] -> q (fp4x2 [R, K/2] | e4m3 [R, K]), sf ue8m0 [R, K/32].
void quantize_mxfp4(const TensorRef& x, TensorRef q, TensorRef sf);
void dequantize_mxfp4(const TensorRef& q, const TensorRef& sf, TensorRef out);
void quantize_mxfp8(const TensorRef& x, TensorRef q, TensorRef sf);
void dequantize_mxfp8(const TensorRef& q, const TensorRef& sf, TensorRef out);

// FlashInfer 128x4 weight-scale swizzle (DESIGN.md 3.3). sf uint8-sized [E, rows, cols] ->
// out [E, round_up(rows,128), round_up(cols,4)] whose bytes are in swizzled order (padding = 0).
int64_t swizzled_offset(int64_t expert, int64_t row, int64_t col, int64_t row_tiles, int64_t col_tiles);
void swizzle_scales_128x4(const TensorRef& sf, TensorRef out);
void unswizzle_scales_128x4(const TensorRef& swizzled, TensorRef sf);  // sf gives rows/cols

// Gate/up conventions for W13 [E, 2I, C] (any dtype, C = packed columns):
//   SGLang     : rows [gate(0..I); up(0..I)]
//   FlashInfer : [up; gate] interleaved in 64-row groups: [up 0:64, gate 0:64, up 64:128, ...]
// Also applies to row-major per-row scales [E, 2I, K/16|K/32]. Needs I % 64 == 0.
void gate_up_sglang_to_flashinfer(const TensorRef& w, TensorRef out);
void gate_up_flashinfer_to_sglang(const TensorRef& w, TensorRef out);

}  // namespace qmoe
