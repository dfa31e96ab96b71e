// Tests of include/qmoe/formats.h: the scalar codecs (exhaustive over e4m3 / e2m1 codes, RNE ties,
// saturation, NaN), every array-level function against an independent loop written here, both int4
// scale layouts, the 128x4 swizzle (DESIGN.md 3.3 offsets on hand-computed points), the gate/up row
// orders, and one test per validation rule (the message names the argument, outputs stay untouched).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "qmoe/formats.h"

namespace qmoe {
namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

std::vector<float> random_floats(size_t n, float lo, float hi, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = dist(rng);
    if (x == 0.0f) x = 0.5f;  // never zeros unless a test puts them there
  }
  return v;
}

// Expects `fn` to throw qmoe::Error whose argument() is `argument` and whose message names it.
template <class Fn>
void expect_error(Fn fn, const std::string& argument, ErrorKind kind = ErrorKind::kValue) {
  try {
    fn();
    ADD_FAILURE() << "expected qmoe::Error for argument '" << argument << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("'" + argument + "'"), std::string::npos) << e.what();
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << e.what();
  }
}

// ---- scalar codecs -----------------------------------------------------------------------------

TEST(FormatsScalar, E4M3DecodeKnownCodes) {
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x3c), 1.5f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
}

TEST(FormatsScalar, E4M3ExhaustiveRoundTrip) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_float(static_cast<uint8_t>(c));
    EXPECT_EQ(float_to_e4m3(v), c) << "code " << c << " value " << v;
  }
}

TEST(FormatsScalar, E4M3RneBetweenEveryAdjacentPair) {
  for (int c = 0; c < 0x7e; ++c) {
    for (int sign : {0, 0x80}) {
      const float a = e4m3_to_float(static_cast<uint8_t>(c | sign));
      const float b = e4m3_to_float(static_cast<uint8_t>((c + 1) | sign));
      const float mid = (a + b) / 2;  // exact in fp32
      const int even = (c % 2 == 0) ? c : c + 1;
      EXPECT_EQ(float_to_e4m3(mid), even | sign) << "tie between codes " << c << " and " << c + 1;
      EXPECT_EQ(float_to_e4m3(std::nextafter(mid, a)), c | sign);
      EXPECT_EQ(float_to_e4m3(std::nextafter(mid, b)), (c + 1) | sign);
    }
  }
}

TEST(FormatsScalar, E4M3SaturationNaNAndTiny) {
  EXPECT_EQ(float_to_e4m3(449.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7e);
  EXPECT_EQ(float_to_e4m3(kInf), 0x7e);
  EXPECT_EQ(float_to_e4m3(-kInf), 0xfe);
  EXPECT_EQ(float_to_e4m3(kNaN), 0x7f);
  EXPECT_EQ(float_to_e4m3(-kNaN), 0xff);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // tie with the smallest subnormal -> 0
  EXPECT_EQ(float_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3(1e-45f), 0x00);
  EXPECT_EQ(float_to_e4m3(-1e-45f), 0x80);
  EXPECT_EQ(float_to_e4m3(std::ldexp(15.0f, -10)), 0x08);  // 7.5 * 2^-9 ties up to the even code 8
}

TEST(FormatsScalar, E2M1AllCodesTiesSaturationNaN) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(float_to_e2m1(e2m1_to_float(static_cast<uint8_t>(c))), c);
  const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const int want[] = {0, 2, 2, 4, 4, 6, 6};
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(float_to_e2m1(ties[i]), want[i]) << ties[i];
    EXPECT_EQ(float_to_e2m1(-ties[i]), want[i] | 8) << -ties[i];
  }
  // Just above / below each midpoint.
  const float above[] = {0.2500001f, 0.7500001f, 1.2500001f, 1.7500001f, 2.5000002f, 3.5000002f, 5.0000005f};
  const int above_want[] = {1, 2, 3, 4, 5, 6, 7};
  for (int i = 0; i < 7; ++i) EXPECT_EQ(float_to_e2m1(above[i]), above_want[i]) << above[i];
  const float below[] = {0.2499999f, 0.7499999f, 1.2499999f, 1.7499999f, 2.4999998f, 3.4999998f, 4.9999995f};
  const int below_want[] = {0, 1, 2, 3, 4, 5, 6};
  for (int i = 0; i < 7; ++i) EXPECT_EQ(float_to_e2m1(below[i]), below_want[i]) << below[i];
  EXPECT_EQ(float_to_e2m1(7.0f), 0x7);
  EXPECT_EQ(float_to_e2m1(-1e9f), 0xf);
  EXPECT_EQ(float_to_e2m1(kInf), 0x7);
  EXPECT_EQ(float_to_e2m1(kNaN), 0x7);
  EXPECT_EQ(float_to_e2m1(-kNaN), 0x7);
  EXPECT_EQ(float_to_e2m1(-0.1f), 0x8);
}

