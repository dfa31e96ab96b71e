// Valid calls of every public C++ entry, built from a seed with all their memory, for the hostile-input
// and concurrency tests (test_hostile_inputs.cpp, test_concurrency.cpp): routing
// (get_cutlass_w4a8_moe_mm_data; top-k up to 9 > E allowed, some ids out of range), the grouped GEMM
// (cutlass_w4a8_moe_mm; K = 256 or 512, one row outside every group), the fused MoE (every quant mode
// via fused_moe_case.h, EP local range) and six formats.h functions. Each exposes its tensor
// arguments as Slots (name, TensorRef, output?, legal dtypes) so a test can change one, its scalars
// through bad_scalar(), and every buffer for byte snapshots.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fused_moe_case.h"
#include "qmoe/error.h"
#include "qmoe/expert_parallel_layer.h"
#include "qmoe/formats.h"
#include "qmoe/fused_moe.h"
#include "qmoe/grouped_gemm.h"
#include "qmoe/routing.h"

namespace hostile {

using fused_moe_test::Rng;
using qmoe::Device;
using qmoe::DType;
using qmoe::TensorRef;

inline constexpr DType kAllDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                                DType::kUE8M0,   DType::kInt4x2,  DType::kFloat4E2M1x2, DType::kInt8,
                                DType::kUInt8,   DType::kInt32,   DType::kInt64};

// One tensor argument of a call: where its TensorRef lives, whether it is written, which dtypes
// it may legally have, and whether its shape is free (only numel matters).
struct Slot {
  std::string name;
  TensorRef* ref;
  bool output;
  std::vector<DType> accepted;
  bool shape_free = false;
  // A size this argument may also legally have (w4a8_int4's a1: [1] or [T]): growing into it is not a
  // bad call (the memory behind it is the caller's promise), so the generator skips that case.
  int64_t also_legal_numel = -1;
};

// One valid call with all its memory. Built fresh for every mutation.
struct Target {
  std::string label;
  std::vector<Slot> slots;
  std::vector<std::string> scalars;
  std::function<void()> run;
  std::vector<std::pair<const void*, size_t>> memory;  // every buffer of the call (pointer, bytes)
  std::function<void(Rng&, const std::string&)> bad_scalar;

  std::set<std::string> names() const {
    std::set<std::string> s(scalars.begin(), scalars.end());
    for (const auto& slot : slots) s.insert(slot.name);
    return s;
  }
};

struct Counts {
  int64_t rejected = 0, accepted = 0, recovered = 0;
};

inline std::vector<uint8_t> random_bytes(Rng& rng, size_t n) {
  std::vector<uint8_t> v(n);
  rng.fill(v);
  return v;
}

// ---- routing: get_cutlass_w4a8_moe_mm_data -----------------------------------------------------
struct RoutingCall {
  int64_t E, T, K, slots;
  std::vector<uint8_t> ids, offsets, ps1, ps2, inp, outp;
  TensorRef t_ids, t_off, t_ps1, t_ps2, t_in, t_out;
  int64_t num_experts, n = 64, k = 256;

