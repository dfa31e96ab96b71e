// CPU reference of cutlass_w4a8_moe_mm (DESIGN.md 3.1, include/qmoe/grouped_gemm.h): for every
// expert e and row r in [expert_offsets[e], expert_offsets[e] + problem_sizes[e][1]), and every
// output feature o in [0, N), with G = K / 128:
//
//   P[g]    = sum_{k = 128g}^{128g+127} f32(A[r, k]) * q[e, o, k]     (fp32; the products are exact)
//   acc     = fmaf(S[e, o, g], P[g], acc) for g = 0, 1, ..., G-1     (acc starts at 0)
//   D[r, o] = bf16_rne( a_scale(r) * acc )                            a_scale(r) = a_scales[0] or a_scales[r]
//
// which is what the Hopper kernel does: an FP8 WGMMA per 128-wide K group into a fresh fp32
// fragment, promoted into the main accumulator with one FMA by the bf16 group scale.
// Layouts: A e4m3 [R, K]; q packed int4 [E, N, K/2] (even k in the low nibble); S bf16 stored as
// [E, K/512, 4N] (entry [e, kb, 4o + j] = S[e, o, 4kb + j]) when K % 512 == 0, else [E, K/128, N].
// Rows outside every group are neither read nor written. Arguments are assumed validated by
// qmoe::validate_w4a8_moe_mm (src/api/grouped_gemm.cpp), in particular that groups are disjoint.
//
// Work is split into (expert, 32-row block, 128-feature block) items run by hardware_concurrency
// std::threads; each item decodes its activation rows once and each weight row once, so the result
// does not depend on the thread count (every output element is computed by one fixed sequence).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

#include "qmoe/formats.h"
#include "qmoe/grouped_gemm.h"

namespace qmoe::reference {

namespace {

constexpr int64_t kGroup = 128;       // K elements per weight scale (int4-g128)
constexpr int64_t kRowBlock = 32;     // activation rows decoded together per work item
constexpr int64_t kFeatureBlock = 128;  // output features per work item
constexpr int kLanes = 16;            // independent partial sums: lets the compiler vectorize the dot

// Decoding tables built from the formats.h codecs (a table lookup is much cheaper than the
// bit manipulation per element, and gives identical values).
struct DecodeTables {
  float e4m3[256];
  float int4_low[256];
  float int4_high[256];
  DecodeTables() {
    for (int c = 0; c < 256; ++c) {
      e4m3[c] = e4m3_to_float(static_cast<uint8_t>(c));
      int4_low[c] = static_cast<float>(qmoe::int4_low(static_cast<uint8_t>(c)));
      int4_high[c] = static_cast<float>(qmoe::int4_high(static_cast<uint8_t>(c)));
    }
  }
};

// fp32 sum of the 128 products of one K group. The order of additions is fixed (16 lanes, then
// a fixed tree), so the value is reproducible; the products themselves are exact in fp32
// (e4m3 has 4 significant bits, int4 3).
inline float group_dot(const float* a, const float* w) {
  float lane[kLanes] = {};
  for (int64_t k = 0; k < kGroup; k += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += a[k + l] * w[k + l];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}

struct WorkItem {
  int64_t expert, row_begin, row_end, feature_begin, feature_end;
};

struct Problem {
  int64_t rows, n, k, groups;
  bool packed4;  // scale layout [E, K/512, 4N] (else [E, K/128, N])
  const uint8_t* a;
  const uint8_t* b;
  const uint16_t* b_scales;
  const float* a_scales;
  bool per_row_scale;
  uint16_t* d;
};

// S[e, o, g] from the stored layout.
inline float group_scale(const Problem& p, int64_t e, int64_t o, int64_t g) {
  size_t index;
  if (p.packed4) {
    index = static_cast<size_t>(((e * (p.groups / 4) + g / 4) * 4 * p.n) + 4 * o + (g % 4));
  } else {
    index = static_cast<size_t>((e * p.groups + g) * p.n + o);
  }
  return bf16_to_float(p.b_scales[index]);
}

void run_item(const Problem& p, const DecodeTables& tables, const WorkItem& item, std::vector<float>& a_rows,
              std::vector<float>& w_row, std::vector<float>& scales) {
  const int64_t rows = item.row_end - item.row_begin;
  a_rows.resize(static_cast<size_t>(rows * p.k));
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* src = p.a + (item.row_begin + i) * p.k;
    float* dst = a_rows.data() + i * p.k;
    for (int64_t kk = 0; kk < p.k; ++kk) dst[kk] = tables.e4m3[src[kk]];
  }
  w_row.resize(static_cast<size_t>(p.k));
  scales.resize(static_cast<size_t>(p.groups));
  for (int64_t o = item.feature_begin; o < item.feature_end; ++o) {
    const uint8_t* packed = p.b + (item.expert * p.n + o) * (p.k / 2);
    for (int64_t j = 0; j < p.k / 2; ++j) {
      w_row[static_cast<size_t>(2 * j)] = tables.int4_low[packed[j]];
      w_row[static_cast<size_t>(2 * j + 1)] = tables.int4_high[packed[j]];
    }
    for (int64_t g = 0; g < p.groups; ++g) scales[static_cast<size_t>(g)] = group_scale(p, item.expert, o, g);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = item.row_begin + i;
      const float* a_row = a_rows.data() + i * p.k;
      float acc = 0.0f;
      for (int64_t g = 0; g < p.groups; ++g)
        acc = std::fma(scales[static_cast<size_t>(g)], group_dot(a_row + g * kGroup, w_row.data() + g * kGroup),
                       acc);
      const float a_scale = p.per_row_scale ? p.a_scales[r] : p.a_scales[0];
      p.d[r * p.n + o] = float_to_bf16(a_scale * acc);
    }
  }
}

}  // namespace