TEST(FormatsScalar, UE8M0Ceil) {
  EXPECT_EQ(ue8m0_ceil(0.0f), 0);
  EXPECT_EQ(ue8m0_ceil(1.0f), 127);
  EXPECT_EQ(ue8m0_ceil(1.5f), 128);
  EXPECT_EQ(ue8m0_ceil(2.0f), 128);
  EXPECT_EQ(ue8m0_ceil(std::nextafter(2.0f, 3.0f)), 129);
  EXPECT_EQ(ue8m0_ceil(std::ldexp(1.0f, -127)), 0);
  EXPECT_EQ(ue8m0_ceil(std::nextafter(std::ldexp(1.0f, -127), 1.0f)), 1);
  EXPECT_EQ(ue8m0_ceil(std::ldexp(1.0f, -126)), 1);
  EXPECT_EQ(ue8m0_ceil(std::ldexp(1.0f, 127)), 254);
  EXPECT_EQ(ue8m0_ceil(std::ldexp(1.5f, 127)), 254);
  EXPECT_EQ(ue8m0_ceil(kInf), 254);
  EXPECT_EQ(ue8m0_ceil(kNaN), 255);
  EXPECT_EQ(ue8m0_to_float(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(ue8m0_to_float(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(ue8m0_to_float(255)));
  // Random positive values: the code is the smallest power of two >= v.
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits(0x00500000u, 0x7effffffu);
  for (int i = 0; i < 20000; ++i) {
    const float v = bits_float(bits(rng));
    const uint8_t c = ue8m0_ceil(v);
    ASSERT_GE(ue8m0_to_float(c), v);
    ASSERT_LT(ue8m0_to_float(static_cast<uint8_t>(c - 1)), v);
  }
}

TEST(FormatsScalar, BF16RneAndNaN) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);            // tie -> even
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);        // tie -> even (up)
  EXPECT_EQ(float_to_bf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3f81);
  EXPECT_EQ(float_to_bf16(kInf), 0x7f80);
  EXPECT_EQ(float_to_bf16(3.4e38f), 0x7f80);  // rounds past the largest bf16 to inf
  EXPECT_EQ(float_to_bf16(kNaN), 0x7fc0);
  EXPECT_EQ(float_to_bf16(-kNaN), 0xffc0);
  EXPECT_EQ(float_to_bf16(bits_float(0x7f800001u)), 0x7fc0);  // signalling NaN with a low payload
}

// ---- int4 ----------------------------------------------------------------------------------------

TEST(FormatsInt4, QuantizeMatchesIndependentLoopAndDequantizes) {
  const int64_t e = 2, n = 3, k = 384;
  std::vector<float> w = random_floats(e * n * k, -3.0f, 3.0f, 1);
  for (int i = 128; i < 256; ++i) w[i] = 0.0f;  // one all-zero group -> scale 1
  std::vector<int8_t> q(e * n * k / 2, static_cast<int8_t>(0xAA));
  std::vector<float> s(e * n * k / 128, kNaN);
  quantize_int4_g128(make_tensor(w.data(), DType::kFloat32, {e, n, k}),
                     make_tensor(q.data(), DType::kInt8, {e, n, k / 2}),
                     make_tensor(s.data(), DType::kFloat32, {e, n, k / 128}));
  for (int64_t g = 0; g < e * n * k / 128; ++g) {
    float amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(w[g * 128 + i]));
    const float want_s = amax == 0 ? 1.0f : amax / 7.0f;
    ASSERT_EQ(s[g], want_s) << g;
    for (int i = 0; i < 128; ++i) {
      const int want = static_cast<int>(std::min(7.0f, std::max(-8.0f, std::nearbyint(w[g * 128 + i] / want_s))));
      const uint8_t b = static_cast<uint8_t>(q[(g * 128 + i) / 2]);
      ASSERT_EQ(i % 2 == 0 ? int4_low(b) : int4_high(b), want) << g << " " << i;
    }
  }
  EXPECT_EQ(s[1], 1.0f);
  std::vector<float> out(e * n * k, kNaN);
  dequantize_int4_g128(make_tensor(q.data(), DType::kInt4x2, {e, n, k / 2}),
                       make_tensor(s.data(), DType::kFloat32, {e, n, k / 128}),
                       make_tensor(out.data(), DType::kFloat32, {e, n, k}));
  for (size_t i = 0; i < w.size(); ++i) ASSERT_LE(std::fabs(out[i] - w[i]), s[i / 128] * 0.5001f) << i;
}

TEST(FormatsInt4, QuantizeBf16InputAndNonFiniteGroups) {
  const int64_t k = 256;
  std::vector<float> wf = random_floats(k, -1.0f, 1.0f, 2);
  wf[3] = kNaN;    // group 0 is NaN
  wf[200] = kInf;  // group 1 is inf
  std::vector<uint16_t> w(k);
  for (int i = 0; i < k; ++i) w[i] = float_to_bf16(wf[i]);
  std::vector<uint8_t> q(k / 2, 0xAA);
  std::vector<float> s(2, 0.0f);
  quantize_int4_g128(make_tensor(w.data(), DType::kBFloat16, {1, k}), make_tensor(q.data(), DType::kUInt8, {1, k / 2}),
                     make_tensor(s.data(), DType::kFloat32, {1, 2}));
  EXPECT_TRUE(std::isnan(s[0]));
  EXPECT_TRUE(std::isinf(s[1]));
  for (auto b : q) EXPECT_EQ(b, 0);
  std::vector<float> out(k, 0.0f);
  dequantize_int4_g128(make_tensor(q.data(), DType::kUInt8, {1, k / 2}), make_tensor(s.data(), DType::kFloat32, {1, 2}),
                       make_tensor(out.data(), DType::kFloat32, {1, k}));
  for (auto v : out) EXPECT_TRUE(std::isnan(v));  // 0 * NaN, 0 * inf: the non-finite value is not hidden
}

