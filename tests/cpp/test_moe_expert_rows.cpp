// moe_expert_rows + moe_finalize (include/qmoe/fused_moe.h): the two halves of the deterministic
// fused MoE, as expert parallelism uses them. The core property, for every quant mode:
//   moe_finalize(moe_expert_rows(p)) == fused_moe(p, deterministic = true)   bit for bit,
// rows of non-local / invalid slots are left unwritten by moe_expert_rows and never read by
// moe_finalize (both poisoned with NaN), and every validation rule names its argument.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "fused_moe_case.h"

namespace {

using namespace fused_moe_test;

constexpr uint16_t kNanBf16 = 0x7fc0;

struct Split {
  std::vector<uint16_t> rows;
  std::vector<uint8_t> out;
};

// Routes some slots outside the local range / outside [0, E) so that the skip rule is exercised.
void add_foreign_slots(Case& cs) {
  Rng rng(99);
  for (size_t s = 0; s < cs.ids.size(); s += 3) {
    const int64_t pick = rng.below(3);
    if (pick == 0) cs.ids[s] = -1;
    if (pick == 1) cs.ids[s] = static_cast<int32_t>(cs.c.E);  // >= num_experts
    if (pick == 2 && cs.c.offset > 0) cs.ids[s] = static_cast<int32_t>(cs.c.offset - 1);  // another rank's
  }
}

qmoe::MoeFinalizeParams finalize_params(Case& cs, Split& sp) {
  const int64_t T = cs.c.T, k = cs.c.k, H = cs.c.H;
  qmoe::MoeFinalizeParams f;
  f.rows = qmoe::make_tensor(sp.rows.data(), DType::kBFloat16, {T * k, H});
  f.topk_ids = qmoe::make_tensor(cs.ids.data(), DType::kInt32, {T, k});
  f.topk_weights = qmoe::make_tensor(cs.wts.data(), DType::kFloat32, {T, k});
  f.output = qmoe::make_tensor(sp.out.data(), cs.c.out, {T, H});
  f.num_experts = cs.c.E;
  f.num_local_experts = cs.c.El;
  f.local_expert_offset = cs.c.offset;
  f.routed_scaling_factor = cs.c.rsf;
  return f;
}

// Runs both paths; returns the number of slots the routing keeps (so a case cannot be vacuous).
int64_t check_split_equals_fused(Case& cs) {
  const int64_t T = cs.c.T, k = cs.c.k, H = cs.c.H;
  cs.c.deterministic = true;
  cs.poison();
  qmoe::fused_moe(cs.params());

  Split sp;
  sp.rows.assign(static_cast<size_t>(T * k * H), kNanBf16);
  sp.out.assign(cs.out.size(), 0xAA);
  qmoe::moe_expert_rows(cs.params(), qmoe::make_tensor(sp.rows.data(), DType::kBFloat16, {T * k, H}));
  qmoe::moe_finalize(finalize_params(cs, sp));
  EXPECT_EQ(0, std::memcmp(sp.out.data(), cs.out.data(), cs.out.size())) << "finalize(rows) != fused_moe";

  int64_t kept = 0;
  for (int64_t s = 0; s < T * k; ++s) {
    const int64_t e = cs.ids[static_cast<size_t>(s)], l = e - cs.c.offset;
    const bool local = e >= 0 && e < cs.c.E && l >= 0 && l < cs.c.El;
    kept += local;
    int64_t poisoned = 0;
    for (int64_t n = 0; n < H; ++n) poisoned += sp.rows[static_cast<size_t>(s * H + n)] == kNanBf16;
    if (local) {
      EXPECT_EQ(poisoned, 0) << "slot " << s << " is local but its row was not written";
    } else {
      EXPECT_EQ(poisoned, H) << "slot " << s << " is not local but its row was written";
    }
  }
  return kept;
}

struct ModeCase {
  QuantMode mode;
  DType out;
  bool per_token;
};

TEST(MoeExpertRows, FinalizeOfRowsEqualsDeterministicFusedMoeEveryMode) {
  const ModeCase modes[] = {{QuantMode::kW4A8Int4, DType::kBFloat16, false},
                            {QuantMode::kW4A16Int4, DType::kFloat32, false},
                            {QuantMode::kW4A4, DType::kFloat16, false},
                            {QuantMode::kW4A4, DType::kBFloat16, true},
                            {QuantMode::kW4A8Mx, DType::kBFloat16, false},
                            {QuantMode::kW4A16, DType::kFloat32, false}};
  uint64_t seed = 1;
  for (const ModeCase& m : modes) {
    SCOPED_TRACE(qmoe::quant_mode_name(m.mode));
    Config c;
    c.mode = m.mode;
    c.out = m.out;
    c.per_token = m.per_token;
    c.T = 5, c.k = 3, c.E = 8, c.El = 4, c.offset = 2, c.H = 256, c.I = 128;
    c.rsf = 2.5f;
    Case cs = make_case(c, seed++);
    add_foreign_slots(cs);
    EXPECT_GT(check_split_equals_fused(cs), 0);
  }
}

TEST(MoeExpertRows, W4A8Int4ScaleVariantsAndOneToken) {
  // a1: 0 = [1], 1 = [T], 2 = dynamic; a2 static or dynamic; x bf16 or e4m3; T = 1.
  for (int a1 = 0; a1 < 3; ++a1)
    for (int a2_dynamic = 0; a2_dynamic < 2; ++a2_dynamic)
      for (int64_t T : {1, 7}) {
        SCOPED_TRACE("a1=" + std::to_string(a1) + " a2_dynamic=" + std::to_string(a2_dynamic) +
                     " T=" + std::to_string(T));
        Config c;
        c.T = T, c.k = 4, c.E = 6;
        c.a1 = a1;
        c.a2_dynamic = a2_dynamic != 0;
        c.x_e4m3 = a1 != 2 && T == 7;  // an e4m3 x needs an explicit a1
        c.out = DType::kBFloat16;
        c.rsf = 0.75f;
        Case cs = make_case(c, 40 + static_cast<uint64_t>(a1 * 4 + a2_dynamic * 2 + T));
        EXPECT_GT(check_split_equals_fused(cs), 0);
      }
}

// ---- validation: each rule names its argument and writes nothing --------------------------------

struct Fixture {
  Case cs;
  Split sp;
  Fixture() {
    Config c;
    c.T = 3, c.k = 2, c.E = 4;
    cs = make_case(c, 7);
    sp.rows.assign(static_cast<size_t>(c.T * c.k * c.H), kNanBf16);
    sp.out.assign(cs.out.size(), 0xAA);
  }
  TensorRef rows() { return qmoe::make_tensor(sp.rows.data(), DType::kBFloat16, {cs.c.T * cs.c.k, cs.c.H}); }
  bool rows_untouched() const {
    for (uint16_t v : sp.rows)
      if (v != kNanBf16) return false;
    return true;
  }
  bool out_untouched() const {
    for (uint8_t v : sp.out)
      if (v != 0xAA) return false;
    return true;
  }
};

template <class F>
void expect_error(F&& fn, const std::string& argument, qmoe::ErrorKind kind = qmoe::ErrorKind::kValue) {
  try {
    fn();
    ADD_FAILURE() << "no error for argument '" << argument << "'";
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find("'" + argument + "'"), std::string::npos) << e.what();
  }
}

