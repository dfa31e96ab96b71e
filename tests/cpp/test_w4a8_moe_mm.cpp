// Tests of cutlass_w4a8_moe_mm on CPU (reference backend, include/qmoe/grouped_gemm.h):
// results against an independent float64 loop written here (decode the full weights with their
// scales, then dot), on random data: both scale layouts, per-tensor and per-row a_scales, empty
// experts, rows outside every group (poisoned rows must keep their poison), one row, NaN input;
// then one test per validation rule (the message names the argument; d is not written).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuda/launch.h"
#include "qmoe/error.h"
#include "qmoe/formats.h"
#include "qmoe/grouped_gemm.h"

namespace {

using qmoe::Device;
using qmoe::DType;
using qmoe::TensorRef;

constexpr uint16_t kPoisonBits = 0x7FAB;  // a NaN payload the GEMM never produces

// ---- independent decoders (not formats.h) ---------------------------------------------------
double e4m3_value(uint8_t c) {
  const int sign = c >> 7, exp = (c >> 3) & 15, man = c & 7;
  const double mag = exp == 0 ? std::ldexp(man, -9) : std::ldexp(8 + man, exp - 10);
  return sign ? -mag : mag;
}
int nibble_value(int nibble) { return nibble >= 8 ? nibble - 16 : nibble; }
float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One random problem with every buffer it needs. Experts' row blocks are laid out in reverse
// expert order with one unused (poisoned) row before each block and at the end.
struct GemmCase {
  int64_t experts = 0, n = 0, k = 0, rows = 0, groups = 0;
  bool per_row = false;
  std::vector<int64_t> counts;
  std::vector<uint8_t> a, b;
  std::vector<float> scales;  // logical S[e, o, g], bf16 values
  std::vector<uint16_t> scales_stored;
  std::vector<float> a_scales;
  std::vector<int32_t> offsets, sizes;
  std::vector<int64_t> a_str, b_str, d_str, s_str;
  std::vector<uint16_t> d;
  std::vector<int64_t> owner;  // expert of each row, -1 when outside every group

  GemmCase(uint32_t seed, int64_t experts_, int64_t n_, int64_t k_, std::vector<int64_t> counts_, bool per_row_)
      : experts(experts_), n(n_), k(k_), groups(k_ / 128), per_row(per_row_), counts(std::move(counts_)) {
    std::mt19937 rng(seed);
    offsets.assign(experts, 0);
    rows = 0;
    for (int64_t e = experts - 1; e >= 0; --e) {
      rows += 1;  // gap row
      offsets[e] = counts[e] > 0 ? static_cast<int32_t>(rows) : 0;
      rows += counts[e];
    }
    rows += 1;
    owner.assign(rows, -1);
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t i = 0; i < counts[e]; ++i) owner[offsets[e] + i] = e;