TEST(FormatsInt4, DequantizeWithBf16Scales) {
  const int64_t k = 128;
  std::vector<uint8_t> q(k / 2);
  for (int i = 0; i < k / 2; ++i) q[i] = static_cast<uint8_t>(i * 37 + 11);
  const uint16_t s = float_to_bf16(0.3f);
  std::vector<float> out(k, kNaN);
  dequantize_int4_g128(make_tensor(q.data(), DType::kInt8, {k / 2}), make_tensor((void*)&s, DType::kBFloat16, {1}),
                       make_tensor(out.data(), DType::kFloat32, {k}));
  for (int i = 0; i < k; ++i) {
    const int v = i % 2 ? int4_high(q[i / 2]) : int4_low(q[i / 2]);
    ASSERT_EQ(out[i], v * bf16_to_float(s));
  }
}

TEST(FormatsInt4, PackUnpackRoundTripAndNibbleOrder) {
  std::vector<int8_t> v(64);
  for (int i = 0; i < 64; ++i) v[i] = static_cast<int8_t>((i * 5 + 3) % 16 - 8);
  std::vector<uint8_t> p(32, 0xAA);
  pack_int4(make_tensor(v.data(), DType::kInt8, {2, 32}), make_tensor(p.data(), DType::kInt4x2, {2, 16}));
  for (int i = 0; i < 32; ++i) EXPECT_EQ(p[i], ((v[2 * i] & 0xf) | ((v[2 * i + 1] & 0xf) << 4))) << i;
  std::vector<int8_t> back(64, 99);
  unpack_int4(make_tensor(p.data(), DType::kInt4x2, {2, 16}), make_tensor(back.data(), DType::kInt8, {2, 32}));
  EXPECT_EQ(back, v);
  int8_t pair[2] = {-8, 7};
  uint8_t one = 0;
  pack_int4(make_tensor(pair, DType::kInt8, {2}), make_tensor(&one, DType::kUInt8, {1}));
  EXPECT_EQ(one, 0x78);  // even index (-8 = 0x8) in the low nibble
}

TEST(FormatsInt4, ScaleLayoutShapes) {
  int64_t s[3];
  int4_scale_layout_shape(4, 10, 1024, s);
  EXPECT_EQ(s[0], 4); EXPECT_EQ(s[1], 2); EXPECT_EQ(s[2], 40);
  int4_scale_layout_shape(4, 10, 384, s);
  EXPECT_EQ(s[0], 4); EXPECT_EQ(s[1], 3); EXPECT_EQ(s[2], 10);
  expect_error([&] { int4_scale_layout_shape(4, 10, 100, s); }, "k");
}

void check_interleave(int64_t e, int64_t n, int64_t g, DType dt) {
  const int size = dtype_size(dt);
  std::vector<float> logical_f = random_floats(e * n * g, 0.01f, 2.0f, 3);
  std::vector<uint8_t> logical(e * n * g * size);
  for (int64_t i = 0; i < e * n * g; ++i) {
    if (dt == DType::kFloat32) std::memcpy(&logical[i * 4], &logical_f[i], 4);
    else { uint16_t h = float_to_bf16(logical_f[i]); std::memcpy(&logical[i * 2], &h, 2); }
  }
  const bool wide = g % 4 == 0;
  std::vector<uint8_t> stored(logical.size(), 0xAA);
  TensorRef st = wide ? make_tensor(stored.data(), dt, {e, g / 4, 4 * n}) : make_tensor(stored.data(), dt, {e, g, n});
  interleave_int4_scales(make_tensor(logical.data(), dt, {e, n, g}), st);
  for (int64_t a = 0; a < e; ++a)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < g; ++j) {
        const int64_t src = (a * n + i) * g + j;
        const int64_t dst = wide ? (a * (g / 4) + j / 4) * 4 * n + 4 * i + j % 4 : (a * g + j) * n + i;
        ASSERT_EQ(0, std::memcmp(&stored[dst * size], &logical[src * size], size)) << a << " " << i << " " << j;
      }
  std::vector<uint8_t> back(logical.size(), 0xAA);
  deinterleave_int4_scales(st, make_tensor(back.data(), dt, {e, n, g}));
  EXPECT_EQ(back, logical);
}

