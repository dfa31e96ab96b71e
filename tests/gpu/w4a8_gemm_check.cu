// GPU check and timing of cutlass_w4a8_moe_mm (src/cuda/gemm/sm90_grouped_gemm_w4a8_int4.cu).
//
// Correctness: random e4m3 activations, random packed int4 weights, random bf16 scales, ragged
// experts (empty, 1, 17, 257 rows...), gap rows between groups and after the last one; D poisoned
// with NaN. For every compiled tactic and the heuristic choice: relative RMS vs the CPU reference
// (qmoe::reference::w4a8_moe_mm) <= 1e-2, no NaN inside groups, rows outside groups bit-identical
// to the poison; every mma.sync tactic (all but the two WGMMA tiles) gives the first one's bits. Both
// scale layouts (K % 512 == 0 -> [E, K/512, 4N], else [E, K/128, N]), per-tensor
// and per-row a_scales, N not a multiple of the tile, E = 1024.
// Timing (--bench): DeepSeek-V3 GEMM1 (N 4096, K 7168) and GEMM2 (N 7168, K 2048), E 256, top-8
// uniform routing, T in {1, 8, 64, 256, 1024, 2048, 4096}, every compiled tactic: CUDA events around each launch
// through the validating API (3 warm-ups, median of 20) and around 32 back-to-back launcher calls
// (the table uses the latter with QMOE_BENCH_BATCH=1); routings rotated (different experts each
// launch, weights of all 256 experts >> L2). Filters: QMOE_BENCH_GEMM, QMOE_BENCH_T (comma list of any T),
// QMOE_BENCH_TACTIC (a comma list of names, or "heuristic"), QMOE_BENCH_SHAPES (other E:topk:N:K shapes),
// QMOE_BENCH_PER_ROW_SCALES=1 (a per-row a_scales, as the fused w4a8_int4 GEMMs; default one scale);
// --bench-only skips the checks (for profilers).
// Build: tests/gpu/build_w4a8_check.sh build/w4a8_check. Exit status 0 only when every check
// passes. The short table is printed last.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench_env.h"
#include "qmoe/grouped_gemm.h"
#include "qmoe/tactics.h"
#include "qmoe/tensor.h"
#include "cuda/launch.h"

