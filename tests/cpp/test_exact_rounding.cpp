// The fast roundings of src/cuda/common/exact_rounding.cuh against their slow forms, on the host (the GPU glue
// check then compares the kernels that use them with the host codecs bit for bit):
//   - UniformDivisor(b).divide(x) == x / b (IEEE) for every e4m3 divisor (the NVFP4 block scales), powers of
//     two, random fp32 divisors and the fallback's edges, over random x, x near every rounding boundary of
//     the quotient, zeros of both signs, subnormals, inf and NaN;
//   - e2m1_round(x) == e2m1_to_float(float_to_e2m1(x)) over a dense sweep of all fp32 bit patterns plus
//     every value near the grid's midpoints. (QMOE_EXHAUSTIVE=1 sweeps all 2^32 patterns, ~1 minute.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <vector>

#include "cuda/common/exact_rounding.cuh"
#include "qmoe/formats.h"

namespace {

using qmoe::cuda::UniformDivisor;

using qmoe::bits_float;
using qmoe::float_bits;

struct Rng {
  uint64_t s = 0x243F6A8885A308D3ull;
  uint32_t next() {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    return static_cast<uint32_t>(s >> 16);
  }
};

// Same bits, NaNs compared as "both NaN" (the payload of x / b is the hardware's choice).
bool same(float got, float want) { return (std::isnan(got) && std::isnan(want)) || float_bits(got) == float_bits(want); }

int divide_mismatches(float b, Rng& rng) {
  const UniformDivisor div(b);
  int bad = 0;
  auto check = [&](float x) {
    if (!same(div.divide(x), x / b)) ++bad;
  };
  for (int i = 0; i < 20000; ++i) check(bits_float(rng.next()));  // every exponent, NaN and inf included
  for (int i = 0; i < 20000; ++i) {  // quotients in [2^-12, 2^12]: where e4m3 / e2m1 codes are decided
    const float q = std::ldexp(1.0f + (rng.next() >> 9) * 0x1p-23f, static_cast<int>(rng.next() % 25) - 12);
    const float x = q * b;
    // x itself and its neighbours: quotients on both sides of rounding boundaries
    for (int d = -2; d <= 2; ++d) check(bits_float(float_bits(x) + d));
  }
  for (float x : {0.0f, -0.0f, 1.0f, -1.0f, 6.0f, 448.0f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::min(), std::numeric_limits<float>::max(), 0x1p-80f, 0x1p80f})
    check(x);
  return bad;
}

TEST(ExactRounding, UniformDivisorEveryE4m3Divisor) {
  Rng rng;
  for (uint32_t code = 1; code < 0x7f; ++code) {  // every positive finite nonzero e4m3 value
    const float b = qmoe::e4m3_to_float(static_cast<uint8_t>(code));
    EXPECT_EQ(divide_mismatches(b, rng), 0) << "e4m3 divisor " << b;
  }
}

TEST(ExactRounding, UniformDivisorRandomAndEdgeDivisors) {
  Rng rng;
  std::vector<float> divisors;
  for (int e = -100; e <= 100; e += 7) divisors.push_back(std::ldexp(1.0f, e));  // MX scales and beyond
  for (int i = 0; i < 300; ++i) {  // random fp32 divisors, both signs, exponents in [-90, 90]
    const float m = 1.0f + (rng.next() >> 9) * 0x1p-23f;
    const float b = std::ldexp(m, static_cast<int>(rng.next() % 181) - 90);
    divisors.push_back(rng.next() & 1 ? -b : b);
  }
  for (float b : {0x1p-80f, 0x1p80f, 0x1.fffffep-81f, 0x1.000002p80f, 1.0f / 448.0f, 3.0f, 0x1.fffffep0f,
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(), 0.0f,
                  std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()})
    divisors.push_back(b);
  for (float b : divisors) EXPECT_EQ(divide_mismatches(b, rng), 0) << "divisor " << b;
}

float e2m1_codec(float x) { return qmoe::e2m1_to_float(qmoe::float_to_e2m1(x)); }

TEST(ExactRounding, E2m1RoundMatchesTheCodec) {
  const bool exhaustive = std::getenv("QMOE_EXHAUSTIVE") != nullptr;
  const uint64_t stride = exhaustive ? 1 : 4099;  // a prime stride reaches every mantissa pattern class
  int64_t bad = 0;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += stride) {
    const float x = bits_float(static_cast<uint32_t>(u));
    if (!same(qmoe::cuda::e2m1_round(x), e2m1_codec(x))) ++bad;
  }
  // Every float within 64 ulps of each midpoint, grid value and the saturation edge, both signs.
  for (float c : {0.0f, 0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f, 2.5f, 3.0f, 3.5f, 4.0f, 5.0f, 6.0f, 7.0f,
                  8.0f})
    for (int d = -64; d <= 64; ++d)
      for (float s : {1.0f, -1.0f}) {
        const uint32_t u = float_bits(c) + d;
        if (c == 0.0f && d < 0) continue;
        const float x = s * bits_float(u);
        if (!same(qmoe::cuda::e2m1_round(x), e2m1_codec(x))) ++bad;
      }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(float_bits(qmoe::cuda::e2m1_round(-0.0f)), float_bits(-0.0f));
  EXPECT_EQ(qmoe::cuda::e2m1_round(std::numeric_limits<float>::quiet_NaN()), 6.0f);
  EXPECT_EQ(qmoe::cuda::e2m1_round(-std::numeric_limits<float>::infinity()), -6.0f);
}

}  // namespace