TEST(FormatsInt4, InterleaveScalesKMultipleOf512) { check_interleave(3, 5, 8, DType::kBFloat16); }
TEST(FormatsInt4, InterleaveScalesKNotMultipleOf512) { check_interleave(3, 5, 3, DType::kBFloat16); }
TEST(FormatsInt4, InterleaveScalesFloat32) {
  check_interleave(2, 4, 4, DType::kFloat32);
  check_interleave(2, 4, 6, DType::kFloat32);
}

// ---- FP8 -------------------------------------------------------------------------------------------

TEST(FormatsFp8, PerTensorAndPerTokenQuantize) {
  const int64_t r = 5, k = 48;
  std::vector<float> x = random_floats(r * k, -600.0f, 600.0f, 4);
  x[7] = kNaN; x[8] = -kNaN; x[9] = kInf; x[10] = 1e-6f;
  std::vector<float> scale_t = {0.8f};
  std::vector<uint8_t> q(r * k, 0xAA);
  quantize_fp8(make_tensor(x.data(), DType::kFloat32, {r, k}), make_tensor(scale_t.data(), DType::kFloat32, {1}),
               make_tensor(q.data(), DType::kFloat8E4M3, {r, k}));
  for (int64_t i = 0; i < r * k; ++i) {
    if (std::isnan(x[i])) ASSERT_EQ(q[i], std::signbit(x[i]) ? 0xff : 0x7f);
    else ASSERT_EQ(q[i], float_to_e4m3(x[i] / 0.8f)) << i;
  }
  EXPECT_EQ(q[9], 0x7e);  // inf saturates
  std::vector<float> scale_r(r, kNaN);
  fp8_dynamic_scale(make_tensor(x.data(), DType::kFloat32, {r, k}), make_tensor(scale_r.data(), DType::kFloat32, {r}));
  EXPECT_TRUE(std::isnan(scale_r[0]));  // row 0 holds the NaNs
  for (int64_t row = 1; row < r; ++row) {
    float amax = 0;
    for (int i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[row * k + i]));
    EXPECT_EQ(scale_r[row], amax / 448.0f);
  }
  std::fill(q.begin(), q.end(), 0xAA);
  quantize_fp8(make_tensor(x.data(), DType::kFloat32, {r, k}), make_tensor(scale_r.data(), DType::kFloat32, {r}),
               make_tensor(q.data(), DType::kUInt8, {r, k}));
  for (int64_t i = k; i < r * k; ++i) ASSERT_EQ(q[i], float_to_e4m3(x[i] / scale_r[i / k])) << i;
  std::vector<float> out(r * k, kNaN);
  dequantize_fp8(make_tensor(q.data(), DType::kUInt8, {r, k}), make_tensor(scale_r.data(), DType::kFloat32, {r}),
                 make_tensor(out.data(), DType::kFloat32, {r, k}));
  for (int64_t i = k; i < r * k; ++i) {
    ASSERT_EQ(out[i], e4m3_to_float(q[i]) * scale_r[i / k]);
    ASSERT_LE(std::fabs(out[i] - x[i]), std::fabs(x[i]) * 0.0625f + scale_r[i / k] * std::ldexp(1.0f, -9)) << i;
  }
}

TEST(FormatsFp8, DynamicScaleZeroAndPerTensor) {
  std::vector<float> x(64, 0.0f);
  float s = kNaN;
  fp8_dynamic_scale(make_tensor(x.data(), DType::kFloat32, {4, 16}), make_tensor(&s, DType::kFloat32, {1}));
  EXPECT_EQ(s, 1.0f);
  x[17] = -896.0f;
  fp8_dynamic_scale(make_tensor(x.data(), DType::kFloat32, {4, 16}), make_tensor(&s, DType::kFloat32, {1}));
  EXPECT_EQ(s, 2.0f);
  std::vector<float> rows(4, kNaN);
  fp8_dynamic_scale(make_tensor(x.data(), DType::kFloat32, {2, 2, 16}), make_tensor(rows.data(), DType::kFloat32, {2, 2}));
  EXPECT_EQ(rows[0], 1.0f);
  EXPECT_EQ(rows[1], 2.0f);
}

// ---- NVFP4 -----------------------------------------------------------------------------------------

TEST(FormatsNvfp4, HandComputedBlock) {
  // amax 6, gs 1 -> sf = e4m3(1.0) = 0x38; elements quantize on the e2m1 grid directly.
  std::vector<float> x = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                          -0.25f, -0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, -6.0f};
  std::vector<uint8_t> q(8, 0xAA), sf(1, 0xAA);
  quantize_nvfp4(make_tensor(x.data(), DType::kFloat32, {16}), 1.0f, make_tensor(q.data(), DType::kUInt8, {8}),
                 make_tensor(sf.data(), DType::kFloat8E4M3, {1}));
  EXPECT_EQ(sf[0], 0x38);
  const uint8_t want[8] = {0x10, 0x32, 0x54, 0x76, 0xA8, 0x42, 0x64, 0xF6};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(q[i], want[i]) << i;
}

