// Register converter from packed signed int4 to e4m3 operands of the FP8 WGMMA.
//
// int4x8_to_e4m3x8 (exact values):  (one 32-bit word, element i in bits [4i, 4i+4), i.e.
// the even K index in the low nibble) -> 8 e4m3 bytes in two 32-bit words (elements 0..3 in `lo`,
// 4..7 in `hi`, element i in byte i % 4). Exact: every int4 value is an e4m3 value.
//
// Method: two byte-permute (prmt) lookups per 4 outputs, one in a table of the e4m3 codes of
// 0..7 and one of -8..-1, both indexed by the nibble's low 3 bits, then a third prmt picks per
// byte the negative candidate when the nibble's bit 3 (the sign) is set: the sign, moved to bit 2
// of a selector nibble, turns "byte i of the positive word" into "byte i of the negative word".
// Cost: 11 integer instructions per 8 elements.
#pragma once

#include <cstdint>

#include "cuda/common/int4_to_f16.cuh"  // and_xor

namespace qmoe::cuda {

// e4m3 codes: 0 0x00, 1 0x38, 2 0x40, 3 0x44, 4 0x48, 5 0x4A, 6 0x4C, 7 0x4E;
// -8 0xD0, -7 0xCE, -6 0xCC, -5 0xCA, -4 0xC8, -3 0xC4, -2 0xC0, -1 0xB8 (sign bit 0x80).
constexpr uint32_t kE4m3Pos0123 = 0x44403800u;
constexpr uint32_t kE4m3Pos4567 = 0x4E4C4A48u;
constexpr uint32_t kE4m3NegM8toM5 = 0xCACCCED0u;  // bytes: -8, -7, -6, -5
constexpr uint32_t kE4m3NegM4toM1 = 0xB8C0C4C8u;  // bytes: -4, -3, -2, -1

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

__device__ __forceinline__ uint32_t int4x4_to_e4m3x4(uint32_t index, uint32_t select) {
  // NOTE: prmt reads only the low 16 bits of the selector (4 nibbles); a set bit 3 in a nibble
  // would mean "replicate the sign", hence `index` holds the low 3 bits of each nibble only.
  const uint32_t pos = prmt(kE4m3Pos0123, kE4m3Pos4567, index);
  const uint32_t neg = prmt(kE4m3NegM8toM5, kE4m3NegM4toM1, index);
  return prmt(pos, neg, select);
}

__device__ __forceinline__ void int4x8_to_e4m3x8(uint32_t packed, uint32_t& lo, uint32_t& hi) {
  const uint32_t index = packed & 0x77777777u;
  // Selector nibble i = i (byte i of `pos`) or 4 + i (byte i of `neg`) when element i is negative.
  const uint32_t select = ((packed >> 1) & 0x44444444u) | 0x32103210u;
  lo = int4x4_to_e4m3x4(index, select);
  hi = int4x4_to_e4m3x4(index >> 16, select >> 16);
}

// Biased codes (an experiment of the WGMMA kernels, their BIASED flag): bytes (q XOR 8), which e4m3
// reads as (q + 8) * 2^-9 exactly (codes 0..15 share the spacing 2^-9), for 4 consecutive nibbles of
// `word`: nibbles 0-3 with select = 0x5140, nibbles 4-7 with select = 0x7362 (the even and odd nibbles
// are split by two masks, then interleaved back into K order by one byte permute).
// 4 instructions (and_xor: one LOP3 each, int4_to_f16.cuh).
__device__ __forceinline__ uint32_t int4x4_to_biased_e4m3x4(uint32_t word, uint32_t select) {
  const uint32_t even = and_xor(word, 0x0F0F0F0Fu, 0x08080808u);
  const uint32_t odd = and_xor(word >> 4, 0x0F0F0F0Fu, 0x08080808u);
  return prmt(even, odd, select);
}

}  // namespace qmoe::cuda
