// The expert-parallel layers from C++ (include/qmoe/expert_parallel_layer.h), low-latency and throughput
// modes, on CPU tensors:
// W ranks as W threads joined by an in-process Exchange (the NCCL one runs in the 2-GPU script). Each
// rank holds E/W experts and its own tokens; its output must equal fused_moe(deterministic = true) over
// all experts on its tokens, bit for bit: every quant mode, a1 static / per token / dynamic, ranks with
// no token, tokens whose every slot lives on another rank, invalid ids. With deterministic = false (the
// reduced combine) the output must equal, bit for bit, the rank-order sum of the W partial outputs
// fused_moe(its tokens, owner d's experts) rounded to the output dtype, and fused_moe over all experts
// within the fused finalize's tolerance. Plus the argument checks, each raised before any exchange.
#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "fused_moe_case.h"
#include "qmoe/expert_parallel_layer.h"
#include "qmoe/formats.h"
#include "reference/f16_bits.h"

namespace {

using namespace fused_moe_test;
using qmoe::ep::LowLatencyLayer;
using qmoe::ep::PeerTransfer;
using qmoe::ep::ThroughputLayer;

// W threads exchanging through host memory: each posts its transfers, then copies what every peer
// addressed to it; two barriers keep the buffers alive and unchanged while peers read them.
class LoopbackGroup {
 public:
  explicit LoopbackGroup(int world) : world_(world), posted_(static_cast<size_t>(world)) {}
  qmoe::ep::Exchange exchange(int rank) {
    return [this, rank](const std::vector<PeerTransfer>& peers, cudaStream_t) {
      if (static_cast<int>(peers.size()) != world_) throw std::runtime_error("peers.size() != world size");
      posted_[static_cast<size_t>(rank)] = &peers;
      barrier();
      for (int p = 0; p < world_; ++p) {
        const PeerTransfer& from = (*posted_[static_cast<size_t>(p)])[static_cast<size_t>(rank)];
        const PeerTransfer& to = peers[static_cast<size_t>(p)];
        if (from.send_bytes != to.recv_bytes) throw std::runtime_error("send and receive sizes differ");
        if (from.send_bytes > 0) std::memcpy(to.recv, from.send, static_cast<size_t>(from.send_bytes));
      }
      barrier();
      ++calls_[rank];
    };
  }
  int calls(int rank) const { return calls_[rank]; }
  // A rank that failed: the others leave their barrier with an error instead of waiting forever.
  void abort() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  void barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    const int gen = generation_;
    if (++waiting_ == world_) {
      waiting_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen || aborted_; });
    }
    if (aborted_) throw std::runtime_error("a peer rank failed");
  }
  bool aborted_ = false;
  int world_;
  std::vector<const std::vector<PeerTransfer>*> posted_;
  std::mutex mu_;
  std::condition_variable cv_;
  int waiting_ = 0, generation_ = 0;
  int calls_[8] = {};
};

// The layer of rank r: its tokens [first, first + count) of the global case, its experts' weights.
struct RankView {
  FusedMoeParams p;
  std::vector<uint8_t> out;
};