TEST(FormatsNvfp4, RandomMatchesIndependentLoopAndNaNZeroBlocks) {
  const int64_t r = 3, k = 64;
  const float gs = 448.0f * 6.0f / 20.0f;
  std::vector<float> x = random_floats(r * k, -20.0f, 20.0f, 5);
  for (int i = 16; i < 32; ++i) x[i] = 0.0f;  // zero block
  x[40] = kNaN;                               // NaN block (block 2)
  x[70] = 1e-30f;
  std::vector<uint16_t> xb(r * k);
  for (int64_t i = 0; i < r * k; ++i) xb[i] = float_to_bf16(x[i]);
  std::vector<uint8_t> q(r * k / 2, 0xAA), sf(r * k / 16, 0xAA);
  quantize_nvfp4(make_tensor(xb.data(), DType::kBFloat16, {r, k}), gs, make_tensor(q.data(), DType::kFloat4E2M1x2, {r, k / 2}),
                 make_tensor(sf.data(), DType::kUInt8, {r, k / 16}));
  for (int64_t b = 0; b < r * k / 16; ++b) {
    float amax = 0;
    bool nan = false;
    for (int i = 0; i < 16; ++i) {
      const float v = bf16_to_float(xb[b * 16 + i]);
      nan |= std::isnan(v);
      amax = std::max(amax, std::fabs(v));
    }
    const uint8_t want_sf = nan ? 0x7f : float_to_e4m3(gs * amax / 6.0f);
    ASSERT_EQ(sf[b], want_sf) << b;
    const float sfv = e4m3_to_float(want_sf);
    for (int i = 0; i < 16; ++i) {
      const int64_t idx = b * 16 + i;
      const uint8_t code = (idx % 2) ? q[idx / 2] >> 4 : q[idx / 2] & 0xf;
      const uint8_t want = nan ? 0x7 : sfv == 0 ? 0 : float_to_e2m1(bf16_to_float(xb[idx]) * gs / sfv);
      ASSERT_EQ(code, want) << idx;
    }
  }
  EXPECT_EQ(sf[1], 0x00);
  EXPECT_EQ(sf[2], 0x7f);
  std::vector<float> out(r * k, 0.5f);
  dequantize_nvfp4(make_tensor(q.data(), DType::kUInt8, {r, k / 2}), make_tensor(sf.data(), DType::kFloat8E4M3, {r, k / 16}),
                   gs, make_tensor(out.data(), DType::kFloat32, {r, k}));
  for (int64_t i = 0; i < r * k; ++i) {
    const int64_t b = i / 16;
    if (b == 2) { ASSERT_TRUE(std::isnan(out[i])); continue; }
    const uint8_t code = (i % 2) ? q[i / 2] >> 4 : q[i / 2] & 0xf;
    ASSERT_EQ(out[i], e2m1_to_float(code) * e4m3_to_float(sf[b]) / gs);
    const float step = e4m3_to_float(sf[b]) / gs;  // largest e2m1 gap is 2 units of the block scale
    ASSERT_LE(std::fabs(out[i] - bf16_to_float(xb[i])), step * 1.0001f + 1e-6f) << i;
  }
}

// ---- MX --------------------------------------------------------------------------------------------

void check_mx(bool fp4) {
  const int64_t r = 4, k = 96;
  const float max_code = fp4 ? 6.0f : 448.0f;
  std::vector<float> x = random_floats(r * k, -1.0f, 1.0f, 6);
  for (int64_t i = 0; i < r * k; ++i) x[i] *= std::ldexp(1.0f, static_cast<int>(i / 32) * 7 - 40);  // wide range
  for (int i = 32; i < 64; ++i) x[i] = 0.0f;  // zero block 1
  x[100] = -kNaN;                             // NaN block 3
  x[150] = kInf;                              // inf block 4
  x[200] = 1e-40f;                            // fp32 denormal inside block 6
  const int per = fp4 ? 2 : 1;
  std::vector<uint8_t> q(r * k / per, 0xAA), sf(r * k / 32, 0xAA);
  TensorRef qt = fp4 ? make_tensor(q.data(), DType::kFloat4E2M1x2, {r, k / 2}) : make_tensor(q.data(), DType::kFloat8E4M3, {r, k});
  TensorRef st = make_tensor(sf.data(), DType::kUE8M0, {r, k / 32});
  TensorRef xt = make_tensor(x.data(), DType::kFloat32, {r, k});
  if (fp4) quantize_mxfp4(xt, qt, st); else quantize_mxfp8(xt, qt, st);
  EXPECT_EQ(sf[1], 0);
  EXPECT_EQ(sf[3], 0xff);
  EXPECT_EQ(sf[4], 254);
  for (int64_t b = 0; b < r * k / 32; ++b) {
    float amax = 0;
    bool nan = false;
    for (int i = 0; i < 32; ++i) { nan |= std::isnan(x[b * 32 + i]); amax = std::max(amax, std::fabs(x[b * 32 + i])); }
    if (!nan && amax > 0 && std::isfinite(amax)) {
      const float scale = ue8m0_to_float(sf[b]);
      ASSERT_GE(scale * max_code, amax) << b;                       // no element saturates
      if (sf[b] > 0) { ASSERT_LT(scale * 0.5f * max_code, amax) << b; }  // smallest such power of two
    }
    for (int i = 0; i < 32; ++i) {
      const int64_t idx = b * 32 + i;
      const uint8_t code = fp4 ? ((idx % 2) ? q[idx / 2] >> 4 : q[idx / 2] & 0xf) : q[idx];
      const float v = x[idx] / ue8m0_to_float(sf[b]);
      const uint8_t want = nan ? (fp4 ? 0x7 : 0x7f) : fp4 ? float_to_e2m1(v) : float_to_e4m3(v);
      ASSERT_EQ(code, want) << idx;
    }
  }
  std::vector<float> out(r * k, 0.25f);
  TensorRef ot = make_tensor(out.data(), DType::kFloat32, {r, k});
  if (fp4) dequantize_mxfp4(qt, st, ot); else dequantize_mxfp8(qt, st, ot);
  for (int64_t i = 0; i < r * k; ++i) {
    const int64_t b = i / 32;
    const uint8_t code = fp4 ? ((i % 2) ? q[i / 2] >> 4 : q[i / 2] & 0xf) : q[i];
    const float elem = fp4 ? e2m1_to_float(code) : e4m3_to_float(code);
    if (b == 3) ASSERT_TRUE(std::isnan(out[i]));
    else ASSERT_EQ(out[i], elem * ue8m0_to_float(sf[b])) << i;
  }
}