    std::uniform_int_distribution<int> byte(0, 255);
    a.resize(rows * k);
    for (auto& c : a) {
      do c = static_cast<uint8_t>(byte(rng));
      while ((c & 0x7F) == 0x7F);  // no NaN codes
    }
    b.resize(experts * n * k / 2);
    for (auto& c : b) c = static_cast<uint8_t>(byte(rng));
    std::normal_distribution<float> normal(0.0f, 0.005f);
    scales.resize(experts * n * groups);
    for (auto& s : scales) s = qmoe::round_bf16(normal(rng));
    // SGLang's stored layout, built here from the logical scales.
    scales_stored.assign(experts * n * groups, 0);
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t o = 0; o < n; ++o)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t index = k % 512 == 0 ? (e * (groups / 4) + g / 4) * 4 * n + 4 * o + g % 4
                                             : (e * groups + g) * n + o;
          scales_stored[index] = qmoe::float_to_bf16(scales[(e * n + o) * groups + g]);
        }
    std::uniform_real_distribution<float> scale_dist(0.5f, 2.0f);
    a_scales.resize(per_row ? rows : 1);
    for (size_t i = 0; i < a_scales.size(); ++i) a_scales[i] = scale_dist(rng) * (i % 3 == 1 ? -1.0f : 1.0f);
    for (int64_t e = 0; e < experts; ++e) {
      sizes.push_back(static_cast<int32_t>(n));
      sizes.push_back(static_cast<int32_t>(counts[e]));
      sizes.push_back(static_cast<int32_t>(k));
    }
    a_str.assign(experts * 3, k);
    b_str.assign(experts * 3, k);
    d_str.assign(experts * 3, n);
    s_str.assign(experts * 3, n);
    d.assign(rows * n, kPoisonBits);
  }

  qmoe::W4A8MoeMmArgs args(bool with_strides = true) {
    qmoe::W4A8MoeMmArgs x;
    x.d = qmoe::make_tensor(d.data(), DType::kBFloat16, {rows, n});
    x.a = qmoe::make_tensor(a.data(), DType::kFloat8E4M3, {rows, k});
    x.b = qmoe::make_tensor(b.data(), DType::kInt8, {experts, n, k / 2});
    x.a_scales = qmoe::make_tensor(a_scales.data(), DType::kFloat32, {static_cast<int64_t>(a_scales.size())});
    if (k % 512 == 0) {
      x.b_scales = qmoe::make_tensor(scales_stored.data(), DType::kBFloat16, {experts, k / 512, 4 * n});
    } else {
      x.b_scales = qmoe::make_tensor(scales_stored.data(), DType::kBFloat16, {experts, groups, n});
    }
    x.expert_offsets = qmoe::make_tensor(offsets.data(), DType::kInt32, {experts});
    x.problem_sizes = qmoe::make_tensor(sizes.data(), DType::kInt32, {experts, 3});
    if (with_strides) {
      x.a_strides = qmoe::make_tensor(a_str.data(), DType::kInt64, {experts, 3});
      x.b_strides = qmoe::make_tensor(b_str.data(), DType::kInt64, {experts, 3});
      x.d_strides = qmoe::make_tensor(d_str.data(), DType::kInt64, {experts, 3});
      x.s_strides = qmoe::make_tensor(s_str.data(), DType::kInt64, {experts, 3});
    }
    return x;
  }

  // float64: dequantize the weight row fully (q * S), dot with the decoded activations.
  void expected(int64_t r, int64_t o, double* value, double* magnitude) const {
    const int64_t e = owner[r];
    double sum = 0.0, abs_sum = 0.0;
    for (int64_t kk = 0; kk < k; ++kk) {
      const uint8_t byte = b[(e * n + o) * (k / 2) + kk / 2];
      const int q = nibble_value(kk % 2 == 0 ? (byte & 15) : (byte >> 4));
      const double w = q * static_cast<double>(scales[(e * n + o) * groups + kk / 128]);
      const double term = e4m3_value(a[r * k + kk]) * w;
      sum += term;
      abs_sum += std::fabs(term);
    }
    const double a_scale = per_row ? a_scales[r] : a_scales[0];
    *value = a_scale * sum;
    *magnitude = std::fabs(a_scale) * abs_sum;
  }

  // Every row outside the groups keeps its poison; inside, each checked element is within
  // bf16 rounding (2^-9 relative, doubled for margin) plus fp32 accumulation error (bounded by
  // ~70 roundings of 2^-24 times the sum of |terms|) of the float64 value.
  void check(int64_t feature_step = 1) const {
    double err2 = 0.0, ref2 = 0.0;
    int64_t checked = 0;
    for (int64_t r = 0; r < rows; ++r) {
      if (owner[r] < 0) {
        for (int64_t o = 0; o < n; ++o)
          ASSERT_EQ(d[r * n + o], kPoisonBits) << "row " << r << " is outside every group but was written";
        continue;
      }
      for (int64_t o = (r % feature_step); o < n; o += feature_step) {
        double want, magnitude;
        expected(r, o, &want, &magnitude);
        const double got = bf16_bits_to_float(d[r * n + o]);
        const double tolerance = std::ldexp(std::fabs(want), -8) + 2e-5 * magnitude;
        ASSERT_NEAR(got, want, tolerance) << "row " << r << " (expert " << owner[r] << ") feature " << o;
        err2 += (got - want) * (got - want);
        ref2 += want * want;
        ++checked;
      }
    }
    if (checked > 0) {
      EXPECT_GT(ref2, 0.0);
      EXPECT_LT(std::sqrt(err2 / ref2), 4e-3) << "relative RMS error";
    }
  }
};