RankView rank_view(Case& cs, int world, int rank, int64_t first, int64_t count, bool local_weights) {
  RankView v;
  FusedMoeParams all = cs.params();
  const int64_t E = cs.c.E, per = E / world, k = cs.c.k, H = cs.c.H;
  auto rows_of = [&](const TensorRef& t) {  // tokens [first, first + count) of a [T, ...] tensor
    TensorRef r = t;
    int64_t row = qmoe::dtype_size(t.dtype);
    for (int d = 1; d < t.ndim; ++d) row *= t.shape[d];
    r.data = static_cast<uint8_t*>(t.data) + first * row;
    r.shape[0] = count;
    return r;
  };
  auto experts_of = [&](const TensorRef& t) {  // experts [rank*per, +per) of an [E, ...] tensor
    TensorRef r = t;
    const int64_t per_expert = t.numel() / t.size(0) * qmoe::dtype_size(t.dtype);
    r.data = static_cast<uint8_t*>(t.data) + rank * per * per_expert;
    r.shape[0] = per;
    return r;
  };
  v.p = all;
  v.p.x = rows_of(all.x);
  if (all.x_scale && all.x_scale->numel() > 1) v.p.x_scale = rows_of(*all.x_scale);
  if (all.per_token_scale) v.p.per_token_scale = rows_of(*all.per_token_scale);
  v.p.topk_ids = rows_of(all.topk_ids);
  v.p.topk_weights = rows_of(all.topk_weights);
  v.out.assign(static_cast<size_t>(count * H * qmoe::dtype_size(cs.c.out)), 0xAA);  // poisoned
  v.p.output = qmoe::make_tensor(v.out.data(), cs.c.out, {count, H});
  v.p.deterministic = true;
  v.p.num_experts = E;
  if (local_weights) {
    v.p.w1 = experts_of(all.w1);
    v.p.w1_scale = experts_of(all.w1_scale);
    v.p.w2 = experts_of(all.w2);
    v.p.w2_scale = experts_of(all.w2_scale);
    if (all.w1_alpha) v.p.w1_alpha = experts_of(*all.w1_alpha);
    if (all.w2_alpha) v.p.w2_alpha = experts_of(*all.w2_alpha);
    v.p.num_local_experts = per;
    v.p.local_expert_offset = rank * per;
  } else {
    v.p.num_local_experts = 0;
    v.p.local_expert_offset = 0;
  }
  (void)k;
  return v;
}

// `run` must throw a qmoe::Error whose message names the argument `name`.
template <class Run>
void expect_named_error(Run run, const char* name) {
  try {
    run();
    ADD_FAILURE() << "expected an error naming " << name;
  } catch (const qmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find(std::string("'") + name + "'"), std::string::npos) << e.what();
  }
}

// Rank 0 of 2 with 5 tokens over E = 8 experts, its output poisoned, and an exchange that only counts
// its calls: the argument-error tests (nothing may be exchanged or written).
struct RefusalCase {
  Case cs;
  RankView v;
  int calls = 0;
  qmoe::ep::Exchange counting = [this](const std::vector<PeerTransfer>&, cudaStream_t) { ++calls; };
  explicit RefusalCase(uint64_t seed) : cs(make_case(config(), seed)), v(rank_view(cs, 2, 0, 0, 5, true)) {}
  static Config config() {
    Config cfg;
    cfg.E = 8;
    cfg.T = 5;
    cfg.deterministic = true;
    return cfg;
  }
};

struct EpSetup {
  Config cfg;
  int world = 2;
  std::vector<int64_t> tokens;  // per rank
  int64_t capacity = 8;
};

