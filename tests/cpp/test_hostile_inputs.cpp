// Hostile inputs over the C++ API (reliability issue, parts 1 and 6), CPU backend.
//
// A seeded generator builds a VALID call of each public entry (get_cutlass_w4a8_moe_mm_data,
// cutlass_w4a8_moe_mm, fused_moe and moe_expert_rows in every quant mode, moe_finalize with and
// without row_index, the array functions of formats.h), then
// changes ONE thing: a TensorRef field (dtype, dtype/device values outside the enums, ndim outside
// [0, 8], a negative / grown / zero / huge size, a stride, a negative stride, a null data pointer,
// the device, an extra axis, an output pointing into an input, misaligned CUDA pointers) or a
// scalar (counts, chunk size, enums cast from out-of-range integers, NaN parameters). Each call
// must throw qmoe::Error before any write: outputs and inputs byte-identical afterwards, and the
// error names the mutated argument (for size / device / ndim mutations of coupled tensors, any
// argument of the call: which tensor of a coupled pair is blamed is the validator's choice).
// Mutations that are legal by design (topk_ids of any shape with the same numel; expert ids out of
// range, which are dropped) must succeed and give the unmutated / formula result. After every
// error the next valid call must give the baseline again (fault recovery).
//
// Built with -fsanitize=address,undefined (build/reliability_asan), a read or write past a buffer
// that validation let through shows up here too. Counts of calls are printed at the end of each test.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "hostile_calls.h"
#include "qmoe/error.h"
#include "qmoe/formats.h"
#include "qmoe/fused_moe.h"
#include "qmoe/grouped_gemm.h"
#include "qmoe/routing.h"

using namespace hostile;  // NOLINT: the call builders of hostile_calls.h