TEST(FormatsMx, Mxfp4) { check_mx(true); }
TEST(FormatsMx, Mxfp8) { check_mx(false); }

// ---- swizzle -----------------------------------------------------------------------------------------

TEST(FormatsSwizzle, OffsetFormulaHandPoints) {
  // Mt = 2, Kt = 3 (rows padded to 256, cols to 12).
  EXPECT_EQ(swizzled_offset(0, 0, 0, 2, 3), 0);
  EXPECT_EQ(swizzled_offset(0, 0, 3, 2, 3), 3);
  EXPECT_EQ(swizzled_offset(0, 1, 0, 2, 3), 16);
  EXPECT_EQ(swizzled_offset(0, 32, 0, 2, 3), 4);
  EXPECT_EQ(swizzled_offset(0, 33, 2, 2, 3), 16 + 4 + 2);
  EXPECT_EQ(swizzled_offset(0, 127, 3, 2, 3), 31 * 16 + 3 * 4 + 3);  // 511: last byte of tile 0
  EXPECT_EQ(swizzled_offset(0, 0, 4, 2, 3), 512);
  EXPECT_EQ(swizzled_offset(0, 128, 0, 2, 3), 3 * 512);
  EXPECT_EQ(swizzled_offset(0, 200, 9, 2, 3), (3 + 2) * 512 + (200 % 32) * 16 + 2 * 4 + 1);  // 2560+128+9
  EXPECT_EQ(swizzled_offset(1, 0, 0, 2, 3), 6 * 512);
  EXPECT_EQ(swizzled_offset(1, 255, 11, 2, 3), 12 * 512 - 1);
}

TEST(FormatsSwizzle, RoundTripWithPaddingAndEveryByteOnce) {
  const int64_t e = 2, rows = 200, cols = 6, rp = 256, cp = 8;
  std::vector<uint8_t> sf(e * rows * cols);
  std::mt19937 rng(8);
  for (auto& b : sf) b = static_cast<uint8_t>(1 + rng() % 255);  // nonzero so padding is visible
  std::vector<uint8_t> out(e * rp * cp, 0xAA);
  swizzle_scales_128x4(make_tensor(sf.data(), DType::kUE8M0, {e, rows, cols}), make_tensor(out.data(), DType::kUInt8, {e, rp, cp}));
  std::vector<int> hits(out.size(), 0);
  for (int64_t a = 0; a < e; ++a)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t off = ((a * 2 + r / 128) * 2 + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4;
        ASSERT_EQ(out[off], sf[(a * rows + r) * cols + c]);
        hits[off]++;
      }
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_LE(hits[i], 1);
    if (!hits[i]) { ASSERT_EQ(out[i], 0) << "padding byte " << i; }
  }
  std::vector<uint8_t> back(sf.size(), 0);
  unswizzle_scales_128x4(make_tensor(out.data(), DType::kUInt8, {e, rp, cp}), make_tensor(back.data(), DType::kUE8M0, {e, rows, cols}));
  EXPECT_EQ(back, sf);
  // 2-D form equals expert 0 of the 3-D form.
  std::vector<uint8_t> out2(rp * cp, 0xAA);
  swizzle_scales_128x4(make_tensor(sf.data(), DType::kUE8M0, {rows, cols}), make_tensor(out2.data(), DType::kUE8M0, {rp, cp}));
  EXPECT_TRUE(std::equal(out2.begin(), out2.end(), out.begin()));
}

// ---- gate/up ------------------------------------------------------------------------------------------

