// Tests of get_cutlass_w4a8_moe_mm_data (routing metadata, include/qmoe/routing.h): the worked
// example exactly, random ids against an independent stable-sort construction plus invariants,
// and one test per validation rule (the message names the argument; nothing is written).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/launch.h"
#include "qmoe/error.h"
#include "qmoe/routing.h"

namespace {

using qmoe::Device;
using qmoe::DType;
using qmoe::TensorRef;

constexpr int32_t kPoison = static_cast<int32_t>(0xAAAAAAAAu);

// Outputs of one call, poisoned before the call.
struct Outputs {
  std::vector<int32_t> offsets, sizes1, sizes2, in_perm, out_perm;
  TensorRef t_offsets, t_sizes1, t_sizes2, t_in, t_out;
  Outputs(int64_t experts, int64_t slots)
      : offsets(experts + 1, kPoison), sizes1(experts * 3, kPoison), sizes2(experts * 3, kPoison),
        in_perm(slots, kPoison), out_perm(slots, kPoison) {
    t_offsets = qmoe::make_tensor(offsets.data(), DType::kInt32, {experts + 1});
    t_sizes1 = qmoe::make_tensor(sizes1.data(), DType::kInt32, {experts, 3});
    t_sizes2 = qmoe::make_tensor(sizes2.data(), DType::kInt32, {experts, 3});
    t_in = qmoe::make_tensor(in_perm.data(), DType::kInt32, {slots});
    t_out = qmoe::make_tensor(out_perm.data(), DType::kInt32, {slots});
  }
  bool untouched() const {
    auto all = [](const std::vector<int32_t>& v) {
      return std::all_of(v.begin(), v.end(), [](int32_t x) { return x == kPoison; });
    };
    return all(offsets) && all(sizes1) && all(sizes2) && all(in_perm) && all(out_perm);
  }
};

void run(const TensorRef& ids, Outputs& o, int64_t experts, int64_t n, int64_t k) {
  qmoe::get_cutlass_w4a8_moe_mm_data(ids, o.t_offsets, o.t_sizes1, o.t_sizes2, o.t_in, o.t_out, experts, n, k);
}

// Independent construction: stable sort of the valid slots by expert id.
template <class Id>
void check_against_stable_sort(const std::vector<Id>& ids, const Outputs& o, int64_t experts, int64_t n, int64_t k) {
  const int64_t slots = static_cast<int64_t>(ids.size());
  std::vector<int64_t> valid;
  for (int64_t s = 0; s < slots; ++s)
    if (ids[s] >= 0 && static_cast<int64_t>(ids[s]) < experts) valid.push_back(s);
  std::stable_sort(valid.begin(), valid.end(), [&](int64_t x, int64_t y) { return ids[x] < ids[y]; });

  std::vector<int32_t> want_in(slots, -1), want_out(slots, -1);
  for (size_t r = 0; r < valid.size(); ++r) {
    want_in[r] = static_cast<int32_t>(valid[r]);
    want_out[valid[r]] = static_cast<int32_t>(r);
  }
  ASSERT_EQ(o.in_perm, want_in);
  ASSERT_EQ(o.out_perm, want_out);

  std::vector<int64_t> counts(experts, 0);
  for (int64_t s : valid) ++counts[ids[s]];
  ASSERT_EQ(o.offsets[0], 0);
  for (int64_t e = 0; e < experts; ++e) {
    ASSERT_EQ(o.offsets[e + 1] - o.offsets[e], counts[e]) << "expert " << e;
    ASSERT_EQ(o.sizes1[3 * e + 0], 2 * n);
    ASSERT_EQ(o.sizes1[3 * e + 1], counts[e]);
    ASSERT_EQ(o.sizes1[3 * e + 2], k);
    ASSERT_EQ(o.sizes2[3 * e + 0], k);
    ASSERT_EQ(o.sizes2[3 * e + 1], counts[e]);
    ASSERT_EQ(o.sizes2[3 * e + 2], n);
  }
  ASSERT_EQ(o.offsets[experts], static_cast<int32_t>(valid.size()));
  // Every row of expert e's block holds a slot routed to e.
  for (int64_t e = 0; e < experts; ++e)
    for (int32_t r = o.offsets[e]; r < o.offsets[e + 1]; ++r) ASSERT_EQ(static_cast<int64_t>(ids[o.in_perm[r]]), e);
}

TEST(MoeMmData, WorkedExample) {
  std::vector<int32_t> ids = {2, 0, 0, 5};
  const TensorRef t = qmoe::make_tensor(ids.data(), DType::kInt32, {2, 2});
  Outputs o(3, 4);
  run(t, o, 3, 16, 64);
  EXPECT_EQ(o.offsets, (std::vector<int32_t>{0, 2, 2, 3}));
  EXPECT_EQ(o.sizes1, (std::vector<int32_t>{32, 2, 64, 32, 0, 64, 32, 1, 64}));
  EXPECT_EQ(o.sizes2, (std::vector<int32_t>{64, 2, 16, 64, 0, 16, 64, 1, 16}));
  EXPECT_EQ(o.in_perm, (std::vector<int32_t>{1, 2, 0, -1}));
  EXPECT_EQ(o.out_perm, (std::vector<int32_t>{2, 0, 1, -1}));
}

TEST(MoeMmData, WorkedExampleInt64Ids) {
  std::vector<int64_t> ids = {2, 0, 0, 5};
  const TensorRef t = qmoe::make_tensor(ids.data(), DType::kInt64, {2, 2});
  Outputs o(3, 4);
  run(t, o, 3, 16, 64);
  EXPECT_EQ(o.offsets, (std::vector<int32_t>{0, 2, 2, 3}));
  EXPECT_EQ(o.in_perm, (std::vector<int32_t>{1, 2, 0, -1}));
  EXPECT_EQ(o.out_perm, (std::vector<int32_t>{2, 0, 1, -1}));
}

template <class Id>
void random_case(std::mt19937& rng, int64_t experts, int64_t topk, int64_t tokens, DType dtype) {
  // About 1 id in 8 is invalid: negative or >= E (including the sentinel E itself).
  std::uniform_int_distribution<int64_t> id_dist(0, experts - 1), bad_dist(-3, 3), pick(0, 7);
  std::vector<Id> ids(static_cast<size_t>(tokens * topk));
  for (auto& id : ids) {
    if (pick(rng) == 0) {
      const int64_t b = bad_dist(rng);
      id = static_cast<Id>(b < 0 ? b : experts + b);
    } else {
      id = static_cast<Id>(id_dist(rng));
    }
  }
  const TensorRef t = qmoe::make_tensor(ids.data(), dtype, {tokens, topk});
  Outputs o(experts, tokens * topk);
  run(t, o, experts, 96, 256);
  SCOPED_TRACE("E=" + std::to_string(experts) + " topk=" + std::to_string(topk) + " T=" + std::to_string(tokens));
  check_against_stable_sort(ids, o, experts, 96, 256);
}

TEST(MoeMmData, RandomIdsInt32) {
  std::mt19937 rng(1234);
  for (int64_t experts : {1, 8, 256, 1024})
    for (int64_t topk = 1; topk <= 16; ++topk)
      for (int64_t tokens : {1, 7, 130}) random_case<int32_t>(rng, experts, topk, tokens, DType::kInt32);
}

TEST(MoeMmData, RandomIdsInt64) {
  std::mt19937 rng(99);
  for (int64_t experts : {1, 8, 256, 1024})
    for (int64_t topk : {1, 2, 6, 8, 16})
      for (int64_t tokens : {1, 33, 257}) random_case<int64_t>(rng, experts, topk, tokens, DType::kInt64);
}

TEST(MoeMmData, Int64IdsAreNotTruncated) {
  // 2^32 + 1 would read as expert 1 if the ids were narrowed to int32; it must be dropped.
  std::vector<int64_t> ids = {(int64_t{1} << 32) + 1, 1, -(int64_t{1} << 32), 0};
  const TensorRef t = qmoe::make_tensor(ids.data(), DType::kInt64, {4});
  Outputs o(2, 4);
  run(t, o, 2, 8, 128);
  EXPECT_EQ(o.offsets, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(o.in_perm, (std::vector<int32_t>{3, 1, -1, -1}));
  EXPECT_EQ(o.out_perm, (std::vector<int32_t>{-1, 1, -1, 0}));
}

TEST(MoeMmData, AllSlotsOnOneExpert) {
  const int64_t experts = 8, slots = 8 * 37;
  std::vector<int32_t> ids(slots, 5);
  const TensorRef t = qmoe::make_tensor(ids.data(), DType::kInt32, {37, 8});
  Outputs o(experts, slots);
  run(t, o, experts, 2048, 7168);
  EXPECT_EQ(o.offsets, (std::vector<int32_t>{0, 0, 0, 0, 0, 0, slots, slots, slots}));
  std::vector<int32_t> identity(slots);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(o.in_perm, identity);
  EXPECT_EQ(o.out_perm, identity);
  check_against_stable_sort(ids, o, experts, 2048, 7168);
}

TEST(MoeMmData, AllSlotsDropped) {
  std::vector<int32_t> ids = {-1, 4, 4, -1, 7, 100};
  const TensorRef t = qmoe::make_tensor(ids.data(), DType::kInt32, {3, 2});
  Outputs o(4, 6);
  run(t, o, 4, 8, 128);
  EXPECT_EQ(o.offsets, (std::vector<int32_t>{0, 0, 0, 0, 0}));
  EXPECT_EQ(o.in_perm, std::vector<int32_t>(6, -1));
  EXPECT_EQ(o.out_perm, std::vector<int32_t>(6, -1));
  for (int e = 0; e < 4; ++e) EXPECT_EQ(o.sizes1[3 * e + 1], 0);
}

TEST(MoeMmData, EmptyExpertsAndRepeatedExpertInOneToken) {
  // Only odd experts used; token 1 routes twice to expert 3 (counts twice).
  std::vector<int32_t> ids = {3, 1, 3, 3, 7, 1};
  const TensorRef t = qmoe::make_tensor(ids.data(), DType::kInt32, {3, 2});
  Outputs o(8, 6);
  run(t, o, 8, 8, 128);
  EXPECT_EQ(o.offsets, (std::vector<int32_t>{0, 0, 2, 2, 5, 5, 5, 5, 6}));
  EXPECT_EQ(o.in_perm, (std::vector<int32_t>{1, 5, 0, 2, 3, 4}));
  EXPECT_EQ(o.out_perm, (std::vector<int32_t>{2, 0, 3, 4, 5, 1}));
}

TEST(MoeMmData, ZeroSlots) {
  std::vector<int32_t> ids(1);
  TensorRef t = qmoe::make_tensor(ids.data(), DType::kInt32, {0, 8});
  Outputs o(4, 0);
  run(t, o, 4, 8, 128);
  EXPECT_EQ(o.offsets, (std::vector<int32_t>{0, 0, 0, 0, 0}));
}

// ---------------------------------------------------------------------------------------------
// Validation: one test per rule; each checks the argument named and that nothing was written.
// ---------------------------------------------------------------------------------------------

struct ValidCall {
  std::vector<int32_t> ids = {0, 1, 2, 3, 1, 0};
  TensorRef t_ids = qmoe::make_tensor(ids.data(), DType::kInt32, {3, 2});
  Outputs o{4, 6};
  int64_t experts = 4, n = 64, k = 256;
  void call() {
    qmoe::get_cutlass_w4a8_moe_mm_data(t_ids, o.t_offsets, o.t_sizes1, o.t_sizes2, o.t_in, o.t_out, experts, n, k);
  }
};

void expect_error(const std::function<void(ValidCall&)>& mutate, const std::string& argument,
                  qmoe::ErrorKind kind = qmoe::ErrorKind::kValue) {
  ValidCall c;
  mutate(c);
  try {
    c.call();
    FAIL() << "no error raised; expected one naming '" << argument << "'";
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("'" + argument + "'"), std::string::npos) << e.what();
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << e.what();
  }
  EXPECT_TRUE(c.o.untouched()) << "an output was written before validation failed";
}

TEST(MoeMmDataValidation, ValidCallPasses) {
  ValidCall c;
  c.call();
  EXPECT_EQ(c.o.offsets, (std::vector<int32_t>{0, 2, 4, 5, 6}));
}

TEST(MoeMmDataValidation, TopkIdsDtype) {
  expect_error([](ValidCall& c) { c.t_ids.dtype = DType::kFloat32; }, "topk_ids", qmoe::ErrorKind::kType);
  expect_error([](ValidCall& c) { c.t_ids.dtype = DType::kInt8; }, "topk_ids", qmoe::ErrorKind::kType);
}
TEST(MoeMmDataValidation, TopkIdsContiguous) {
  expect_error(
      [](ValidCall& c) {
        c.t_ids = qmoe::make_tensor(c.ids.data(), DType::kInt32, {2, 2});
        c.t_ids.strides[0] = 3;  // a [2, 2] slice of a [2, 3] matrix
      },
      "topk_ids");
}
TEST(MoeMmDataValidation, TopkIdsNullData) {
  expect_error([](ValidCall& c) { c.t_ids.data = nullptr; }, "topk_ids");
}
TEST(MoeMmDataValidation, NumExpertsRange) {
  expect_error([](ValidCall& c) { c.experts = 0; }, "num_experts");
  expect_error([](ValidCall& c) { c.experts = 1025; }, "num_experts");
  expect_error([](ValidCall& c) { c.experts = -4; }, "num_experts");
}
TEST(MoeMmDataValidation, NPositiveAndFitsInt32) {
  expect_error([](ValidCall& c) { c.n = 0; }, "n");
  expect_error([](ValidCall& c) { c.n = int64_t{1} << 30; }, "n");  // 2n overflows int32
}
TEST(MoeMmDataValidation, KPositiveAndFitsInt32) {
  expect_error([](ValidCall& c) { c.k = -1; }, "k");
  expect_error([](ValidCall& c) { c.k = int64_t{1} << 31; }, "k");
}
TEST(MoeMmDataValidation, ExpertOffsetsShapeAndDtype) {
  expect_error([](ValidCall& c) { c.o.t_offsets.shape[0] = 4; }, "expert_offsets");  // [E], not [E+1]
  expect_error([](ValidCall& c) { c.o.t_offsets.dtype = DType::kInt64; }, "expert_offsets", qmoe::ErrorKind::kType);
}
TEST(MoeMmDataValidation, ProblemSizes1ShapeAndDtype) {
  expect_error([](ValidCall& c) { c.o.t_sizes1.shape[1] = 2; }, "problem_sizes1");
  expect_error([](ValidCall& c) { c.o.t_sizes1.dtype = DType::kInt64; }, "problem_sizes1", qmoe::ErrorKind::kType);
}
TEST(MoeMmDataValidation, ProblemSizes2ShapeAndDtype) {
  expect_error([](ValidCall& c) { c.o.t_sizes2.shape[0] = 5; }, "problem_sizes2");
  expect_error([](ValidCall& c) { c.o.t_sizes2.dtype = DType::kFloat32; }, "problem_sizes2", qmoe::ErrorKind::kType);
}
TEST(MoeMmDataValidation, PermutationShapes) {
  expect_error([](ValidCall& c) { c.o.t_in.shape[0] = 5; }, "input_permutation");
  expect_error([](ValidCall& c) { c.o.t_out.shape[0] = 7; }, "output_permutation");
}
TEST(MoeMmDataValidation, OutputsContiguous) {
  expect_error(
      [](ValidCall& c) {
        c.t_ids = qmoe::make_tensor(c.ids.data(), DType::kInt32, {1, 3});
        c.o.t_in.shape[0] = 3;
        c.o.t_out.shape[0] = 3;
        c.o.t_out.strides[0] = 2;  // every other element of a 6-element buffer
      },
      "output_permutation");
  expect_error([](ValidCall& c) { c.o.t_sizes1.strides[0] = 4; }, "problem_sizes1");
}
TEST(MoeMmDataValidation, SameDevice) {
  expect_error([](ValidCall& c) { c.o.t_sizes2.device = Device::kCUDA; }, "problem_sizes2");
  expect_error([](ValidCall& c) {
    c.t_ids.device = Device::kCUDA;
    c.o.t_offsets.device = c.o.t_sizes1.device = c.o.t_sizes2.device = c.o.t_in.device = Device::kCUDA;
  }, "output_permutation");
}
TEST(MoeMmDataValidation, OutputMustNotAliasTopkIds) {
  expect_error([](ValidCall& c) { c.o.t_in.data = c.ids.data(); }, "input_permutation");
}
TEST(MoeMmDataValidation, OutputsMustNotAliasEachOther) {
  expect_error([](ValidCall& c) { c.o.t_out.data = c.o.in_perm.data(); }, "output_permutation");
}
TEST(MoeMmDataValidation, CudaTensorsGoToTheCudaLauncher) {
  if (qmoe::cuda::kernels_built()) GTEST_SKIP() << "would launch on fake device pointers";
  // CPU-only build: the CUDA launcher is a stub that raises; reaching it proves the dispatch.
  ValidCall c;
  c.t_ids.device = Device::kCUDA;
  for (TensorRef* t : {&c.o.t_offsets, &c.o.t_sizes1, &c.o.t_sizes2, &c.o.t_in, &c.o.t_out}) t->device = Device::kCUDA;
  try {
    c.call();
    FAIL() << "expected the CPU-only stub to raise";
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(qmoe::ErrorKind::kRuntime)) << e.what();
  }
  EXPECT_TRUE(c.o.untouched());
}

}  // namespace