namespace {

enum Kind {
  kDtype, kDtypeValue, kDeviceValue, kNdim, kNegativeSize, kGrow, kZero, kHuge, kStride, kNegativeStride,
  kNull, kDevice, kExtraAxis, kAlias, kScalar, kNumKinds
};
const char* kind_name(int k) {
  const char* names[] = {"dtype", "dtype value", "device value", "ndim", "negative size", "grow", "zero",
                         "huge", "stride", "negative stride", "null", "device", "extra axis", "alias", "scalar"};
  return names[k];
}

// Applies one mutation of `kind` to t (kAlias points an output at another tensor's memory).
// Returns false when the kind does not apply; sets *strict when the error must name `*arg`,
// *legal when the call must succeed.
bool mutate(Rng& rng, Target& t, int kind, std::string* arg, bool* strict, bool* legal) {
  *strict = true;
  *legal = false;
  if (kind == kScalar) {
    if (t.scalars.empty()) return false;
    *arg = t.scalars[static_cast<size_t>(rng.below(static_cast<int64_t>(t.scalars.size())))];
    t.bad_scalar(rng, *arg);
    return true;
  }
  Slot& s = t.slots[static_cast<size_t>(rng.below(static_cast<int64_t>(t.slots.size())))];
  TensorRef& r = *s.ref;
  *arg = s.name;
  const int dim = r.ndim > 0 ? static_cast<int>(rng.below(r.ndim)) : -1;
  switch (kind) {
    case kDtype: {
      std::vector<DType> wrong;
      for (DType d : kAllDtypes)
        if (std::find(s.accepted.begin(), s.accepted.end(), d) == s.accepted.end()) wrong.push_back(d);
      r.dtype = wrong[static_cast<size_t>(rng.below(static_cast<int64_t>(wrong.size())))];
      return true;
    }
    case kDtypeValue: r.dtype = static_cast<DType>(11 + rng.below(200)); return true;
    case kDeviceValue: r.device = static_cast<Device>(2 + rng.below(100)); *strict = false; return true;
    case kNdim: {
      const int bad[] = {-1, INT_MIN, 9, 64, 1000, INT_MAX};
      r.ndim = bad[rng.below(6)];
      *strict = false;
      return true;
    }
    case kNegativeSize:
      if (dim < 0) return false;
      r.shape[dim] = rng.below(2) ? -1 : INT64_MIN;
      *strict = false;
      return true;
    case kGrow:
      if (dim < 0) return false;
      r.shape[dim] += 1 + rng.below(3);
      if (r.numel() == s.also_legal_numel) return false;  // a legal shape of this argument (see Slot)
      *strict = false;
      return true;
    case kZero:
      if (dim < 0 || r.shape[dim] == 0) return false;
      r.shape[dim] = 0;
      *strict = false;
      return true;
    case kHuge:
      if (dim < 0) return false;
      r.shape[dim] = rng.below(2) ? (int64_t{1} << 40) : INT64_MAX;
      *strict = false;
      return true;
    case kStride:
    case kNegativeStride: {
      std::vector<int> dims;
      for (int i = 0; i < r.ndim; ++i)
        if (r.shape[i] > 1) dims.push_back(i);
      if (dims.empty()) return false;
      const int i = dims[static_cast<size_t>(rng.below(static_cast<int64_t>(dims.size())))];
      r.strides[i] = kind == kStride ? r.strides[i] * 2 + rng.below(2) : -r.strides[i];
      return true;
    }
    case kNull:
      if (r.numel() == 0) return false;
      r.data = nullptr;
      return true;
    case kDevice:
      r.device = Device::kCUDA;
      r.device_index = static_cast<int>(rng.below(2));
      *strict = false;
      return true;
    case kExtraAxis:
      if (r.ndim >= qmoe::kMaxDims) return false;
      r.shape[r.ndim] = 1;
      r.strides[r.ndim] = 1;
      ++r.ndim;
      *legal = s.shape_free;
      *strict = false;
      return true;
    case kAlias: {
      if (!s.output) return false;
      std::vector<Slot*> others;
      for (auto& o : t.slots)
        if (&o != &s && o.ref->numel() > 0) others.push_back(&o);
      if (others.empty() || r.numel() == 0) return false;
      r.data = others[static_cast<size_t>(rng.below(static_cast<int64_t>(others.size())))]->ref->data;
      *strict = false;  // two outputs overlapping: either may be named
      return true;
    }
    default: return false;
  }
}

// Runs one mutated call and checks the outcome. Returns 1 for a rejection, 0 for an accepted call.
int check_call(Target& t, const std::string& arg, bool strict, bool legal, const std::string& what) {
  static const bool verbose = std::getenv("QMOE_HOSTILE_VERBOSE") != nullptr;  // names each call (to find a crash)
  if (verbose) std::fprintf(stderr, "%s\n", what.c_str());
  const auto before = snapshot(t);
  try {
    t.run();
  } catch (const qmoe::Error& e) {
    EXPECT_FALSE(legal) << what << ": legal mutation rejected: " << e.what();
    const auto names = t.names();
    if (strict) {
      EXPECT_EQ(e.argument(), arg) << what << ": " << e.what();
    } else {
      EXPECT_TRUE(names.count(e.argument())) << what << ": error names no argument of the call: " << e.what();
    }
    EXPECT_NE(e.kind(), qmoe::ErrorKind::kRuntime) << what << ": " << e.what();
    const auto after = snapshot(t);
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(before[i] == after[i]) << what << ": buffer " << i << " written although the call failed";
    return 1;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": not a qmoe::Error: " << e.what();
    return 1;
  }
  EXPECT_TRUE(legal) << what << ": illegal mutation accepted";
  return 0;
}

template <class Call>
void hostile_loop(const char* label, int iterations, uint64_t seed0) {
  Counts counts;
  Rng rng(seed0);
  for (int it = 0; it < iterations; ++it) {
    const uint64_t seed = seed0 * 100003 + static_cast<uint64_t>(it % 16);  // 16 valid calls, reused
    Call baseline_call(seed);
    Target base = baseline_call.target();
    base.run();  // the valid call works
    const auto baseline = snapshot(base);

    Call call(seed);
    Target t = call.target();
    const int kind = static_cast<int>(rng.below(kNumKinds));
    std::string arg;
    bool strict = true, legal = false;
    if (!mutate(rng, t, kind, &arg, &strict, &legal)) continue;
    const std::string what = t.label + " seed " + std::to_string(seed) + ": " + kind_name(kind) + " of '" + arg + "'";
    if (check_call(t, arg, strict, legal, what)) {
      ++counts.rejected;
    } else {
      ++counts.accepted;
      const auto after = snapshot(t);  // legal layout-only mutation: same result as the valid call
      for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i] == baseline[i]) << what << ": buffer " << i;
    }
    // Fault recovery: a valid call right after gives the baseline again.
    Call again(seed);
    Target t2 = again.target();
    t2.run();
    const auto after2 = snapshot(t2);
    for (size_t i = 0; i < after2.size(); ++i) ASSERT_TRUE(after2[i] == baseline[i]) << what << ": recovery, buffer " << i;
    ++counts.recovered;
    if (::testing::Test::HasFailure()) return;
  }
  std::printf("[hostile] %s: %lld rejected, %lld accepted, %lld recovery calls\n", label,
              static_cast<long long>(counts.rejected), static_cast<long long>(counts.accepted),
              static_cast<long long>(counts.recovered));
  EXPECT_GT(counts.rejected, iterations / 2);
}

}  // namespace

