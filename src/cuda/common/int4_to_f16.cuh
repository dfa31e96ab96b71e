// int4 weights and e4m3 activations as fp16 MMA operands (mma.sync m16n8k16, fp32 accumulate).
//
// Why fp16: Hopper has no fp8 mma.sync. ptxas lowers mma.sync m16n8k32 e4m3 to two fp16 HMMAs that
// each start from zero, one e4m3 -> f16 unpack per 2 operands, and 4 FADDs per MMA to add the
// result in (measured in the SASS of the decode kernel: 128 FADD and 161 F2FP per 2 K groups).
// Issuing the fp16 MMAs directly keeps the fp32 chain in the tensor core and lets the int4 codes
// become fp16 operands without any conversion instruction but a mask:
//
//   f16 bits (x & 0x000F000F) ^ 0x00080008 = the two nibbles 0 and 4 of x, each as u = q + 8 in the
//   mantissa of an fp16 subnormal, value u * 2^-24 (exact: subnormals are m * 2^-24, m < 1024).
//   Nibbles 1 and 5 (mask 0x00F000F0) come out as 16 u * 2^-24; nibbles 2, 3, 6, 7 the same after
//   x >> 8. 5 instructions per 8 weights.
//
// The activation operand of the "x16" registers is scaled by 1/16 (exact for every e4m3 value:
// e4m3 >= 2^-9, fp16 subnormals reach 2^-24), so every product is (q + 8) * a * 2^-24 exactly.
// An extra MMA per token fragment with all weights = -8 (the same codes, sign set) cancels the
// bias in fp32; the group scale absorbs 2^24 (kF16BiasedUnit).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define QMOE_INT4_F16_HD __host__ __device__ __forceinline__
#else
#define QMOE_INT4_F16_HD inline  // the bit algebra is also tested on the host (tests/cpp/test_int4_operand_codes.cpp)
#endif

namespace qmoe::cuda {

constexpr float kF16BiasedUnit = 16777216.f;         // 2^24: biased fp16 codes count in units of 2^-24
constexpr uint32_t kF16MinusEight = 0x80088008u;     // two fp16 -8 * 2^-24 (pairs with unit activations)
constexpr uint32_t kF16MinusEightX16 = 0x80808080u;  // two fp16 -128 * 2^-24 (pairs with activations / 16)

// (x & mask) ^ bits. NOTE: one LOP3 on the device only when written out: ptxas emits two for the
// C expression (measured: 257 instead of 128 LOP3 in the decode kernel's inner loop).
QMOE_INT4_F16_HD uint32_t and_xor(uint32_t x, uint32_t mask, uint32_t bits) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(d) : "r"(x), "r"(mask), "r"(bits));
  return d;
#else
  return (x & mask) ^ bits;
#endif
}

// x: int4 elements 0..7 (element i in bits [4i, 4i + 4)). Outputs (f16x2, low half first):
//   u04 = (e0, e4) and u26 = (e2, e6) in units of 2^-24; u15 = (e1, e5) and u37 = (e3, e7) in
//   units of 16 * 2^-24; each element is its biased code q + 8.
QMOE_INT4_F16_HD void int4x8_to_biased_f16(uint32_t x, uint32_t& u04, uint32_t& u26, uint32_t& u15, uint32_t& u37) {
  const uint32_t y = x >> 8;
  u04 = and_xor(x, 0x000F000Fu, 0x00080008u);
  u15 = and_xor(x, 0x00F000F0u, 0x00800080u);
  u26 = and_xor(y, 0x000F000Fu, 0x00080008u);
  u37 = and_xor(y, 0x00F000F0u, 0x00800080u);
}

#if defined(__CUDACC__)

// fp16 m16n8k16, fp32 accumulate.
__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One K step (8 K) of the bias chain: bias += (-8 2^-24) x the activations of the step's slots (all weight rows alike).
// The decode tiles run it per token fragment; e4m3_to_f16_slots runs the same sequence per row, so its sums are
// these bits.
__device__ __forceinline__ void bias_mma_step(float (&bias)[4], uint32_t b04, uint32_t b26, uint32_t b15, uint32_t b37) {
  mma_f16(bias, kF16MinusEight, kF16MinusEight, kF16MinusEight, kF16MinusEight, b04, b26);
  mma_f16(bias, kF16MinusEightX16, kF16MinusEightX16, kF16MinusEightX16, kF16MinusEightX16, b15, b37);
}

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t bytes16) {
  uint32_t d;
  asm("{\n.reg .b16 t;\ncvt.u16.u32 t, %1;\ncvt.rn.f16x2.e4m3x2 %0, t;\n}" : "=r"(d) : "r"(bytes16));
  return d;
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// lo, hi: 8 e4m3 activations (elements 0..3, 4..7) matching int4x8_to_biased_f16's K slots:
//   b04 = (e0, e4), b26 = (e2, e6), b15 = (e1, e5) / 16, b37 = (e3, e7) / 16.
__device__ __forceinline__ void e4m3x8_to_f16_slots(uint32_t lo, uint32_t hi, uint32_t& b04, uint32_t& b26,
                                                    uint32_t& b15, uint32_t& b37) {
  uint32_t even, odd;
  asm("prmt.b32 %0, %1, %2, 0x6240;" : "=r"(even) : "r"(lo), "r"(hi));  // bytes e0 e4 e2 e6
  asm("prmt.b32 %0, %1, %2, 0x7351;" : "=r"(odd) : "r"(lo), "r"(hi));   // bytes e1 e5 e3 e7
  constexpr uint32_t kSixteenth = 0x2C002C00u;                          // fp16 2^-4, twice
  b04 = e4m3x2_to_f16x2(even);
  b26 = e4m3x2_to_f16x2(even >> 16);
  b15 = hmul2(e4m3x2_to_f16x2(odd), kSixteenth);
  b37 = hmul2(e4m3x2_to_f16x2(odd >> 16), kSixteenth);
}

#endif  // __CUDACC__

}  // namespace qmoe::cuda
