// CPU reference of the fused MoE forward (DESIGN.md 1, 3, 3b, 4, 5.2; include/qmoe/fused_moe.h).
// This is the executable semantics the GPU path and the numpy twin are compared with.
//
// Routing. Slot (t, j) with e = topk_ids[t, j] is valid when 0 <= e < num_experts and
// l = e - local_expert_offset lies in [0, num_local_experts). Each valid slot is one "row"
// (the same expert twice in a token gives two rows). Rows are numbered in flat slot order t*k + j.
//
// Dot products acc = W . a of a weight row with an fp32 operand row:
//   FP4 weights : acc = fp32( sum_k a[k] * wd[k] ) accumulated in fp64 (wd = dequantized weight)
//   int4 weights: SGLang's group promotion (DESIGN.md 3.1): P_g = fp32( sum_{k in g} a[k] * q[k] )
//                 in fp64, then for g = 0, 1, ...: acc = fma_fp32(S[g], P_g, acc)
// GEMM1 (row r = (t, j, l), W1 row n): int4 h = (acc * s1(t)) * w1_alpha[l];  FP4 h = acc * (w1_alpha[l] * s1(t))
// GEMM2 (row r, output feature n):     y = (s2(r) * w2_alpha[l]) * acc
// (w*_alpha optional in every mode but w4a4 / w4a16, where they carry NVFP4's global scales; 1 if absent).
// Operands a (all products below are exact in fp32) and the row scales s1, s2:
//   w4a8_int4  a = e4m3(x / a1(t)) (x bf16) or e4m3 x;  s1 = a1(t);  s2 = a2
//              a1: x_scale [1] or [T], or dynamic = amax|x| / 448 over the whole x (0 -> 1)
//   w4a16_int4 a = bf16 x;  s1 = s2 = 1
//   w4a4       a = e2m1 * e4m3(x_scale[t, h/16]);  wd = e2m1 * e4m3(swizzled sf)
//              s1 = per_token_scale[t] or 1;  s2 = row_scale (per-token variant, below) or 1
//   w4a8       a = e4m3 * ue8m0(x_scale[t, h/32]);  wd = e2m1 * ue8m0(swizzled sf);  s1 = s2 = 1
//   w4a16      a = bf16 x;  wd as w4a4;  s1 = s2 = 1
// This is the numpy twin's arithmetic (python/qmoe/reference.py) step for step.
//
// Activation v[r, i], i in [0, I) (src/reference/activations.h, evaluated in fp64 from the fp32 h and
// rounded once to fp32). Gated modes read W1 rows per gate_up_layout: kGateUp gate = i, up = I + i;
// kUpGateInterleaved64 up = 128*(i/64) + i%64, gate = up + 64. ReLU^2 reads row i (W1 has I rows).
//
// Intermediate md[r, :] (requantized from fp32 v, blocks along the logical I axis):
//   w4a8_int4  md = e4m3(v / a2); a2 = fc2_input_scale[0] or dynamic amax|v| / 448 over ALL rows (0 -> 1)
//   w4a4       NVFP4 with gs = fc2_input_scale[0]: per 16 block sf = e4m3(gs * amax / 6),
//              q = e2m1(v * gs / sf) (0 when sf == 0), md = q * sf
//   w4a4 + per_token_scale: b = bf16(v); row_scale = amax|b| * fc2_input_scale[0]; NVFP4 of b with
//              gs = 1 / row_scale; s2 = row_scale; a row with row_scale == 0 gives y = 0
//   w4a8       MXFP8: per 32 block s = ue8m0 value of ue8m0_ceil(amax / 448), md = e4m3(v / s) * s
//   w4a16, w4a16_int4: md = bf16(v)
//
// Finalize (rsf = routed_scaling_factor; round_out = rounding to the output dtype):
//   deterministic: out[t] = round_out(rsf * sum_j (w[t, j] * bf16(y[r_j])))  fp32 sum in slot order
//                  (product and sum each rounded to fp32: no fma contraction on the x86-64 baseline)
//   fused:         o = 0; for j in slot order: o = round_out(o + bf16(rsf * w[t, j] * y[r_j]))
//                  (emulates the bf16 atomic adds of the GPU scatter, in one fixed order)
// A token without a valid slot gets a zero row. Scalar products are evaluated left to right.
//
// Split entry points (expert parallelism): moe_expert_rows stops before the finalize and writes
// bf16(y[r_s]) at flat slot s for the valid local slots; moe_finalize runs the deterministic
// finalize above on such rows. Both share the code of fused_moe (compute_rows and
// finalize_deterministic below), so finalize(rows) == fused_moe(deterministic) bit for bit.
//
// Threads: work items are (expert, block of output features); each item decodes the weight rows
// it owns once and applies them to all rows of that expert, so each element is produced by one
// thread in a fixed order and the result does not depend on the thread count.
// Arguments are assumed validated (qmoe::validate_fused_moe, src/api/fused_moe.cpp).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "qmoe/formats.h"
#include "qmoe/fused_moe.h"
#include "reference/activations.h"
#include "reference/f16_bits.h"
#include "reference/out_element.h"

