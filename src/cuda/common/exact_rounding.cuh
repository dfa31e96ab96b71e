// Cheaper forms of two roundings the glue kernels repeat per element, each bit-identical to the slow form
// (tests/cpp/test_exact_rounding.cpp checks them on the host against plain IEEE division and the e2m1 codec):
//
//   UniformDivisor(b).divide(x) == x / b   (IEEE fp32, round to nearest even; what __fdiv_rn gives)
//     for many x and one b: y = 1 / b once (rounded), then q = x * y and two remainder corrections
//     q += (x - b q) * y with exact FMA remainders (Markstein). __fdiv_rn pays a MUFU reciprocal, its
//     refinement and a range check per element; this is 5 FMA-pipe instructions. The correction is
//     proven for normal operands away from overflow / underflow: outside |b|, |q| in [2^-80, 2^80],
//     |x| >= 2^-80 (never in practice: scales and activations are far inside) it falls back to
//     __fdiv_rn; x == 0 gives x * y (the signed zero of x / b).
//
//   e2m1_round(x) == e2m1_to_float(float_to_e2m1(x))   (qmoe/formats.h), without the codec's table
//     The e2m1 grid is multiples of 0.5 below 2, of 1 in [2, 4), of 2 from 4: adding and subtracting
//     C = 2^22, 2^23 or 2^24 rounds to that step with ties to even, which are the codec's ties
//     (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); saturates to 6, keeps
//     the sign (also of zero); NaN -> +6 (code 0x7).
#pragma once

#include <cmath>
#include <cstdint>

#include "qmoe/formats.h"  // QMOE_HD, float_bits, bits_float

namespace qmoe::cuda {

namespace exact_rounding_detail {
// One rounding each, never contracted into a neighbour (nvcc contracts a * b + c by default).
QMOE_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
QMOE_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
QMOE_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
QMOE_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
}  // namespace exact_rounding_detail

class UniformDivisor {
 public:
  QMOE_HD explicit UniformDivisor(float b) : b_(b), y_(exact_rounding_detail::div_rn(1.0f, b)) {
    const float a = std::fabs(b);
    fast_ = a >= 0x1p-80f && a <= 0x1p80f;
  }
  QMOE_HD float divide(float x) const {
    namespace d = exact_rounding_detail;
    float q = d::mul_rn(x, y_);
    q = d::fma_rn(d::fma_rn(-q, b_, x), y_, q);
    q = d::fma_rn(d::fma_rn(-q, b_, x), y_, q);
    const float ax = std::fabs(x), aq = std::fabs(q);
    if (!(fast_ && ax >= 0x1p-80f && aq >= 0x1p-80f && aq <= 0x1p80f))  // rare: NaN, inf, 0, extreme ranges
      q = fast_ && x == 0.0f ? d::mul_rn(x, y_) : d::div_rn(x, b_);
    return q;
  }

 private:
  float b_, y_;
  bool fast_;
};

QMOE_HD float e2m1_round(float x) {
  namespace d = exact_rounding_detail;
  const uint32_t u = float_bits(x);
  const float a = bits_float(u & 0x7fffffffu);
  const float c = a < 2.0f ? 0x1p22f : a < 4.0f ? 0x1p23f : 0x1p24f;
  float m = d::add_rn(d::add_rn(a, c), -c);
  m = m < 6.0f ? m : 6.0f;  // also inf
  if ((u & 0x7fffffffu) > 0x7f800000u) return 6.0f;
  return bits_float(float_bits(m) | (u & 0x80000000u));
}

}  // namespace qmoe::cuda