void run_and_check(GemmCase& c) {
  qmoe::cutlass_w4a8_moe_mm(c.args());
  c.check();
}

TEST(W4A8MoeMm, PackedScalesK512PerTensor) {
  GemmCase c(1, 4, 128, 512, {3, 7, 1, 12}, false);
  run_and_check(c);
}
TEST(W4A8MoeMm, PackedScalesK1024PerRow) {
  GemmCase c(2, 3, 64, 1024, {9, 2, 16}, true);
  run_and_check(c);
}
TEST(W4A8MoeMm, TransposedScalesK256WithEmptyExpert) {
  GemmCase c(3, 3, 64, 256, {5, 0, 9}, false);
  run_and_check(c);
}
TEST(W4A8MoeMm, TransposedScalesK384PerRow) {
  GemmCase c(4, 2, 24, 384, {33, 4}, true);  // G = 3, N not a multiple of 16
  run_and_check(c);
}
TEST(W4A8MoeMm, PackedScalesK1536ManyExperts) {
  GemmCase c(5, 16, 40, 1536, {0, 1, 2, 3, 0, 5, 6, 0, 8, 1, 1, 0, 2, 3, 4, 40}, false);
  run_and_check(c);
}
TEST(W4A8MoeMm, OneRowK128) {
  GemmCase c(6, 1, 8, 128, {1}, false);  // G = 1, smallest shape
  run_and_check(c);
}
TEST(W4A8MoeMm, AllExpertsEmpty) {
  GemmCase c(7, 3, 16, 512, {0, 0, 0}, false);
  run_and_check(c);  // nothing written: every row keeps its poison
}
TEST(W4A8MoeMm, WithoutStrideTensors) {
  GemmCase c(8, 2, 32, 512, {4, 6}, true);
  qmoe::cutlass_w4a8_moe_mm(c.args(false));
  c.check();
}

TEST(W4A8MoeMm, StorageDtypesOfBAgree) {
  GemmCase c(9, 2, 32, 512, {7, 5}, false);
  qmoe::cutlass_w4a8_moe_mm(c.args());
  const std::vector<uint16_t> first = c.d;
  for (DType storage : {DType::kInt4x2, DType::kUInt8}) {
    c.d.assign(c.d.size(), kPoisonBits);
    auto x = c.args();
    x.b.dtype = storage;
    qmoe::cutlass_w4a8_moe_mm(x);
    EXPECT_EQ(c.d, first) << qmoe::dtype_name(storage);
  }
}

TEST(W4A8MoeMm, PublicEntryMatchesReferenceAndIsDeterministic) {
  // Large enough to run on several threads.
  GemmCase c(10, 3, 256, 1024, {40, 17, 64}, true);
  qmoe::cutlass_w4a8_moe_mm(c.args());
  const std::vector<uint16_t> first = c.d;
  c.d.assign(c.d.size(), kPoisonBits);
  qmoe::reference::w4a8_moe_mm(c.args());
  EXPECT_EQ(c.d, first);
  c.check(7);
}

TEST(W4A8MoeMm, NanActivationPropagatesToItsRowOnly) {
  GemmCase c(11, 2, 16, 256, {3, 2}, false);
  const int64_t row = c.offsets[1] + 1;
  c.a[row * c.k + 200] = 0xFF;  // e4m3 NaN
  qmoe::cutlass_w4a8_moe_mm(c.args());
  for (int64_t o = 0; o < c.n; ++o) EXPECT_TRUE(std::isnan(bf16_bits_to_float(c.d[row * c.n + o]))) << o;
  for (int64_t o = 0; o < c.n; ++o) EXPECT_NE(c.d[row * c.n + o], kPoisonBits);
  // Check the other rows against float64 with the NaN row taken out of the comparison.
  c.owner[row] = -1;
  for (int64_t o = 0; o < c.n; ++o) c.d[row * c.n + o] = kPoisonBits;
  c.check();
}

