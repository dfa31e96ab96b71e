// EP dispatch/combine planning (include/qmoe/expert_parallel.h): the worked example of the header
// exactly, invariants on random routing against a brute-force count, the owner-side return order
// matching the home-side one, the low-latency capacity rule and argument errors.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

#include "qmoe/expert_parallel.h"

namespace {

using qmoe::DType;
using qmoe::TensorRef;
namespace ep = qmoe::ep;

TensorRef ids_tensor(std::vector<int32_t>& ids, int64_t k) {
  return qmoe::make_tensor(ids.data(), DType::kInt32, {static_cast<int64_t>(ids.size()) / k, k});
}

TEST(EpPlan, WorkedExampleOfTheHeader) {
  std::vector<int32_t> ids = {0, 3, 1, 0, 2, 9};
  const ep::DispatchPlan p = ep::plan_dispatch(ids_tensor(ids, 2), 4, 2);
  EXPECT_EQ(p.send_counts, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(p.send_offsets, (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(p.send_tokens, (std::vector<int64_t>{0, 1, 0, 2}));
  EXPECT_EQ(p.return_counts, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(p.return_offsets, (std::vector<int64_t>{0, 3, 5}));
  EXPECT_EQ(p.return_slots, (std::vector<int64_t>{0, 2, 3, 1, 4}));
}

// The owner's return order, computed from what it received, equals the home's expectation.
TEST(EpPlan, RandomRoutingInvariantsAndOwnerOrder) {
  std::mt19937 rng(5);
  for (int64_t W : {1, 2, 4, 8}) {
    const int64_t E = 16, T = 37, k = 6;
    // Several homes: each home rank has its own routing; -1 and E are invalid ids.
    std::vector<std::vector<int32_t>> home_ids(static_cast<size_t>(W));
    std::vector<ep::DispatchPlan> plans;
    for (int64_t h = 0; h < W; ++h) {
      auto& ids = home_ids[static_cast<size_t>(h)];
      for (int64_t i = 0; i < T * k; ++i) ids.push_back(static_cast<int32_t>(rng() % (E + 2)) - 1);
      plans.push_back(ep::plan_dispatch(ids_tensor(ids, k), E, W));
      const ep::DispatchPlan& p = plans.back();
      for (int64_t d = 0; d < W; ++d) {
        std::set<int64_t> want_tokens;
        int64_t want_slots = 0;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t j = 0; j < k; ++j) {
            const int32_t e = ids[static_cast<size_t>(t * k + j)];
            if (e >= 0 && e < E && e / (E / W) == d) want_tokens.insert(t), ++want_slots;
          }
        const auto first = p.send_tokens.begin() + p.send_offsets[static_cast<size_t>(d)];
        const std::vector<int64_t> got(first, first + p.send_counts[static_cast<size_t>(d)]);
        EXPECT_EQ(got, std::vector<int64_t>(want_tokens.begin(), want_tokens.end())) << "W=" << W << " d=" << d;
        EXPECT_EQ(p.return_counts[static_cast<size_t>(d)], want_slots);
      }
    }
    // Owner d receives, from each home h in rank order, the routing rows of h's list for d.
    for (int64_t d = 0; d < W; ++d) {
      std::vector<int32_t> recv;
      std::vector<int64_t> want;  // (home, slot) flattened as the home-side return order
      for (int64_t h = 0; h < W; ++h) {
        const ep::DispatchPlan& p = plans[static_cast<size_t>(h)];
        const int64_t base = static_cast<int64_t>(recv.size()) / k;
        for (int64_t i = p.send_offsets[static_cast<size_t>(d)]; i < p.send_offsets[static_cast<size_t>(d) + 1]; ++i) {
          const int64_t t = p.send_tokens[static_cast<size_t>(i)];
          for (int64_t j = 0; j < k; ++j) recv.push_back(home_ids[static_cast<size_t>(h)][static_cast<size_t>(t * k + j)]);
        }
        // The home expects its return_slots for owner d in this order; map them to receive positions.
        int64_t pos = base - 1, last_t = -1;
        for (int64_t i = p.return_offsets[static_cast<size_t>(d)]; i < p.return_offsets[static_cast<size_t>(d) + 1]; ++i) {
          const int64_t s = p.return_slots[static_cast<size_t>(i)], t = s / k;
          if (t != last_t) ++pos, last_t = t;
          want.push_back(pos * k + s % k);
        }
      }
      std::vector<int32_t> recv_copy = recv;
      const std::vector<int64_t> got =
          recv.empty() ? std::vector<int64_t>{} : ep::owner_return_slots(ids_tensor(recv_copy, k), E, W, d);
      EXPECT_EQ(got, want) << "W=" << W << " owner " << d;
    }
  }
}

TEST(EpPlan, EmptyBatchAndRankWithNothing) {
  std::vector<int32_t> none;
  const ep::DispatchPlan p0 = ep::plan_dispatch(qmoe::make_tensor(none.data(), DType::kInt32, {0, 4}), 8, 4);
  EXPECT_EQ(p0.send_counts, (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(p0.send_offsets, (std::vector<int64_t>{0, 0, 0, 0, 0}));
  std::vector<int32_t> ids = {0, 1, 1, 0};  // every slot on rank 0's experts
  const ep::DispatchPlan p = ep::plan_dispatch(ids_tensor(ids, 2), 8, 4);
  EXPECT_EQ(p.send_counts, (std::vector<int64_t>{2, 0, 0, 0}));
  EXPECT_EQ(p.return_counts, (std::vector<int64_t>{4, 0, 0, 0}));
}

TEST(EpPlan, LowLatencyPositionsAndCapacityError) {
  std::vector<int32_t> ids = {0, 3, 1, 0, 2, 9};
  const ep::DispatchPlan p = ep::plan_dispatch(ids_tensor(ids, 2), 4, 2);
  EXPECT_EQ(ep::low_latency_send_positions(p, 3), (std::vector<int64_t>{0, 1, 3, 4}));
  EXPECT_EQ(ep::low_latency_send_positions(p, 5), (std::vector<int64_t>{0, 1, 5, 6}));
  try {
    ep::low_latency_send_positions(p, 2);  // T = 3 > 2
    ADD_FAILURE() << "no capacity error";
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(e.argument(), "max_tokens_per_rank");
    EXPECT_NE(std::string(e.what()).find("T = 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ep::check_low_latency_capacity(0, 0), qmoe::Error);
  EXPECT_NO_THROW(ep::check_low_latency_capacity(4, 4));
}

template <class F>
void expect_arg(F&& fn, const std::string& argument) {
  try {
    fn();
    ADD_FAILURE() << "no error for " << argument;
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
  }
}

TEST(EpPlan, ArgumentErrorsNameTheArgument) {
  std::vector<int32_t> ids = {0, 1, 2, 3};
  expect_arg([&] { ep::plan_dispatch(ids_tensor(ids, 2), 6, 4); }, "num_experts");  // 6 % 4
  expect_arg([&] { ep::plan_dispatch(ids_tensor(ids, 2), 4, 0); }, "world_size");
  expect_arg([&] { ep::plan_dispatch(ids_tensor(ids, 2), 0, 1); }, "num_experts");
  TensorRef bad = ids_tensor(ids, 2);
  bad.dtype = DType::kInt64;
  expect_arg([&] { ep::plan_dispatch(bad, 4, 2); }, "topk_ids");
  expect_arg([&] { ep::owner_return_slots(ids_tensor(ids, 2), 4, 2, 2); }, "rank");
  expect_arg([&] { ep::exclusive_offsets({1, -1}); }, "counts");
}

}  // namespace
