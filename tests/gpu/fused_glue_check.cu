// Bitwise check of the fused MoE's small kernels (src/cuda/fused/: gather_quantize,
// gather_dequantize, activation_amax, activation_requant, activation_requant_bf16, finalize,
// scatter_slot_rows) against a host evaluation of the formulas of fused_moe_kernels.h with the
// reference codecs of qmoe/formats.h (what the kernels computed before their rows x column-chunks
// rewrite, element by element). Host float arithmetic is IEEE (x86-64 SSE, no FMA contraction at
// the default -march), so every finite result must match bit for bit; a NaN must map to a NaN code.
// The activation values v = act(h) (expf / tanhf) are produced on the GPU by a plain one-feature-per-
// thread kernel using the scalar gate/up index rule, so the requant checks also pin the vectorized
// gate/up addressing of both layouts.
//
// Cases: decode (T = 1, k = 8) and T = 64 at DeepSeek-V3 / Qwen3 sizes, H not a multiple of the
// 1024-feature CTA chunk, H % 8 != 0 and a misaligned x (the one-feature-at-a-time paths), 0 valid
// rows, ids that are -1 or not local, rows past the valid count poisoned and checked untouched.
//
// Build (after scripts/device_build.sh) and run on a Hopper GPU:
//   tests/gpu/build_w4a8_check.sh build/fused_glue_check tests/gpu/fused_glue_check.cu && build/fused_glue_check
// Exit status 0 and "PASS" when all cases agree.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/fused/fused_moe_kernels.h"
#include "qmoe/formats.h"
#include "reference/activations.h"

using namespace qmoe;
namespace fz = qmoe::cuda::fused;