namespace qmoe::reference {

namespace {

// ------------------------------------------------------------------------------------------------
// Small helpers
// ------------------------------------------------------------------------------------------------

// Runs fn(i) for i in [0, n) on up to hardware_concurrency threads; rethrows the first exception.
template <class F>
void parallel_for(int64_t n, const F& fn) {
  if (n <= 0) return;
  const int64_t hw = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  const int64_t threads = std::min<int64_t>({n, hw, 64});
  if (threads == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    try {
      for (int64_t i = next++; i < n; i = next++) fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next = n;
    }
  };
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

// fp64 dot product of fp32 vectors. Eight independent partial sums let the compiler vectorize;
// the combination order is fixed, so the result is deterministic.
double dot(const float* a, const float* b, int64_t n) {
  double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t n8 = n - n % 8;
  for (int64_t i = 0; i < n8; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += static_cast<double>(a[i + j]) * static_cast<double>(b[i + j]);
  for (int64_t i = n8; i < n; ++i) s[0] += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// max |v| that propagates NaN (std::max and fmaxf would drop it).
float amax_nan(const float* v, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(v[i]);
    if (a > m || a != a) m = a;
    if (m != m) break;
  }
  return m;
}

// Dynamic per-tensor fp8 scale, as qmoe::fp8_dynamic_scale: amax / 448, an all-zero tensor gets 1.
float dynamic_fp8_scale(float amax) {
  const float s = amax / 448.0f;
  return s == 0.0f ? 1.0f : s;
}

float round_to(DType dtype, float v) {
  switch (dtype) {
    case DType::kBFloat16: return round_bf16(v);
    case DType::kFloat16: return half_bits_to_float(float_to_half_bits(v));
    default: return v;
  }
}
void store(const TensorRef& out, int64_t index, float v) { store_out_element(out.dtype, out.data, index, v); }

float opt_at(const std::optional<TensorRef>& t, int64_t index, float fallback) {
  return t ? t->ptr<const float>()[t->numel() == 1 ? 0 : index] : fallback;
}

// Two decoded 4-bit values per byte (even K index in the low nibble).
struct NibbleTables {
  float int4[256][2];
  float e2m1[256][2];
  NibbleTables() {
    for (int b = 0; b < 256; ++b) {
      const auto byte = static_cast<uint8_t>(b);
      int4[b][0] = static_cast<float>(int4_low(byte));
      int4[b][1] = static_cast<float>(int4_high(byte));
      e2m1[b][0] = e2m1_to_float(byte & 0xf);
      e2m1[b][1] = e2m1_to_float(byte >> 4);
    }
  }
};
const NibbleTables& nibbles() {
  static const NibbleTables tables;
  return tables;
}

// NVFP4 quantize -> dequantize (without 1/gs) of one block: md = e2m1(v * gs / sf) * sf.
void nvfp4_block(const float* v, int64_t n, float gs, float* md) {
  const float sf = e4m3_to_float(float_to_e4m3(gs * amax_nan(v, n) / 6.0f));
  for (int64_t e = 0; e < n; ++e) {
    const float q = sf == 0.0f ? 0.0f : e2m1_to_float(float_to_e2m1(v[e] * gs / sf));
    md[e] = q * sf;
  }
}
// MXFP8 quantize -> dequantize of one block.
void mxfp8_block(const float* v, int64_t n, float* md) {
  const float scale = ue8m0_to_float(ue8m0_ceil(amax_nan(v, n) / 448.0f));
  for (int64_t e = 0; e < n; ++e) md[e] = e4m3_to_float(float_to_e4m3(v[e] / scale)) * scale;
}

// The routing rule of every entry: slot id e counts when 0 <= e < num_experts and
// e - local_expert_offset lies in [0, local).
bool slot_is_local(int64_t e, int64_t num_experts, int64_t local_expert_offset, int64_t local) {
  const int64_t l = e - local_expert_offset;
  return e >= 0 && e < num_experts && l >= 0 && l < local;
}

// Deterministic finalize (header comment): out[t, n] = round_out(rsf * sum_j w[t, j] * row(s, n)),
// s = t*k + j over the slots the routing rule keeps, fp32 in slot order. row(s, n) returns the
// bf16-rounded GEMM2 element as a float; fused_moe reads it from its fp32 rows, moe_finalize from
// the caller's bf16 rows: one loop, so the two cannot drift apart.
template <class RowValue>
void finalize_deterministic(const int32_t* ids, const float* wts, int64_t tokens, int64_t topk, int64_t hidden,
                            int64_t num_experts, int64_t local_expert_offset, int64_t local, float rsf,
                            const TensorRef& out, const RowValue& row) {
  const DType dt = out.dtype;
  parallel_for(tokens, [&](int64_t t) {
    for (int64_t n = 0; n < hidden; ++n) {
      float o = 0.0f;
      for (int64_t j = 0; j < topk; ++j) {
        const int64_t s = t * topk + j;
        if (!slot_is_local(ids[s], num_experts, local_expert_offset, local)) continue;
        o += wts[s] * row(s, n);
      }
      store(out, t * hidden + n, round_to(dt, rsf * o));
    }
  });
}

// ------------------------------------------------------------------------------------------------
// The problem
// ------------------------------------------------------------------------------------------------

enum class WeightFormat { kInt4G128, kNvfp4, kMxfp4 };

WeightFormat weight_format(QuantMode m) {
  switch (m) {
    case QuantMode::kW4A8Int4:
    case QuantMode::kW4A16Int4: return WeightFormat::kInt4G128;
    case QuantMode::kW4A8Mx: return WeightFormat::kMxfp4;
    default: return WeightFormat::kNvfp4;
  }
}

class FusedMoe {
 public:
  explicit FusedMoe(const FusedMoeParams& p) : p_(p) {
    tokens_ = p.topk_ids.size(0);
    topk_ = p.topk_ids.size(1);
    hidden_ = p.w2.size(1);
    inter_ = 2 * p.w2.size(2);
    local_ = p.num_local_experts == 0 ? p.num_experts : p.num_local_experts;
    gated_ = p.activation != Activation::kRelu2;
    format_ = weight_format(p.quant_mode);
  }

  void run() {
    compute_rows();
    finalize();
  }

  // Everything up to (not including) the finalize: y_ holds alpha2 * GEMM2 per row.
  void compute_rows() {
    route();
    decode_activations();
    gemm1_and_activation();
    requantize();
    gemm2();
  }

  // rows[s, :] = bf16(y[r_s, :]) for the valid local slots s (bf16 [T*k, H]); other rows untouched.
  void write_rows(const TensorRef& rows) const {
    const int64_t H = hidden_;
    uint16_t* dst = rows.ptr<uint16_t>();
    parallel_for(tokens_ * topk_, [&](int64_t s) {
      const int64_t r = row_of_slot_[static_cast<size_t>(s)];
      if (r < 0) return;
      for (int64_t n = 0; n < H; ++n) dst[s * H + n] = float_to_bf16(y_[static_cast<size_t>(r * H + n)]);
    });
  }

 private:
  // Valid slots -> rows, in flat slot order; rows grouped per local expert.
  void route() {
    const int32_t* ids = p_.topk_ids.ptr<const int32_t>();
    row_of_slot_.assign(static_cast<size_t>(tokens_ * topk_), -1);
    expert_rows_.assign(static_cast<size_t>(local_), {});
    for (int64_t s = 0; s < tokens_ * topk_; ++s) {
      const int64_t e = ids[s];
      const int64_t l = e - p_.local_expert_offset;
      if (!slot_is_local(e, p_.num_experts, p_.local_expert_offset, local_)) continue;
      const auto r = static_cast<int64_t>(row_token_.size());
      row_of_slot_[static_cast<size_t>(s)] = r;
      row_token_.push_back(s / topk_);
      row_expert_.push_back(l);
      expert_rows_[static_cast<size_t>(l)].push_back(r);
    }
    for (int64_t l = 0; l < local_; ++l)
      if (!expert_rows_[static_cast<size_t>(l)].empty()) hit_experts_.push_back(l);
  }

  // xd [T, H] fp32 (the operand a of GEMM1) and the per-token GEMM1 scale s1.
  void decode_activations() {
    const int64_t T = tokens_, H = hidden_;
    xd_.assign(static_cast<size_t>(T * H), 0.0f);
    token_scale1_.assign(static_cast<size_t>(T), 1.0f);
    const auto& x = p_.x;
    switch (p_.quant_mode) {
      case QuantMode::kW4A8Int4: {
        float a1_dynamic = 1.0f;
        if (!p_.x_scale) {  // dynamic: amax over the whole bf16 tensor
          float m = 0.0f;
          const uint16_t* xb = x.ptr<const uint16_t>();
          for (int64_t i = 0; i < T * H; ++i) {
            const float a = std::fabs(bf16_to_float(xb[i]));
            if (a > m || a != a) m = a;
          }
          a1_dynamic = dynamic_fp8_scale(m);
        }
        for (int64_t t = 0; t < T; ++t) {
          const float a1 = opt_at(p_.x_scale, t, a1_dynamic);
          token_scale1_[static_cast<size_t>(t)] = a1;
          float* out = &xd_[static_cast<size_t>(t * H)];
          if (x.dtype == DType::kBFloat16) {
            const uint16_t* row = x.ptr<const uint16_t>() + t * H;
            for (int64_t h = 0; h < H; ++h) out[h] = e4m3_to_float(float_to_e4m3(bf16_to_float(row[h]) / a1));
          } else {
            const uint8_t* row = x.ptr<const uint8_t>() + t * H;
            for (int64_t h = 0; h < H; ++h) out[h] = e4m3_to_float(row[h]);
          }
        }
        break;
      }
      case QuantMode::kW4A16:
      case QuantMode::kW4A16Int4: {
        const uint16_t* xb = x.ptr<const uint16_t>();
        for (int64_t i = 0; i < T * H; ++i) xd_[static_cast<size_t>(i)] = bf16_to_float(xb[i]);
        break;
      }
      case QuantMode::kW4A4: {
        const auto& tab = nibbles();
        const uint8_t* q = x.ptr<const uint8_t>();
        const uint8_t* sf = p_.x_scale->ptr<const uint8_t>();
        for (int64_t t = 0; t < T; ++t) {
          token_scale1_[static_cast<size_t>(t)] = opt_at(p_.per_token_scale, t, 1.0f);
          for (int64_t h = 0; h < H; h += 2) {
            const float s = e4m3_to_float(sf[t * (H / 16) + h / 16]);
            const uint8_t b = q[(t * H + h) / 2];
            xd_[static_cast<size_t>(t * H + h)] = tab.e2m1[b][0] * s;
            xd_[static_cast<size_t>(t * H + h + 1)] = tab.e2m1[b][1] * s;
          }
        }
        break;
      }
      case QuantMode::kW4A8Mx: {
        const uint8_t* q = x.ptr<const uint8_t>();
        const uint8_t* sf = p_.x_scale->ptr<const uint8_t>();
        for (int64_t t = 0; t < T; ++t)
          for (int64_t h = 0; h < H; ++h)
            xd_[static_cast<size_t>(t * H + h)] = e4m3_to_float(q[t * H + h]) * ue8m0_to_float(sf[t * (H / 32) + h / 32]);
        break;
      }
    }
  }

  // Decodes row n of W1 (which == 1) or W2 (which == 2) of local expert l into out[K]: the int4
  // codes and their group scales group_scale[K/128] (int4), or the dequantized values (FP4).
  void decode_weight_row(int which, int64_t l, int64_t n, float* out, float* group_scale) const {
    const TensorRef& w = which == 1 ? p_.w1 : p_.w2;
    const TensorRef& sc = which == 1 ? p_.w1_scale : p_.w2_scale;
    const int64_t N = w.size(1), K = 2 * w.size(2);
    const uint8_t* row = w.ptr<const uint8_t>() + (l * N + n) * (K / 2);
    const auto& tab = nibbles();
    switch (format_) {
      case WeightFormat::kInt4G128: {
        const int64_t G = K / 128;
        const uint16_t* s = sc.ptr<const uint16_t>();
        for (int64_t g = 0; g < G; ++g) {
          // SGLang stored layout (DESIGN.md 3.1): [E, G/4, 4N] when G % 4 == 0, else [E, G, N].
          const int64_t index = G % 4 == 0 ? (l * (G / 4) + g / 4) * 4 * N + 4 * n + g % 4 : (l * G + g) * N + n;
          group_scale[g] = bf16_to_float(s[index]);
          for (int64_t b = g * 64; b < (g + 1) * 64; ++b) {
            out[2 * b] = tab.int4[row[b]][0];
            out[2 * b + 1] = tab.int4[row[b]][1];
          }
        }
        break;
      }
      case WeightFormat::kNvfp4:
      case WeightFormat::kMxfp4: {
        const bool nv = format_ == WeightFormat::kNvfp4;
        const int64_t block = nv ? 16 : 32;
        const int64_t cols = K / block;
        const int64_t row_tiles = (N + 127) / 128, col_tiles = (cols + 3) / 4;
        const uint8_t* s = sc.ptr<const uint8_t>();
        for (int64_t c = 0; c < cols; ++c) {
          const uint8_t code = s[swizzled_offset(l, n, c, row_tiles, col_tiles)];
          const float scale = nv ? e4m3_to_float(code) : ue8m0_to_float(code);
          for (int64_t b = c * block / 2; b < (c + 1) * block / 2; ++b) {
            out[2 * b] = tab.e2m1[row[b]][0] * scale;
            out[2 * b + 1] = tab.e2m1[row[b]][1] * scale;
          }
        }
        break;
      }
    }
  }

  // acc = W . a for a decoded weight row (see the header comment).
  float row_dot(const float* a, const float* w, const float* group_scale, int64_t k) const {
    if (format_ != WeightFormat::kInt4G128) return static_cast<float>(dot(a, w, k));
    float acc = 0.0f;
    for (int64_t g = 0; g < k / 128; ++g) {
      const auto p = static_cast<float>(dot(a + 128 * g, w + 128 * g, 128));
      // fp32 fma: the product of a bf16 scale and an fp32 value is exact in fp64.
      acc = static_cast<float>(static_cast<double>(acc) + static_cast<double>(group_scale[g]) * p);
    }
    return acc;
  }

  float w_alpha(const std::optional<TensorRef>& alpha, int64_t l) const {
    return alpha ? alpha->ptr<const float>()[l] : 1.0f;
  }

  // The activation in fp64, rounded once to fp32.
  float act(float g, float u) const {
    const double gd = g, ud = u;
    double v;
    switch (p_.activation) {
      case Activation::kSwiglu:
        v = activation::swiglu<double>(gd, ud, p_.swiglu_alpha, p_.swiglu_beta, p_.swiglu_limit);
        break;
      case Activation::kGegluTanh: v = activation::geglu_tanh<double>(gd, ud); break;
      case Activation::kSitu:
        v = activation::situ<double>(gd, ud, p_.situ_beta, p_.situ_linear_beta.has_value(),
                                     p_.situ_linear_beta.value_or(1.0f));
        break;
      default: v = activation::relu2<double>(gd); break;
    }
    return static_cast<float>(v);
  }

  // W1 row of the gate (or, for ReLU^2, the only) input of logical intermediate column i.
  int64_t gate_row(int64_t i) const {
    if (!gated_) return i;
    return p_.gate_up_layout == GateUpLayout::kGateUp ? i : 128 * (i / 64) + 64 + i % 64;
  }
  int64_t up_row(int64_t i) const {
    return p_.gate_up_layout == GateUpLayout::kGateUp ? inter_ + i : 128 * (i / 64) + i % 64;
  }

  // v[r, i] = act(alpha1 * dot(xd, w1 gate row), alpha1 * dot(xd, w1 up row)).
  void gemm1_and_activation() {
    const int64_t H = hidden_, I = inter_, rows = static_cast<int64_t>(row_token_.size());
    v_.assign(static_cast<size_t>(rows * I), 0.0f);
    const bool int4 = format_ == WeightFormat::kInt4G128;
    constexpr int64_t kBlock = 32;  // intermediate columns per work item
    const int64_t blocks = (I + kBlock - 1) / kBlock;
    parallel_for(static_cast<int64_t>(hit_experts_.size()) * blocks, [&](int64_t item) {
      const int64_t l = hit_experts_[static_cast<size_t>(item / blocks)];
      const int64_t i0 = (item % blocks) * kBlock, i1 = std::min(I, i0 + kBlock);
      const auto& rows_l = expert_rows_[static_cast<size_t>(l)];
      const float w1a = w_alpha(p_.w1_alpha, l);
      std::vector<float> gate(static_cast<size_t>(H)), up(static_cast<size_t>(gated_ ? H : 0));
      std::vector<float> gate_s(static_cast<size_t>(H / 128 + 1)), up_s(gate_s.size());
      for (int64_t i = i0; i < i1; ++i) {
        decode_weight_row(1, l, gate_row(i), gate.data(), gate_s.data());
        if (gated_) decode_weight_row(1, l, up_row(i), up.data(), up_s.data());
        for (int64_t r : rows_l) {
          const int64_t t = row_token_[static_cast<size_t>(r)];
          const float* x = &xd_[static_cast<size_t>(t * H)];
          const float s1 = token_scale1_[static_cast<size_t>(t)];
          auto scaled = [&](float acc) { return int4 ? (acc * s1) * w1a : acc * (w1a * s1); };
          const float g = scaled(row_dot(x, gate.data(), gate_s.data(), H));
          const float u = gated_ ? scaled(row_dot(x, up.data(), up_s.data(), H)) : 0.0f;
          v_[static_cast<size_t>(r * I + i)] = act(g, u);
        }
      }
    });
  }

  // md[r, :] and alpha2(r) from v (see the header comment).
  void requantize() {
    const int64_t I = inter_, rows = static_cast<int64_t>(row_token_.size());
    md_.assign(static_cast<size_t>(rows * I), 0.0f);
    row_alpha2_.assign(static_cast<size_t>(rows), 1.0f);
    row_zero_.assign(static_cast<size_t>(rows), 0);
    float a2 = 1.0f;
    if (p_.quant_mode == QuantMode::kW4A8Int4)
      a2 = p_.fc2_input_scale ? p_.fc2_input_scale->ptr<const float>()[0]
                              : dynamic_fp8_scale(amax_nan(v_.data(), rows * I));
    const bool per_token = p_.quant_mode == QuantMode::kW4A4 && p_.per_token_scale.has_value();
    parallel_for(rows, [&](int64_t r) {
      const int64_t l = row_expert_[static_cast<size_t>(r)];
      const float* v = &v_[static_cast<size_t>(r * I)];
      float* md = &md_[static_cast<size_t>(r * I)];
      float& alpha2 = row_alpha2_[static_cast<size_t>(r)];
      const float w2a = w_alpha(p_.w2_alpha, l);
      switch (p_.quant_mode) {
        case QuantMode::kW4A8Int4:
          for (int64_t i = 0; i < I; ++i) md[i] = e4m3_to_float(float_to_e4m3(v[i] / a2));
          alpha2 = a2 * w2a;
          break;
        case QuantMode::kW4A16:
        case QuantMode::kW4A16Int4:
          for (int64_t i = 0; i < I; ++i) md[i] = round_bf16(v[i]);
          alpha2 = w2a;
          break;
        case QuantMode::kW4A8Mx:
          for (int64_t i = 0; i < I; i += 32) mxfp8_block(v + i, 32, md + i);
          alpha2 = w2a;
          break;
        case QuantMode::kW4A4: {
          const float fc2 = p_.fc2_input_scale->ptr<const float>()[0];
          if (!per_token) {
            for (int64_t i = 0; i < I; i += 16) nvfp4_block(v + i, 16, fc2, md + i);
            alpha2 = w2a;
            break;
          }
          std::vector<float> b(static_cast<size_t>(I));
          for (int64_t i = 0; i < I; ++i) b[static_cast<size_t>(i)] = round_bf16(v[i]);
          const float row_scale = amax_nan(b.data(), I) * fc2;
          if (row_scale == 0.0f) {  // md stays 0; the row contributes exactly 0
            row_zero_[static_cast<size_t>(r)] = 1;
            alpha2 = 0.0f;
            break;
          }
          const float gs = 1.0f / row_scale;
          for (int64_t i = 0; i < I; i += 16) nvfp4_block(b.data() + i, 16, gs, md + i);
          alpha2 = w2a * row_scale;
          break;
        }
      }
    });
  }

  // y[r, n] = alpha2(r) * dot(md[r], w2 row n).
  void gemm2() {
    const int64_t H = hidden_, I = inter_, rows = static_cast<int64_t>(row_token_.size());
    y_.assign(static_cast<size_t>(rows * H), 0.0f);
    constexpr int64_t kBlock = 64;  // output features per work item
    const int64_t blocks = (H + kBlock - 1) / kBlock;
    parallel_for(static_cast<int64_t>(hit_experts_.size()) * blocks, [&](int64_t item) {
      const int64_t l = hit_experts_[static_cast<size_t>(item / blocks)];
      const int64_t n0 = (item % blocks) * kBlock, n1 = std::min(H, n0 + kBlock);
      const auto& rows_l = expert_rows_[static_cast<size_t>(l)];
      std::vector<float> w(static_cast<size_t>(I)), w_s(static_cast<size_t>(I / 128 + 1));
      for (int64_t n = n0; n < n1; ++n) {
        decode_weight_row(2, l, n, w.data(), w_s.data());
        for (int64_t r : rows_l) {
          if (row_zero_[static_cast<size_t>(r)]) continue;  // y stays exactly 0
          y_[static_cast<size_t>(r * H + n)] =
              row_alpha2_[static_cast<size_t>(r)] * row_dot(&md_[static_cast<size_t>(r * I)], w.data(), w_s.data(), I);
        }
      }
    });
  }

  void finalize() {
    const int64_t H = hidden_, k = topk_;
    const float rsf = p_.routed_scaling_factor;
    const float* wts = p_.topk_weights.ptr<const float>();
    if (p_.deterministic) {
      finalize_deterministic(p_.topk_ids.ptr<const int32_t>(), wts, tokens_, k, H, p_.num_experts,
                             p_.local_expert_offset, local_, rsf, p_.output, [&](int64_t s, int64_t n) {
                               const int64_t r = row_of_slot_[static_cast<size_t>(s)];
                               return round_bf16(y_[static_cast<size_t>(r * H + n)]);
                             });
      return;
    }
    const DType dt = p_.output.dtype;
    parallel_for(tokens_, [&](int64_t t) {
      for (int64_t n = 0; n < H; ++n) {
        float o = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t r = row_of_slot_[static_cast<size_t>(t * k + j)];
          if (r < 0) continue;
          const float w = wts[t * k + j];
          const float y = y_[static_cast<size_t>(r * H + n)];
          o = round_to(dt, o + round_bf16(rsf * w * y));
        }
        store(p_.output, t * H + n, o);
      }
    });
  }

  const FusedMoeParams& p_;
  int64_t tokens_ = 0, topk_ = 0, hidden_ = 0, inter_ = 0, local_ = 0;
  bool gated_ = true;
  WeightFormat format_ = WeightFormat::kInt4G128;

  std::vector<int64_t> row_of_slot_;  // [T*k] -> row or -1
  std::vector<int64_t> row_token_, row_expert_;
  std::vector<std::vector<int64_t>> expert_rows_;
  std::vector<int64_t> hit_experts_;

  std::vector<float> xd_, token_scale1_;
  std::vector<float> v_, md_, row_alpha2_, y_;
  std::vector<uint8_t> row_zero_;
};

}  // namespace

namespace {
// Packed FP4 weights (FusedMoeParams::fp4_weights_packed): the reference reads plain copies.
struct PlainWeights {
  std::vector<uint8_t> w1, w2;
  FusedMoeParams params;
  explicit PlainWeights(const FusedMoeParams& p) : params(p) {
    if (!p.fp4_weights_packed) return;
    auto plain = [](const TensorRef& packed, std::vector<uint8_t>& bytes, TensorRef& slot) {
      bytes.resize(static_cast<size_t>(packed.numel()));
      TensorRef out = packed;
      out.data = bytes.data();
      unpack_fp4_weights(packed, out);
      slot = out;
    };
    plain(p.w1, w1, params.w1);
    plain(p.w2, w2, params.w2);
    params.fp4_weights_packed = false;
  }
};
}  // namespace

void fused_moe(const FusedMoeParams& p) {
  const PlainWeights plain(p);
  FusedMoe(plain.params).run();
}

void moe_expert_rows(const FusedMoeParams& p, const TensorRef& rows) {
  const PlainWeights plain(p);
  FusedMoe moe(plain.params);
  moe.compute_rows();
  moe.write_rows(rows);
}

void moe_finalize(const MoeFinalizeParams& p) {
  const int64_t hidden = p.rows.size(1), tokens = p.topk_ids.size(0), topk = p.topk_ids.size(1);
  const uint16_t* rows = p.rows.ptr<const uint16_t>();
  const int64_t local = p.num_local_experts == 0 ? p.num_experts : p.num_local_experts;
  if (!p.row_index) {
    finalize_deterministic(p.topk_ids.ptr<const int32_t>(), p.topk_weights.ptr<const float>(), tokens, topk, hidden,
                           p.num_experts, p.local_expert_offset, local, p.routed_scaling_factor, p.output,
                           [&](int64_t s, int64_t n) { return bf16_to_float(rows[s * hidden + n]); });
    return;
  }
  // Row index: a slot whose index lies outside [0, R) is dropped like an invalid id, so the ids the
  // shared loop sees are the caller's with those slots set to -1 (same loop, same bits).
  const int32_t* index = p.row_index->ptr<const int32_t>();
  const int32_t* ids = p.topk_ids.ptr<const int32_t>();
  const int64_t num_rows = p.rows.size(0);
  std::vector<int32_t> kept_ids(static_cast<size_t>(tokens * topk));
  for (int64_t s = 0; s < tokens * topk; ++s) kept_ids[s] = index[s] >= 0 && index[s] < num_rows ? ids[s] : -1;
  finalize_deterministic(kept_ids.data(), p.topk_weights.ptr<const float>(), tokens, topk, hidden, p.num_experts,
                         p.local_expert_offset, local, p.routed_scaling_factor, p.output, [&](int64_t s, int64_t n) {
                           return bf16_to_float(rows[static_cast<int64_t>(index[s]) * hidden + n]);
                         });
}

}  // namespace qmoe::reference