  RoutingCall(uint64_t seed) {
    Rng rng(seed);
    E = 1 + rng.below(9);
    T = 1 + rng.below(7);
    K = 1 + rng.below(9);  // top-k > E is legal here: an expert twice in a token counts twice
    slots = T * K;
    num_experts = E;
    ids.resize(static_cast<size_t>(slots * 4));
    for (int64_t s = 0; s < slots; ++s) {
      const int32_t id = static_cast<int32_t>(rng.below(E + 3)) - 1;  // some -1 and >= E: dropped
      std::memcpy(&ids[static_cast<size_t>(4 * s)], &id, 4);
    }
    offsets.assign(static_cast<size_t>((E + 1) * 4), 0xAA);
    ps1.assign(static_cast<size_t>(E * 12), 0xAA);
    ps2.assign(static_cast<size_t>(E * 12), 0xAA);
    inp.assign(static_cast<size_t>(slots * 4), 0xAA);
    outp.assign(static_cast<size_t>(slots * 4), 0xAA);
    t_ids = qmoe::make_tensor(ids.data(), DType::kInt32, {T, K});
    t_off = qmoe::make_tensor(offsets.data(), DType::kInt32, {E + 1});
    t_ps1 = qmoe::make_tensor(ps1.data(), DType::kInt32, {E, 3});
    t_ps2 = qmoe::make_tensor(ps2.data(), DType::kInt32, {E, 3});
    t_in = qmoe::make_tensor(inp.data(), DType::kInt32, {slots});
    t_out = qmoe::make_tensor(outp.data(), DType::kInt32, {slots});
  }
  Target target() {
    Target t;
    t.label = "moe_mm_data";
    const std::vector<DType> i32 = {DType::kInt32};
    t.slots = {{"topk_ids", &t_ids, false, {DType::kInt32, DType::kInt64}, true},
               {"expert_offsets", &t_off, true, i32},
               {"problem_sizes1", &t_ps1, true, i32},
               {"problem_sizes2", &t_ps2, true, i32},
               {"input_permutation", &t_in, true, i32},
               {"output_permutation", &t_out, true, i32}};
    t.scalars = {"num_experts", "n", "k"};
    t.run = [this] {
      qmoe::get_cutlass_w4a8_moe_mm_data(t_ids, t_off, t_ps1, t_ps2, t_in, t_out, num_experts, n, k);
    };
    for (auto* v : {&ids, &offsets, &ps1, &ps2, &inp, &outp}) t.memory.emplace_back(v->data(), v->size());
    t.bad_scalar = [this](Rng& rng, const std::string& name) {
      const int64_t bad[] = {0, -1, INT64_MIN, INT64_MAX, int64_t{1} << 31, 1025};
      const int64_t v = bad[rng.below(6)];
      if (name == "num_experts") num_experts = v == int64_t{1} << 31 ? 1025 : v;
      if (name == "n") n = v == 1025 ? int64_t{1} << 30 : v;
      if (name == "k") k = v == 1025 ? 0 : v;
    };
    return t;
  }
};

// ---- grouped GEMM: cutlass_w4a8_moe_mm ----------------------------------------------------------
struct GemmCall {
  int64_t E, N, K, R;
  std::vector<uint8_t> d, a, b, a_scales, b_scales, offsets, sizes, sa, sb, sd, ss;
  qmoe::W4A8MoeMmArgs args;

