// The bit algebra behind the int4 operands of the W4A8 kernels, checked on the host:
//   - int4x8_to_biased_f16 (src/cuda/common/int4_to_f16.cuh, the decode tiles): every nibble value in
//     every position becomes the fp16 (q + 8) * 2^-24, times 16 for the odd positions, in the half the
//     kernel pairs it with; the bias constants are -8 * 2^-24 and -128 * 2^-24.
//   - Int4ToE4m3 (src/cuda/common/int4_to_e4m3.cuh, the WGMMA tiles): every 16-bit word of four int4 becomes
//     their four e4m3 codes (qmoe::float_to_e4m3 of each value), through the host model of prmt.
// The GPU tests check the kernels end to end; these pin the encodings they rely on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/int4_to_e4m3.cuh"
#include "cuda/common/int4_to_f16.cuh"
#include "qmoe/formats.h"

namespace {

// IEEE fp16 bits -> value (subnormals included; the tests never produce inf or NaN).
double f16_value(uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  const double magnitude = exponent == 0 ? std::ldexp(mantissa, -24) : std::ldexp(1024 + mantissa, exponent - 25);
  return sign ? -magnitude : magnitude;
}

TEST(Int4OperandCodes, BiasedFp16SubnormalsEveryNibbleAndPosition) {
  uint32_t filler = 0x9E3779B9u;  // other nibbles: arbitrary, they must not leak into the checked half
  for (int position = 0; position < 8; ++position) {
    for (int q = -8; q <= 7; ++q) {
      filler = filler * 1664525u + 1013904223u;
      const uint32_t x = (filler & ~(0xFu << (4 * position))) | (static_cast<uint32_t>(q & 0xF) << (4 * position));
      uint32_t u04, u26, u15, u37;
      qmoe::cuda::int4x8_to_biased_f16(x, u04, u26, u15, u37);
      // Which register and half holds element `position` (int4_to_f16.cuh): (0, 4), (2, 6), (1, 5), (3, 7).
      const uint32_t reg = position % 2 == 0 ? (position % 4 == 0 ? u04 : u26) : (position % 4 == 1 ? u15 : u37);
      const uint16_t half = static_cast<uint16_t>(position < 4 ? reg & 0xFFFF : reg >> 16);
      const double unit = position % 2 == 0 ? 1.0 : 16.0;
      EXPECT_EQ(f16_value(half), (q + 8) * unit * std::ldexp(1.0, -24)) << "position " << position << " q " << q;
    }
  }
}

TEST(Int4OperandCodes, BiasConstants) {
  for (uint16_t half : {static_cast<uint16_t>(qmoe::cuda::kF16MinusEight & 0xFFFF),
                        static_cast<uint16_t>(qmoe::cuda::kF16MinusEight >> 16)})
    EXPECT_EQ(f16_value(half), -8 * std::ldexp(1.0, -24));
  for (uint16_t half : {static_cast<uint16_t>(qmoe::cuda::kF16MinusEightX16 & 0xFFFF),
                        static_cast<uint16_t>(qmoe::cuda::kF16MinusEightX16 >> 16)})
    EXPECT_EQ(f16_value(half), -8 * 16 * std::ldexp(1.0, -24));
  EXPECT_EQ(qmoe::cuda::kF16BiasedUnit, std::ldexp(1.0f, 24));
}

TEST(Int4OperandCodes, E4m3LookupEveryWord) {
  const qmoe::cuda::Int4ToE4m3 cvt = qmoe::cuda::Int4ToE4m3::constants();
  int wrong = 0;
  for (uint32_t v = 0; v <= 0xFFFFu; ++v) {
    const uint32_t codes = cvt(v);
    for (int i = 0; i < 4; ++i) {
      const int nibble = static_cast<int>((v >> (4 * i)) & 0xFu);
      const int q = nibble >= 8 ? nibble - 16 : nibble;
      const uint32_t expected = qmoe::float_to_e4m3(static_cast<float>(q));
      if (((codes >> (8 * i)) & 0xFFu) != expected && ++wrong <= 5) {
        ADD_FAILURE() << "word 0x" << std::hex << v << " element " << i << ": got 0x" << ((codes >> (8 * i)) & 0xFFu)
                      << ", expected 0x" << expected;
      }
    }
  }
  EXPECT_EQ(wrong, 0);
  // Bits above the low 16 are ignored (the kernels load 16-bit pieces; a wider word must not leak in).
  EXPECT_EQ(cvt(0xABCD1234u), cvt(0x1234u));
}

// The biased codes of the WGMMA 32-token tile: row A's and row B's four int4 each become
// the e4m3 codes of (q + 8) 2^-9, byte i = element i; the bias operand is -8 2^-9 in every byte.
TEST(Int4OperandCodes, BiasedE4m3SpreadEveryRowPair) {
  const qmoe::cuda::Int4PairToBiasedE4m3 spread = qmoe::cuda::Int4PairToBiasedE4m3::constants();
  int wrong = 0;
  uint32_t other = 0x2545F491u;
  for (uint32_t v = 0; v <= 0xFFFFu; ++v) {
    other = other * 1664525u + 1013904223u;
    for (const bool a_side : {true, false}) {
      const uint32_t w = a_side ? (v | (other << 16)) : ((v << 16) | (other & 0xFFFFu));
      uint32_t row_a, row_b;
      spread(w, row_a, row_b);
      const uint32_t codes = a_side ? row_a : row_b;
      for (int i = 0; i < 4; ++i) {
        const int nibble = static_cast<int>((v >> (4 * i)) & 0xFu);
        const int q = nibble >= 8 ? nibble - 16 : nibble;
        const uint32_t expected = qmoe::float_to_e4m3(std::ldexp(static_cast<float>(q + 8), -9));
        if (((codes >> (8 * i)) & 0xFFu) != expected && ++wrong <= 5)
          ADD_FAILURE() << "word 0x" << std::hex << w << (a_side ? " row A" : " row B") << " element " << i;
      }
    }
  }
  EXPECT_EQ(wrong, 0);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ((qmoe::cuda::kE4m3MinusEightUlp >> (8 * i)) & 0xFFu, qmoe::float_to_e4m3(-8 * std::ldexp(1.0f, -9)));
  EXPECT_EQ(qmoe::cuda::kBiasedOperandScale, std::ldexp(1.0f, 9));
}

}  // namespace
