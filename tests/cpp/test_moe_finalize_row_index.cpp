// moe_finalize with a row index (include/qmoe/fused_moe.h, CPU reference):
//
//   moe_finalize(rows [R, H], row_index = i) == moe_finalize(rows[i] gathered into slot order)   bit for bit
//
// where a slot whose index lies outside [0, R) is dropped (the gathered side gives it id -1). Rows no
// kept slot points at are NaN (never read), the output is poisoned (0xAA) before each call and left
// untouched when validation fails; each rule of the index names 'row_index'.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "qmoe/error.h"
#include "qmoe/formats.h"
#include "qmoe/fused_moe.h"

namespace {

using qmoe::DType;
using qmoe::TensorRef;

constexpr int64_t kT = 9, kK = 4, kH = 24, kR = 17, kE = 8;
constexpr uint16_t kNanBf16 = 0x7FC0;

struct Case {
  std::vector<uint16_t> rows = std::vector<uint16_t>(kR * kH);
  std::vector<int32_t> ids = std::vector<int32_t>(kT * kK), index = std::vector<int32_t>(kT * kK);
  std::vector<float> wts = std::vector<float>(kT * kK);
  std::vector<uint16_t> out = std::vector<uint16_t>(kT * kH, 0xAAAA);

  explicit Case(unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> value(-2.0f, 2.0f), weight(0.1f, 1.0f);
    for (auto& r : rows) r = qmoe::float_to_bf16(value(rng));
    for (int64_t s = 0; s < kT * kK; ++s) {
      ids[s] = static_cast<int32_t>(rng() % kE);
      index[s] = static_cast<int32_t>(rng() % kR);
      wts[s] = weight(rng);
    }
    ids[1] = -1;
    ids[6] = kE;       // dropped by the routing rule
    index[3] = -1;
    index[9] = kR;     // dropped by the index
    index[14] = -5;
    // Rows no kept slot points at are NaN: reading one would show in the output.
    std::vector<bool> referenced(kR, false);
    for (int64_t s = 0; s < kT * kK; ++s)
      if (ids[s] >= 0 && ids[s] < kE && index[s] >= 0 && index[s] < kR) referenced[index[s]] = true;
    for (int64_t r = 0; r < kR; ++r)
      if (!referenced[r])
        for (int64_t n = 0; n < kH; ++n) rows[r * kH + n] = kNanBf16;
  }