  GemmCall(uint64_t seed) {
    Rng rng(seed);
    E = 1 + rng.below(4);
    N = 8 * (1 + rng.below(3));
    K = rng.below(2) ? 512 : 256;
    std::vector<int64_t> counts(static_cast<size_t>(E));
    R = 1;  // one row outside every group
    for (auto& c : counts) {
      c = rng.below(4);
      R += c;
    }
    d.assign(static_cast<size_t>(R * N * 2), 0xAA);
    a = random_bytes(rng, static_cast<size_t>(R * K));
    for (auto& c : a) c &= 0x77;  // finite e4m3 codes of modest size
    b = random_bytes(rng, static_cast<size_t>(E * N * K / 2));
    const bool per_row = rng.below(2);
    a_scales.resize(static_cast<size_t>((per_row ? R : 1) * 4));
    for (size_t i = 0; i < a_scales.size(); i += 4) {
      const float s = rng.uni(0.5f, 2.0f);
      std::memcpy(&a_scales[i], &s, 4);
    }
    b_scales.resize(static_cast<size_t>(E * N * (K / 128) * 2));
    for (size_t i = 0; i < b_scales.size(); i += 2) {
      const uint16_t s = qmoe::float_to_bf16(rng.uni(0.004f, 0.012f));
      std::memcpy(&b_scales[i], &s, 2);
    }
    offsets.resize(static_cast<size_t>(E * 4));
    sizes.resize(static_cast<size_t>(E * 12));
    int32_t row = 1;
    for (int64_t e = 0; e < E; ++e) {
      const int32_t v[3] = {static_cast<int32_t>(N), static_cast<int32_t>(counts[static_cast<size_t>(e)]),
                            static_cast<int32_t>(K)};
      std::memcpy(&offsets[static_cast<size_t>(4 * e)], &row, 4);
      std::memcpy(&sizes[static_cast<size_t>(12 * e)], v, 12);
      row += v[1];
    }
    auto fill64 = [&](std::vector<uint8_t>& s, int64_t value) {
      s.resize(static_cast<size_t>(E * 3 * 8));
      for (size_t i = 0; i < s.size(); i += 8) std::memcpy(&s[i], &value, 8);
    };
    fill64(sa, K), fill64(sb, K), fill64(sd, N), fill64(ss, N);
    args.d = qmoe::make_tensor(d.data(), DType::kBFloat16, {R, N});
    args.a = qmoe::make_tensor(a.data(), DType::kFloat8E4M3, {R, K});
    args.b = qmoe::make_tensor(b.data(), DType::kInt8, {E, N, K / 2});
    args.a_scales = qmoe::make_tensor(a_scales.data(), DType::kFloat32, {static_cast<int64_t>(a_scales.size() / 4)});
    args.b_scales = K % 512 == 0 ? qmoe::make_tensor(b_scales.data(), DType::kBFloat16, {E, K / 512, 4 * N})
                                 : qmoe::make_tensor(b_scales.data(), DType::kBFloat16, {E, K / 128, N});
    args.expert_offsets = qmoe::make_tensor(offsets.data(), DType::kInt32, {E});
    args.problem_sizes = qmoe::make_tensor(sizes.data(), DType::kInt32, {E, 3});
    args.a_strides = qmoe::make_tensor(sa.data(), DType::kInt64, {E, 3});
    args.b_strides = qmoe::make_tensor(sb.data(), DType::kInt64, {E, 3});
    args.d_strides = qmoe::make_tensor(sd.data(), DType::kInt64, {E, 3});
    args.s_strides = qmoe::make_tensor(ss.data(), DType::kInt64, {E, 3});
    args.topk = 2;
  }
  Target target() {
    Target t;
    t.label = "w4a8_moe_mm";
    const std::vector<DType> i64 = {DType::kInt64};
    t.slots = {{"d", &args.d, true, {DType::kBFloat16}},
               {"a", &args.a, false, {DType::kFloat8E4M3}},
               {"b", &args.b, false, {DType::kInt8, DType::kInt4x2, DType::kUInt8}},
               {"a_scales", &args.a_scales, false, {DType::kFloat32}},
               {"b_scales", &args.b_scales, false, {DType::kBFloat16}},
               {"expert_offsets", &args.expert_offsets, false, {DType::kInt32}},
               {"problem_sizes", &args.problem_sizes, false, {DType::kInt32}},
               {"a_strides", &*args.a_strides, false, i64},
               {"b_strides", &*args.b_strides, false, i64},
               {"d_strides", &*args.d_strides, false, i64},
               {"s_strides", &*args.s_strides, false, i64}};
    t.scalars = {"chunk_size", "topk"};
    t.run = [this] { qmoe::cutlass_w4a8_moe_mm(args); };
    for (auto* v : {&d, &a, &b, &a_scales, &b_scales, &offsets, &sizes, &sa, &sb, &sd, &ss})
      t.memory.emplace_back(v->data(), v->size());
    t.bad_scalar = [this](Rng& rng, const std::string& name) {
      const int64_t bad[] = {0, -1, -128, 64, 129, 256, INT64_MIN, INT64_MAX};
      if (name == "chunk_size") args.chunk_size = bad[rng.below(8)];
      const int64_t bad_topk[] = {0, -1, INT64_MIN};
      if (name == "topk") args.topk = bad_topk[rng.below(3)];
    };
    return t;
  }
};

// ---- fused MoE ---------------------------------------------------------------------------------
struct FusedCall {
  fused_moe_test::Case cs;
  qmoe::FusedMoeParams p;

