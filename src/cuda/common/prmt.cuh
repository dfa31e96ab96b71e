// Byte permute (PTX prmt.b32, default mode), with a host model so that the encodings built on it are
// checked on the host (tests/cpp/test_int4_operand_codes.cpp): byte i of the result is byte
// (nibble i of selector) & 7 of {b, a} (a = bytes 0..3), replicated from its sign bit when bit 3 of the
// nibble is set.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define QMOE_PRMT_HD __host__ __device__ __forceinline__
#else
#define QMOE_PRMT_HD inline
#endif

namespace qmoe::cuda {

QMOE_PRMT_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
#else
  const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (selector >> (4 * i)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>(bytes >> (8 * (nibble & 7u))) & 0xFFu;
    if (nibble & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    d |= byte << (8 * i);
  }
  return d;
#endif
}

}  // namespace qmoe::cuda
