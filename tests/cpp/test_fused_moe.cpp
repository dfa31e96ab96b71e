// Tests of the fused MoE CPU reference through the public entry (include/qmoe/fused_moe.h): every
// quant mode against expected values computed from DESIGN.md's formulas (fused_moe_case.h), a case
// computed by hand, the activations on known inputs, deterministic vs fused finalize, expert-parallel
// masking, the routed scaling factor, ReLU^2, both gate/up layouts, output dtypes, NaN propagation
// and model-shaped cases. Validation rules: test_fused_moe_validation.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "fused_moe_case.h"
#include "qmoe/formats.h"
#include "qmoe/fused_moe.h"
#include "reference/activations.h"

namespace {

using namespace fused_moe_test;

// ---------------------------------------------------------------------------------------------
// Activations on known inputs (double-precision formulas)
// ---------------------------------------------------------------------------------------------

double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(FusedMoeActivation, KnownValues) {
  namespace act = qmoe::activation;
  EXPECT_NEAR(act::sigmoid(0.0f), 0.5f, 1e-7);
  EXPECT_NEAR(act::swiglu(1.0f, 2.0f, 1.0f, 0.0f, kFltMax), 2.0 * sigmoid_d(1.0), 1e-6);
  EXPECT_NEAR(act::swiglu(-3.0f, 0.5f, 1.0f, 0.0f, kFltMax), -3.0 * sigmoid_d(-3.0) * 0.5, 1e-6);
  // gpt-oss: gate clamped above at 7 only, up clamped to [-7, 7], +beta.
  EXPECT_NEAR(act::swiglu(8.0f, -9.0f, 1.702f, 1.0f, 7.0f), 7.0 * sigmoid_d(1.702 * 7.0) * (-7.0 + 1.0), 1e-5);
  EXPECT_NEAR(act::swiglu(-9.0f, 2.0f, 1.702f, 1.0f, 7.0f), -9.0 * sigmoid_d(1.702 * -9.0) * 3.0, 1e-6);
  EXPECT_NEAR(act::swiglu(0.5f, 9.0f, 1.702f, 1.0f, 7.0f), 0.5 * sigmoid_d(0.851) * 8.0, 1e-6);
  const double g = 1.3, u = -0.7;
  EXPECT_NEAR(act::geglu_tanh(1.3f, -0.7f), 0.5 * g * (1 + std::tanh(0.7978845608 * (g + 0.044715 * g * g * g))) * u,
              1e-6);
  EXPECT_EQ(act::relu2(-3.0f), 0.0f);
  EXPECT_EQ(act::relu2(1.5f), 2.25f);
  EXPECT_NEAR(act::situ(0.7f, 3.0f, 1.75f, false, 0.0f), 1.75 * std::tanh(0.7 / 1.75) * sigmoid_d(0.7) * 3.0, 1e-6);
  EXPECT_NEAR(act::situ(0.7f, 3.0f, 0.8f, true, 1.5f),
              0.8 * std::tanh(0.7 / 0.8) * sigmoid_d(0.7) * 1.5 * std::tanh(3.0 / 1.5), 1e-6);
}

TEST(FusedMoeActivation, NanPropagates) {
  namespace act = qmoe::activation;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(act::swiglu(nan, 1.0f, 1.702f, 1.0f, 7.0f)));
  EXPECT_TRUE(std::isnan(act::swiglu(1.0f, nan, 1.702f, 1.0f, 7.0f)));
  EXPECT_TRUE(std::isnan(act::relu2(nan)));
  EXPECT_TRUE(std::isnan(act::geglu_tanh(nan, 1.0f)));
  EXPECT_TRUE(std::isnan(act::situ(1.0f, nan, 1.0f, true, 2.0f)));
}

// ---------------------------------------------------------------------------------------------
// A case computed by hand
// ---------------------------------------------------------------------------------------------

// w4a8_int4, H = I = 128, x = 1 (bf16), a1 = a2 = 1/64, int4 codes 1 (gate, W2) and 2 (up) with
// scale 1/128:  xq = e4m3(1 * 64) = 64;  g = (1/64) * 128 * 64 * 1/128 = 1;  u = 2;
// v = silu(1) * 2 = 1.46211716;  e4m3(v * 64 = 93.58) = 96 (grid step 8 in [64, 128));
// y = (1/64) * 128 * 96 * 1/128 = 1.5;  out = rsf * (0.5 + 0.25) * 1.5 = 2.25 with rsf = 2.
// Defaults a caller gets without setting them: FlashInfer's (fused finalize, PDL on).
TEST(FusedMoe, ParamsDefaultsFollowFlashInfer) {
  const qmoe::FusedMoeParams p;
  EXPECT_FALSE(p.deterministic);
  EXPECT_TRUE(p.enable_pdl);
  EXPECT_EQ(p.routed_scaling_factor, 1.0f);
  EXPECT_EQ(p.aux_stream, nullptr);
}