  static fused_moe_test::Config config(uint64_t seed) {
    Rng rng(seed);
    fused_moe_test::Config c;
    const qmoe::QuantMode modes[] = {qmoe::QuantMode::kW4A4, qmoe::QuantMode::kW4A8Mx, qmoe::QuantMode::kW4A16,
                                     qmoe::QuantMode::kW4A8Int4, qmoe::QuantMode::kW4A16Int4};
    c.mode = modes[rng.below(5)];
    const bool int4 = c.mode == qmoe::QuantMode::kW4A8Int4 || c.mode == qmoe::QuantMode::kW4A16Int4;
    c.layout = int4 ? qmoe::GateUpLayout::kGateUp : qmoe::GateUpLayout::kUpGateInterleaved64;
    c.T = 1 + rng.below(4);
    c.k = 1 + rng.below(3);
    c.E = 6;
    c.El = 4;
    c.offset = rng.below(3);
    c.H = int4 ? 128 : 64;
    c.I = int4 ? 128 : 64;
    c.per_token = c.mode == qmoe::QuantMode::kW4A4 && rng.below(2);
    c.deterministic = rng.below(2);
    c.out = rng.below(2) ? DType::kFloat32 : DType::kBFloat16;
    return c;
  }
  explicit FusedCall(uint64_t seed) : cs(fused_moe_test::make_case(config(seed), seed)) {
    cs.poison();
    p = cs.params();
  }
  // The fused call's tensor slots, buffers and scalar mutations on params p of case cs (shared with
  // EpLayerCall, whose layer takes the same tensors).
  static void add_fused(Target& t, fused_moe_test::Case& cs, qmoe::FusedMoeParams& p) {
    const bool int4 = fused_moe_test::fmt_of(cs.c.mode) == fused_moe_test::Fmt::kInt4;
    const std::vector<DType> w = int4 ? std::vector<DType>{DType::kInt4x2, DType::kInt8, DType::kUInt8}
                                      : std::vector<DType>{DType::kFloat4E2M1x2, DType::kUInt8};
    std::vector<DType> ws = {DType::kBFloat16};
    if (cs.c.mode == qmoe::QuantMode::kW4A8Mx) ws = {DType::kUE8M0, DType::kUInt8};
    if (cs.c.mode == qmoe::QuantMode::kW4A4 || cs.c.mode == qmoe::QuantMode::kW4A16) ws = {DType::kFloat8E4M3, DType::kUInt8};
    std::vector<DType> xd = {DType::kBFloat16};
    if (cs.c.mode == qmoe::QuantMode::kW4A8Int4) xd = {DType::kBFloat16, DType::kFloat8E4M3};
    if (cs.c.mode == qmoe::QuantMode::kW4A4) xd = {DType::kFloat4E2M1x2, DType::kUInt8};
    if (cs.c.mode == qmoe::QuantMode::kW4A8Mx) xd = {DType::kFloat8E4M3};
    t.slots = {{"x", &p.x, false, xd},
               {"topk_ids", &p.topk_ids, false, {DType::kInt32}},
               {"topk_weights", &p.topk_weights, false, {DType::kFloat32}},
               {"w1", &p.w1, false, w},
               {"w1_scale", &p.w1_scale, false, ws},
               {"w2", &p.w2, false, w},
               {"w2_scale", &p.w2_scale, false, ws},
               {"output", &p.output, true, {DType::kBFloat16, DType::kFloat16, DType::kFloat32}}};
    auto opt = [&](std::optional<TensorRef>& r, const char* name, std::vector<DType> dt) {
      if (r) t.slots.push_back({name, &*r, false, dt});
    };
    std::vector<DType> xs = {DType::kFloat32};
    if (cs.c.mode == qmoe::QuantMode::kW4A4) xs = {DType::kFloat8E4M3, DType::kUInt8};
    if (cs.c.mode == qmoe::QuantMode::kW4A8Mx) xs = {DType::kUE8M0, DType::kUInt8};
    opt(p.x_scale, "x_scale", xs);
    if (cs.c.mode == qmoe::QuantMode::kW4A8Int4 && p.x_scale) t.slots.back().also_legal_numel = p.topk_ids.size(0);
    opt(p.w1_alpha, "w1_alpha", {DType::kFloat32});
    opt(p.w2_alpha, "w2_alpha", {DType::kFloat32});
    opt(p.fc2_input_scale, "fc2_input_scale", {DType::kFloat32});
    opt(p.per_token_scale, "per_token_scale", {DType::kFloat32});
    t.scalars = {"quant_mode", "activation", "gate_up_layout", "num_experts", "num_local_experts",
                 "local_expert_offset", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit", "situ_beta",
                 "tactic"};
    auto add = [&](const auto& v) {
      if (!v.empty()) t.memory.emplace_back(v.data(), v.size() * sizeof(v[0]));
    };
    add(cs.ids), add(cs.wts), add(cs.x16), add(cs.x8), add(cs.xsf), add(cs.a1), add(cs.a2), add(cs.w1a);
    add(cs.w2a), add(cs.pts), add(cs.out), add(cs.w1.packed), add(cs.w1.stored16), add(cs.w1.stored8);
    add(cs.w2.packed), add(cs.w2.stored16), add(cs.w2.stored8);
  }
  static void bad_fused_scalar(qmoe::FusedMoeParams& p, Rng& rng, const std::string& name) {
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    if (name == "quant_mode") p.quant_mode = static_cast<qmoe::QuantMode>(rng.below(2) ? 5 : -1);
    if (name == "activation") p.activation = static_cast<qmoe::Activation>(rng.below(2) ? 4 : 200);
    if (name == "gate_up_layout") p.gate_up_layout = static_cast<qmoe::GateUpLayout>(rng.below(2) ? 2 : -7);
    if (name == "num_experts") p.num_experts = rng.below(2) ? 0 : -5;
    if (name == "num_local_experts") p.num_local_experts = rng.below(2) ? -1 : INT64_MIN;
    if (name == "local_expert_offset") p.local_expert_offset = rng.below(2) ? -1 : INT64_MIN;
    if (name == "routed_scaling_factor") p.routed_scaling_factor = rng.below(2) ? nan : -inf;
    if (name == "swiglu_alpha") p.swiglu_alpha = rng.below(2) ? nan : inf;
    if (name == "swiglu_limit") p.swiglu_limit = rng.below(2) ? nan : 0.0f;
    if (name == "situ_beta") p.situ_beta = rng.below(2) ? nan : 2.0f;  // 2: a SiTU parameter with another act
    if (name == "tactic") p.tactic = "decode_m128_n8_k256";
  }
  Target target() {
    Target t;
    t.label = std::string("fused_moe[") + qmoe::quant_mode_name(cs.c.mode) + "]";
    add_fused(t, cs, p);
    t.run = [this] { qmoe::fused_moe(p); };
    t.bad_scalar = [this](Rng& rng, const std::string& name) { bad_fused_scalar(p, rng, name); };
    return t;
  }
};