  qmoe::MoeFinalizeParams params() {
    qmoe::MoeFinalizeParams p;
    p.rows = qmoe::make_tensor(rows.data(), DType::kBFloat16, {kR, kH});
    p.topk_ids = qmoe::make_tensor(ids.data(), DType::kInt32, {kT, kK});
    p.topk_weights = qmoe::make_tensor(wts.data(), DType::kFloat32, {kT, kK});
    p.output = qmoe::make_tensor(out.data(), DType::kBFloat16, {kT, kH});
    p.row_index = qmoe::make_tensor(index.data(), DType::kInt32, {kT * kK});
    p.num_experts = kE;
    p.routed_scaling_factor = 2.5f;
    return p;
  }
  bool out_untouched() const {
    for (uint16_t v : out)
      if (v != 0xAAAA) return false;
    return true;
  }
};

TEST(MoeFinalizeRowIndex, EqualsFinalizeOfGatheredRowsBitwise) {
  Case c(7);
  qmoe::moe_finalize(c.params());
  // The gathered side: slot s holds rows[index[s]]; slots dropped by the index get id -1 and NaN rows.
  std::vector<uint16_t> gathered(kT * kK * kH, kNanBf16), want(kT * kH, 0xAAAA);
  std::vector<int32_t> ids = c.ids;
  for (int64_t s = 0; s < kT * kK; ++s) {
    if (c.index[s] < 0 || c.index[s] >= kR) {
      ids[s] = -1;
      continue;
    }
    std::memcpy(&gathered[s * kH], &c.rows[c.index[s] * kH], kH * sizeof(uint16_t));
  }
  qmoe::MoeFinalizeParams g = c.params();
  g.row_index.reset();
  g.rows = qmoe::make_tensor(gathered.data(), DType::kBFloat16, {kT * kK, kH});
  g.topk_ids = qmoe::make_tensor(ids.data(), DType::kInt32, {kT, kK});
  g.output = qmoe::make_tensor(want.data(), DType::kBFloat16, {kT, kH});
  qmoe::moe_finalize(g);
  EXPECT_EQ(c.out, want);
  bool nonzero = false;
  for (uint16_t v : c.out) {
    EXPECT_FALSE(std::isnan(qmoe::bf16_to_float(v))) << "a row no kept slot points at was read";
    nonzero = nonzero || qmoe::bf16_to_float(v) != 0.0f;
  }
  EXPECT_TRUE(nonzero);
  // A [T, k] index gives the same bits.
  std::vector<uint16_t> square(kT * kH, 0xAAAA);
  qmoe::MoeFinalizeParams q = c.params();
  q.row_index = qmoe::make_tensor(c.index.data(), DType::kInt32, {kT, kK});
  q.output = qmoe::make_tensor(square.data(), DType::kBFloat16, {kT, kH});
  qmoe::moe_finalize(q);
  EXPECT_EQ(square, c.out);
}

TEST(MoeFinalizeRowIndex, NoRowsGivesZeros) {
  Case c(8);
  std::vector<int32_t> none(kT * kK, -1);
  qmoe::MoeFinalizeParams p = c.params();
  p.rows = qmoe::make_tensor(nullptr, DType::kBFloat16, {0, kH});
  p.row_index = qmoe::make_tensor(none.data(), DType::kInt32, {kT * kK});
  qmoe::moe_finalize(p);
  for (uint16_t v : c.out) EXPECT_EQ(v, 0) << "every slot is dropped: the output is +0";
}

template <class F>
void expect_row_index_error(F&& fn, qmoe::ErrorKind kind = qmoe::ErrorKind::kValue) {
  try {
    fn();
    ADD_FAILURE() << "no error for argument 'row_index'";
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(e.argument(), "row_index") << e.what();
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find("'row_index'"), std::string::npos) << e.what();
  }
}

TEST(MoeFinalizeRowIndex, EachRuleNamesRowIndex) {
  Case c(9);
  qmoe::MoeFinalizeParams p = c.params();
  p.row_index->dtype = DType::kFloat32;
  expect_row_index_error([&] { qmoe::moe_finalize(p); }, qmoe::ErrorKind::kType);
  p = c.params();
  p.row_index->shape[0] -= 1;  // [T*k - 1]
  expect_row_index_error([&] { qmoe::moe_finalize(p); });
  p = c.params();
  *p.row_index = qmoe::make_tensor(c.index.data(), DType::kInt32, {kK, kT});  // transposed shape
  expect_row_index_error([&] { qmoe::moe_finalize(p); });
  p = c.params();
  *p.row_index = qmoe::make_tensor(c.index.data(), DType::kInt32, {kT, kK});
  p.row_index->strides[0] = 1;
  p.row_index->strides[1] = kT;  // column-major: not contiguous
  expect_row_index_error([&] { qmoe::moe_finalize(p); });
  p = c.params();
  p.row_index->data = nullptr;
  expect_row_index_error([&] { qmoe::moe_finalize(p); });
  p = c.params();
  p.row_index->device = qmoe::Device::kCUDA;  // rows on the CPU
  expect_row_index_error([&] { qmoe::moe_finalize(p); });
  EXPECT_TRUE(c.out_untouched());
  // The output overlapping the index: named by the output rule.
  p = c.params();
  p.row_index->data = c.out.data();
  EXPECT_THROW(qmoe::moe_finalize(p), qmoe::Error);
  EXPECT_TRUE(c.out_untouched());
}

}  // namespace
