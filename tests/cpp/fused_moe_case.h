// Test support for the fused MoE tests (test_fused_moe.cpp, test_fused_moe_validation.cpp):
// random cases for every quant mode (packed weights, logical scale codes and the stored scale
// layouts built here from DESIGN.md 3.1 / 3.3), and `expected`, an independent naive evaluation of
// the fused MoE formulas (DESIGN.md 3b, include/qmoe/fused_moe.h) that decodes the stored layouts
// with its own index math instead of calling the reference's internals.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "qmoe/formats.h"
#include "qmoe/fused_moe.h"

namespace fused_moe_test {

using qmoe::Activation;
using qmoe::Device;
using qmoe::DType;
using qmoe::FusedMoeParams;
using qmoe::GateUpLayout;
using qmoe::QuantMode;
using qmoe::TensorRef;

constexpr float kFltMax = std::numeric_limits<float>::max();

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  float uni(float a, float b) { return a + (b - a) * static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  float normal() {
    const double u1 = (static_cast<double>(next() >> 11) + 1.0) / 9007199254740993.0;
    const double u2 = static_cast<double>(next() >> 11) / 9007199254740992.0;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  void fill(std::vector<uint8_t>& v) {
    for (size_t i = 0; i < v.size(); i += 8) {
      const uint64_t r = next();
      std::memcpy(v.data() + i, &r, std::min<size_t>(8, v.size() - i));
    }
  }
};

enum class Fmt { kInt4, kNvfp4, kMxfp4 };
inline Fmt fmt_of(QuantMode m) {
  if (m == QuantMode::kW4A8Int4 || m == QuantMode::kW4A16Int4) return Fmt::kInt4;
  return m == QuantMode::kW4A8Mx ? Fmt::kMxfp4 : Fmt::kNvfp4;
}
inline int64_t block_of(Fmt f) { return f == Fmt::kInt4 ? 128 : f == Fmt::kNvfp4 ? 16 : 32; }

// One weight stack [El, N, K]: random packed nibbles, logical scale codes [El, N, K/block], and the
// stored scale layout built here from the DESIGN.md formulas.
struct Weights {
  Fmt fmt = Fmt::kInt4;
  int64_t El = 0, N = 0, K = 0;
  std::vector<uint8_t> packed;
  std::vector<uint16_t> scale;   // bf16 bits (int4) or one byte code (e4m3 / ue8m0)
  std::vector<uint16_t> stored16;
  std::vector<uint8_t> stored8;

  int64_t cols() const { return K / block_of(fmt); }
  int nibble(int64_t e, int64_t n, int64_t k) const {
    return (packed[static_cast<size_t>((e * N + n) * (K / 2) + k / 2)] >> (4 * (k % 2))) & 0xf;
  }
  float value(int64_t e, int64_t n, int64_t k) const {
    const int q = nibble(e, n, k);
    const uint16_t s = scale[static_cast<size_t>((e * N + n) * cols() + k / block_of(fmt))];
    if (fmt == Fmt::kInt4) return static_cast<float>(q >= 8 ? q - 16 : q) * qmoe::bf16_to_float(s);
    const float v = qmoe::e2m1_to_float(static_cast<uint8_t>(q));
    return v * (fmt == Fmt::kNvfp4 ? qmoe::e4m3_to_float(static_cast<uint8_t>(s))
                                   : qmoe::ue8m0_to_float(static_cast<uint8_t>(s)));
  }
  void build_stored() {
    const int64_t c = cols();
    if (fmt == Fmt::kInt4) {  // DESIGN.md 3.1
      stored16.assign(static_cast<size_t>(El * N * c), 0);
      for (int64_t e = 0; e < El; ++e)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t g = 0; g < c; ++g) {
            const int64_t at = c % 4 == 0 ? (e * (c / 4) + g / 4) * 4 * N + 4 * n + g % 4 : (e * c + g) * N + n;
            stored16[static_cast<size_t>(at)] = scale[static_cast<size_t>((e * N + n) * c + g)];
          }
      return;
    }
    // DESIGN.md 3.3; padding holds a NaN code so a misread padding byte shows up in the output.
    const int64_t mt = (N + 127) / 128, kt = (c + 3) / 4;
    stored8.assign(static_cast<size_t>(El * mt * kt * 512), fmt == Fmt::kNvfp4 ? 0x7f : 0xff);
    for (int64_t e = 0; e < El; ++e)
      for (int64_t r = 0; r < N; ++r)
        for (int64_t j = 0; j < c; ++j) {
          const int64_t at = ((e * mt + r / 128) * kt + j / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + j % 4;
          stored8[static_cast<size_t>(at)] = static_cast<uint8_t>(scale[static_cast<size_t>((e * N + r) * c + j)]);
        }
  }
  void randomize(Rng& rng, Fmt f, int64_t el, int64_t n, int64_t k) {
    fmt = f;
    El = el, N = n, K = k;
    packed.assign(static_cast<size_t>(El * N * K / 2), 0);
    rng.fill(packed);
    scale.resize(static_cast<size_t>(El * N * cols()));
    for (auto& s : scale) {
      if (f == Fmt::kInt4) s = qmoe::float_to_bf16(rng.uni(0.004f, 0.012f));
      else if (f == Fmt::kNvfp4) s = static_cast<uint16_t>(0x30 + rng.below(17));  // e4m3 0.5 .. 2
      else s = static_cast<uint16_t>(125 + rng.below(5));                          // 2^-2 .. 2^2
    }
    build_stored();
  }
  TensorRef tensor() {
    const DType dt = fmt == Fmt::kInt4 ? DType::kInt4x2 : DType::kFloat4E2M1x2;
    return qmoe::make_tensor(packed.data(), dt, {El, N, K / 2});
  }
  TensorRef scale_tensor() {
    const int64_t c = cols();
    if (fmt == Fmt::kInt4)
      return c % 4 == 0 ? qmoe::make_tensor(stored16.data(), DType::kBFloat16, {El, c / 4, 4 * N})
                        : qmoe::make_tensor(stored16.data(), DType::kBFloat16, {El, c, N});
    return qmoe::make_tensor(stored8.data(), fmt == Fmt::kNvfp4 ? DType::kFloat8E4M3 : DType::kUE8M0,
                             {El, (N + 127) / 128 * 128, (c + 3) / 4 * 4});
  }
};

struct Config {
  QuantMode mode = QuantMode::kW4A8Int4;
  Activation act = Activation::kSwiglu;
  GateUpLayout layout = GateUpLayout::kGateUp;
  int64_t T = 3, k = 2, E = 4, El = 0, offset = 0, H = 256, I = 128;
  bool deterministic = false;
  float rsf = 1.0f;
  DType out = DType::kFloat32;
  float swiglu_alpha = 1.0f, swiglu_beta = 0.0f, swiglu_limit = kFltMax, situ_beta = 1.0f;
  std::optional<float> situ_lb;
  bool x_e4m3 = false;     // w4a8_int4: x already e4m3
  int a1 = 0;              // w4a8_int4: 0 = f32 [1], 1 = f32 [T], 2 = dynamic (None)
  bool a2_dynamic = false;  // w4a8_int4
  bool per_token = false;   // w4a4
  bool alphas = true;       // optional alphas (int4 and w4a8 modes)
  float w_alpha_lo = 0.5f, w_alpha_hi = 1.5f;
};

struct Case {
  Config c;
  int64_t El = 0;
  std::vector<int32_t> ids;
  std::vector<float> wts;
  Weights w1, w2;
  std::vector<uint16_t> x16;
  std::vector<uint8_t> x8, xsf;
  std::vector<float> a1, a2, w1a, w2a, pts;
  std::vector<uint8_t> out;

  bool gated() const { return c.act != Activation::kRelu2; }
  int64_t rows1() const { return gated() ? 2 * c.I : c.I; }

  FusedMoeParams params() {
    FusedMoeParams p;
    const int64_t T = c.T, H = c.H;
    p.quant_mode = c.mode;
    switch (c.mode) {
      case QuantMode::kW4A8Int4:
        p.x = c.x_e4m3 ? qmoe::make_tensor(x8.data(), DType::kFloat8E4M3, {T, H})
                       : qmoe::make_tensor(x16.data(), DType::kBFloat16, {T, H});
        if (c.a1 != 2) p.x_scale = qmoe::make_tensor(a1.data(), DType::kFloat32, {static_cast<int64_t>(a1.size())});
        if (!c.a2_dynamic) p.fc2_input_scale = qmoe::make_tensor(a2.data(), DType::kFloat32, {1});
        break;
      case QuantMode::kW4A16Int4:
      case QuantMode::kW4A16: p.x = qmoe::make_tensor(x16.data(), DType::kBFloat16, {T, H}); break;
      case QuantMode::kW4A4:
        p.x = qmoe::make_tensor(x8.data(), DType::kFloat4E2M1x2, {T, H / 2});
        p.x_scale = qmoe::make_tensor(xsf.data(), DType::kFloat8E4M3, {T, H / 16});
        p.fc2_input_scale = qmoe::make_tensor(a2.data(), DType::kFloat32, {1});
        if (c.per_token) p.per_token_scale = qmoe::make_tensor(pts.data(), DType::kFloat32, {T});
        break;
      case QuantMode::kW4A8Mx:
        p.x = qmoe::make_tensor(x8.data(), DType::kFloat8E4M3, {T, H});
        p.x_scale = qmoe::make_tensor(xsf.data(), DType::kUE8M0, {T, H / 32});
        break;
    }
    p.topk_ids = qmoe::make_tensor(ids.data(), DType::kInt32, {T, c.k});
    p.topk_weights = qmoe::make_tensor(wts.data(), DType::kFloat32, {T, c.k});
    p.w1 = w1.tensor();
    p.w1_scale = w1.scale_tensor();
    p.w2 = w2.tensor();
    p.w2_scale = w2.scale_tensor();
    if (!w1a.empty()) p.w1_alpha = qmoe::make_tensor(w1a.data(), DType::kFloat32, {El});
    if (!w2a.empty()) p.w2_alpha = qmoe::make_tensor(w2a.data(), DType::kFloat32, {El});
    p.output = qmoe::make_tensor(out.data(), c.out, {T, H});
    p.num_experts = c.E;
    p.num_local_experts = c.El;
    p.local_expert_offset = c.offset;
    p.activation = c.act;
    p.swiglu_alpha = c.swiglu_alpha;
    p.swiglu_beta = c.swiglu_beta;
    p.swiglu_limit = c.swiglu_limit;
    p.situ_beta = c.situ_beta;
    p.situ_linear_beta = c.situ_lb;
    p.gate_up_layout = c.layout;
    p.deterministic = c.deterministic;
    p.routed_scaling_factor = c.rsf;
    return p;
  }

  void poison() {
    if (c.out == DType::kFloat32) {
      for (size_t i = 0; i < out.size(); i += 4) std::memcpy(&out[i], "\x00\x00\xc0\x7f", 4);  // NaN
    } else {
      const uint16_t nan = c.out == DType::kBFloat16 ? 0x7fc0 : 0x7e00;
      for (size_t i = 0; i < out.size(); i += 2) std::memcpy(&out[i], &nan, 2);
    }
  }
  float out_at(int64_t i) const {
    if (c.out == DType::kFloat32) {
      float v;
      std::memcpy(&v, &out[static_cast<size_t>(4 * i)], 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, &out[static_cast<size_t>(2 * i)], 2);
    if (c.out == DType::kBFloat16) return qmoe::bf16_to_float(h);
    _Float16 f;
    std::memcpy(&f, &h, 2);
    return static_cast<float>(f);
  }
};

inline Case make_case(const Config& cfg, uint64_t seed) {
  Rng rng(seed);
  Case cs;
  cs.c = cfg;
  cs.El = cfg.El == 0 ? cfg.E : cfg.El;
  cs.c.El = cs.El;
  const int64_t T = cfg.T, H = cfg.H, I = cfg.I;
  cs.ids.resize(static_cast<size_t>(T * cfg.k));
  for (auto& id : cs.ids) id = static_cast<int32_t>(cfg.offset + rng.below(cs.El));
  cs.wts.resize(cs.ids.size());
  for (auto& w : cs.wts) w = rng.uni(0.1f, 1.0f);
  const Fmt f = fmt_of(cfg.mode);
  cs.w1.randomize(rng, f, cs.El, cs.rows1(), H);
  cs.w2.randomize(rng, f, cs.El, H, I);
  cs.x16.resize(static_cast<size_t>(T * H));
  for (auto& v : cs.x16) v = qmoe::float_to_bf16(rng.normal());
  const bool int4 = f == Fmt::kInt4;
  switch (cfg.mode) {
    case QuantMode::kW4A8Int4:
      if (cfg.x_e4m3) {
        cs.x8.resize(static_cast<size_t>(T * H));
        for (auto& v : cs.x8) v = qmoe::float_to_e4m3(rng.normal() * 100.0f);
      }
      if (cfg.a1 == 0) cs.a1 = {rng.uni(0.004f, 0.01f)};
      if (cfg.a1 == 1)
        for (int64_t t = 0; t < T; ++t) cs.a1.push_back(rng.uni(0.004f, 0.01f));
      cs.a2 = {rng.uni(0.002f, 0.004f)};
      break;
    case QuantMode::kW4A4:
      cs.x8.resize(static_cast<size_t>(T * H / 2));
      rng.fill(cs.x8);
      for (int64_t i = 0; i < T * H / 16; ++i) cs.xsf.push_back(static_cast<uint8_t>(0x30 + rng.below(17)));
      cs.a2 = {cfg.per_token ? 1.0f / 2688.0f : rng.uni(1.5f, 3.0f)};
      for (int64_t t = 0; t < T; ++t) cs.pts.push_back(rng.uni(0.5f, 2.0f));
      break;
    case QuantMode::kW4A8Mx:
      cs.x8.resize(static_cast<size_t>(T * H));
      for (auto& v : cs.x8) v = qmoe::float_to_e4m3(rng.normal() * 8.0f);
      for (int64_t i = 0; i < T * H / 32; ++i) cs.xsf.push_back(static_cast<uint8_t>(124 + rng.below(4)));
      break;
    default: break;
  }
  // Alphas scale GEMM1 so that the activation sees values of order 1.
  const bool need = cfg.mode == QuantMode::kW4A4 || cfg.mode == QuantMode::kW4A16;
  if (need || cfg.alphas) {
    const float base = int4 ? 1.0f : cfg.mode == QuantMode::kW4A8Mx ? 0.01f : 0.03f;
    for (int64_t e = 0; e < cs.El; ++e) {
      cs.w1a.push_back(base * rng.uni(cfg.w_alpha_lo, cfg.w_alpha_hi));
      cs.w2a.push_back(rng.uni(0.5f, 1.5f) * (int4 ? 1.0f : 0.05f));
    }
  }
  cs.out.assign(static_cast<size_t>(T * H * (cfg.out == DType::kFloat32 ? 4 : 2)), 0);
  return cs;
}

// ---------------------------------------------------------------------------------------------
// The expected result, from the formulas (DESIGN.md 3b; fused_moe.h header).
// ---------------------------------------------------------------------------------------------

// DESIGN.md 4, evaluated in double from the fp32 inputs and rounded once to fp32.
inline float act_formula(const Config& c, double g, double u) {
  auto sigmoid = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  const double lim = c.swiglu_limit;
  switch (c.act) {
    case Activation::kSwiglu: {
      const double gc = g > lim ? lim : g;
      const double uc = u > lim ? lim : u < -lim ? -lim : u;
      return static_cast<float>(gc * sigmoid(double{c.swiglu_alpha} * gc) * (uc + double{c.swiglu_beta}));
    }
    case Activation::kGegluTanh:
      return static_cast<float>(0.5 * g * (1.0 + std::tanh(0.7978845608 * (g + 0.044715 * g * g * g))) * u);
    case Activation::kRelu2: {
      const double r = g < 0.0 ? 0.0 : g;
      return static_cast<float>(r * r);
    }
    case Activation::kSitu: {
      const double lb = c.situ_lb.value_or(1.0f), b = c.situ_beta;
      const double up = c.situ_lb ? lb * std::tanh(u / lb) : u;
      return static_cast<float>(b * std::tanh(g / b) * sigmoid(g) * up);
    }
  }
  return 0.0f;
}

// acc = W[e, n, :] . a: fp64 dot of dequantized FP4 weights rounded to fp32; for int4, SGLang's
// fp32 group promotion acc = fma(S[g], P_g, acc) with P_g = fp32(sum over the group in fp64).
inline float weight_dot(const Weights& w, int64_t e, int64_t n, const double* a) {
  if (w.fmt != Fmt::kInt4) {
    double acc = 0;
    for (int64_t k = 0; k < w.K; ++k) acc += a[k] * w.value(e, n, k);
    return static_cast<float>(acc);
  }
  float acc = 0.0f;
  for (int64_t g = 0; g < w.K / 128; ++g) {
    double p = 0;
    for (int64_t k = 128 * g; k < 128 * (g + 1); ++k) {
      const int q = w.nibble(e, n, k);
      p += a[k] * (q >= 8 ? q - 16 : q);
    }
    const double s = qmoe::bf16_to_float(w.scale[static_cast<size_t>((e * w.N + n) * w.cols() + g)]);
    acc = static_cast<float>(acc + s * static_cast<float>(p));
  }
  return acc;
}

inline float amax_of(const std::vector<float>& v, size_t begin, size_t n) {
  float m = 0.0f;
  for (size_t i = begin; i < begin + n; ++i) m = std::max(m, std::fabs(v[i]));
  return m;
}

inline float round_out(DType dt, float v) {
  if (dt == DType::kBFloat16) return qmoe::round_bf16(v);
  if (dt == DType::kFloat16) return static_cast<float>(static_cast<_Float16>(v));
  return v;
}

// Expected output rows of `tokens` (all when empty), as floats of the output dtype.
inline std::vector<float> expected(const Case& cs, std::vector<int64_t> tokens = {}) {
  const Config& c = cs.c;
  const int64_t T = c.T, H = c.H, I = c.I, k = c.k;
  if (tokens.empty())
    for (int64_t t = 0; t < T; ++t) tokens.push_back(t);
  // a1: static, per token, or dynamic over the whole bf16 x.
  float a1_dyn = 0.0f;
  for (uint16_t v : cs.x16) a1_dyn = std::max(a1_dyn, std::fabs(qmoe::bf16_to_float(v)));
  a1_dyn /= 448.0f;
  auto a1_of = [&](int64_t t) { return c.a1 == 2 ? a1_dyn : cs.a1[cs.a1.size() == 1 ? 0 : static_cast<size_t>(t)]; };
  auto w1a = [&](int64_t l) { return cs.w1a.empty() ? 1.0f : cs.w1a[static_cast<size_t>(l)]; };
  auto w2a = [&](int64_t l) { return cs.w2a.empty() ? 1.0f : cs.w2a[static_cast<size_t>(l)]; };
  auto x_value = [&](int64_t t, int64_t h) -> float {
    switch (c.mode) {
      case QuantMode::kW4A8Int4:
        if (c.x_e4m3) return qmoe::e4m3_to_float(cs.x8[static_cast<size_t>(t * H + h)]);
        return qmoe::e4m3_to_float(
            qmoe::float_to_e4m3(qmoe::bf16_to_float(cs.x16[static_cast<size_t>(t * H + h)]) / a1_of(t)));
      case QuantMode::kW4A4: {
        const int q = (cs.x8[static_cast<size_t>((t * H + h) / 2)] >> (4 * (h % 2))) & 0xf;
        return qmoe::e2m1_to_float(static_cast<uint8_t>(q)) *
               qmoe::e4m3_to_float(cs.xsf[static_cast<size_t>(t * (H / 16) + h / 16)]);
      }
      case QuantMode::kW4A8Mx:
        return qmoe::e4m3_to_float(cs.x8[static_cast<size_t>(t * H + h)]) *
               qmoe::ue8m0_to_float(cs.xsf[static_cast<size_t>(t * (H / 32) + h / 32)]);
      default: return qmoe::bf16_to_float(cs.x16[static_cast<size_t>(t * H + h)]);
    }
  };
  auto w1_row = [&](bool gate, int64_t i) -> int64_t {
    if (!cs.gated()) return i;
    if (c.layout == GateUpLayout::kGateUp) return gate ? i : I + i;
    return (i / 64) * 128 + (gate ? 64 : 0) + i % 64;
  };
  auto local_of = [&](int64_t id) -> int64_t {
    const int64_t l = id - c.offset;
    return (id < 0 || id >= c.E || l < 0 || l >= cs.El) ? -1 : l;
  };

  // Pass 1: v for every valid slot (all tokens: the dynamic a2 spans every row of the call).
  std::vector<float> v(static_cast<size_t>(T * k * I), 0.0f);
  std::vector<char> valid(static_cast<size_t>(T * k), 0);
  const bool need_all = c.mode == QuantMode::kW4A8Int4 && c.a2_dynamic;
  std::vector<char> wanted(static_cast<size_t>(T), need_all ? 1 : 0);
  for (int64_t t : tokens) wanted[static_cast<size_t>(t)] = 1;
  for (int64_t t = 0; t < T; ++t) {
    if (!wanted[static_cast<size_t>(t)]) continue;
    std::vector<double> x(static_cast<size_t>(H));
    for (int64_t h = 0; h < H; ++h) x[static_cast<size_t>(h)] = x_value(t, h);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t l = local_of(cs.ids[static_cast<size_t>(t * k + j)]);
      if (l < 0) continue;
      valid[static_cast<size_t>(t * k + j)] = 1;
      // GEMM1 scales: int4 (acc * s1) * w1_alpha; FP4 acc * (w1_alpha * s1); s1 = a1 or pts or 1.
      float s1 = 1.0f;
      if (c.mode == QuantMode::kW4A8Int4) s1 = a1_of(t);
      if (c.mode == QuantMode::kW4A4 && c.per_token) s1 = cs.pts[static_cast<size_t>(t)];
      const bool int4 = cs.w1.fmt == Fmt::kInt4;
      auto scaled = [&](float acc) { return int4 ? (acc * s1) * w1a(l) : acc * (w1a(l) * s1); };
      for (int64_t i = 0; i < I; ++i) {
        const float g = scaled(weight_dot(cs.w1, l, w1_row(true, i), x.data()));
        const float u = cs.gated() ? scaled(weight_dot(cs.w1, l, w1_row(false, i), x.data())) : 0.0f;
        v[static_cast<size_t>((t * k + j) * I + i)] = act_formula(c, g, u);
      }
    }
  }
  float a2 = c.mode == QuantMode::kW4A8Int4 && !c.a2_dynamic ? cs.a2[0] : 1.0f;
  if (c.mode == QuantMode::kW4A8Int4 && c.a2_dynamic) {
    float m = 0.0f;
    for (size_t s = 0; s < valid.size(); ++s)
      if (valid[s]) m = std::max(m, amax_of(v, s * static_cast<size_t>(I), static_cast<size_t>(I)));
    a2 = m == 0.0f ? 1.0f : m / 448.0f;
  }
  auto nvfp4 = [](std::vector<float>& md, size_t at, const float* src, float gs) {
    float m = 0.0f;
    for (int e = 0; e < 16; ++e) m = std::max(m, std::fabs(src[e]));
    const float sf = qmoe::e4m3_to_float(qmoe::float_to_e4m3(gs * m / 6.0f));
    for (int e = 0; e < 16; ++e)
      md[at + e] = sf == 0.0f ? 0.0f : qmoe::e2m1_to_float(qmoe::float_to_e2m1(src[e] * gs / sf)) * sf;
  };

  std::vector<float> result;
  for (int64_t t : tokens) {
    std::vector<float> o(static_cast<size_t>(H), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      if (!valid[static_cast<size_t>(t * k + j)]) continue;
      const int64_t l = local_of(cs.ids[static_cast<size_t>(t * k + j)]);
      const float* vr = &v[static_cast<size_t>((t * k + j) * I)];
      std::vector<float> md(static_cast<size_t>(I), 0.0f);
      float alpha2 = w2a(l);
      bool zero_row = false;
      switch (c.mode) {
        case QuantMode::kW4A8Int4:
          for (int64_t i = 0; i < I; ++i) md[static_cast<size_t>(i)] = qmoe::e4m3_to_float(qmoe::float_to_e4m3(vr[i] / a2));
          alpha2 = a2 * w2a(l);
          break;
        case QuantMode::kW4A8Mx:
          for (int64_t b = 0; b < I; b += 32) {
            float m = 0.0f;
            for (int e = 0; e < 32; ++e) m = std::max(m, std::fabs(vr[b + e]));
            const float sc = qmoe::ue8m0_to_float(qmoe::ue8m0_ceil(m / 448.0f));
            for (int e = 0; e < 32; ++e)
              md[static_cast<size_t>(b + e)] = qmoe::e4m3_to_float(qmoe::float_to_e4m3(vr[b + e] / sc)) * sc;
          }
          break;
        case QuantMode::kW4A4:
          if (!c.per_token) {
            for (int64_t b = 0; b < I; b += 16) nvfp4(md, static_cast<size_t>(b), vr + b, cs.a2[0]);
          } else {
            std::vector<float> bv(static_cast<size_t>(I));
            float m = 0.0f;
            for (int64_t i = 0; i < I; ++i) {
              bv[static_cast<size_t>(i)] = qmoe::round_bf16(vr[i]);
              m = std::max(m, std::fabs(bv[static_cast<size_t>(i)]));
            }
            const float row_scale = m * cs.a2[0];
            zero_row = row_scale == 0.0f;
            if (!zero_row)
              for (int64_t b = 0; b < I; b += 16) nvfp4(md, static_cast<size_t>(b), bv.data() + b, 1.0f / row_scale);
            alpha2 = w2a(l) * row_scale;
          }
          break;
        default:
          for (int64_t i = 0; i < I; ++i) md[static_cast<size_t>(i)] = qmoe::round_bf16(vr[i]);
      }
      const float w = cs.wts[static_cast<size_t>(t * k + j)];
      const std::vector<double> md64(md.begin(), md.end());
      for (int64_t n = 0; n < H; ++n) {
        const float y = zero_row ? 0.0f : alpha2 * weight_dot(cs.w2, l, n, md64.data());
        float& on = o[static_cast<size_t>(n)];
        if (c.deterministic) on += w * qmoe::round_bf16(y);
        else on = round_out(c.out, on + qmoe::round_bf16(c.rsf * w * y));
      }
    }
    for (int64_t n = 0; n < H; ++n)
      result.push_back(c.deterministic ? round_out(c.out, c.rsf * o[static_cast<size_t>(n)]) : o[static_cast<size_t>(n)]);
  }
  return result;
}

// Runs the public entry on poisoned output; every element must match the formula. The only
// freedom is the fp64 summation order of the dot products (rounded once to fp32), hence a tolerance
// of a few fp32 ulps of the row's scale; a misread scale or row is off by far more.
inline void run_and_check(Case& cs, const char* what) {
  SCOPED_TRACE(what);
  cs.poison();
  qmoe::fused_moe(cs.params());
  const std::vector<float> want = expected(cs);
  const int64_t H = cs.c.H;
  const float ulp = cs.c.out == DType::kBFloat16 ? 1.0f / 128 : cs.c.out == DType::kFloat16 ? 1.0f / 1024 : 1e-5f;
  int64_t bad = 0;
  double sum_sq = 0;
  for (int64_t t = 0; t < cs.c.T; ++t) {
    const float scale = amax_of(want, static_cast<size_t>(t * H), static_cast<size_t>(H));
    for (int64_t n = 0; n < H; ++n) {
      const float got = cs.out_at(t * H + n), exp = want[static_cast<size_t>(t * H + n)];
      sum_sq += static_cast<double>(exp) * exp;
      if (!(std::fabs(got - exp) <= ulp * std::max(std::fabs(exp), 1e-3f * scale)) && bad++ < 5)
        ADD_FAILURE() << "t=" << t << " n=" << n << " got " << got << " expected " << exp;
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_GT(sum_sq, 0.0) << "the expected output is all zero: the case tests nothing";
}

}  // namespace fused_moe_test