TEST(W4A8MoeMm, DeepSeekShapeRunsFast) {
  // EP GEMM1 of DeepSeek-V3 decode: N = 4096, K = 7168, 64 rows. Checks a sample of features.
  GemmCase c(12, 1, 4096, 7168, {64}, false);
  const auto start = std::chrono::steady_clock::now();
  qmoe::cutlass_w4a8_moe_mm(c.args());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  RecordProperty("seconds", std::to_string(seconds));
  std::printf("[          ] reference N=4096 K=7168 64 rows: %.3f s\n", seconds);
  EXPECT_LT(seconds, 20.0);  // generous: shared 2-core CI machines; a typical run takes well under 1 s
  c.check(61);
}

// ---------------------------------------------------------------------------------------------
// Validation: one test per rule. The call must throw before writing d.
// ---------------------------------------------------------------------------------------------

struct Valid {
  Valid() = default;
  Valid(const Valid&) = delete;  // x views c's buffers
  GemmCase c{100, 2, 16, 512, {2, 3}, false};
  qmoe::W4A8MoeMmArgs x = c.args();
  std::optional<qmoe::Tactic> tactic;
};

void expect_error(const std::function<void(Valid&)>& mutate, const std::string& argument,
                  qmoe::ErrorKind kind = qmoe::ErrorKind::kValue, const std::string& mentions = "") {
  Valid v;
  mutate(v);
  try {
    qmoe::cutlass_w4a8_moe_mm(v.x, nullptr, v.tactic);
    FAIL() << "no error raised; expected one naming '" << argument << "'";
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("'" + argument + "'"), std::string::npos) << e.what();
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << e.what();
    if (!mentions.empty()) EXPECT_NE(std::string(e.what()).find(mentions), std::string::npos) << e.what();
  }
  for (uint16_t bits : v.c.d) ASSERT_EQ(bits, kPoisonBits) << "d was written before validation failed";
}

