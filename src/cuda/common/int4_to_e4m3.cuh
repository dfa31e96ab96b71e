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

// Biased codes (the WGMMA 32- and 48-token tiles, sm90_grouped_gemm_w4a8_int4_wgmma.cu): q + 8 (0..15) read as an e4m3
// code is the value (q + 8) 2^-9 (codes 0..7 are the subnormals m 2^-9, 8..15 the first binade (8 + m) 2^-9), so the
// lookup becomes a nibble spread: 6 ALU instructions per 8 weights of a row pair instead of 12. The caller cancels the
// bias with one more wgmma per K step whose A operand is -8 2^-9 in every byte (kE4m3MinusEightUlp) and scales the sums
// by 2^9. w holds 4 int4 of row A (bits 0..15, nibble i = element i) and 4 of row B (bits 16..31).
constexpr uint32_t kE4m3MinusEightUlp = 0x88888888u;  // e4m3 0x88: sign | code 8 = -(8 2^-9)
constexpr float kBiasedOperandScale = 512.f;          // 2^9
struct Int4PairToBiasedE4m3 {
  uint32_t nibbles, flip;  // 0x0F0F0F0F, 0x08080808 in registers (one LOP3 takes both)
  uint32_t minus_eight[4];  // kE4m3MinusEightUlp each: the bias wgmma's A operand (four registers, read once)
  static constexpr Int4PairToBiasedE4m3 constants() {
    return {0x0F0F0F0Fu, 0x08080808u, {kE4m3MinusEightUlp, kE4m3MinusEightUlp, kE4m3MinusEightUlp, kE4m3MinusEightUlp}};
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ static Int4PairToBiasedE4m3 make() {
    __shared__ uint32_t words[3];  // read back through volatile shared memory: see Int4ToE4m3::make
    volatile uint32_t* w = words;
    constexpr Int4PairToBiasedE4m3 c = constants();
    w[0] = c.nibbles;
    w[1] = c.flip;
    w[2] = c.minus_eight[0];
    return {w[0], w[1], {w[2], w[2], w[2], w[2]}};  // four volatile reads: four registers the compiler keeps
  }
#endif
  QMOE_INT4_E4M3_HD void operator()(uint32_t w, uint32_t& row_a, uint32_t& row_b) const {
    const uint32_t even = (w & nibbles) ^ flip;        // A0 A2 B0 B2 (q + 8 each)
    const uint32_t odd = ((w >> 4) & nibbles) ^ flip;  // A1 A3 B1 B3
    row_a = prmt(even, odd, 0x5140u);
    row_b = prmt(even, odd, 0x7362u);
  }
};

}  // namespace qmoe::cuda