TEST(HostileInputs, MoeMmData) { hostile_loop<RoutingCall>("moe_mm_data", 3000, 1); }
TEST(HostileInputs, W4A8MoeMm) { hostile_loop<GemmCall>("w4a8_moe_mm", 3000, 2); }
TEST(HostileInputs, FusedMoe) { hostile_loop<FusedCall>("fused_moe", 2000, 3); }
TEST(HostileInputs, Formats) { hostile_loop<FormatsCall>("formats", 3000, 4); }
TEST(HostileInputs, MoeFinalize) { hostile_loop<FinalizeCall>("moe_finalize", 3000, 5); }
TEST(HostileInputs, MoeExpertRows) { hostile_loop<ExpertRowsCall>("moe_expert_rows", 2000, 6); }
TEST(HostileInputs, EpLayers) { hostile_loop<EpLayerCall>("ep_low_latency_layer / ep_throughput_layer", 2000, 7); }

namespace {

// Routing ids: any int32 value is legal (outside [0, E) dropped). Checked by invariants computed here:
// counts of valid ids, offsets as their prefix sum, permutations inverse to each other and stable.
void check_routing_invariants(const RoutingCall& c) {
  auto at = [](const std::vector<uint8_t>& v, int64_t i) {
    int32_t x;
    std::memcpy(&x, &v[static_cast<size_t>(4 * i)], 4);
    return x;
  };
  std::vector<int64_t> counts(static_cast<size_t>(c.E), 0);
  for (int64_t s = 0; s < c.slots; ++s) {
    const int32_t id = at(c.ids, s);
    if (id >= 0 && id < c.E) ++counts[static_cast<size_t>(id)];
  }
  int64_t run = 0;
  for (int64_t e = 0; e < c.E; ++e) {
    ASSERT_EQ(at(c.offsets, e), run);
    ASSERT_EQ(at(c.ps1, 3 * e + 1), counts[static_cast<size_t>(e)]);
    run += counts[static_cast<size_t>(e)];
  }
  ASSERT_EQ(at(c.offsets, c.E), run);
  int64_t previous_slot = -1, previous_expert = -1;
  for (int64_t r = 0; r < c.slots; ++r) {
    const int32_t slot = at(c.inp, r);
    if (r >= run) {
      ASSERT_EQ(slot, -1);
      continue;
    }
    ASSERT_TRUE(slot >= 0 && slot < c.slots);
    ASSERT_EQ(at(c.outp, slot), r);
    const int32_t expert = at(c.ids, slot);
    ASSERT_TRUE(expert > previous_expert || (expert == previous_expert && slot > previous_slot));  // stable
    previous_expert = expert, previous_slot = slot;
  }
  for (int64_t s = 0; s < c.slots; ++s) {
    const int32_t id = at(c.ids, s);
    if (id < 0 || id >= c.E) ASSERT_EQ(at(c.outp, s), -1);
  }
}

}  // namespace

TEST(HostileInputs, MoeMmDataAnyIdValue) {
  Rng rng(77);
  const int32_t extremes[] = {INT32_MIN, INT32_MAX, -1, 0, 1023, 1024, 1 << 30};
  for (int it = 0; it < 500; ++it) {
    RoutingCall c(static_cast<uint64_t>(it));
    for (int64_t s = 0; s < c.slots; ++s) {
      if (rng.below(2)) continue;
      const int32_t id = rng.below(2) ? extremes[rng.below(7)] : static_cast<int32_t>(rng.next());
      std::memcpy(&c.ids[static_cast<size_t>(4 * s)], &id, 4);
    }
    c.target().run();
    check_routing_invariants(c);
    if (HasFatalFailure()) return;
  }
}