TEST(FormatsGateUp, ReorderAndRoundTrip) {
  const int64_t e = 2, inter = 128, c = 3;
  std::vector<int32_t> w(e * 2 * inter * c);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<int32_t>(i * 7 + 1);
  std::vector<int32_t> fi(w.size(), -1);
  gate_up_sglang_to_flashinfer(make_tensor(w.data(), DType::kInt32, {e, 2 * inter, c}),
                               make_tensor(fi.data(), DType::kInt32, {e, 2 * inter, c}));
  for (int64_t a = 0; a < e; ++a)
    for (int64_t row = 0; row < 2 * inter; ++row) {
      const int64_t block = row / 64, t = row % 64;
      const int64_t src = (block % 2 == 0) ? inter + (block / 2) * 64 + t : (block / 2) * 64 + t;  // up, then gate
      for (int64_t j = 0; j < c; ++j) ASSERT_EQ(fi[(a * 2 * inter + row) * c + j], w[(a * 2 * inter + src) * c + j]);
    }
  EXPECT_EQ(fi[0], w[inter * c]);  // FlashInfer row 0 = up row 0 = SGLang row I
  std::vector<int32_t> back(w.size(), -1);
  gate_up_flashinfer_to_sglang(make_tensor(fi.data(), DType::kInt32, {e, 2 * inter, c}),
                               make_tensor(back.data(), DType::kInt32, {e, 2 * inter, c}));
  EXPECT_EQ(back, w);
}

// ---- elementwise codecs --------------------------------------------------------------------------------

TEST(FormatsElementwise, EncodeDecode) {
  std::vector<float> x = {1.0f, -3.3f, kNaN, 500.0f, 0.2f};
  std::vector<uint8_t> codes(5, 0xAA);
  encode_elementwise(make_tensor(x.data(), DType::kFloat32, {5}), ScalarCodec::kE4M3, make_tensor(codes.data(), DType::kUInt8, {5}));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(codes[i], float_to_e4m3(x[i]));
  std::vector<float> out(5, 0.0f);
  decode_elementwise(make_tensor(codes.data(), DType::kUInt8, {5}), ScalarCodec::kE2M1, make_tensor(out.data(), DType::kFloat32, {5}));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(out[i], e2m1_to_float(codes[i] & 0xf));
  std::vector<uint16_t> h(5);
  encode_elementwise(make_tensor(x.data(), DType::kFloat32, {5}), ScalarCodec::kBF16, make_tensor(h.data(), DType::kBFloat16, {5}));
  EXPECT_EQ(h[0], 0x3f80);
}

// ---- validation ------------------------------------------------------------------------------------------

