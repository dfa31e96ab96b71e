// The bit algebra behind the int4 operands of the W4A8 kernels, checked on the host:
//   - int4x8_to_biased_f16 (src/cuda/common/int4_to_f16.cuh, the decode tiles): every nibble value in
//     every position becomes the fp16 (q + 8) * 2^-24, times 16 for the odd positions, in the half the
//     kernel pairs it with; the bias constants are -8 * 2^-24 and -128 * 2^-24;
//   - the biased e4m3 codes (the WGMMA kernels' BIASED experiment): byte (q XOR 8) is (q + 8) * 2^-9,
//     and 0x88 is -8 * 2^-9.
//   - the K slots of the fp16 WGMMA decode tile (sm90_grouped_gemm_w4a8_int4_wgmma.cu, wgmma_f16): the
//     weights as its A fragments take them and the activations as its operand writer places them meet
//     in the same logical K, so one 128-wide group sums q * a over every physical K once; its weight
//     codes (int4x8_to_magic_f16) minus their constant are q and 16 q exactly.
// The GPU tests check the kernels end to end; these pin the encodings they rely on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

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
  EXPECT_EQ(qmoe::e4m3_to_float(0x88), -8.0f * std::ldexp(1.0f, -9));  // the WGMMA bias weight
}

TEST(Int4OperandCodes, MagicFp16MinusItsConstantIsQEveryNibbleAndPosition) {
  uint32_t filler = 0x2545F491u;
  for (int position = 0; position < 8; ++position) {
    for (int q = -8; q <= 7; ++q) {
      filler = filler * 1664525u + 1013904223u;
      const uint32_t x = (filler & ~(0xFu << (4 * position))) | (static_cast<uint32_t>(q & 0xF) << (4 * position));
      uint32_t m04, m26, m15, m37;
      qmoe::cuda::int4x8_to_magic_f16(x, m04, m26, m15, m37);
      const uint32_t reg = position % 2 == 0 ? (position % 4 == 0 ? m04 : m26) : (position % 4 == 1 ? m15 : m37);
      const uint32_t magic = position % 2 == 0 ? qmoe::cuda::kF16Magic : qmoe::cuda::kF16MagicX16;
      const uint16_t half = static_cast<uint16_t>(position < 4 ? reg & 0xFFFF : reg >> 16);
      const double unit = position % 2 == 0 ? 1.0 : 16.0;
      EXPECT_EQ(f16_value(half) - f16_value(static_cast<uint16_t>(magic & 0xFFFF)), q * unit)
          << "position " << position << " q " << q;
      EXPECT_EQ(magic & 0xFFFF, magic >> 16);
    }
  }
  EXPECT_EQ(f16_value(static_cast<uint16_t>(qmoe::cuda::kF16Magic)), 1032.0);
  EXPECT_EQ(f16_value(static_cast<uint16_t>(qmoe::cuda::kF16MagicX16)), 1152.0);
}

// One weight row and one token over a 128-wide K group, through wgmma_f16's index math (kept in step
// with the kernel): A side: thread tig's word b (bytes 16 tig + 4 b of the row) feeds k16 steps 2 b + s,
// registers a0 (logical K 2 tig + e of the step) = m04 / m26 and a2 (8 + 2 tig + e) = m15 / m37, each
// minus its magic constant (int4x8_to_magic_f16: q, or 16 q).
// B side (stage_operand): the run at physical K 32 tig + 8 b gives chunk q of logical K 32 b + 8 q the
// pair (e_q, e_{q+4}) at positions 2 tig, 2 tig + 1, divided by 16 for odd q (e4m3x8_to_f16_slots).
TEST(Int4OperandCodes, WgmmaF16SlotsPairEveryPhysicalKOnce) {
  uint32_t seed = 12345u;
  auto next = [&] { return seed = seed * 1664525u + 1013904223u; };
  for (int trial = 0; trial < 64; ++trial) {
    int q[128];
    float a[128];
    uint8_t row[64] = {};
    for (int k = 0; k < 128; ++k) {
      q[k] = static_cast<int>(next() >> 28) - 8;
      uint8_t code = static_cast<uint8_t>(next() >> 24);
      if ((code & 0x7F) == 0x7F) code ^= 1;  // no NaN
      a[k] = qmoe::e4m3_to_float(code);
      row[k / 2] |= static_cast<uint8_t>((q[k] & 0xF) << (4 * (k % 2)));
    }
    double weight_slot[128] = {}, act_slot[128] = {};
    int weight_set[128] = {}, act_set[128] = {};
    for (int tig = 0; tig < 4; ++tig) {
      for (int b = 0; b < 4; ++b) {
        const int byte = 16 * tig + 4 * b;
        const uint32_t word = row[byte] | row[byte + 1] << 8 | row[byte + 2] << 16 | static_cast<uint32_t>(row[byte + 3]) << 24;
        uint32_t m04, m26, m15, m37;
        qmoe::cuda::int4x8_to_magic_f16(word, m04, m26, m15, m37);
        for (int s = 0; s < 2; ++s) {
          const uint32_t a0 = s == 0 ? m04 : m26, a2 = s == 0 ? m15 : m37;
          for (int e = 0; e < 2; ++e) {
            const int l0 = 16 * (2 * b + s) + 2 * tig + e, l2 = l0 + 8;
            // the kernel's f16x2 subtract of 1032 / 1152 (exact: integers below 2048)
            weight_slot[l0] = f16_value(static_cast<uint16_t>(e == 0 ? a0 & 0xFFFF : a0 >> 16)) - 1032;
            weight_slot[l2] = f16_value(static_cast<uint16_t>(e == 0 ? a2 & 0xFFFF : a2 >> 16)) - 1152;
            ++weight_set[l0];
            ++weight_set[l2];
          }
        }
        // stage_operand's item (n, b), run tig: chunk 2 tig + b / 2, byte 8 (b % 2) -> physical K 32 tig + 8 b.
        const int run_k = 16 * (2 * tig + (b >> 1)) + 8 * (b & 1);
        for (int slot_q = 0; slot_q < 4; ++slot_q) {
          for (int e = 0; e < 2; ++e) {
            const int l = 32 * b + 8 * slot_q + 2 * tig + e;
            act_slot[l] = a[run_k + slot_q + 4 * e] / (slot_q % 2 == 1 ? 16.0 : 1.0);
            ++act_set[l];
          }
        }
      }
    }
    double dot = 0, want = 0;
    for (int l = 0; l < 128; ++l) {
      ASSERT_EQ(weight_set[l], 1) << "logical K " << l;
      ASSERT_EQ(act_set[l], 1) << "logical K " << l;
      dot += weight_slot[l] * act_slot[l];
    }
    for (int k = 0; k < 128; ++k) want += q[k] * static_cast<double>(a[k]);
    EXPECT_EQ(dot, want) << "trial " << trial;
  }
}

TEST(Int4OperandCodes, BiasedE4m3CodesAreExact) {
  for (int q = -8; q <= 7; ++q) {
    const uint8_t code = static_cast<uint8_t>((q & 0xF) ^ 8);
    EXPECT_EQ(qmoe::e4m3_to_float(code), (q + 8) * std::ldexp(1.0f, -9)) << "q " << q;
  }
}

}  // namespace