// Row groups of the grouped GEMM (expert_offsets, problem_sizes values, read on the CPU): legal when
// every non-empty block lies in [0, R) with (N, M_e >= 0, K) and no two overlap; then rows outside
// every group keep their poison. Otherwise an error names one of the two tensors and nothing is written.
TEST(HostileInputs, W4A8MoeMmGroupValues) {
  Rng rng(88);
  int64_t rejected = 0, accepted = 0;
  for (int it = 0; it < 1500; ++it) {
    GemmCall c(static_cast<uint64_t>(it % 32));
    auto get = [](std::vector<uint8_t>& v, int64_t i) {
      int32_t x;
      std::memcpy(&x, &v[static_cast<size_t>(4 * i)], 4);
      return x;
    };
    auto set = [](std::vector<uint8_t>& v, int64_t i, int32_t x) { std::memcpy(&v[static_cast<size_t>(4 * i)], &x, 4); };
    const int64_t e = rng.below(c.E);
    const int32_t values[] = {-1, 0, 1, static_cast<int32_t>(c.R - 1), static_cast<int32_t>(c.R),
                              static_cast<int32_t>(c.R + 1), INT32_MIN, INT32_MAX, static_cast<int32_t>(rng.below(c.R))};
    const int32_t v = values[rng.below(9)];
    const int field = static_cast<int>(rng.below(4));  // 0: offset, 1..3: problem_sizes (N, M, K)
    if (field == 0) set(c.offsets, e, v);
    else set(c.sizes, 3 * e + field - 1, v);
    bool legal = true;
    std::vector<std::pair<int64_t, int64_t>> blocks;
    for (int64_t x = 0; x < c.E; ++x) {
      const int64_t n = get(c.sizes, 3 * x), m = get(c.sizes, 3 * x + 1), k = get(c.sizes, 3 * x + 2);
      const int64_t begin = get(c.offsets, x);
      if (n != c.N || k != c.K || m < 0) legal = false;
      if (m > 0) {
        if (begin < 0 || begin + m > c.R) legal = false;
        blocks.emplace_back(begin, begin + m);
      }
    }
    std::sort(blocks.begin(), blocks.end());
    for (size_t i = 1; i < blocks.size(); ++i)
      if (blocks[i].first < blocks[i - 1].second) legal = false;
    Target t = c.target();
    const std::string what = "group value, iteration " + std::to_string(it);
    const auto before = snapshot(t);
    try {
      t.run();
      ASSERT_TRUE(legal) << what << ": accepted";
      ++accepted;
      std::vector<bool> inside(static_cast<size_t>(c.R), false);
      for (const auto& [b, end] : blocks)
        for (int64_t r = b; r < end; ++r) inside[static_cast<size_t>(r)] = true;
      for (int64_t r = 0; r < c.R; ++r)
        for (int64_t o = 0; o < c.N * 2; ++o) {
          const uint8_t byte = c.d[static_cast<size_t>(r * c.N * 2 + o)];
          if (!inside[static_cast<size_t>(r)]) ASSERT_EQ(byte, 0xAA) << what << ": row " << r << " outside every group written";
        }
    } catch (const qmoe::Error& err) {
      ASSERT_FALSE(legal) << what << ": " << err.what();
      ++rejected;
      const std::string arg = err.argument();
      ASSERT_TRUE(arg == "problem_sizes" || arg == "expert_offsets") << err.what();
      ASSERT_TRUE(snapshot(t) == before) << what << ": written although rejected";
    }
  }
  std::printf("[hostile] w4a8_moe_mm group values: %lld rejected, %lld accepted\n", static_cast<long long>(rejected),
              static_cast<long long>(accepted));
  EXPECT_GT(rejected, 100);
  EXPECT_GT(accepted, 100);
}

// CUDA tensors are validated on the host without touching their memory: misaligned TMA base
// addresses are refused by name; aligned ones reach the launch (in a CPU-only build, a kRuntime
// "kernels not built" error, still without a write).
TEST(HostileInputs, CudaTensorsAreCheckedWithoutDereferencing) {
  for (int it = 0; it < 64; ++it) {
    GemmCall c(static_cast<uint64_t>(it));
    Target t = c.target();
    for (auto& s : t.slots) s.ref->device = Device::kCUDA;
    const char* names[] = {"a", "b", "b_scales", "d"};
    const std::string victim = names[it % 4];
    const int offset = 1 + it % 15;
    for (auto& s : t.slots)
      if (s.name == victim) s.ref->data = static_cast<uint8_t*>(s.ref->data) + offset;
    const auto before = snapshot(t);
    try {
      t.run();
      FAIL() << "a misaligned CUDA '" << victim << "' was accepted";
    } catch (const qmoe::Error& e) {
      EXPECT_EQ(e.argument(), victim) << e.what();
    }
    EXPECT_TRUE(snapshot(t) == before);
  }
}

