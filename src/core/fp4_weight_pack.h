// qmoe's packed FP4 weight word (pack_fp4_weights, docs/design.md 3.4): the bits of each little-endian 32-bit word of
// an fp4x2 weight row (8 e2m1 codes, K 8w .. 8w + 7, code k at bits 4k .. 4k + 3) moved so that the GEMMs
// decode a K pair (2m, 2m + 1) (byte m) to the bf16x2 e2m1 * 2^-126 (sign at 15 / 31, the 3 magnitude bits at
// 8..6 / 24..22; sm90_grouped_gemm_bf16_w4.cuh) in 1-3 ALU instructions instead of 3-4:
//   byte 0: bits S = {6,7,8,15 | 22,23,24,31}   -> v & S
//   byte 1: S rotated left by 3                  -> rotr(v, 3) & S
//   byte 2: S rotated left by 6                  -> rotr(v, 6) & S
//   byte 3: magnitude {3,4,0}, sign 1 (| +16)    -> ((v & 0x001B001B) * 0x4108) & S
//           (the multiply adds three disjoint copies, << 3, << 8, << 14: no carries)
// The four sets partition the 32 bits, so the map is a bit permutation (pack and unpack are inverses).
#pragma once

#include <cstdint>

#include "qmoe/formats.h"  // QMOE_HD

namespace qmoe::fp4pack {

constexpr uint32_t kDecodeMask = 0x81C081C0u;  // S
constexpr uint32_t kByte3Mask = 0x001B001Bu;
constexpr uint32_t kByte3Mul = 0x4108u;

// Packed bit position of bit j (0..3: 3 magnitude bits, then the sign) of code c (0..7) of a word.
QMOE_HD constexpr int packed_bit(int c, int j) {
  const int m = c / 2, half = c % 2;                   // byte m, low (even K) or high (odd K) bf16
  const int s = (j < 3 ? 6 + j : 15) + 16 * half;      // its place in S
  if (m < 3) return (s + 3 * m) % 32;                  // S rotated left by 3 m
  const int low[4] = {3, 4, 0, 1};                     // byte 3
  return low[j] + 16 * half;
}

QMOE_HD constexpr uint32_t pack_word(uint32_t w) {
  uint32_t v = 0;
  for (int c = 0; c < 8; ++c)
    for (int j = 0; j < 4; ++j) v |= ((w >> (4 * c + j)) & 1u) << packed_bit(c, j);
  return v;
}

QMOE_HD constexpr uint32_t unpack_word(uint32_t v) {
  uint32_t w = 0;
  for (int c = 0; c < 8; ++c)
    for (int j = 0; j < 4; ++j) w |= ((v >> packed_bit(c, j)) & 1u) << (4 * c + j);
  return w;
}

QMOE_HD constexpr uint32_t rotr(uint32_t v, int r) { return r == 0 ? v : (v >> r) | (v << (32 - r)); }

// Host model of the GEMMs' decode of byte m (tests/cpp/test_fp4_weight_pack.cpp checks it against e2m1).
QMOE_HD constexpr uint32_t decode_byte(uint32_t v, int m) {
  return m < 3 ? rotr(v, 3 * m) & kDecodeMask : ((v & kByte3Mask) * kByte3Mul) & kDecodeMask;
}

}  // namespace qmoe::fp4pack