void w4a8_moe_mm(const W4A8MoeMmArgs& args) {
  static const DecodeTables tables;
  Problem p;
  p.rows = args.a.size(0);
  p.k = args.a.size(1);
  p.n = args.d.size(1);
  p.groups = p.k / kGroup;
  p.packed4 = p.k % 512 == 0;
  p.a = args.a.ptr<const uint8_t>();
  p.b = args.b.ptr<const uint8_t>();
  p.b_scales = args.b_scales.ptr<const uint16_t>();
  p.a_scales = args.a_scales.ptr<const float>();
  p.per_row_scale = args.a_scales.numel() > 1;
  p.d = args.d.ptr<uint16_t>();

  const int64_t experts = args.expert_offsets.size(0);
  const int32_t* offsets = args.expert_offsets.ptr<const int32_t>();
  const int32_t* sizes = args.problem_sizes.ptr<const int32_t>();

  std::vector<WorkItem> items;
  int64_t macs = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t begin = offsets[e], count = sizes[3 * e + 1];
    for (int64_t r = begin; r < begin + count; r += kRowBlock)
      for (int64_t f = 0; f < p.n; f += kFeatureBlock)
        items.push_back({e, r, std::min(r + kRowBlock, begin + count), f, std::min(f + kFeatureBlock, p.n)});
    macs += count * p.n * p.k;
  }
  if (items.empty()) return;

  // Threads only pay off beyond a few million multiply-adds.
  const int64_t hw = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  const int64_t threads = macs < (int64_t{1} << 22) ? 1 : std::min<int64_t>(hw, static_cast<int64_t>(items.size()));

  std::atomic<size_t> next{0};
  auto worker = [&]() {
    std::vector<float> a_rows, w_row, scales;
    for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1))
      run_item(p, tables, items[i], a_rows, w_row, scales);
  };
  if (threads == 1) {
    worker();
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int64_t t = 1; t < threads; ++t) {
    // A thread that cannot be started only means fewer workers: the queue is shared.
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;
    }
  }
  worker();
  for (auto& t : pool) t.join();
}

}  // namespace qmoe::reference