// Several host threads calling the ops at once on their own data give bit for bit the serial
// results (issue part 5), including threads whose calls fail validation (part 6).
// ---- one test per rule added to the shared checks (src/core/tensor.cpp) and the GEMM (grouped_gemm.cpp) ----
namespace {
void expect_named(const std::function<void()>& f, const std::string& argument, const std::string& mentions) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming '" << argument << "'";
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(mentions), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(TensorChecks, NegativeSizeIsNotAWildcard) {
  // check_shape treats -1 in the EXPECTED shape as "any": a tensor whose own size is -1 used to pass a
  // shape computed from another negative size (fused_moe accepted topk_ids [-5, 2]).
  int32_t buf[4] = {};
  TensorRef t = qmoe::make_tensor(buf, DType::kInt32, {2, 2});
  t.shape[0] = -5;
  expect_named([&] { qmoe::check_shape(t, "topk_ids", {-5, 2}); }, "topk_ids", "sizes >= 0");
  expect_named([&] { qmoe::check_dtype(t, "topk_ids", DType::kInt32); }, "topk_ids", "sizes >= 0");
}

TEST(TensorChecks, NdimOutsideZeroToEight) {
  int32_t buf[4] = {};
  for (int ndim : {-1, 9, 1000}) {
    TensorRef t = qmoe::make_tensor(buf, DType::kInt32, {4});
    t.ndim = ndim;
    expect_named([&] { qmoe::check_contiguous(t, "expert_offsets"); }, "expert_offsets", "0 to 8 dimensions");
    EXPECT_EQ(qmoe::shape_string(t), "[ndim = " + std::to_string(ndim) + "]");
  }
}

TEST(TensorChecks, UnknownDtypeAndDeviceValues) {
  int32_t buf[4] = {};
  TensorRef t = qmoe::make_tensor(buf, DType::kInt32, {4});
  t.dtype = static_cast<DType>(99);
  expect_named([&] { qmoe::check_dtype_in(t, "x", {DType::kInt32}); }, "x", "dtype value 99");
  t.dtype = DType::kInt32;
  t.device = static_cast<Device>(7);
  expect_named([&] { qmoe::check_ndim(t, "x", 1); }, "x", "device value 7");
  t.device = Device::kCUDA;
  t.device_index = -2;
  expect_named([&] { qmoe::check_ndim(t, "x", 1); }, "x", "device index -2");
}

TEST(TensorChecks, ByteSizeOverflow) {
  int32_t buf[4] = {};
  TensorRef t = qmoe::make_tensor(buf, DType::kInt64, {4, 4});
  t.shape[0] = int64_t{1} << 40;
  t.shape[1] = int64_t{1} << 30;
  expect_named([&] { qmoe::check_dtype(t, "a", DType::kInt64); }, "a", "2^62 bytes");
  t.shape[1] = 0;  // empty: no overflow to fear
  EXPECT_NO_THROW(qmoe::check_dtype(t, "a", DType::kInt64));
}

TEST(W4A8MoeMmAlias, OutputOverlappingAStrideTensorIsRefused) {
  for (const char* name : {"a_strides", "b_strides", "d_strides", "s_strides"}) {
    GemmCall c(3);
    std::optional<TensorRef>* strides = std::string(name) == "a_strides"   ? &c.args.a_strides
                                        : std::string(name) == "b_strides" ? &c.args.b_strides
                                        : std::string(name) == "d_strides" ? &c.args.d_strides
                                                                           : &c.args.s_strides;
    // One buffer holding the stride values at its start and d over all of it: d overlaps that
    // stride tensor and nothing else.
    const size_t stride_bytes = static_cast<size_t>((*strides)->numel() * 8);
    std::vector<uint8_t> shared(static_cast<size_t>(c.R * c.N * 2) + stride_bytes, 0xAA);
    std::memcpy(shared.data(), (*strides)->data, stride_bytes);
    (*strides)->data = shared.data();
    c.args.d.data = shared.data();
    const std::vector<uint8_t> before = shared;
    expect_named([&] { qmoe::cutlass_w4a8_moe_mm(c.args); }, "d", std::string("'") + name + "'");
    EXPECT_TRUE(shared == before) << "written although rejected";
  }
}