TEST(W4A8MoeMmValidation, ValidCallPasses) {
  Valid v;
  EXPECT_NO_THROW(qmoe::validate_w4a8_moe_mm(v.x));
  qmoe::cutlass_w4a8_moe_mm(v.x);
  v.c.check();
}
TEST(W4A8MoeMmValidation, ChunkSizeMustBe128) {
  expect_error([](Valid& v) { v.x.chunk_size = 64; }, "chunk_size", qmoe::ErrorKind::kValue, "128");
  expect_error([](Valid& v) { v.x.chunk_size = 256; }, "chunk_size");
}
TEST(W4A8MoeMmValidation, TopkPositive) {
  expect_error([](Valid& v) { v.x.topk = 0; }, "topk");
}
TEST(W4A8MoeMmValidation, ADtype) {
  expect_error([](Valid& v) { v.x.a.dtype = DType::kBFloat16; }, "a", qmoe::ErrorKind::kType);
  expect_error([](Valid& v) { v.x.a.dtype = DType::kInt8; }, "a", qmoe::ErrorKind::kType);
}
TEST(W4A8MoeMmValidation, ATwoDimensional) {
  expect_error([](Valid& v) { v.x.a = qmoe::make_tensor(v.c.a.data(), DType::kFloat8E4M3, {1, v.c.rows, 512}); },
               "a");
}
TEST(W4A8MoeMmValidation, AContiguous) {
  expect_error([](Valid& v) { v.x.a.strides[0] = 1024; }, "a");
}
TEST(W4A8MoeMmValidation, KMultipleOf128) {
  // K = 320: SGLang returns wrong values silently.
  expect_error([](Valid& v) { v.x.a = qmoe::make_tensor(v.c.a.data(), DType::kFloat8E4M3, {v.c.rows, 320}); }, "a",
               qmoe::ErrorKind::kValue, "128");
}
TEST(W4A8MoeMmValidation, DFloat16IsRefusedAsNotBf16) {
  expect_error([](Valid& v) { v.x.d.dtype = DType::kFloat16; }, "d", qmoe::ErrorKind::kType, "only output dtype");
}
TEST(W4A8MoeMmValidation, DDtype) {
  expect_error([](Valid& v) { v.x.d.dtype = DType::kFloat32; }, "d", qmoe::ErrorKind::kType, "bfloat16");
}
TEST(W4A8MoeMmValidation, DRowsMatchA) {
  expect_error([](Valid& v) { v.x.d = qmoe::make_tensor(v.c.d.data(), DType::kBFloat16, {v.c.rows - 1, 16}); }, "d");
}
TEST(W4A8MoeMmValidation, NMultipleOf8) {
  expect_error([](Valid& v) { v.x.d = qmoe::make_tensor(v.c.d.data(), DType::kBFloat16, {v.c.rows, 12}); }, "d",
               qmoe::ErrorKind::kValue, "multiple of 8");
}
TEST(W4A8MoeMmValidation, DContiguous) {
  expect_error([](Valid& v) { v.x.d.strides[1] = 2; }, "d");
}
TEST(W4A8MoeMmValidation, ExpertOffsetsInt32) {
  expect_error([](Valid& v) { v.x.expert_offsets.dtype = DType::kInt64; }, "expert_offsets", qmoe::ErrorKind::kType);
}
TEST(W4A8MoeMmValidation, ExpertCountAtMost1024) {
  // SGLang: E = 1025 makes an illegal memory access. Fails before anything reads the offsets.
  expect_error([](Valid& v) { v.x.expert_offsets.shape[0] = 1025; }, "expert_offsets", qmoe::ErrorKind::kValue,
               "1024");
  expect_error([](Valid& v) { v.x.expert_offsets.shape[0] = 0; }, "expert_offsets");
}
TEST(W4A8MoeMmValidation, BDtype) {
  expect_error([](Valid& v) { v.x.b.dtype = DType::kFloat32; }, "b", qmoe::ErrorKind::kType);
}
TEST(W4A8MoeMmValidation, BShape) {
  expect_error([](Valid& v) { v.x.b = qmoe::make_tensor(v.c.b.data(), DType::kInt8, {2, 16, 512}); }, "b");
  expect_error([](Valid& v) { v.x.b = qmoe::make_tensor(v.c.b.data(), DType::kInt8, {1, 16, 256}); }, "b");
}
TEST(W4A8MoeMmValidation, BContiguous) {
  expect_error([](Valid& v) { v.x.b.strides[0] = 16 * 512; }, "b");
}
TEST(W4A8MoeMmValidation, AScalesDtype) {
  expect_error([](Valid& v) { v.x.a_scales.dtype = DType::kBFloat16; }, "a_scales", qmoe::ErrorKind::kType);
}
TEST(W4A8MoeMmValidation, AScalesShapeOneOrRows) {
  expect_error([](Valid& v) { v.x.a_scales.shape[0] = 2; }, "a_scales");
  expect_error([](Valid& v) { v.x.a_scales.shape[0] = v.c.rows + 1; }, "a_scales");
}
TEST(W4A8MoeMmValidation, BScalesDtype) {
  expect_error([](Valid& v) { v.x.b_scales.dtype = DType::kFloat32; }, "b_scales", qmoe::ErrorKind::kType);
}
TEST(W4A8MoeMmValidation, BScalesLayoutFollowsK) {
  // K = 512 needs the packed [E, K/512, 4N] layout; the transposed [E, K/128, N] one is refused.
  expect_error(
      [](Valid& v) { v.x.b_scales = qmoe::make_tensor(v.c.scales_stored.data(), DType::kBFloat16, {2, 4, 16}); },
      "b_scales");
}
TEST(W4A8MoeMmValidation, ProblemSizesDtypeAndShape) {
  expect_error([](Valid& v) { v.x.problem_sizes.dtype = DType::kInt64; }, "problem_sizes", qmoe::ErrorKind::kType);
  expect_error([](Valid& v) { v.x.problem_sizes.shape[1] = 2; }, "problem_sizes");
}
TEST(W4A8MoeMmValidation, ProblemSizesValues) {
  expect_error([](Valid& v) { v.c.sizes[3] = 32; }, "problem_sizes");     // N of expert 1
  expect_error([](Valid& v) { v.c.sizes[5] = 256; }, "problem_sizes");    // K of expert 1
  expect_error([](Valid& v) { v.c.sizes[1] = -1; }, "problem_sizes");     // M of expert 0
}
TEST(W4A8MoeMmValidation, GroupsWithinRows) {
  expect_error([](Valid& v) { v.c.sizes[1] = 6; }, "expert_offsets");     // runs past R
  expect_error([](Valid& v) { v.c.offsets[0] = -1; }, "expert_offsets");
}
TEST(W4A8MoeMmValidation, GroupsDisjoint) {
  expect_error([](Valid& v) { v.c.offsets[0] = v.c.offsets[1] + 1; }, "expert_offsets", qmoe::ErrorKind::kValue,
               "overlapping");
}
TEST(W4A8MoeMmValidation, StrideTensors) {
  expect_error([](Valid& v) { v.x.a_strides->dtype = DType::kInt32; }, "a_strides", qmoe::ErrorKind::kType);
  expect_error([](Valid& v) { v.x.b_strides->shape[0] = 3; }, "b_strides");
  expect_error([](Valid& v) { v.c.d_str[4] = 17; }, "d_strides");
  expect_error([](Valid& v) { v.c.s_str[0] = 64; }, "s_strides");   // packed scales still have leading dim N
  expect_error([](Valid& v) { v.c.a_str[5] = 256; }, "a_strides");
  expect_error([](Valid& v) { v.c.b_str[2] = 16; }, "b_strides");
}
TEST(W4A8MoeMmValidation, SameDevice) {
  expect_error([](Valid& v) { v.x.b.device = Device::kCUDA; }, "b");
  expect_error([](Valid& v) { v.x.problem_sizes.device = Device::kCUDA; }, "problem_sizes");
  expect_error([](Valid& v) { v.x.s_strides->device = Device::kCUDA; }, "s_strides");
}
TEST(W4A8MoeMmValidation, DMustNotAliasInputs) {
  expect_error([](Valid& v) { v.x.d.data = v.c.a.data(); }, "d");
  expect_error([](Valid& v) { v.x.b.data = v.c.d.data() + 8; }, "d");
}
// a_slots (a qmoe extension): uint8 [R, 2K + K/32] scratch; on the CPU it is checked and then not needed.
TEST(W4A8MoeMmValidation, ActivationSlotsAccepted) {
  Valid v;
  const int64_t pitch = 2 * v.c.k + v.c.k / 32;
  std::vector<uint8_t> slots(static_cast<size_t>(v.c.rows) * pitch, 0xAB);
  v.x.a_slots = qmoe::make_tensor(slots.data(), DType::kUInt8, {v.c.rows, pitch});
  qmoe::cutlass_w4a8_moe_mm(v.x);
  v.c.check();
}
TEST(W4A8MoeMmValidation, ActivationSlotsShapeDtypeAndAliasing) {
  std::vector<uint8_t> slots(static_cast<size_t>(100) * 1040 + 64);  // K = 512: rows of 2K + K/32 = 1040 bytes
  auto with = [&](int64_t rows, int64_t cols, DType dtype) {
    return [&slots, rows, cols, dtype](Valid& v) {
      v.x.a_slots = qmoe::make_tensor(slots.data(), dtype, {rows, cols});
    };
  };
  expect_error(with(100, 1024, DType::kUInt8), "a_slots", qmoe::ErrorKind::kValue, "1040");  // [R, 2K]: no bias sums
  expect_error(with(99, 1040, DType::kUInt8), "a_slots");
  expect_error(with(100, 1040, DType::kBFloat16), "a_slots", qmoe::ErrorKind::kType);
  expect_error([](Valid& v) { v.x.a_slots = qmoe::make_tensor(v.c.a.data(), DType::kUInt8, {100, 1040}); },
               "a_slots");  // overlaps a
  expect_error([&](Valid& v) {
    v.x.a_slots = qmoe::make_tensor(slots.data(), DType::kUInt8, {100, 1040});
    v.x.a_slots->device = Device::kCUDA;
  }, "a_slots");
}
TEST(W4A8MoeMmValidation, NullData) {
  expect_error([](Valid& v) { v.x.b.data = nullptr; }, "b");
}
TEST(W4A8MoeMmValidation, ForcedTacticMustBeValid) {
  qmoe::Tactic bogus;
  bogus.tile_m = 3;  // no tactic has 3-row tiles
  expect_error([&](Valid& v) { v.tactic = bogus; }, "tactic");
}