namespace {

int g_failures = 0;

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));      \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count, int poison = 0xAA) : n(count) {
    CK(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T) + 64));
    CK(cudaMemset(p, poison, std::max<size_t>(1, n) * sizeof(T) + 64));
  }
  Dev(const std::vector<T>& h) : Dev(h.size()) { CK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
  ~Dev() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

void expect(bool ok, const char* what, int64_t i, double got, double want) {
  if (ok) return;
  if (g_failures < 20) std::printf("  MISMATCH %s at %lld: got %.9g want %.9g\n", what, (long long)i, got, want);
  ++g_failures;
}
bool same_e4m3(uint8_t a, uint8_t b) { return a == b || ((a & 0x7f) == 0x7f && (b & 0x7f) == 0x7f); }
bool same_float(float a, float b) { return float_bits(a) == float_bits(b) || (std::isnan(a) && std::isnan(b)); }

std::mt19937 rng(1234);
float rnd(float scale = 1.0f) { return std::normal_distribution<float>(0.0f, scale)(rng); }
// Mostly normal values, some huge (saturating), tiny (subnormal codes) and exact zeros.
float rnd_wide() {
  const int kind = std::uniform_int_distribution<int>(0, 19)(rng);
  if (kind == 0) return rnd(5000.0f);
  if (kind == 1) return rnd(1e-4f);
  if (kind == 2) return 0.0f;
  return rnd(3.0f);
}

// Host routing: ids in [-1, local + 2) -> local ids, expert-sorted rows (stable by slot).
struct Routing {
  int64_t tokens, topk, local, slots, valid;
  std::vector<int32_t> local_ids, offsets, in_perm, out_perm;
};
Routing make_routing(int64_t tokens, int64_t topk, int64_t local, bool none_valid = false) {
  Routing r{tokens, topk, local, tokens * topk, 0, {}, {}, {}, {}};
  r.local_ids.resize(r.slots);
  for (auto& id : r.local_ids) {
    id = std::uniform_int_distribution<int>(-1, static_cast<int>(local) + 1)(rng);
    if (id >= local || none_valid) id = -1;
  }
  r.offsets.assign(local + 1, 0);
  r.in_perm.assign(r.slots, -1);
  r.out_perm.assign(r.slots, -1);
  int64_t row = 0;
  for (int64_t e = 0; e < local; ++e) {
    r.offsets[e] = static_cast<int32_t>(row);
    for (int64_t s = 0; s < r.slots; ++s)
      if (r.local_ids[s] == e) r.in_perm[row] = static_cast<int32_t>(s), r.out_perm[s] = static_cast<int32_t>(row++);
  }
  r.offsets[local] = static_cast<int32_t>(row);
  r.valid = row;
  return r;
}
struct DevRouting {
  Dev<int32_t> ids, offsets, in_perm, out_perm;
  fz::RowRouting rr;
  explicit DevRouting(const Routing& r)
      : ids(r.local_ids), offsets(r.offsets), in_perm(r.in_perm), out_perm(r.out_perm),
        rr{ids.p, offsets.p, in_perm.p, out_perm.p, static_cast<int>(r.local), static_cast<int>(r.topk), r.slots} {}
};

std::vector<uint16_t> rnd_bf16(size_t n) {
  std::vector<uint16_t> v(n);
  for (auto& b : v) b = float_to_bf16(rnd_wide());
  return v;
}

// ---- gather_quantize ---------------------------------------------------------------------------
void check_gather_quantize(int64_t tokens, int64_t topk, int64_t local, int64_t H, int scale_kind, bool misalign,
                           bool e4m3_x, bool none_valid = false) {
  std::printf("gather_quantize T=%lld k=%lld H=%lld scale=%d misalign=%d e4m3=%d none=%d\n", (long long)tokens,
              (long long)topk, (long long)H, scale_kind, misalign, e4m3_x, none_valid);
  const Routing r = make_routing(tokens, topk, local, none_valid);
  DevRouting dr(r);
  std::vector<uint16_t> x = rnd_bf16(tokens * H + 8);
  std::vector<uint8_t> x8(tokens * H + 16);
  for (auto& c : x8) c = static_cast<uint8_t>(rng());
  std::vector<float> xs(tokens), alpha(local);
  for (auto& s : xs) s = std::fabs(rnd(0.05f)) + 1e-3f;
  for (auto& a : alpha) a = rnd(1.0f);
  uint32_t amax = 0;
  for (int64_t i = 0; i < tokens * H; ++i) amax = std::max(amax, float_bits(bf16_to_float(x[i + misalign])) & 0x7fffffffu);
  Dev<uint16_t> dx(x);
  Dev<uint8_t> dx8(x8);
  Dev<float> dxs(xs), dalpha(alpha);
  Dev<uint32_t> damax(std::vector<uint32_t>{amax});
  Dev<uint8_t> a_out(r.slots * H);
  Dev<float> s1(r.slots);
  const void* xp = e4m3_x ? static_cast<const void*>(dx8.p + misalign) : static_cast<const void*>(dx.p + misalign);
  const float* scale = scale_kind == 2 ? nullptr : dxs.p;
  fz::gather_quantize(dr.rr, xp, e4m3_x, H, scale, scale_kind == 1, damax.p, dalpha.p, a_out.p, s1.p, nullptr);
  const auto got = a_out.get();
  const auto got_s1 = s1.get();
  float dyn = bits_float(amax) / 448.0f;
  if (dyn == 0.0f) dyn = 1.0f;
  for (int64_t row = 0; row < r.slots; ++row) {
    if (row >= r.valid) {
      for (int64_t h = 0; h < H; ++h) expect(got[row * H + h] == 0xAA, "untouched row", row * H + h, got[row * H + h], 0xAA);
      continue;
    }
    const int64_t slot = r.in_perm[row], t = slot / topk;
    const float a1 = scale_kind == 2 ? dyn : xs[scale_kind == 1 ? t : 0];
    expect(same_float(got_s1[row], a1 * alpha[r.local_ids[slot]]), "s1", row, got_s1[row], a1 * alpha[r.local_ids[slot]]);
    for (int64_t h = 0; h < H; ++h) {
      const uint8_t want =
          e4m3_x ? x8[t * H + h + misalign] : float_to_e4m3(bf16_to_float(x[t * H + h + misalign]) / a1);
      expect(same_e4m3(got[row * H + h], want), "a1", row * H + h, got[row * H + h], want);
    }
  }
}

// ---- gather_dequantize ---------------------------------------------------------------------------
void check_gather_dequant(fz::ActivationInput input, int64_t tokens, int64_t topk, int64_t local, int64_t H) {
  std::printf("gather_dequantize input=%d T=%lld H=%lld\n", static_cast<int>(input), (long long)tokens, (long long)H);
  const Routing r = make_routing(tokens, topk, local);
  DevRouting dr(r);
  std::vector<uint8_t> xb(tokens * H * 2), sc(tokens * H / 16);
  for (auto& c : xb) c = static_cast<uint8_t>(rng());
  for (auto& c : sc) c = static_cast<uint8_t>(input == fz::ActivationInput::kMxfp8 ? 100 + rng() % 50 : rng() % 0x7f);
  std::vector<float> pts(tokens), alpha(local);
  for (auto& s : pts) s = rnd(1.0f);
  for (auto& a : alpha) a = rnd(1.0f);
  Dev<uint8_t> dx(xb), dsc(sc);
  Dev<float> dpts(pts), dalpha(alpha);
  Dev<uint16_t> a_out(r.slots * H);
  Dev<float> s1(r.slots);
  fz::gather_dequantize(dr.rr, input, dx.p, dsc.p, H, dpts.p, dalpha.p, a_out.p, s1.p, nullptr);
  const auto got = a_out.get();
  const auto got_s1 = s1.get();
  const uint16_t* xbf = reinterpret_cast<const uint16_t*>(xb.data());
  for (int64_t row = 0; row < r.valid; ++row) {
    const int64_t slot = r.in_perm[row], t = slot / topk;
    const float want_s1 = alpha[r.local_ids[slot]] * pts[t];
    expect(same_float(got_s1[row], want_s1), "s1", row, got_s1[row], want_s1);
    for (int64_t h = 0; h < H; ++h) {
      uint16_t want;
      if (input == fz::ActivationInput::kBf16) {
        want = xbf[t * H + h];
      } else if (input == fz::ActivationInput::kNvfp4) {
        const uint8_t byte = xb[t * (H / 2) + h / 2];
        const uint8_t code = static_cast<uint8_t>(h % 2 == 0 ? byte & 0xf : byte >> 4);
        want = float_to_bf16(e2m1_to_float(code) * e4m3_to_float(sc[t * (H / 16) + h / 16]));
      } else {
        want = float_to_bf16(e4m3_to_float(xb[t * H + h]) * ue8m0_to_float(sc[t * (H / 32) + h / 32]));
      }
      const uint16_t g = got[row * H + h];
      expect(g == want || (std::isnan(bf16_to_float(g)) && std::isnan(bf16_to_float(want))), "a1 bf16", row * H + h,
             bf16_to_float(g), bf16_to_float(want));
    }
  }
}

// ---- activations -------------------------------------------------------------------------------
// v[r, i] = act(h[r]) with the scalar index rule, one feature per thread (the check's own kernel).
__global__ void act_ref_kernel(const float* h, int64_t rows, int64_t rows1, int64_t inter, fz::ActivationArgs a,
                               float* v) {
  const int64_t n = rows * inter;
  for (int64_t x = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; x < n; x += gridDim.x * blockDim.x) {
    const int64_t r = x / inter, i = x % inter;
    const float* row = h + r * rows1;
    float out;
    if (a.activation == Activation::kRelu2) {
      out = activation::relu2<float>(row[i]);
    } else {
      const int64_t up = a.layout == GateUpLayout::kGateUp ? inter + i : 128 * (i / 64) + i % 64;
      const int64_t gate = a.layout == GateUpLayout::kGateUp ? i : up + 64;
      const float g = row[gate], u = row[up];
      if (a.activation == Activation::kSwiglu) out = activation::swiglu<float>(g, u, a.swiglu_alpha, a.swiglu_beta, a.swiglu_limit);
      else if (a.activation == Activation::kGegluTanh) out = activation::geglu_tanh<float>(g, u);
      else out = activation::situ<float>(g, u, a.situ_beta, a.has_situ_linear_beta, a.situ_linear_beta);
    }
    v[x] = out;
  }
}

fz::ActivationArgs act_args(Activation act, GateUpLayout layout) {
  return fz::ActivationArgs{act, layout, 1.702f, 1.0f, 7.0f, 1.0f, true, 2.0f};
}

// Host v over the valid rows (computed on the GPU by act_ref_kernel).
std::vector<float> act_values(const Dev<float>& h, int64_t rows, int64_t rows1, int64_t I, const fz::ActivationArgs& a) {
  Dev<float> v(std::max<int64_t>(rows, 1) * I);
  if (rows > 0) act_ref_kernel<<<256, 256>>>(h.p, rows, rows1, I, a, v.p);
  CK(cudaGetLastError());
  return v.get();
}

void check_requant_fp8(Activation act, GateUpLayout layout, int64_t tokens, int64_t topk, int64_t local, int64_t I,
                       bool dynamic) {
  std::printf("activation_requant act=%d layout=%d T=%lld I=%lld dynamic=%d\n", static_cast<int>(act),
              static_cast<int>(layout), (long long)tokens, (long long)I, dynamic);
  const Routing r = make_routing(tokens, topk, local);
  DevRouting dr(r);
  const int64_t rows1 = act == Activation::kRelu2 ? I : 2 * I;
  std::vector<float> hh(r.slots * rows1), alpha(local);
  for (auto& x : hh) x = rnd(4.0f);
  for (auto& a : alpha) a = rnd(1.0f);
  Dev<float> h(hh), dalpha(alpha), a2s(std::vector<float>{0.0123f});
  Dev<uint32_t> amax(std::vector<uint32_t>{0});
  Dev<uint8_t> a_out(r.slots * I);
  Dev<float> s2(r.slots);
  const fz::ActivationArgs a = act_args(act, layout);
  if (dynamic) fz::activation_amax(dr.rr, h.p, rows1, I, a, amax.p, nullptr);
  fz::activation_requant(dr.rr, h.p, rows1, I, a, dynamic ? nullptr : a2s.p, amax.p, dalpha.p, a_out.p, s2.p, nullptr);
  const auto got = a_out.get();
  const auto got_s2 = s2.get();
  const std::vector<float> v = act_values(h, r.valid, rows1, I, a);
  uint32_t want_amax = 0;
  for (int64_t i = 0; i < r.valid * I; ++i) want_amax = std::max(want_amax, float_bits(v[i]) & 0x7fffffffu);
  if (dynamic) {
    const uint32_t got_amax = amax.get()[0];
    expect(got_amax == want_amax, "amax bits", 0, got_amax, want_amax);
  }
  float a2 = 0.0123f;
  if (dynamic) a2 = bits_float(want_amax) / 448.0f == 0.0f ? 1.0f : bits_float(want_amax) / 448.0f;
  for (int64_t row = 0; row < r.slots; ++row) {
    for (int64_t i = 0; i < I; ++i) {
      const uint8_t want = row < r.valid ? float_to_e4m3(v[row * I + i] / a2) : 0xAA;
      expect(same_e4m3(got[row * I + i], want), "a2", row * I + i, got[row * I + i], want);
    }
    if (row < r.valid) {
      const float want_s2 = a2 * alpha[r.local_ids[r.in_perm[row]]];
      expect(same_float(got_s2[row], want_s2), "s2", row, got_s2[row], want_s2);
    }
  }
}

void check_requant_bf16(fz::Bf16Requant mode, Activation act, GateUpLayout layout, int64_t tokens, int64_t topk,
                        int64_t local, int64_t I) {
  std::printf("activation_requant_bf16 mode=%d act=%d layout=%d T=%lld I=%lld\n", static_cast<int>(mode),
              static_cast<int>(act), static_cast<int>(layout), (long long)tokens, (long long)I);
  const Routing r = make_routing(tokens, topk, local);
  DevRouting dr(r);
  const int64_t rows1 = act == Activation::kRelu2 ? I : 2 * I;
  std::vector<float> hh(r.slots * rows1), alpha(local);
  for (auto& x : hh) x = rnd(4.0f);
  // One all-zero row of h (a zero activation row for relu2 / swiglu): the per-token zero-row path.
  if (r.valid > 1)
    for (int64_t c = 0; c < rows1; ++c) hh[1 * rows1 + c] = 0.0f;
  for (auto& a : alpha) a = rnd(1.0f);
  const float fc2 = 0.37f;
  Dev<float> h(hh), dalpha(alpha), dfc2(std::vector<float>{fc2});
  Dev<uint16_t> a_out(r.slots * I);
  Dev<float> s2(r.slots);
  const fz::ActivationArgs a = act_args(act, layout);
  fz::activation_requant_bf16(dr.rr, h.p, rows1, I, a, mode, dfc2.p, dalpha.p, a_out.p, s2.p, nullptr);
  const auto got = a_out.get();
  const auto got_s2 = s2.get();
  const std::vector<float> v = act_values(h, r.valid, rows1, I, a);
  for (int64_t row = 0; row < r.valid; ++row) {
    const float w2a = alpha[r.local_ids[r.in_perm[row]]];
    const float* vr = v.data() + row * I;
    std::vector<float> md(I);
    float want_s2 = w2a;
    auto nvfp4 = [&](const float* in, float gs) {
      for (int64_t b = 0; b < I; b += 16) {
        uint32_t m = 0;
        for (int j = 0; j < 16; ++j) m = std::max(m, float_bits(in[b + j]) & 0x7fffffffu);
        const float sf = e4m3_to_float(float_to_e4m3(gs * bits_float(m) / 6.0f));
        for (int j = 0; j < 16; ++j) {
          const float q = sf == 0.0f ? 0.0f : e2m1_to_float(float_to_e2m1(in[b + j] * gs / sf));
          md[b + j] = q * sf;
        }
      }
    };
    if (mode == fz::Bf16Requant::kBf16) {
      for (int64_t i = 0; i < I; ++i) md[i] = vr[i];
    } else if (mode == fz::Bf16Requant::kNvfp4) {
      nvfp4(vr, fc2);
    } else if (mode == fz::Bf16Requant::kMxfp8) {
      for (int64_t b = 0; b < I; b += 32) {
        uint32_t m = 0;
        for (int j = 0; j < 32; ++j) m = std::max(m, float_bits(vr[b + j]) & 0x7fffffffu);
        const float s = ue8m0_to_float(ue8m0_ceil(bits_float(m) / 448.0f));
        for (int j = 0; j < 32; ++j) md[b + j] = e4m3_to_float(float_to_e4m3(vr[b + j] / s)) * s;
      }
    } else {
      std::vector<float> b(I);
      uint32_t m = 0;
      for (int64_t i = 0; i < I; ++i) b[i] = round_bf16(vr[i]), m = std::max(m, float_bits(b[i]) & 0x7fffffffu);
      const float row_scale = bits_float(m) * fc2;
      if (row_scale == 0.0f) {
        std::fill(md.begin(), md.end(), 0.0f);
        want_s2 = 0.0f;
      } else {
        nvfp4(b.data(), 1.0f / row_scale);
        want_s2 = w2a * row_scale;
      }
    }
    expect(same_float(got_s2[row], want_s2), "s2", row, got_s2[row], want_s2);
    for (int64_t i = 0; i < I; ++i) {
      const uint16_t want = float_to_bf16(md[i]), g = got[row * I + i];
      expect(g == want, "a2 bf16", row * I + i, bf16_to_float(g), bf16_to_float(want));
    }
  }
  for (int64_t row = r.valid; row < r.slots; ++row)
    for (int64_t i = 0; i < I; ++i) expect(got[row * I + i] == 0xAAAA, "untouched row", row * I + i, got[row * I + i], 0xAAAA);
}

// ---- finalize / scatter_slot_rows ----------------------------------------------------------------
template <class OutT>
float round_host(float v);
template <> float round_host<__nv_bfloat16>(float v) { return bf16_to_float(float_to_bf16(v)); }
template <> float round_host<__half>(float v) { return __half2float(__float2half_rn(v)); }
template <> float round_host<float>(float v) { return v; }
template <class OutT> float out_value(OutT x);
template <> float out_value<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> float out_value<__half>(__half x) { return __half2float(x); }
template <> float out_value<float>(float x) { return x; }

template <class OutT>
void check_finalize(DType dtype, int64_t tokens, int64_t topk, int64_t local, int64_t H, bool deterministic,
                    bool misalign_y) {
  std::printf("finalize dtype=%s T=%lld k=%lld H=%lld det=%d misalign=%d\n", dtype_name(dtype), (long long)tokens,
              (long long)topk, (long long)H, deterministic, misalign_y);
  const Routing r = make_routing(tokens, topk, local);
  std::vector<uint16_t> y = rnd_bf16(r.slots * H + 8);
  std::vector<float> w(r.slots);
  for (auto& x : w) x = rnd(0.3f);
  const float rsf = 2.5f;
  Dev<uint16_t> dy(y);
  Dev<int32_t> perm(r.out_perm);
  Dev<float> dw(w);
  Dev<OutT> out(tokens * H);
  fz::finalize(dy.p + misalign_y, perm.p, dw.p, tokens, static_cast<int>(topk), H, rsf, deterministic, dtype, out.p,
               nullptr);
  const auto got = out.get();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t n = 0; n < H; ++n) {
      float o = 0.0f;
      for (int64_t j = 0; j < topk; ++j) {
        const int32_t row = r.out_perm[t * topk + j];
        if (row < 0) continue;
        const float v = bf16_to_float(y[row * H + n + misalign_y]), wj = w[t * topk + j];
        if (deterministic) o = o + wj * v;
        else o = round_host<OutT>(o + round_bf16(rsf * wj * v));
      }
      const float want = deterministic ? round_host<OutT>(rsf * o) : o;
      const float g = out_value(got[t * H + n]);
      expect(same_float(g, want), "out", t * H + n, g, want);
    }
  Dev<uint16_t> slot_rows(r.slots * H);
  fz::scatter_slot_rows(dy.p + misalign_y, perm.p, r.slots, H, slot_rows.p, nullptr);
  const auto sr = slot_rows.get();
  for (int64_t s = 0; s < r.slots; ++s)
    for (int64_t n = 0; n < H; ++n) {
      const uint16_t want = r.out_perm[s] < 0 ? 0xAAAA : y[r.out_perm[s] * H + n + misalign_y];
      expect(sr[s * H + n] == want, "slot_rows", s * H + n, sr[s * H + n], want);
    }
}

}  // namespace

