// IEEE fp16 bits on the host (the CPU engine's fp16 outputs): round-to-nearest-even from fp32, NaN
// stays NaN (quiet, sign kept), |x| >= 65520 gives inf, subnormals exact; the reverse is exact.
#pragma once

#include <cmath>
#include <cstdint>

#include "qmoe/formats.h"  // float_bits, bits_float

namespace qmoe {

inline uint16_t float_to_half_bits(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                       // normal half: RNE on the 13 dropped bits
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r >> 13) - (112u << 10)));
  }
  // Subnormal half: rne(|x| * 2^24); the scaling is exact.
  const float q = std::nearbyint(bits_float(a) * 16777216.0f);
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(q));
}
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -mag : mag;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

}  // namespace qmoe