// ---- moe_expert_rows: the fused call's inputs, per-slot rows out (no output, weights or rsf) ----
struct ExpertRowsCall {
  FusedCall f;
  std::vector<uint8_t> rows;
  TensorRef t_rows;

  explicit ExpertRowsCall(uint64_t seed) : f(seed) {
    const int64_t slots = f.cs.c.T * f.cs.c.k, hidden = f.cs.c.H;
    rows.assign(static_cast<size_t>(slots * hidden * 2), 0xAA);
    t_rows = qmoe::make_tensor(rows.data(), DType::kBFloat16, {slots, hidden});
  }
  Target target() {
    Target t = f.target();
    t.label = std::string("moe_expert_rows[") + qmoe::quant_mode_name(f.cs.c.mode) + "]";
    // p.output and p.routed_scaling_factor are not used by moe_expert_rows (fused_moe.h).
    for (size_t i = 0; i < t.slots.size(); ++i)
      if (t.slots[i].name == "output") t.slots.erase(t.slots.begin() + static_cast<std::ptrdiff_t>(i));
    t.slots.push_back({"rows", &t_rows, true, {DType::kBFloat16}});
    std::vector<std::string> scalars;
    for (const auto& n : t.scalars)
      if (n != "routed_scaling_factor") scalars.push_back(n);
    t.scalars = scalars;
    t.run = [this] { qmoe::moe_expert_rows(f.p, t_rows); };
    t.memory.emplace_back(rows.data(), rows.size());
    return t;
  }
};

// ---- the EP layers (expert_parallel_layer.h) on one rank: the fused call's tensors with all experts
// local, an in-memory exchange (a rank sending to itself); seeds with bit 0 set run the throughput
// layer, the others the low-latency one with capacity T + 1; seeds with bit 1 set the reduced combine
// (deterministic = false), the others the per-slot one.
struct EpLayerCall {
  fused_moe_test::Case cs;
  qmoe::ep::LowLatencyLayer layer;