int main() {
  // gather_quantize: decode and T = 64 at DeepSeek-V3 H, H off the 1024 chunk, scalar paths.
  for (int scale = 0; scale < 3; ++scale) {
    check_gather_quantize(1, 8, 256, 7168, scale, false, false);
    check_gather_quantize(64, 8, 32, 2048, scale, false, false);
    check_gather_quantize(7, 3, 5, 1160, scale, false, false);
    check_gather_quantize(3, 2, 4, 1160, scale, true, false);  // misaligned x: scalar path
    check_gather_quantize(3, 2, 4, 100, scale, false, false);  // H % 8 != 0
  }
  check_gather_quantize(5, 4, 6, 7168, 0, false, true);
  check_gather_quantize(5, 4, 6, 7168, 0, true, true);
  check_gather_quantize(4, 2, 3, 256, 2, false, false, /*none_valid=*/true);
  // gather_dequantize.
  for (auto in : {fz::ActivationInput::kBf16, fz::ActivationInput::kNvfp4, fz::ActivationInput::kMxfp8}) {
    check_gather_dequant(in, 1, 8, 256, 7168);
    check_gather_dequant(in, 9, 4, 16, 1056);
    check_gather_dequant(in, 700, 8, 64, 7168);  // 5600 rows: CTAs loop over rows (capped grid)
  }
  // activation_requant (fp8): every activation, both layouts, static / dynamic a2, I off the chunk.
  for (Activation act : {Activation::kSwiglu, Activation::kGegluTanh, Activation::kRelu2, Activation::kSitu})
    for (GateUpLayout layout : {GateUpLayout::kGateUp, GateUpLayout::kUpGateInterleaved64})
      for (bool dynamic : {false, true}) {
        check_requant_fp8(act, layout, 1, 8, 256, 2048, dynamic);
        check_requant_fp8(act, layout, 9, 4, 8, 1152, dynamic);
      }
  check_requant_fp8(Activation::kSwiglu, GateUpLayout::kUpGateInterleaved64, 700, 8, 64, 2048, false);  // looped grid
  check_requant_fp8(Activation::kRelu2, GateUpLayout::kGateUp, 3, 2, 4, 100, true);  // I % 8 != 0: scalar path
  // activation_requant_bf16: every mode x activation x layout.
  for (auto mode : {fz::Bf16Requant::kBf16, fz::Bf16Requant::kNvfp4, fz::Bf16Requant::kNvfp4PerToken,
                    fz::Bf16Requant::kMxfp8})
    for (Activation act : {Activation::kSwiglu, Activation::kRelu2, Activation::kGegluTanh})
      for (GateUpLayout layout : {GateUpLayout::kGateUp, GateUpLayout::kUpGateInterleaved64}) {
        check_requant_bf16(mode, act, layout, 1, 8, 128, 768);
        check_requant_bf16(mode, act, layout, 9, 4, 8, 2176);
      }
  for (auto mode : {fz::Bf16Requant::kBf16, fz::Bf16Requant::kNvfp4, fz::Bf16Requant::kMxfp8})  // looped grid
    check_requant_bf16(mode, Activation::kSwiglu, GateUpLayout::kUpGateInterleaved64, 1100, 8, 64, 2048);
  // finalize: both modes, three output dtypes, vector and scalar paths.
  for (bool det : {true, false}) {
    check_finalize<__nv_bfloat16>(DType::kBFloat16, 1, 8, 256, 7168, det, false);
    check_finalize<__nv_bfloat16>(DType::kBFloat16, 64, 8, 32, 7168, det, false);
    check_finalize<__half>(DType::kFloat16, 5, 16, 8, 1160, det, false);
    check_finalize<float>(DType::kFloat32, 5, 3, 4, 1160, det, false);
    check_finalize<float>(DType::kFloat32, 5, 3, 4, 100, det, false);
    check_finalize<__nv_bfloat16>(DType::kBFloat16, 5, 6, 4, 1160, det, true);
  }
  std::printf(g_failures == 0 ? "PASS\n" : "FAIL (%d mismatches)\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