TEST(FusedMoe, HandComputedW4A8Int4) {
  const int64_t H = 128, I = 128;
  std::vector<uint16_t> x(H, qmoe::float_to_bf16(1.0f));
  std::vector<uint8_t> w1(2 * I * H / 2), w2(H * I / 2, qmoe::pack_int4_pair(1, 1));
  for (int64_t r = 0; r < 2 * I; ++r)
    for (int64_t b = 0; b < H / 2; ++b) w1[r * H / 2 + b] = r < I ? qmoe::pack_int4_pair(1, 1) : qmoe::pack_int4_pair(2, 2);
  std::vector<uint16_t> s1(2 * I, qmoe::float_to_bf16(1.0f / 128)), s2(H, qmoe::float_to_bf16(1.0f / 128));
  std::vector<float> a1 = {1.0f / 64}, a2 = {1.0f / 64}, wts = {0.5f, 0.25f};
  std::vector<int32_t> ids = {0, 0};
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (bool det : {false, true}) {
      std::vector<float> out_f(H, NAN);
      std::vector<uint16_t> out_b(H, 0x7fc0);
      FusedMoeParams p;
      p.quant_mode = QuantMode::kW4A8Int4;
      p.x = qmoe::make_tensor(x.data(), DType::kBFloat16, {1, H});
      p.x_scale = qmoe::make_tensor(a1.data(), DType::kFloat32, {1});
      p.fc2_input_scale = qmoe::make_tensor(a2.data(), DType::kFloat32, {1});
      p.topk_ids = qmoe::make_tensor(ids.data(), DType::kInt32, {1, 2});
      p.topk_weights = qmoe::make_tensor(wts.data(), DType::kFloat32, {1, 2});
      p.w1 = qmoe::make_tensor(w1.data(), DType::kInt4x2, {1, 2 * I, H / 2});
      p.w1_scale = qmoe::make_tensor(s1.data(), DType::kBFloat16, {1, 1, 2 * I});  // K/128 = 1 group
      p.w2 = qmoe::make_tensor(w2.data(), DType::kInt4x2, {1, H, I / 2});
      p.w2_scale = qmoe::make_tensor(s2.data(), DType::kBFloat16, {1, 1, H});
      p.output = dt == DType::kFloat32 ? qmoe::make_tensor(out_f.data(), dt, {1, H})
                                       : qmoe::make_tensor(out_b.data(), dt, {1, H});
      p.num_experts = 1;
      p.routed_scaling_factor = 2.0f;
      p.deterministic = det;
      qmoe::fused_moe(p);
      for (int64_t n = 0; n < H; ++n) {
        const float got = dt == DType::kFloat32 ? out_f[n] : qmoe::bf16_to_float(out_b[n]);
        ASSERT_EQ(got, 2.25f) << "n=" << n << " det=" << det;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Every mode against the formulas
// ---------------------------------------------------------------------------------------------

TEST(FusedMoe, W4A8Int4StaticScales) {
  Config c;
  c.mode = QuantMode::kW4A8Int4;
  c.H = 512;  // K % 512 == 0: packed-4 scale layout for W1; I = 128: transposed layout for W2
  Case cs = make_case(c, 1);
  run_and_check(cs, "a1 [1], a2 [1]");
}

TEST(FusedMoe, W4A8Int4PerTokenA1AndDynamicA2) {
  Config c;
  c.mode = QuantMode::kW4A8Int4;
  c.a1 = 1;
  c.a2_dynamic = true;
  c.alphas = true;
  Case cs = make_case(c, 2);
  run_and_check(cs, "a1 [T], dynamic a2");
}

TEST(FusedMoe, W4A8Int4DynamicA1NoAlphas) {
  Config c;
  c.mode = QuantMode::kW4A8Int4;
  c.a1 = 2;
  c.alphas = false;
  Case cs = make_case(c, 3);
  run_and_check(cs, "dynamic a1, no w*_alpha");
}

TEST(FusedMoe, W4A8Int4PreQuantizedX) {
  Config c;
  c.mode = QuantMode::kW4A8Int4;
  c.x_e4m3 = true;
  c.a1 = 1;
  c.k = 3;
  Case cs = make_case(c, 4);
  for (auto& a : cs.a1) a *= 0.01f;  // x holds e4m3 values up to 448
  run_and_check(cs, "e4m3 x");
}

TEST(FusedMoe, W4A16Int4) {
  Config c;
  c.mode = QuantMode::kW4A16Int4;
  Case cs = make_case(c, 5);
  run_and_check(cs, "with alphas");
  c.alphas = false;
  Case cs2 = make_case(c, 6);
  run_and_check(cs2, "without alphas");
}

TEST(FusedMoe, W4A4PerTensor) {
  Config c;
  c.mode = QuantMode::kW4A4;
  c.I = 64;
  Case cs = make_case(c, 7);
  run_and_check(cs, "w4a4");
}

TEST(FusedMoe, W4A4PerToken) {
  Config c;
  c.mode = QuantMode::kW4A4;
  c.per_token = true;
  c.I = 64;
  Case cs = make_case(c, 8);
  run_and_check(cs, "w4a4 per-token");
}

// A per-token row whose intermediate is exactly zero contributes 0 (ReLU^2 of all-negative
// pre-activations), while the other rows still count.
TEST(FusedMoe, W4A4PerTokenZeroRow) {
  Config c;
  c.mode = QuantMode::kW4A4;
  c.per_token = true;
  c.act = Activation::kRelu2;
  c.I = 64;
  c.T = 2;
  c.k = 2;
  c.E = 2;
  Case cs = make_case(c, 9);
  cs.ids = {0, 1, 1, 0};
  // Expert 0: every W1 nibble = -2 (code 0xC) while x >= 0 (codes 0..7): the pre-activation is <= 0.
  std::fill(cs.w1.packed.begin(), cs.w1.packed.begin() + static_cast<long>(cs.w1.packed.size() / 2), 0xCC);
  for (auto& b : cs.x8) b &= 0x77;
  run_and_check(cs, "zero row");
  // Token 0 with only expert 0 is exactly zero.
  cs.ids = {0, 0, 1, 0};
  cs.poison();
  qmoe::fused_moe(cs.params());
  for (int64_t n = 0; n < c.H; ++n) ASSERT_EQ(cs.out_at(n), 0.0f);
}

TEST(FusedMoe, W4A8Mx) {
  Config c;
  c.mode = QuantMode::kW4A8Mx;
  c.I = 64;
  Case cs = make_case(c, 10);
  run_and_check(cs, "w4a8 mx");
}

TEST(FusedMoe, W4A16Nvfp4) {
  Config c;
  c.mode = QuantMode::kW4A16;
  c.I = 64;
  c.H = 160;  // H not a multiple of 128: weight scale rows padded in the swizzle
  Case cs = make_case(c, 11);
  run_and_check(cs, "w4a16");
}

TEST(FusedMoe, ActivationsThroughThePipeline) {
  struct Variant {
    Activation act;
    float a, b, lim, sb;
    std::optional<float> lb;
    const char* name;
  };
  const Variant variants[] = {
      {Activation::kSwiglu, 1.702f, 1.0f, 7.0f, 1.0f, std::nullopt, "swiglu_oai"},
      {Activation::kGegluTanh, 1.0f, 0.0f, kFltMax, 1.0f, std::nullopt, "geglu_tanh"},
      {Activation::kSitu, 1.0f, 0.0f, kFltMax, 1.75f, std::nullopt, "situ"},
      {Activation::kSitu, 1.0f, 0.0f, kFltMax, 0.8f, 1.5f, "situ with linear beta"},
      {Activation::kRelu2, 1.0f, 0.0f, kFltMax, 1.0f, std::nullopt, "relu2"},
  };
  for (QuantMode mode : {QuantMode::kW4A4, QuantMode::kW4A16Int4}) {
    for (const auto& v : variants) {
      Config c;
      c.mode = mode;
      c.act = v.act;
      c.swiglu_alpha = v.a;
      c.swiglu_beta = v.b;
      c.swiglu_limit = v.lim;
      c.situ_beta = v.sb;
      c.situ_lb = v.lb;
      c.w_alpha_lo = 2.0f;  // larger pre-activations so that the clamps of swiglu_oai engage
      c.w_alpha_hi = 6.0f;
      Case cs = make_case(c, 12);
      run_and_check(cs, v.name);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Finalize, routing, layouts, output dtypes
// ---------------------------------------------------------------------------------------------

TEST(FusedMoe, DeterministicAndFusedFinalize) {
  Config c;
  c.mode = QuantMode::kW4A16Int4;
  c.k = 8;
  c.E = 5;
  c.T = 2;
  c.out = DType::kBFloat16;
  c.deterministic = true;
  Case det = make_case(c, 13);
  run_and_check(det, "deterministic");
  c.deterministic = false;
  Case fused = make_case(c, 13);
  run_and_check(fused, "fused");
  // Same data, different finalize: the k bf16 roundings of the fused mode must show somewhere.
  int64_t differ = 0;
  for (int64_t i = 0; i < c.T * c.H; ++i) differ += det.out_at(i) != fused.out_at(i);
  EXPECT_GT(differ, 0);
}

TEST(FusedMoe, DeterministicIsReproducible) {
  Config c;
  c.mode = QuantMode::kW4A4;
  c.I = 64;
  c.T = 5;
  c.k = 4;
  c.deterministic = true;
  c.out = DType::kBFloat16;
  Case cs = make_case(c, 14);
  cs.poison();
  qmoe::fused_moe(cs.params());
  const std::vector<uint8_t> first = cs.out;
  cs.poison();
  qmoe::fused_moe(cs.params());
  EXPECT_EQ(first, cs.out);
}

TEST(FusedMoe, ExpertParallelMasking) {
  Config c;
  c.mode = QuantMode::kW4A8Int4;
  c.E = 6;
  c.El = 2;
  c.offset = 2;
  c.T = 4;
  c.k = 3;
  c.deterministic = true;
  Case cs = make_case(c, 15);
  // t0: expert 3 twice (counts twice) and 2; t1: nothing local (-> zero row);
  // t2: out of range 7 and non-local 4 skipped; t3: -1 and a local expert.
  cs.ids = {2, 3, 3, 0, 5, -1, 7, 2, 4, -1, 1, 3};
  run_and_check(cs, "EP deterministic");
  for (int64_t n = 0; n < c.H; ++n) ASSERT_EQ(cs.out_at(c.H + n), 0.0f) << "token without a local expert";
  cs.c.deterministic = false;
  run_and_check(cs, "EP fused");
  for (int64_t n = 0; n < c.H; ++n) ASSERT_EQ(cs.out_at(c.H + n), 0.0f) << "token without a local expert";
}

// Expert 3 listed twice equals expert 3 once with twice the weight when the weights are equal
// powers of two (the bf16 rows are then scaled exactly in both finalize modes).
TEST(FusedMoe, SameExpertTwiceCountsTwice) {
  Config c;
  c.mode = QuantMode::kW4A16Int4;
  c.T = 1;
  c.k = 2;
  c.deterministic = true;
  Case twice = make_case(c, 16);
  twice.ids = {3, 3};
  twice.wts = {0.25f, 0.25f};
  twice.poison();
  qmoe::fused_moe(twice.params());
  Case once = twice;
  once.ids = {3, -1};
  once.wts = {0.5f, 0.9f};
  once.poison();
  qmoe::fused_moe(once.params());
  for (int64_t n = 0; n < c.H; ++n) ASSERT_EQ(twice.out_at(n), once.out_at(n)) << n;
}

TEST(FusedMoe, RoutedScalingFactor) {
  Config c;
  c.mode = QuantMode::kW4A8Mx;
  c.I = 64;
  c.deterministic = true;
  Case one = make_case(c, 17);
  one.poison();
  qmoe::fused_moe(one.params());
  Case scaled = one;
  scaled.c.rsf = 2.5f;
  run_and_check(scaled, "rsf 2.5 deterministic");
  // Deterministic: the scale multiplies the fp32 sum once, so out(2.5) == fl(2.5 * out(1)) (f32 out).
  for (int64_t i = 0; i < c.T * c.H; ++i) ASSERT_EQ(scaled.out_at(i), 2.5f * one.out_at(i)) << i;
  scaled.c.deterministic = false;
  run_and_check(scaled, "rsf 2.5 fused");
}

TEST(FusedMoe, Relu2) {
  Config c;
  c.act = Activation::kRelu2;
  for (QuantMode mode : {QuantMode::kW4A8Int4, QuantMode::kW4A8Mx}) {
    c.mode = mode;
    c.I = 128;
    Case cs = make_case(c, 18);
    run_and_check(cs, "relu2");
  }
}

// [gate; up] weights and the same rows reordered to [up; gate] interleaved in 64-row groups give
// bitwise the same output.
TEST(FusedMoe, GateUpLayoutsAgree) {
  for (QuantMode mode : {QuantMode::kW4A8Int4, QuantMode::kW4A4, QuantMode::kW4A8Mx}) {
    Config c;
    c.mode = mode;
    c.I = 128;
    c.H = 256;
    Case a = make_case(c, 19);
    Case b = a;
    b.c.layout = GateUpLayout::kUpGateInterleaved64;
    const int64_t I = c.I, bytes = c.H / 2, cols = a.w1.cols();
    for (int64_t e = 0; e < a.El; ++e)
      for (int64_t i = 0; i < I; ++i)
        for (int gate = 0; gate < 2; ++gate) {
          const int64_t src = e * 2 * I + (gate ? i : I + i);
          const int64_t dst = e * 2 * I + (i / 64) * 128 + (gate ? 64 : 0) + i % 64;
          std::memcpy(&b.w1.packed[dst * bytes], &a.w1.packed[src * bytes], bytes);
          std::memcpy(&b.w1.scale[dst * cols], &a.w1.scale[src * cols], cols * sizeof(uint16_t));
        }
    b.w1.build_stored();
    a.poison();
    qmoe::fused_moe(a.params());
    run_and_check(b, qmoe::quant_mode_name(mode));
    EXPECT_EQ(a.out, b.out) << qmoe::quant_mode_name(mode);
  }
}

TEST(FusedMoe, OutputDtypes) {
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (bool det : {false, true}) {
      Config c;
      c.mode = QuantMode::kW4A4;
      c.I = 64;
      c.k = 4;
      c.out = dt;
      c.deterministic = det;
      Case cs = make_case(c, 20);
      run_and_check(cs, qmoe::dtype_name(dt));
    }
  }
}

// Qwen3-30B-A3B shape (E = 128, k = 8, H = 2048, I = 768), T = 32, w4a8_int4: the engine must be fast
// enough for model-shaped checks; two tokens are compared with the formulas.
TEST(FusedMoe, ModelShapedQwen3) {
  Config c;
  c.mode = QuantMode::kW4A8Int4;
  c.E = 128;
  c.k = 8;
  c.H = 2048;
  c.I = 768;
  c.T = 32;
  c.out = DType::kBFloat16;
  Case cs = make_case(c, 21);
  cs.poison();
  const auto t0 = std::chrono::steady_clock::now();
  qmoe::fused_moe(cs.params());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[          ] Qwen3-30B-A3B shape, T=32: %.2f s\n", secs);
  EXPECT_LT(secs, 60.0);
  const std::vector<int64_t> tokens = {0, 31};
  const std::vector<float> want = expected(cs, tokens);
  for (size_t i = 0; i < tokens.size(); ++i)
    for (int64_t n = 0; n < c.H; ++n) {
      const float got = cs.out_at(tokens[i] * c.H + n), exp = want[i * c.H + n];
      ASSERT_LE(std::fabs(got - exp), std::fabs(exp) / 128) << "t=" << tokens[i] << " n=" << n;
    }
}

// DeepSeek-V3 expert shape on one EP8 shard (32 of 256 experts), T = 4. Manual timing check
// (about 1 GB of weights): --gtest_also_run_disabled_tests.
TEST(FusedMoe, DISABLED_ModelShapedDeepSeekV3Shard) {
  Config c;
  c.mode = QuantMode::kW4A8Int4;
  c.E = 256;
  c.El = 32;
  c.offset = 64;
  c.k = 8;
  c.H = 7168;
  c.I = 2048;
  c.T = 4;
  c.out = DType::kBFloat16;
  Case cs = make_case(c, 22);
  cs.poison();
  const auto t0 = std::chrono::steady_clock::now();
  qmoe::fused_moe(cs.params());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[          ] DeepSeek-V3 shard shape, T=4: %.2f s\n", secs);
  const std::vector<float> want = expected(cs, {1});
  for (int64_t n = 0; n < c.H; ++n)
    ASSERT_LE(std::fabs(cs.out_at(c.H + n) - want[n]), std::fabs(want[n]) / 128) << n;
}

// DESIGN.md 3b: a NaN input is never hidden. With per-tensor static scales it poisons only its own
// token (every output of it); a dynamic scale spreads it to the whole call.
TEST(FusedMoe, NanPropagates) {
  for (QuantMode mode : {QuantMode::kW4A16Int4, QuantMode::kW4A8Int4}) {
    for (bool dynamic : {false, true}) {
      Config c;
      c.mode = mode;
      c.a1 = dynamic ? 2 : 0;
      c.T = 3;
      if (mode == QuantMode::kW4A16Int4 && dynamic) continue;
      Case cs = make_case(c, 24);
      cs.x16[5] = 0x7fc0;  // x[0, 5] = NaN
      cs.poison();
      // Poisoned output is NaN already: overwrite it with zeros to see what the call writes.
      std::fill(cs.out.begin(), cs.out.end(), 0);
      qmoe::fused_moe(cs.params());
      for (int64_t t = 0; t < c.T; ++t)
        for (int64_t n = 0; n < c.H; ++n)
          ASSERT_EQ(std::isnan(cs.out_at(t * c.H + n)), t == 0 || dynamic)
              << qmoe::quant_mode_name(mode) << " dynamic=" << dynamic << " t=" << t << " n=" << n;
    }
  }
}

TEST(FusedMoe, EmptyBatch) {
  Config c;
  c.mode = QuantMode::kW4A4;
  c.I = 64;
  c.T = 0;
  Case cs = make_case(c, 23);
  EXPECT_NO_THROW(qmoe::fused_moe(cs.params()));
}

TEST(FusedMoe, Names) {
  for (QuantMode m : {QuantMode::kW4A4, QuantMode::kW4A8Mx, QuantMode::kW4A16, QuantMode::kW4A8Int4,
                      QuantMode::kW4A16Int4}) {
    QuantMode back = QuantMode::kW4A4;
    ASSERT_TRUE(qmoe::quant_mode_from_name(qmoe::quant_mode_name(m), &back));
    EXPECT_EQ(back, m);
  }
  QuantMode unused;
  EXPECT_FALSE(qmoe::quant_mode_from_name("w8a8", &unused));
  EXPECT_STREQ(qmoe::quant_mode_name(QuantMode::kW4A8Mx), "w4a8");
  EXPECT_STREQ(qmoe::activation_name(Activation::kSwiglu), "swiglu");
  EXPECT_STREQ(qmoe::activation_name(Activation::kGegluTanh), "geglu_tanh");
  EXPECT_STREQ(qmoe::activation_name(Activation::kRelu2), "relu2");
  EXPECT_STREQ(qmoe::activation_name(Activation::kSitu), "situ");
}

}  // namespace

// FusedMoeParams::fp4_weights_packed: the same layer on packed w1 / w2 (pack_fp4_weights) gives the same bits on
// the CPU (the engine unpacks copies), for every FP4 weight mode; int4 weights refuse the flag before any work.
TEST(FusedMoe, PackedFp4WeightsGiveTheSameBits) {
  for (QuantMode mode : {QuantMode::kW4A4, QuantMode::kW4A8Mx, QuantMode::kW4A16}) {
    Config c;
    c.mode = mode;
    c.T = 7;
    c.deterministic = true;
    Case plain = make_case(c, 40);
    Case packed = make_case(c, 40);
    for (Weights* w : {&packed.w1, &packed.w2}) {
      const std::vector<uint8_t> bytes = w->packed;
      const TensorRef in = qmoe::make_tensor(const_cast<uint8_t*>(bytes.data()), DType::kUInt8,
                                             {static_cast<int64_t>(bytes.size())});
      qmoe::pack_fp4_weights(in, qmoe::make_tensor(w->packed.data(), DType::kUInt8, {static_cast<int64_t>(bytes.size())}));
      ASSERT_NE(w->packed, bytes);
    }
    plain.poison();
    packed.poison();
    qmoe::fused_moe(plain.params());
    FusedMoeParams p = packed.params();
    p.fp4_weights_packed = true;
    qmoe::fused_moe(p);
    EXPECT_EQ(packed.out, plain.out) << qmoe::quant_mode_name(mode);
    bool any_finite_nonzero = false;
    for (int64_t i = 0; i < c.T * c.H; ++i) any_finite_nonzero |= std::isfinite(plain.out_at(i)) && plain.out_at(i) != 0;
    EXPECT_TRUE(any_finite_nonzero);
  }
  Config c;
  c.mode = QuantMode::kW4A8Int4;
  Case cs = make_case(c, 41);
  cs.poison();
  const std::vector<uint8_t> before = cs.out;
  FusedMoeParams p = cs.params();
  p.fp4_weights_packed = true;
  try {
    qmoe::fused_moe(p);
    FAIL() << "expected an error naming fp4_weights_packed";
  } catch (const qmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp4_weights_packed"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cs.out, before);
}