  static fused_moe_test::Config config(uint64_t seed) {
    fused_moe_test::Config c = FusedCall::config(seed);
    c.El = c.E;
    c.offset = 0;
    c.deterministic = (seed & 2) == 0;
    c.a2_dynamic = false;
    return c;
  }
  bool throughput = false;
  explicit EpLayerCall(uint64_t seed) : cs(fused_moe_test::make_case(config(seed), seed)), throughput((seed & 1) != 0) {
    cs.poison();
    layer.moe = cs.params();
    layer.world_size = 1;
    layer.rank = 0;
    layer.max_tokens_per_rank = cs.c.T + 1;
  }
  Target target() {
    Target t;
    t.label = std::string(throughput ? "ep_throughput_layer[" : "ep_low_latency_layer[") +
              qmoe::quant_mode_name(cs.c.mode) + "]";
    FusedCall::add_fused(t, cs, layer.moe);
    for (const char* name : {"world_size", "rank"}) t.scalars.push_back(name);
    if (!throughput) t.scalars.push_back("max_tokens_per_rank");
    t.run = [this] {
      qmoe::ep::Exchange self = [](const std::vector<qmoe::ep::PeerTransfer>& peers, cudaStream_t) {
        for (const auto& x : peers)
          if (x.send_bytes > 0) std::memcpy(x.recv, x.send, static_cast<size_t>(x.send_bytes));
      };
      if (throughput) qmoe::ep::throughput_layer(qmoe::ep::ThroughputLayer{layer.moe, layer.world_size, layer.rank}, self);
      else qmoe::ep::low_latency_layer(layer, self);
    };
    t.bad_scalar = [this](Rng& rng, const std::string& name) {
      FusedCall::bad_fused_scalar(layer.moe, rng, name);
      if (name == "world_size") layer.world_size = rng.below(2) ? 0 : -3;
      if (name == "rank") layer.rank = rng.below(2) ? -1 : 1;
      if (name == "max_tokens_per_rank") layer.max_tokens_per_rank = rng.below(2) ? 0 : layer.moe.topk_ids.size(0) - 1;
    };
    return t;
  }
};

// ---- moe_finalize (rows in slot order, or through row_index) ----------------------------------
// Seeds with bit 0 set take row_index (rows [R, H], R != T*k; the rows slot is then not mutated:
// any R is legal with an index, and the Python hostile test covers R). Experts: E = 8, local [2, 6).
struct FinalizeCall {
  int64_t T, K, H = 16, R, E = 8;
  bool indexed;
  std::vector<uint8_t> rows, ids, wts, out, index;
  qmoe::MoeFinalizeParams p;

  explicit FinalizeCall(uint64_t seed) {
    Rng rng(seed);
    indexed = (seed & 1) != 0;
    T = 1 + rng.below(5);
    K = (indexed ? 2 : 1) + rng.below(3);  // k >= 2 with an index: [T*k, 1] is then not the legal [T, k]
    R = indexed ? 1 + rng.below(12) : T * K;
    rows.resize(static_cast<size_t>(R * H * 2));
    for (size_t i = 0; i < rows.size(); i += 2) {
      const uint16_t v = qmoe::float_to_bf16(rng.uni(-2.0f, 2.0f));
      std::memcpy(&rows[i], &v, 2);
    }
    ids.resize(static_cast<size_t>(T * K * 4));
    wts.resize(static_cast<size_t>(T * K * 4));
    index.resize(static_cast<size_t>(T * K * 4));
    for (int64_t s = 0; s < T * K; ++s) {
      const int32_t id = static_cast<int32_t>(rng.below(E + 2)) - 1;  // -1 and E: dropped
      const float w = rng.uni(0.1f, 1.0f);
      const int32_t r = static_cast<int32_t>(rng.below(R + 2)) - 1;  // -1 and R: skipped
      std::memcpy(&ids[static_cast<size_t>(4 * s)], &id, 4);
      std::memcpy(&wts[static_cast<size_t>(4 * s)], &w, 4);
      std::memcpy(&index[static_cast<size_t>(4 * s)], &r, 4);
    }
    out.assign(static_cast<size_t>(T * H * 4), 0xAA);
    const DType out_dtype = rng.below(2) ? DType::kFloat32 : DType::kBFloat16;
    p.rows = qmoe::make_tensor(rows.data(), DType::kBFloat16, {R, H});
    p.topk_ids = qmoe::make_tensor(ids.data(), DType::kInt32, {T, K});
    p.topk_weights = qmoe::make_tensor(wts.data(), DType::kFloat32, {T, K});
    p.output = qmoe::make_tensor(out.data(), out_dtype, {T, H});
    if (indexed) p.row_index = qmoe::make_tensor(index.data(), DType::kInt32, {T * K});
    p.num_experts = E;
    p.num_local_experts = 4;
    p.local_expert_offset = 2;
    p.routed_scaling_factor = 1.25f;
  }
  Target target() {
    Target t;
    t.label = indexed ? "moe_finalize[row_index]" : "moe_finalize[slots]";
    t.slots = {{"topk_ids", &p.topk_ids, false, {DType::kInt32}},
               {"topk_weights", &p.topk_weights, false, {DType::kFloat32}},
               {"output", &p.output, true, {DType::kBFloat16, DType::kFloat16, DType::kFloat32}}};
    if (indexed) {
      t.slots.push_back({"row_index", &*p.row_index, false, {DType::kInt32}});
    } else {
      t.slots.push_back({"rows", &p.rows, false, {DType::kBFloat16}});
    }
    t.scalars = {"num_experts", "num_local_experts", "local_expert_offset", "routed_scaling_factor"};
    t.run = [this] { qmoe::moe_finalize(p); };
    for (auto* v : {&rows, &ids, &wts, &out, &index}) t.memory.emplace_back(v->data(), v->size());
    t.bad_scalar = [this](Rng& rng, const std::string& name) {
      // Each value fails the first check that names its own argument.
      if (name == "num_experts") p.num_experts = rng.below(2) ? 0 : -5;
      if (name == "num_local_experts") p.num_local_experts = rng.below(2) ? -1 : INT64_MIN;
      if (name == "local_expert_offset") p.local_expert_offset = rng.below(2) ? -1 : INT64_MIN;
      if (name == "routed_scaling_factor")
        p.routed_scaling_factor = rng.below(2) ? std::numeric_limits<float>::quiet_NaN()
                                               : -std::numeric_limits<float>::infinity();
    };
    return t;
  }
};