// Runs the EP layer (low latency, or throughput) on `world` threads and compares each rank with
// fused_moe on its own tokens.
void check_ep_equals_single(const EpSetup& s, uint64_t seed, bool foreign_ids = true, bool throughput = false) {
  Config cfg = s.cfg;
  int64_t total = 0;
  for (int64_t t : s.tokens) total += t;
  cfg.T = total;
  cfg.deterministic = true;
  Case cs = make_case(cfg, seed);  // routing over all E experts
  if (foreign_ids) {
    for (size_t i = 0; i < cs.ids.size(); i += 5) cs.ids[i] = i % 2 ? -1 : static_cast<int32_t>(cfg.E);  // dropped
  }
  LoopbackGroup group(s.world);
  std::vector<RankView> ep(static_cast<size_t>(s.world)), single(static_cast<size_t>(s.world));
  std::vector<std::thread> threads;
  int64_t first = 0;
  for (int r = 0; r < s.world; ++r) {
    ep[r] = rank_view(cs, s.world, r, first, s.tokens[r], true);
    single[r] = rank_view(cs, s.world, r, first, s.tokens[r], false);
    first += s.tokens[r];
  }
  std::vector<std::string> errors(static_cast<size_t>(s.world));
  for (int r = 0; r < s.world; ++r) {
    threads.emplace_back([&, r] {
      try {
        if (throughput) {
          qmoe::ep::throughput_layer(ThroughputLayer{ep[r].p, s.world, r}, group.exchange(r));
        } else {
          qmoe::ep::low_latency_layer(LowLatencyLayer{ep[r].p, s.world, r, s.capacity}, group.exchange(r));
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
        group.abort();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < s.world; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(group.calls(r), throughput ? 3 : 2) << "rank " << r << ": (counts,) dispatch, combine";
    qmoe::fused_moe(single[r].p);
    EXPECT_TRUE(ep[r].out == single[r].out)
        << "rank " << r << " of " << s.world << ": EP output != fused_moe on its tokens";
  }
}

// Element i of an output buffer of dtype `dtype` as float, and the rounding of a float to it.
float element(const std::vector<uint8_t>& out, DType dtype, size_t i) {
  uint16_t h;
  float f;
  switch (dtype) {
    case DType::kBFloat16: std::memcpy(&h, out.data() + 2 * i, 2); return qmoe::bf16_to_float(h);
    case DType::kFloat16: std::memcpy(&h, out.data() + 2 * i, 2); return qmoe::half_bits_to_float(h);
    default: std::memcpy(&f, out.data() + 4 * i, 4); return f;
  }
}
float round_to(DType dtype, float v) {
  switch (dtype) {
    case DType::kBFloat16: return qmoe::round_bf16(v);
    case DType::kFloat16: return qmoe::half_bits_to_float(qmoe::float_to_half_bits(v));
    default: return v;
  }
}

// The reduced combine (deterministic = false) on `world` threads: each rank's output must be, bit for
// bit, the sum over owners d in rank order of fused_moe(its tokens, d's experts) (each rounded to the
// output dtype, summed in fp32, rounded once), and within 1e-2 relative RMS of fused_moe over all
// experts.
void check_ep_reduced(const EpSetup& s, uint64_t seed, bool throughput) {
  Config cfg = s.cfg;
  int64_t total = 0;
  for (int64_t t : s.tokens) total += t;
  cfg.T = total;
  cfg.deterministic = false;
  Case cs = make_case(cfg, seed);
  for (size_t i = 0; i < cs.ids.size(); i += 5) cs.ids[i] = i % 2 ? -1 : static_cast<int32_t>(cfg.E);  // dropped
  LoopbackGroup group(s.world);
  std::vector<RankView> ep(static_cast<size_t>(s.world));
  std::vector<int64_t> first(static_cast<size_t>(s.world), 0);
  for (int r = 0; r < s.world; ++r) {
    if (r > 0) first[r] = first[r - 1] + s.tokens[r - 1];
    ep[r] = rank_view(cs, s.world, r, first[r], s.tokens[r], true);
    ep[r].p.deterministic = false;
  }
  std::vector<std::string> errors(static_cast<size_t>(s.world));
  std::vector<std::thread> threads;
  for (int r = 0; r < s.world; ++r) {
    threads.emplace_back([&, r] {
      try {
        if (throughput)
          qmoe::ep::throughput_layer(ThroughputLayer{ep[r].p, s.world, r}, group.exchange(r));
        else
          qmoe::ep::low_latency_layer(LowLatencyLayer{ep[r].p, s.world, r, s.capacity}, group.exchange(r));
      } catch (const std::exception& e) {
        errors[r] = e.what();
        group.abort();
      }
    });
  }
  for (auto& t : threads) t.join();
  const DType dtype = cfg.out;
  for (int r = 0; r < s.world; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(group.calls(r), throughput ? 3 : 2) << "rank " << r;
    const size_t n = static_cast<size_t>(s.tokens[r] * cfg.H);
    std::vector<float> expected(n, 0.0f);
    for (int d = 0; d < s.world; ++d) {  // owner d's partial of rank r's tokens
      RankView part = rank_view(cs, s.world, d, first[r], s.tokens[r], true);
      part.p.deterministic = false;
      qmoe::fused_moe(part.p);
      for (size_t i = 0; i < n; ++i) expected[i] += element(part.out, dtype, i);
    }
    RankView single = rank_view(cs, s.world, r, first[r], s.tokens[r], false);
    single.p.deterministic = false;
    qmoe::fused_moe(single.p);
    double err = 0.0, ref = 0.0;
    for (size_t i = 0; i < n; ++i) {
      const float got = element(ep[r].out, dtype, i);
      ASSERT_EQ(qmoe::float_bits(got), qmoe::float_bits(round_to(dtype, expected[i])))
          << "rank " << r << " element " << i << ": not the rank-order sum of the owners' partials";
      const double want = element(single.out, dtype, i);
      err += (got - want) * (got - want);
      ref += want * want;
    }
    if (n == 0) continue;  // a rank with no token
    ASSERT_GT(ref, 0.0) << "rank " << r << ": an all-zero reference checks nothing";
    EXPECT_LE(std::sqrt(err / ref), 1e-2) << "rank " << r << ": far from fused_moe over all experts";
  }
}

TEST(EpReducedCombine, LowLatencyEveryModeAndOutputDtype) {
  const QuantMode modes[] = {QuantMode::kW4A8Int4, QuantMode::kW4A16Int4, QuantMode::kW4A16, QuantMode::kW4A4,
                             QuantMode::kW4A8Mx};
  const DType outs[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  uint64_t seed = 500;
  for (QuantMode mode : modes) {
    for (DType out : outs) {
      EpSetup s;
      s.cfg.mode = mode;
      s.cfg.E = 8;
      s.cfg.k = 3;
      s.cfg.rsf = 1.5f;
      s.cfg.out = out;
      s.tokens = {5, 7};
      SCOPED_TRACE(std::string(qmoe::quant_mode_name(mode)) + " out " + qmoe::dtype_name(out));
      check_ep_reduced(s, seed++, false);
    }
  }
}

TEST(EpReducedCombine, ThroughputFourRanksEmptyRankTopOneAndA1Variants) {
  EpSetup s;
  s.world = 4;
  s.cfg.E = 8;
  s.cfg.k = 3;
  s.cfg.out = DType::kBFloat16;
  s.capacity = 6;
  s.tokens = {6, 0, 1, 4};  // rank 0 at capacity, rank 1 with no token
  check_ep_reduced(s, 600, false);
  check_ep_reduced(s, 601, true);
  s.world = 2;
  s.cfg.k = 1;
  s.tokens = {5, 3};
  check_ep_reduced(s, 602, false);
  check_ep_reduced(s, 603, true);
  s.cfg.k = 4;
  for (int a1 = 1; a1 < 3; ++a1) {  // per-token and dynamic a1
    s.cfg.a1 = a1;
    check_ep_reduced(s, 610 + a1, false);
    check_ep_reduced(s, 620 + a1, true);
  }
}

TEST(EpLowLatencyLayer, EqualsSingleGpuEveryMode) {
  const QuantMode modes[] = {QuantMode::kW4A8Int4, QuantMode::kW4A16Int4, QuantMode::kW4A16, QuantMode::kW4A4,
                             QuantMode::kW4A8Mx};
  uint64_t seed = 1;
  for (QuantMode mode : modes) {
    EpSetup s;
    s.cfg.mode = mode;
    s.cfg.E = 8;
    s.cfg.k = 2;
    s.cfg.out = DType::kBFloat16;
    s.tokens = {5, 7};
    SCOPED_TRACE(qmoe::quant_mode_name(mode));
    check_ep_equals_single(s, seed++);
  }
}

TEST(EpLowLatencyLayer, A1StaticPerTokenDynamicAndE4m3Input) {
  for (int a1 = 0; a1 < 3; ++a1) {
    for (bool e4m3 : {false, true}) {
      if (a1 == 2 && e4m3) continue;  // an e4m3 x needs its a1
      EpSetup s;
      s.cfg.a1 = a1;
      s.cfg.x_e4m3 = e4m3;
      s.cfg.E = 8;
      s.cfg.k = 4;
      s.cfg.rsf = 2.5f;
      s.tokens = {6, 3};
      SCOPED_TRACE("a1 " + std::to_string(a1) + (e4m3 ? " e4m3 x" : " bf16 x"));
      check_ep_equals_single(s, 40 + a1 + (e4m3 ? 10 : 0));
    }
  }
}

TEST(EpLowLatencyLayer, TopOneEveryMode) {  // k = 1: the received ids stay [W*C, 1]
  const QuantMode modes[] = {QuantMode::kW4A8Int4, QuantMode::kW4A16Int4, QuantMode::kW4A16, QuantMode::kW4A4,
                             QuantMode::kW4A8Mx};
  uint64_t seed = 60;
  for (QuantMode mode : modes) {
    EpSetup s;
    s.cfg.mode = mode;
    s.cfg.E = 4;
    s.cfg.k = 1;
    s.tokens = {4, 3};
    SCOPED_TRACE(qmoe::quant_mode_name(mode));
    check_ep_equals_single(s, seed++);
  }
}

TEST(EpLowLatencyLayer, FourRanksEmptyRankAndFullCapacity) {
  EpSetup s;
  s.world = 4;
  s.cfg.E = 8;
  s.cfg.k = 3;
  s.capacity = 6;
  s.tokens = {6, 0, 1, 4};  // rank 0 at capacity, rank 1 with no token
  check_ep_equals_single(s, 77);
}

TEST(EpLowLatencyLayer, AllSlotsOnOtherRanks) {
  // Every slot of rank 0's tokens on rank 1's experts and the other way round: each rank computes
  // nothing for itself.
  Config cfg;
  cfg.E = 4;
  cfg.k = 2;
  cfg.T = 6;
  cfg.deterministic = true;
  Case cs = make_case(cfg, 91);
  for (int64_t t = 0; t < 6; ++t)
    for (int64_t j = 0; j < 2; ++j) cs.ids[static_cast<size_t>(t * 2 + j)] = static_cast<int32_t>((t < 3 ? 2 : 0) + j);
  LoopbackGroup group(2);
  RankView ep0 = rank_view(cs, 2, 0, 0, 3, true), ep1 = rank_view(cs, 2, 1, 3, 3, true);
  RankView s0 = rank_view(cs, 2, 0, 0, 3, false), s1 = rank_view(cs, 2, 1, 3, 3, false);
  std::thread t1([&] { qmoe::ep::low_latency_layer(LowLatencyLayer{ep1.p, 2, 1, 4}, group.exchange(1)); });
  qmoe::ep::low_latency_layer(LowLatencyLayer{ep0.p, 2, 0, 4}, group.exchange(0));
  t1.join();
  qmoe::fused_moe(s0.p);
  qmoe::fused_moe(s1.p);
  EXPECT_EQ(0, std::memcmp(ep0.out.data(), s0.out.data(), s0.out.size()));
  EXPECT_EQ(0, std::memcmp(ep1.out.data(), s1.out.data(), s1.out.size()));
}

TEST(EpThroughputLayer, EqualsSingleGpuEveryModeAndTopK) {
  const QuantMode modes[] = {QuantMode::kW4A8Int4, QuantMode::kW4A16Int4, QuantMode::kW4A16, QuantMode::kW4A4,
                             QuantMode::kW4A8Mx};
  uint64_t seed = 300;
  for (QuantMode mode : modes) {
    for (int64_t k : {1, 3}) {
      EpSetup s;
      s.cfg.mode = mode;
      s.cfg.E = 8;
      s.cfg.k = k;
      s.cfg.out = DType::kBFloat16;
      s.tokens = {5, 7};
      SCOPED_TRACE(std::string(qmoe::quant_mode_name(mode)) + " k " + std::to_string(k));
      check_ep_equals_single(s, seed++, true, true);
    }
  }
}

TEST(EpThroughputLayer, A1VariantsFourRanksAndEmptyRanks) {
  for (int a1 = 0; a1 < 3; ++a1) {
    EpSetup s;
    s.cfg.a1 = a1;
    s.cfg.E = 8;
    s.cfg.k = 4;
    s.cfg.rsf = 2.5f;
    s.tokens = {6, 3};
    SCOPED_TRACE("a1 " + std::to_string(a1));
    check_ep_equals_single(s, 340 + a1, true, true);
  }
  EpSetup s;
  s.world = 4;
  s.cfg.E = 8;
  s.cfg.k = 3;
  s.tokens = {9, 0, 1, 4};  // no capacity in this mode: any T per rank
  check_ep_equals_single(s, 350, true, true);
  s.tokens = {0, 0, 0, 0};  // nothing anywhere: three empty exchanges, empty outputs
  check_ep_equals_single(s, 351, true, true);
}

TEST(EpThroughputLayer, ArgumentErrorsBeforeAnyExchange) {
  RefusalCase rc(6);
  RankView& v = rc.v;
  auto expect_error = [&](ThroughputLayer layer, const char* name) {
    expect_named_error([&] { qmoe::ep::throughput_layer(layer, rc.counting); }, name);
  };
  expect_error({v.p, 0, 0}, "world_size");
  expect_error({v.p, 2, 2}, "rank");
  expect_error({v.p, 3, 0}, "num_experts");
  ThroughputLayer bad{v.p, 2, 0};
  bad.moe.tactic = "decode_m128_n8_k256";
  expect_error(bad, "tactic");
  EXPECT_EQ(rc.calls, 0);
  for (uint8_t b : v.out) ASSERT_EQ(b, 0xAA) << "an output byte was written by a refused call";
}

TEST(EpLowLatencyLayer, ArgumentErrorsNameTheArgumentBeforeAnyExchange) {
  RefusalCase rc(5);
  RankView& v = rc.v;
  auto expect_error = [&](LowLatencyLayer layer, const char* name) {
    expect_named_error([&] { qmoe::ep::low_latency_layer(layer, rc.counting); }, name);
  };
  expect_error({v.p, 2, 0, 4}, "max_tokens_per_rank");  // T = 5 > C = 4
  expect_error({v.p, 2, 0, 0}, "max_tokens_per_rank");
  expect_error({v.p, 0, 0, 8}, "world_size");
  expect_error({v.p, 2, 2, 8}, "rank");
  expect_error({v.p, 3, 0, 8}, "num_experts");  // 8 % 3 != 0
  LowLatencyLayer bad{v.p, 2, 0, 8};
  bad.moe.local_expert_offset = 4;
  expect_error(bad, "local_expert_offset");
  bad = {v.p, 2, 0, 8};
  bad.moe.num_local_experts = 8;
  expect_error(bad, "num_local_experts");
  bad = {v.p, 2, 0, 8};
  bad.moe.fc2_input_scale.reset();
  expect_error(bad, "fc2_input_scale");
  EXPECT_THROW(qmoe::ep::low_latency_layer(LowLatencyLayer{v.p, 2, 0, 8}, qmoe::ep::Exchange{}), qmoe::Error);
  EXPECT_EQ(rc.calls, 0);
  for (uint8_t b : v.out) ASSERT_EQ(b, 0xAA) << "an output byte was written by a refused call";
  EXPECT_EQ(qmoe::ep::low_latency_layer_workspace_size(LowLatencyLayer{v.p, 2, 0, 8}), 0);  // CPU tensors
}

}  // namespace
