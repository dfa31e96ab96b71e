// Register converter from packed signed int4 to e4m3 operands of the FP8 WGMMA.
//
// int4x4_to_e4m3x4 (exact values): 4 int4 (nibble i = element i) -> 4 e4m3 bytes (byte i). Exact:
// every int4 value is an e4m3 value. The caller passes the nibbles' low 3 bits as `index` and the
// selector of the last step as `select` (sm90_grouped_gemm_w4a8_int4_wgmma.cu: int4x4_to_e4m3).
//
// Method: two byte-permute (prmt) lookups per 4 outputs, one in a table of the e4m3 codes of
// 0..7 and one of -8..-1, both indexed by the nibble's low 3 bits, then a third prmt picks per
// byte the negative candidate when the nibble's bit 3 (the sign) is set: the sign, moved to bit 2
// of a selector nibble, turns "byte i of the positive word" into "byte i of the negative word".
#pragma once

#include <cstdint>

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

}  // namespace qmoe::cuda