// ---- formats.h array functions -----------------------------------------------------------------
struct FormatsCall {
  int fn;
  int64_t R, K;
  std::vector<uint8_t> in0, in1, out0, out1;
  TensorRef t_in0, t_in1, t_out0, t_out1;
  float global_scale = 300.0f;

  explicit FormatsCall(uint64_t seed) {
    Rng rng(seed);
    fn = static_cast<int>(seed % 6);
    R = 5 + rng.below(3);  // > 4, so a grown per-tensor scale [1] -> [2..4] never becomes a legal per-row one
    K = 128 * (1 + rng.below(2));
    auto real = [&](std::vector<uint8_t>& v, int64_t n) {
      v.resize(static_cast<size_t>(n * 4));
      for (int64_t i = 0; i < n; ++i) {
        const float f = rng.normal() * 3.0f;
        std::memcpy(&v[static_cast<size_t>(4 * i)], &f, 4);
      }
    };
    auto poison = [](std::vector<uint8_t>& v, int64_t n) { v.assign(static_cast<size_t>(n), 0xAA); };
    switch (fn) {
      case 0:  // quantize_fp8(x, scale, q)
        real(in0, R * K), real(in1, 1);
        poison(out0, R * K);
        t_in0 = qmoe::make_tensor(in0.data(), DType::kFloat32, {R, K});
        t_in1 = qmoe::make_tensor(in1.data(), DType::kFloat32, {1});
        t_out0 = qmoe::make_tensor(out0.data(), DType::kFloat8E4M3, {R, K});
        break;
      case 1:  // quantize_mxfp8(x, q, sf)
      case 2:  // quantize_nvfp4(x, gs, q, sf)
        real(in0, R * K);
        poison(out0, R * K), poison(out1, R * K / 16);
        t_in0 = qmoe::make_tensor(in0.data(), DType::kFloat32, {R, K});
        t_out0 = fn == 1 ? qmoe::make_tensor(out0.data(), DType::kFloat8E4M3, {R, K})
                         : qmoe::make_tensor(out0.data(), DType::kFloat4E2M1x2, {R, K / 2});
        t_out1 = fn == 1 ? qmoe::make_tensor(out1.data(), DType::kUE8M0, {R, K / 32})
                         : qmoe::make_tensor(out1.data(), DType::kFloat8E4M3, {R, K / 16});
        break;
      case 3:  // swizzle_scales_128x4(sf, out)
        in0 = random_bytes(rng, static_cast<size_t>(2 * R * 5));
        poison(out0, 2 * 128 * 8);
        t_in0 = qmoe::make_tensor(in0.data(), DType::kUInt8, {2, R, 5});
        t_out0 = qmoe::make_tensor(out0.data(), DType::kUInt8, {2, 128, 8});
        break;
      case 4:  // quantize_int4_g128(w, q, scales)
        real(in0, R * K);
        poison(out0, R * K / 2), poison(out1, R * K / 128 * 4);
        t_in0 = qmoe::make_tensor(in0.data(), DType::kFloat32, {R, K});
        t_out0 = qmoe::make_tensor(out0.data(), DType::kInt8, {R, K / 2});
        t_out1 = qmoe::make_tensor(out1.data(), DType::kFloat32, {R, K / 128});
        break;
      default:  // pack_int4(values, packed)
        in0.resize(static_cast<size_t>(R * K));
        for (auto& v : in0) v = static_cast<uint8_t>(static_cast<int8_t>(rng.below(16) - 8));
        poison(out0, R * K / 2);
        t_in0 = qmoe::make_tensor(in0.data(), DType::kInt8, {R, K});
        t_out0 = qmoe::make_tensor(out0.data(), DType::kInt8, {R, K / 2});
        break;
    }
  }
  Target target() {
    Target t;
    const char* labels[] = {"quantize_fp8", "quantize_mxfp8", "quantize_nvfp4", "swizzle_scales_128x4",
                            "quantize_int4_g128", "pack_int4"};
    t.label = labels[fn];
    const std::vector<DType> real = {DType::kFloat32, DType::kBFloat16};
    const std::vector<DType> e4m3 = {DType::kFloat8E4M3, DType::kUInt8};
    const std::vector<DType> int4 = {DType::kInt4x2, DType::kInt8, DType::kUInt8};
    const std::vector<DType> bytes = {DType::kFloat8E4M3, DType::kUE8M0, DType::kInt4x2, DType::kFloat4E2M1x2,
                                      DType::kInt8, DType::kUInt8};
    switch (fn) {
      case 0:
        t.slots = {{"x", &t_in0, false, real}, {"scale", &t_in1, false, {DType::kFloat32}}, {"q", &t_out0, true, e4m3}};
        t.run = [this] { qmoe::quantize_fp8(t_in0, t_in1, t_out0); };
        break;
      case 1:
        t.slots = {{"x", &t_in0, false, real}, {"q", &t_out0, true, e4m3},
                   {"sf", &t_out1, true, {DType::kUE8M0, DType::kUInt8}}};
        t.run = [this] { qmoe::quantize_mxfp8(t_in0, t_out0, t_out1); };
        break;
      case 2:
        t.slots = {{"x", &t_in0, false, real}, {"q", &t_out0, true, {DType::kFloat4E2M1x2, DType::kUInt8}},
                   {"sf", &t_out1, true, e4m3}};
        t.scalars = {"global_scale"};
        t.run = [this] { qmoe::quantize_nvfp4(t_in0, global_scale, t_out0, t_out1); };
        t.bad_scalar = [this](Rng& rng, const std::string&) {
          const float bad[] = {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::infinity()};
          global_scale = bad[rng.below(4)];
        };
        break;
      case 3:  // any 1-byte dtype on either side (same dtype, or uint8 on one side)
        t.slots = {{"sf", &t_in0, false, bytes}, {"out", &t_out0, true, bytes}};
        t.run = [this] { qmoe::swizzle_scales_128x4(t_in0, t_out0); };
        break;
      case 4:
        t.slots = {{"w", &t_in0, false, real}, {"q", &t_out0, true, int4}, {"scales", &t_out1, true, {DType::kFloat32}}};
        t.run = [this] { qmoe::quantize_int4_g128(t_in0, t_out0, t_out1); };
        break;
      default:
        t.slots = {{"values", &t_in0, false, {DType::kInt8}}, {"packed", &t_out0, true, int4}};
        t.run = [this] { qmoe::pack_int4(t_in0, t_out0); };
        break;
    }
    for (auto* v : {&in0, &in1, &out0, &out1})
      if (!v->empty()) t.memory.emplace_back(v->data(), v->size());
    return t;
  }
};

// Snapshot of every byte of a call's memory.
inline std::vector<std::vector<uint8_t>> snapshot(const Target& t) {
  std::vector<std::vector<uint8_t>> s;
  for (const auto& [ptr, bytes] : t.memory) {
    const auto* b = static_cast<const uint8_t*>(ptr);
    s.emplace_back(b, b + bytes);
  }
  return s;
}

}  // namespace hostile