TEST(W4A8MoeMmValidation, ValidForcedTacticRunsOnCpu) {
  // The CPU reference computes what every tactic computes; a valid forced tactic is accepted.
  Valid v;
  qmoe::GemmProblem problem;
  problem.n = v.c.n;
  problem.k = v.c.k;
  problem.total_rows = v.c.rows;
  problem.num_experts = v.c.experts;
  const std::vector<qmoe::Tactic> valid = qmoe::valid_tactics(problem);
  ASSERT_FALSE(valid.empty());
  qmoe::cutlass_w4a8_moe_mm(v.x, nullptr, valid.back());
  v.c.check();
}

// All tensors on a (fake) GPU: shape checks only, then the CUDA launcher.
// (Valid is not copied: its argument views point into its own buffers.)
void move_to_cuda(Valid& v) {
  for (TensorRef* t : {&v.x.d, &v.x.a, &v.x.b, &v.x.a_scales, &v.x.b_scales, &v.x.expert_offsets, &v.x.problem_sizes,
                       &*v.x.a_strides, &*v.x.b_strides, &*v.x.d_strides, &*v.x.s_strides})
    t->device = Device::kCUDA;
}

TEST(W4A8MoeMmValidation, CudaChecksShapesNotValues) {
  Valid v;
  move_to_cuda(v);
  v.c.sizes[1] = 1000;  // device memory: not read on the host
  v.c.d_str[0] = 1;
  EXPECT_NO_THROW(qmoe::validate_w4a8_moe_mm(v.x));
}
TEST(W4A8MoeMmValidation, CudaPointersAligned) {
  Valid v;
  move_to_cuda(v);
  v.x.a.data = v.c.a.data() + 1;
  try {
    qmoe::validate_w4a8_moe_mm(v.x);
    FAIL() << "misaligned 'a' accepted";
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(e.argument(), "a") << e.what();
  }
}
TEST(W4A8MoeMmValidation, CudaActivationSlotsAligned) {
  Valid v;
  move_to_cuda(v);
  std::vector<uint8_t> slots(static_cast<size_t>(100) * 1040 + 64);
  v.x.a_slots = qmoe::make_tensor(slots.data() + 1, DType::kUInt8, {100, 1040}, Device::kCUDA, 0);
  try {
    qmoe::validate_w4a8_moe_mm(v.x);
    FAIL() << "misaligned 'a_slots' accepted";
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(e.argument(), "a_slots") << e.what();
  }
}
TEST(W4A8MoeMmValidation, CudaTensorsGoToTheCudaLauncher) {
  if (qmoe::cuda::kernels_built()) GTEST_SKIP() << "would launch on fake device pointers";
  Valid v;
  move_to_cuda(v);
  try {
    qmoe::cutlass_w4a8_moe_mm(v.x);
    FAIL() << "expected the CPU-only stub to raise";
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(qmoe::ErrorKind::kRuntime)) << e.what();
  }
  for (uint16_t bits : v.c.d) ASSERT_EQ(bits, kPoisonBits);
}

}  // namespace
