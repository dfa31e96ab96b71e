// Register converter from packed signed int4 to e4m3 operands of the FP8 WGMMA.
//
// Int4ToE4m3 (exact values): 4 int4 (nibble i = element i) -> 4 e4m3 bytes (byte i). Exact: every
// int4 value is an e4m3 value.
//
// Method: two byte-permute (prmt) lookups per 4 outputs, one in a table of the e4m3 codes of
// 0..7 and one of -8..-1, both indexed by the nibble's low 3 bits, then a third prmt picks per
// byte the negative candidate when the nibble's bit 3 (the sign) is set: the sign, moved to bit 2
// of a selector nibble, turns "byte i of the positive word" into "byte i of the negative word".
// Six instructions per 4 weights: and (index), and-or + shift (selector), three prmt.
#pragma once

#include <cstdint>

#include "cuda/common/prmt.cuh"

#if defined(__CUDACC__)
#define QMOE_INT4_E4M3_HD __host__ __device__ __forceinline__
#else
#define QMOE_INT4_E4M3_HD inline  // the lookup is also checked on the host (tests/cpp/test_int4_operand_codes.cpp)
#endif

namespace qmoe::cuda {

// e4m3 codes: 0 0x00, 1 0x38, 2 0x40, 3 0x44, 4 0x48, 5 0x4A, 6 0x4C, 7 0x4E;
// -8 0xD0, -7 0xCE, -6 0xCC, -5 0xCA, -4 0xC8, -3 0xC4, -2 0xC0, -1 0xB8 (sign bit 0x80).
constexpr uint32_t kE4m3Pos0123 = 0x44403800u;
constexpr uint32_t kE4m3Pos4567 = 0x4E4C4A48u;
constexpr uint32_t kE4m3NegM8toM5 = 0xCACCCED0u;  // bytes: -8, -7, -6, -5
constexpr uint32_t kE4m3NegM4toM1 = 0xB8C0C4C8u;  // bytes: -4, -3, -2, -1

// The tables' low words and the selector's base live in registers, set once per thread (make()): a prmt
// takes its first table from a register, and given the constant the compiler re-materialized it before
// every lookup (one move per prmt), and built the selector in three instructions instead of two. The
// W4A8 WGMMA step fell from 187 to 139 instructions (32-token tile), 1.03-1.09x on the WGMMA tiles
// (bench/results/2026-12-01_s19b_*).
struct Int4ToE4m3 {
  uint32_t pos_lo, neg_lo, select_base;

  // The constants themselves (host tests; kernels use make()).
  static constexpr Int4ToE4m3 constants() { return Int4ToE4m3{kE4m3Pos0123, kE4m3NegM8toM5, 0x6420u}; }
#if defined(__CUDACC__)
  __device__ __forceinline__ static Int4ToE4m3 make() {
    // NOTE: read back through volatile shared memory, so that the compiler cannot see the constants (it
    // folds a mov of one and re-materializes it again). Every thread writes the same three words.
    __shared__ uint32_t words[3];
    volatile uint32_t* w = words;
    constexpr Int4ToE4m3 c = constants();
    w[0] = c.pos_lo;
    w[1] = c.neg_lo;
    w[2] = c.select_base;
    return Int4ToE4m3{w[0], w[1], w[2]};
  }
#endif

  // Four int4 (nibble i of v's low 16 bits = element i) -> four e4m3 bytes (byte i).
  // NOTE: prmt reads only the low 16 bits of the selector (4 nibbles); a set bit 3 in a nibble would mean
  // "replicate the sign", hence the index keeps the low 3 bits of each nibble only. Selector nibble i:
  // i | 4 sign_i = (8 sign_i + 2 i) >> 1 (select_base = 0x6420); bit 0 of every 8 sign + 2 i is 0, so the
  // shift carries nothing across nibbles.
  QMOE_INT4_E4M3_HD uint32_t operator()(uint32_t v) const {
    const uint32_t index = v & 0x7777u;
    const uint32_t pos = prmt(pos_lo, kE4m3Pos4567, index);
    const uint32_t neg = prmt(neg_lo, kE4m3NegM4toM1, index);
    return prmt(pos, neg, ((v & 0x8888u) | select_base) >> 1);
  }
};

}  // namespace qmoe::cuda