TEST(MoeExpertRowsValidation, RowsDtypeShapeAndAlias) {
  Fixture f;
  TensorRef r = f.rows();
  r.dtype = DType::kFloat32;
  expect_error([&] { qmoe::moe_expert_rows(f.cs.params(), r); }, "rows", qmoe::ErrorKind::kType);
  r = f.rows();
  r.shape[0] = f.cs.c.T;  // [T, H] is fused_moe's output shape, not the per-slot rows
  expect_error([&] { qmoe::moe_expert_rows(f.cs.params(), r); }, "rows");
  r = f.rows();
  r.data = f.cs.ids.data();  // overlaps topk_ids
  expect_error([&] { qmoe::moe_expert_rows(f.cs.params(), r); }, "rows");
  EXPECT_TRUE(f.rows_untouched());
}

TEST(MoeExpertRowsValidation, InputsAreCheckedAsInFusedMoe) {
  Fixture f;
  FusedMoeParams p = f.cs.params();
  p.num_local_experts = 5;  // > num_experts
  expect_error([&] { qmoe::moe_expert_rows(p, f.rows()); }, "num_local_experts");
  p = f.cs.params();
  p.topk_weights.dtype = DType::kFloat16;
  expect_error([&] { qmoe::moe_expert_rows(p, f.rows()); }, "topk_weights", qmoe::ErrorKind::kType);
  p = f.cs.params();
  p.tactic = "m64n16";
  expect_error([&] { qmoe::moe_expert_rows(p, f.rows()); }, "tactic");
  EXPECT_TRUE(f.rows_untouched());
}

TEST(MoeFinalizeValidation, EachRuleNamesItsArgument) {
  Fixture f;
  auto fp = [&] { return finalize_params(f.cs, f.sp); };
  qmoe::MoeFinalizeParams p = fp();
  p.rows.shape[0] -= 1;
  expect_error([&] { qmoe::moe_finalize(p); }, "rows");
  p = fp();
  p.rows.dtype = DType::kFloat32;
  expect_error([&] { qmoe::moe_finalize(p); }, "rows", qmoe::ErrorKind::kType);
  p = fp();
  p.topk_ids.dtype = DType::kInt64;
  expect_error([&] { qmoe::moe_finalize(p); }, "topk_ids", qmoe::ErrorKind::kType);
  p = fp();
  p.topk_weights.shape[1] = 3;
  expect_error([&] { qmoe::moe_finalize(p); }, "topk_weights");
  p = fp();
  p.output.dtype = DType::kInt32;
  expect_error([&] { qmoe::moe_finalize(p); }, "output", qmoe::ErrorKind::kType);
  p = fp();
  p.output.shape[1] = 128;
  expect_error([&] { qmoe::moe_finalize(p); }, "output");
  p = fp();
  p.output.data = f.sp.rows.data();
  expect_error([&] { qmoe::moe_finalize(p); }, "output");
  p = fp();
  p.num_experts = 0;
  expect_error([&] { qmoe::moe_finalize(p); }, "num_experts");
  p = fp();
  p.local_expert_offset = -1;
  expect_error([&] { qmoe::moe_finalize(p); }, "local_expert_offset");
  p = fp();
  p.num_local_experts = 3, p.local_expert_offset = 2;
  expect_error([&] { qmoe::moe_finalize(p); }, "num_local_experts");
  p = fp();
  p.routed_scaling_factor = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { qmoe::moe_finalize(p); }, "routed_scaling_factor");
  EXPECT_TRUE(f.out_untouched());
}

}  // namespace