namespace {

#define CHECK_CUDA(x)                                                                       \
  do {                                                                                      \
    cudaError_t err_ = (x);                                                                 \
    if (err_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(err_), __FILE__, __LINE__); \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)

float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct Problem {
  int64_t e, n, k, rows;
  std::vector<int32_t> offsets, sizes;  // [E], [E, 3]
  std::vector<char> in_group;           // per row
};

Problem make_problem(int64_t e, int64_t n, int64_t k, const std::vector<int>& counts, std::mt19937& rng) {
  Problem p{e, n, k, 0, {}, {}, {}};
  int64_t row = 0;
  for (int64_t i = 0; i < e; ++i) {
    if (rng() % 3 == 0) row += 1;  // a gap row nobody owns
    p.offsets.push_back(static_cast<int32_t>(row));
    const int c = counts[i % counts.size()];
    p.sizes.insert(p.sizes.end(), {static_cast<int32_t>(n), c, static_cast<int32_t>(k)});
    row += c;
  }
  p.rows = row + 3;  // trailing rows outside every group
  p.in_group.assign(p.rows, 0);
  for (int64_t i = 0; i < e; ++i)
    for (int r = 0; r < p.sizes[3 * i + 1]; ++r) p.in_group[p.offsets[i] + r] = 1;
  return p;
}

uint8_t random_e4m3(std::mt19937& rng) {
  for (;;) {
    const uint8_t v = static_cast<uint8_t>(rng());
    if ((v & 0x7F) != 0x7F && (v & 0x78) <= 0x50) return v;  // no NaN, |x| <= ~15
  }
}

template <class T>
T* to_device(const std::vector<T>& host) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(host.size(), 1) * sizeof(T)));
  if (!host.empty()) CHECK_CUDA(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

int g_failures = 0;

// Runs one ragged case for every tactic (and the default), returns nothing; counts failures.
void check_case(const char* label, int64_t e, int64_t n, int64_t k, const std::vector<int>& counts,
                bool per_row_scale, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p = make_problem(e, n, k, counts, rng);
  const int64_t r = p.rows;
  std::vector<uint8_t> a(r * k), b(e * n * k / 2);
  for (auto& v : a) v = random_e4m3(rng);
  for (auto& v : b) v = static_cast<uint8_t>(rng());
  const bool packed4 = k % 512 == 0;
  std::vector<uint16_t> s(e * (k / 128) * n);
  std::normal_distribution<float> normal(0.f, 0.005f);
  for (auto& v : s) v = float_to_bf16(normal(rng));
  std::vector<float> as(per_row_scale ? r : 1);
  for (auto& v : as) v = 0.5f + 0.01f * static_cast<float>(rng() % 100);
  if (!per_row_scale) as[0] = -as[0];  // negative scales happen upstream
  const uint16_t kPoison = 0x7FC1;     // a bf16 NaN pattern
  std::vector<uint16_t> ref(r * n, kPoison);

  using qmoe::DType;
  using qmoe::make_tensor;
  const int64_t s_shape0 = packed4 ? k / 512 : k / 128, s_shape1 = packed4 ? 4 * n : n;
  qmoe::W4A8MoeMmArgs host;
  host.d = make_tensor(ref.data(), DType::kBFloat16, {r, n});
  host.a = make_tensor(a.data(), DType::kFloat8E4M3, {r, k});
  host.b = make_tensor(b.data(), DType::kInt8, {e, n, k / 2});
  host.a_scales = make_tensor(as.data(), DType::kFloat32, {static_cast<int64_t>(as.size())});
  host.b_scales = make_tensor(s.data(), DType::kBFloat16, {e, s_shape0, s_shape1});
  host.expert_offsets = make_tensor(p.offsets.data(), DType::kInt32, {e});
  host.problem_sizes = make_tensor(p.sizes.data(), DType::kInt32, {e, 3});
  qmoe::cutlass_w4a8_moe_mm(host);  // CPU tensors: the reference

  uint8_t* da = to_device(a);
  uint8_t* db = to_device(b);
  uint16_t* ds = to_device(s);
  float* das = to_device(as);
  int32_t* doff = to_device(p.offsets);
  int32_t* dsz = to_device(p.sizes);
  uint16_t* dd = nullptr;
  CHECK_CUDA(cudaMalloc(&dd, r * n * 2));
  qmoe::W4A8MoeMmArgs dev = host;
  auto cuda_ref = [](void* ptr, DType t, std::initializer_list<int64_t> shape) {
    return make_tensor(ptr, t, shape, qmoe::Device::kCUDA, 0);
  };
  dev.d = cuda_ref(dd, DType::kBFloat16, {r, n});
  dev.a = cuda_ref(da, DType::kFloat8E4M3, {r, k});
  dev.b = cuda_ref(db, DType::kInt8, {e, n, k / 2});
  dev.a_scales = cuda_ref(das, DType::kFloat32, {static_cast<int64_t>(as.size())});
  dev.b_scales = cuda_ref(ds, DType::kBFloat16, {e, s_shape0, s_shape1});
  dev.expert_offsets = cuda_ref(doff, DType::kInt32, {e});
  dev.problem_sizes = cuda_ref(dsz, DType::kInt32, {e, 3});

  qmoe::GemmProblem gp{n, k, r, e, 8};
  std::vector<qmoe::Tactic> tactics = qmoe::valid_tactics(gp);
  std::vector<std::string> names;
  for (auto& t : tactics) names.push_back(t.name());
  names.push_back("default");
  std::vector<uint16_t> out(r * n);
  // The mma.sync tactics (every tactic but the two WGMMA prefill tiles, whose K order differs) share one
  // fp32 summation order, so they must give the same bits.
  std::vector<uint16_t> first_mma;
  std::string first_mma_name;
  for (size_t ti = 0; ti < names.size(); ++ti) {
    std::vector<uint16_t> poison(r * n, kPoison);
    CHECK_CUDA(cudaMemcpy(dd, poison.data(), r * n * 2, cudaMemcpyHostToDevice));
    if (ti < tactics.size()) qmoe::cutlass_w4a8_moe_mm(dev, nullptr, tactics[ti]);
    else qmoe::cutlass_w4a8_moe_mm(dev, nullptr);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(out.data(), dd, r * n * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0, max_rel = 0;
    int64_t nan_in = 0, touched_out = 0;
    for (int64_t row = 0; row < r; ++row) {
      for (int64_t o = 0; o < n; ++o) {
        const uint16_t got = out[row * n + o];
        if (!p.in_group[row]) {
          touched_out += got != kPoison;
          continue;
        }
        const float x = bf16_to_float(got), y = bf16_to_float(ref[row * n + o]);
        if (std::isnan(x)) { ++nan_in; continue; }
        num += (double(x) - y) * (double(x) - y);
        den += double(y) * y;
        max_rel = std::max(max_rel, std::fabs(double(x) - y) / (std::fabs(y) + 1e-2));
      }
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    int64_t other_bits = 0;  // in-group outputs that differ from the first mma.sync tactic's
    const bool mma_sync = ti < tactics.size() &&
                          !(tactics[ti].family == qmoe::Tactic::Family::kPrefill && tactics[ti].tile_k == 128);
    if (mma_sync && first_mma.empty()) {
      first_mma = out;
      first_mma_name = names[ti];
    } else if (mma_sync) {
      for (int64_t i = 0; i < r * n; ++i) other_bits += p.in_group[i / n] && out[i] != first_mma[i];
    }
    const bool ok = rel <= 1e-2 && nan_in == 0 && touched_out == 0 && other_bits == 0;
    if (!ok) ++g_failures;
    std::printf("%-4s %-34s %-24s rel_rms %.2e max_rel %.2e nan_in_groups %lld written_outside %lld%s%s\n",
                ok ? "ok" : "FAIL", label, names[ti].c_str(), rel, max_rel, (long long)nan_in,
                (long long)touched_out, other_bits ? " bits_differ_from " : "",
                other_bits ? first_mma_name.c_str() : "");
  }
  cudaFree(da); cudaFree(db); cudaFree(ds); cudaFree(das); cudaFree(doff); cudaFree(dsz); cudaFree(dd);
}

// ---------------------------------------------------------------- timing
__global__ void fill_random(uint8_t* p, int64_t n, uint32_t seed, int e4m3) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15; x *= 2246822519u; x ^= x >> 13; x *= 3266489917u; x ^= x >> 16;
    uint8_t v = static_cast<uint8_t>(x);
    if (e4m3) v = (v & 0x87) | 0x30;  // |x| in [0.5, 1): finite
    p[i] = v;
  }
}
__global__ void fill_scales(uint16_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = 0x3C00 | (i & 0x7F);  // ~0.0078
}

struct BenchRow {
  std::string shape;
  int t;
  int hit;
  double us, tbs, tflops;
  std::string tactic;
  double best_us;
  std::string best_tactic;
};

double sglang_us(int gemm, int t) {  // shared/peers/h200-w4a8-grouped-gemm.md, DeepSeek-V3 rows
  const int ts[] = {1, 8, 64, 256, 4096};
  const double g1[] = {65.6, 311.9, 1117.9, 1280.2, 5497.3}, g2[] = {50.0, 283.0, 685.8, 778.2, 2805.6};
  for (int i = 0; i < 5; ++i)
    if (ts[i] == t) return gemm == 1 ? g1[i] : g2[i];
  return 0;
}

void bench(std::vector<BenchRow>& rows_out) {
  // 1024 and 2048 tokens: 32 and 64 rows per expert, where the mma.sync and WGMMA 64-token tiles compete.
  // QMOE_BENCH_SHAPES / QMOE_BENCH_T (bench_env.h) replace the DeepSeek-V3 shapes / this token list.
  const std::vector<int> ts = bench_tokens({1, 8, 64, 256, 1024, 2048, 4096});
  const std::vector<BenchShape> shapes = bench_shapes({{256, 8, 4096, 7168}, {256, 8, 7168, 2048}});
  constexpr int kRoutings = 8, kWarmup = 3, kIters = 20;
  // Optional filters (profiling): QMOE_BENCH_GEMM=<shape index + 1>,
  // QMOE_BENCH_TACTIC=<name>[,<name>...] or "heuristic" (only the tactic select_tactic picks).
  const char* f_gemm = std::getenv("QMOE_BENCH_GEMM");
  const char* f_tactic = std::getenv("QMOE_BENCH_TACTIC");
  for (int gi = 0; gi < static_cast<int>(shapes.size()); ++gi) {
    if (f_gemm && std::atoi(f_gemm) != gi + 1) continue;
    const int64_t E = shapes[gi].e, topk = shapes[gi].topk, n = shapes[gi].n, k = shapes[gi].k;
    uint8_t* b = nullptr;
    uint16_t* s = nullptr;
    const int64_t b_bytes = E * n * k / 2, s_elems = E * (k / 128) * n;
    CHECK_CUDA(cudaMalloc(&b, b_bytes));
    CHECK_CUDA(cudaMalloc(&s, s_elems * 2));
    fill_random<<<2048, 256>>>(b, b_bytes, 1234u + gi, 0);
    fill_scales<<<2048, 256>>>(s, s_elems);
    for (int t : ts) {
      const int64_t r = t * topk;
      uint8_t* a = nullptr;
      uint16_t* d = nullptr;
      float* as = nullptr;
      CHECK_CUDA(cudaMalloc(&a, r * k));
      CHECK_CUDA(cudaMalloc(&d, r * n * 2));
      // QMOE_BENCH_PER_ROW_SCALES=1: a per-row a_scales [R] (the fused w4a8_int4 path's s1 / s2) instead of
      // SGLang's one per-tensor scale: the two epilogues load them differently.
      const bool per_row = std::getenv("QMOE_BENCH_PER_ROW_SCALES") != nullptr;
      const int64_t n_scales = per_row ? r : 1;
      CHECK_CUDA(cudaMalloc(&as, n_scales * 4));
      const std::vector<float> scale_values(n_scales, 0.01f);
      CHECK_CUDA(cudaMemcpy(as, scale_values.data(), n_scales * 4, cudaMemcpyHostToDevice));
      fill_random<<<2048, 256>>>(a, r * k, 99u, 1);
      // Routings: each token takes topk distinct uniform experts.
      std::mt19937 rng(7 + t);
      std::vector<int32_t*> offs(kRoutings), sizes(kRoutings);
      double hit_sum = 0;
      for (int q = 0; q < kRoutings; ++q) {
        std::vector<int> cnt(E, 0);
        for (int tok = 0; tok < t; ++tok) {
          std::vector<int> chosen;
          while (static_cast<int64_t>(chosen.size()) < topk) {
            const int x = static_cast<int>(rng() % E);
            if (std::find(chosen.begin(), chosen.end(), x) == chosen.end()) chosen.push_back(x);
          }
          for (int x : chosen) ++cnt[x];
        }
        std::vector<int32_t> off(E), sz(3 * E);
        int32_t run = 0;
        for (int64_t i = 0; i < E; ++i) {
          off[i] = run;
          sz[3 * i] = static_cast<int32_t>(n); sz[3 * i + 1] = cnt[i]; sz[3 * i + 2] = static_cast<int32_t>(k);
          run += cnt[i];
          hit_sum += cnt[i] > 0;
        }
        offs[q] = to_device(off);
        sizes[q] = to_device(sz);
      }
      const double hit = hit_sum / kRoutings;
      qmoe::W4A8MoeMmArgs args;
      auto cref = [](void* ptr, qmoe::DType dt, std::initializer_list<int64_t> shape) {
        return qmoe::make_tensor(ptr, dt, shape, qmoe::Device::kCUDA, 0);
      };
      args.d = cref(d, qmoe::DType::kBFloat16, {r, n});
      args.a = cref(a, qmoe::DType::kFloat8E4M3, {r, k});
      args.b = cref(b, qmoe::DType::kInt8, {E, n, k / 2});
      args.a_scales = cref(as, qmoe::DType::kFloat32, {n_scales});
      if (k % 512 == 0) args.b_scales = cref(s, qmoe::DType::kBFloat16, {E, k / 512, 4 * n});
      else args.b_scales = cref(s, qmoe::DType::kBFloat16, {E, k / 128, n});
      qmoe::GemmProblem gp{n, k, r, E, topk};
      const qmoe::Tactic chosen = qmoe::select_tactic(gp);
      cudaEvent_t e0, e1;
      CHECK_CUDA(cudaEventCreate(&e0));
      CHECK_CUDA(cudaEventCreate(&e1));
      double chosen_us = 0, best_us = 1e30;
      std::string best;
      for (const qmoe::Tactic& tac : qmoe::valid_tactics(gp)) {
        if (f_tactic && (std::string(f_tactic) == "heuristic" ? !(tac == chosen)
                                                               : ("," + std::string(f_tactic) + ",").find(
                                                                     "," + tac.name() + ",") == std::string::npos))
          continue;
        std::vector<float> times;
        for (int it = 0; it < kWarmup + kIters; ++it) {
          const int q = it % kRoutings;
          args.expert_offsets = cref(offs[q], qmoe::DType::kInt32, {E});
          args.problem_sizes = cref(sizes[q], qmoe::DType::kInt32, {E, 3});
          CHECK_CUDA(cudaEventRecord(e0));
          qmoe::cutlass_w4a8_moe_mm(args, nullptr, tac);
          CHECK_CUDA(cudaEventRecord(e1));
          CHECK_CUDA(cudaEventSynchronize(e1));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
          if (it >= kWarmup) times.push_back(ms * 1000.f);
        }
        std::sort(times.begin(), times.end());
        double us = times[times.size() / 2];
        {
          // Back-to-back launches through the launcher alone (no validation between them): the
          // GPU time without host gaps, averaged over kRoutings * 4 launches.
          CHECK_CUDA(cudaEventRecord(e0));
          for (int it = 0; it < kRoutings * 4; ++it) {
            const int q = it % kRoutings;
            args.expert_offsets = cref(offs[q], qmoe::DType::kInt32, {E});
            args.problem_sizes = cref(sizes[q], qmoe::DType::kInt32, {E, 3});
            qmoe::cuda::w4a8_moe_mm(args, tac, nullptr);
          }
          CHECK_CUDA(cudaEventRecord(e1));
          CHECK_CUDA(cudaEventSynchronize(e1));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
          const double batch_us = ms * 1000.0 / (kRoutings * 4);
          std::printf("  (gemm%d T=%d %s: back-to-back mean %.1f us)\n", gi + 1, t, tac.name().c_str(), batch_us);
          if (std::getenv("QMOE_BENCH_BATCH")) us = batch_us;
        }
        std::printf("  gemm%d N=%lld K=%lld T=%d %-24s %9.1f us\n", gi + 1, (long long)n, (long long)k, t,
                    tac.name().c_str(), us);
        if (tac == chosen) chosen_us = us;
        if (us < best_us) { best_us = us; best = tac.name(); }
      }
      const double bytes = hit * n * (k / 2 + 2.0 * k / 128) + double(r) * k + double(r) * n * 2;
      const double flops = 2.0 * r * n * k;
      rows_out.push_back({"gemm" + std::to_string(gi + 1), t, static_cast<int>(hit + 0.5), chosen_us,
                          bytes / chosen_us * 1e-6, flops / chosen_us * 1e-6, chosen.name(), best_us, best});
      for (int q = 0; q < kRoutings; ++q) { cudaFree(offs[q]); cudaFree(sizes[q]); }
      cudaFree(a); cudaFree(d); cudaFree(as);
      cudaEventDestroy(e0); cudaEventDestroy(e1);
    }
    cudaFree(b); cudaFree(s);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool do_bench = argc > 1 && std::string(argv[1]) == "--bench";
  if (argc > 1 && std::string(argv[1]) == "--bench-only") {
    std::vector<BenchRow> rows;
    bench(rows);
    for (const auto& x : rows)
      std::printf("| %s | %d | %s | %.1f | %.2f TB/s | %.0f TFLOP/s |\n", x.shape.c_str(), x.t, x.tactic.c_str(), x.us,
                  x.tbs, x.tflops);
    return 0;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  check_case("E8 N256 K7168 packed4 ragged", 8, 256, 7168, {0, 1, 17, 257, 0, 3, 64, 9}, false, 1);
  check_case("E4 N264 K2048 packed4 N-tail", 4, 264, 2048, {5, 0, 130, 33}, false, 2);
  check_case("E6 N384 K768 packed1", 6, 384, 768, {1, 0, 0, 40, 257, 2}, false, 3);
  check_case("E3 N136 K384 packed1 per-row scale", 3, 136, 384, {17, 1, 0}, true, 4);
  check_case("E1 N1024 K512 M16", 1, 1024, 512, {16}, false, 5);
  check_case("E4 all empty", 4, 128, 512, {0}, false, 6);
  check_case("E1024 N128 K128 sparse", 1024, 128, 128, {0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 5, 0}, false, 7);
  check_case("E2 N7168 K256 packed1 odd rows", 2, 7168, 256, {33, 129}, true, 8);

  std::vector<BenchRow> rows;
  if (do_bench) bench(rows);

  std::printf("\ncorrectness: %s (%d failures)\n", g_failures == 0 ? "PASS" : "FAIL", g_failures);
  if (!rows.empty()) {
    std::printf("\n| GEMM | T | rows | experts hit | tactic | us | TB/s | TFLOP/s | best tactic (us) | SGLang us |\n");
    std::printf("|---|--:|--:|--:|---|--:|--:|--:|---|--:|\n");
    for (const auto& x : rows)
      std::printf("| %s | %d | %d | %d | %s | %.1f | %.2f | %.0f | %s (%.1f) | %.1f |\n", x.shape.c_str(), x.t,
                  x.t * 8, x.hit, x.tactic.c_str(), x.us, x.tbs, x.tflops, x.best_tactic.c_str(), x.best_us,
                  sglang_us(x.shape == "gemm1" ? 1 : 2, x.t));
  }
  return g_failures == 0 ? 0 : 1;
}