TEST(FormatsValidation, OneTestPerRule) {
  std::vector<float> xf(4 * 256, 1.0f);
  std::vector<uint8_t> b8(4 * 256, 0xAA);
  std::vector<float> f2(4 * 256, kNaN);
  const std::vector<uint8_t> b8_before = b8;
  TensorRef w = make_tensor(xf.data(), DType::kFloat32, {4, 256});
  TensorRef q = make_tensor(b8.data(), DType::kInt8, {4, 128});
  TensorRef s = make_tensor(f2.data(), DType::kFloat32, {4, 2});
  // dtype
  expect_error([&] { quantize_int4_g128(make_tensor(xf.data(), DType::kInt32, {4, 256}), q, s); }, "w", ErrorKind::kType);
  expect_error([&] { quantize_int4_g128(w, make_tensor(b8.data(), DType::kFloat8E4M3, {4, 128}), s); }, "q", ErrorKind::kType);
  expect_error([&] { quantize_int4_g128(w, q, make_tensor(f2.data(), DType::kBFloat16, {4, 2})); }, "scales", ErrorKind::kType);
  // K divisibility
  expect_error([&] { quantize_int4_g128(make_tensor(xf.data(), DType::kFloat32, {4, 200}), q, s); }, "w");
  // shape
  expect_error([&] { quantize_int4_g128(w, make_tensor(b8.data(), DType::kInt8, {4, 64}), s); }, "q");
  expect_error([&] { quantize_int4_g128(w, q, make_tensor(f2.data(), DType::kFloat32, {2, 4})); }, "scales");
  // device
  TensorRef wc = w;
  wc.device = Device::kCUDA;
  expect_error([&] { quantize_int4_g128(wc, q, s); }, "w");
  // contiguity
  TensorRef ws = w;
  ws.strides[1] = 2;
  expect_error([&] { quantize_int4_g128(ws, q, s); }, "w");
  // aliasing
  expect_error([&] { quantize_int4_g128(w, make_tensor(xf.data(), DType::kInt8, {4, 128}), s); }, "q");
  EXPECT_EQ(b8, b8_before);
  for (float v : f2) EXPECT_TRUE(std::isnan(v));  // nothing written by any failed call

  // pack range
  std::vector<int8_t> vals = {1, 2, 8, 0};
  expect_error([&] { pack_int4(make_tensor(vals.data(), DType::kInt8, {4}), make_tensor(b8.data(), DType::kInt4x2, {2})); }, "values");
  EXPECT_EQ(b8, b8_before);
  // interleave shapes / dtype
  expect_error([&] { interleave_int4_scales(make_tensor(xf.data(), DType::kFloat32, {2, 4, 8}), make_tensor(f2.data(), DType::kFloat32, {2, 8, 4})); }, "out");
  expect_error([&] { interleave_int4_scales(make_tensor(xf.data(), DType::kFloat32, {2, 4, 8}), make_tensor(f2.data(), DType::kBFloat16, {2, 2, 16})); }, "out", ErrorKind::kType);
  expect_error([&] { interleave_int4_scales(make_tensor(xf.data(), DType::kFloat32, {8, 8}), make_tensor(f2.data(), DType::kFloat32, {2, 16})); }, "scales");
  // fp8 scale shape
  expect_error([&] { quantize_fp8(w, make_tensor(f2.data(), DType::kFloat32, {3}), make_tensor(b8.data(), DType::kUInt8, {4, 256})); }, "scale");
  expect_error([&] { quantize_fp8(w, make_tensor(f2.data(), DType::kFloat32, {1}), make_tensor(b8.data(), DType::kInt8, {4, 256})); }, "q", ErrorKind::kType);
  // nvfp4 global scale, sf shape, block divisibility
  expect_error([&] { quantize_nvfp4(w, 0.0f, make_tensor(b8.data(), DType::kUInt8, {4, 128}), make_tensor(b8.data() + 600, DType::kUInt8, {4, 16})); }, "global_scale");
  expect_error([&] { quantize_nvfp4(w, kNaN, make_tensor(b8.data(), DType::kUInt8, {4, 128}), make_tensor(b8.data() + 600, DType::kUInt8, {4, 16})); }, "global_scale");
  expect_error([&] { quantize_nvfp4(w, 1.0f, make_tensor(b8.data(), DType::kUInt8, {4, 128}), make_tensor(b8.data() + 600, DType::kUInt8, {4, 8})); }, "sf");
  expect_error([&] { quantize_nvfp4(make_tensor(xf.data(), DType::kFloat32, {4, 24}), 1.0f, make_tensor(b8.data(), DType::kUInt8, {4, 12}), make_tensor(b8.data() + 600, DType::kUInt8, {4, 1})); }, "x");
  expect_error([&] { quantize_nvfp4(w, 1.0f, make_tensor(b8.data(), DType::kUInt8, {4, 128}), make_tensor(b8.data() + 100, DType::kUInt8, {4, 16})); }, "sf");  // overlaps q
  // mx dtypes
  expect_error([&] { quantize_mxfp8(w, make_tensor(b8.data(), DType::kUInt8, {4, 256}), make_tensor(f2.data(), DType::kFloat8E4M3, {4, 8})); }, "sf", ErrorKind::kType);
  expect_error([&] { dequantize_mxfp4(make_tensor(b8.data(), DType::kInt8, {4, 128}), make_tensor(b8.data() + 600, DType::kUInt8, {4, 8}), make_tensor(xf.data(), DType::kFloat32, {4, 256})); }, "q", ErrorKind::kType);
  expect_error([&] { dequantize_mxfp4(make_tensor(b8.data(), DType::kUInt8, {4, 128}), make_tensor(b8.data() + 600, DType::kUInt8, {4, 8}), make_tensor(xf.data(), DType::kBFloat16, {4, 256})); }, "out", ErrorKind::kType);
  EXPECT_EQ(b8, b8_before);
  // swizzle shapes
  expect_error([&] { swizzle_scales_128x4(make_tensor(b8.data(), DType::kUInt8, {100, 5}), make_tensor(b8.data() + 1000, DType::kUInt8, {128, 5})); }, "out");
  expect_error([&] { swizzle_scales_128x4(make_tensor(b8.data(), DType::kUInt8, {1, 1, 100, 5}), make_tensor(b8.data() + 1000, DType::kUInt8, {1, 1, 128, 8})); }, "sf");
  expect_error([&] { swizzle_scales_128x4(make_tensor(xf.data(), DType::kFloat32, {10, 4}), make_tensor(b8.data(), DType::kUInt8, {128, 4})); }, "sf", ErrorKind::kType);
  expect_error([&] { unswizzle_scales_128x4(make_tensor(b8.data(), DType::kUInt8, {128, 8}), make_tensor(b8.data() + 1024, DType::kUInt8, {100, 3})); }, "swizzled");
  // gate/up
  expect_error([&] { gate_up_sglang_to_flashinfer(make_tensor(xf.data(), DType::kFloat32, {96, 2}), make_tensor(f2.data(), DType::kFloat32, {96, 2})); }, "w");
  expect_error([&] { gate_up_sglang_to_flashinfer(make_tensor(xf.data(), DType::kFloat32, {128, 2}), make_tensor(f2.data(), DType::kInt32, {128, 2})); }, "out", ErrorKind::kType);
  expect_error([&] { gate_up_flashinfer_to_sglang(make_tensor(xf.data(), DType::kFloat32, {128, 2}), make_tensor(f2.data(), DType::kFloat32, {128, 3})); }, "out");
  for (float v : f2) EXPECT_TRUE(std::isnan(v));
}

}  // namespace
}  // namespace qmoe
