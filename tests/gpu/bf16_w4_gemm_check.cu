// GPU check and timing of the bf16 x 4-bit grouped GEMM (src/cuda/gemm/sm90_grouped_gemm_bf16_w4.h),
// the GEMM of the fused MoE's w4a16 / w4a16_int4 / w4a4 / w4a8 modes.
//
// Correctness, for each weight format (int4-g128 both scale layouts, NVFP4, MXFP4) x every compiled
// tactic: random bf16 activations, random packed weights, random scales (FP4 scale padding filled
// with NaN codes, which must not leak into the result), ragged experts (empty, 1, 3, 17, 64, 130),
// N not a multiple of 128, K tails (FP4: K % 128 != 0, K / block % 4 != 0), random row scales, fp32
// and bf16 outputs poisoned with NaN. Reference: fp64 sums of exact products on the host (int4: the
// group promotion, one fp32 FMA per group). Passes when rel RMS <= 1e-5 (fp32 out) / 4e-3 (bf16),
// no NaN inside groups, and the rows after the last group still hold the poison. The prefill (WGMMA) tiles
// refuse a fused-finalize scatter with an error, before any launch.
// Timing (--bench [max T]): GEMM1-like (N 4096, K 7168) and GEMM2-like (N 7168, K 2048), E 256, top-8
// uniform routing, T in {1, 8, 64, 512, 4096}, every tactic; median of 20 launches over 8 rotated
// routings. QMOE_BENCH_SHAPES / QMOE_BENCH_T (bench_env.h) replace the shapes / the token list (the
// gemm column then names the shape by its index: gemm1, gemm2, ...); --bench-only skips MXFP4 unless QMOE_BENCH_MX=1.
// Build: tests/gpu/build_w4a8_check.sh build/bf16_w4_check tests/gpu/bf16_w4_gemm_check.cu.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_env.h"
#include "cuda/gemm/sm90_grouped_gemm_bf16_w4.h"
#include "qmoe/error.h"
#include "core/fp4_weight_pack.h"
#include "qmoe/formats.h"
#include "qmoe/tactics.h"

using qmoe::cuda::W4Format;

namespace {

#define CHECK_CUDA(x)                                                                                   \
  do {                                                                                                  \
    cudaError_t err_ = (x);                                                                             \
    if (err_ != cudaSuccess) {                                                                          \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(err_), __FILE__, __LINE__); \
      std::exit(3);                                                                                     \
    }                                                                                                   \
  } while (0)

template <class T>
T* upload(const std::vector<T>& v) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(16, v.size() * sizeof(T))));
  if (!v.empty()) CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

const char* format_name(W4Format f, bool packed = false) {
  if (packed) return f == W4Format::kNvfp4 ? "nvfp4p" : "mxfp4p";  // FP4 weights in qmoe's packed word order
  return f == W4Format::kInt4G128 ? "int4" : f == W4Format::kNvfp4 ? "nvfp4" : "mxfp4";
}

// The same weights with every 32-bit word in qmoe's packed order (core/fp4_weight_pack.h).
std::vector<uint8_t> packed_words(const std::vector<uint8_t>& b) {
  std::vector<uint8_t> out(b.size());
  for (size_t i = 0; i + 4 <= b.size(); i += 4) {
    uint32_t w;
    std::memcpy(&w, &b[i], 4);
    w = qmoe::fp4pack::pack_word(w);
    std::memcpy(&out[i], &w, 4);
  }
  return out;
}

int64_t swizzled_offset(int64_t e, int64_t r, int64_t c, int64_t mt, int64_t kt) {
  return ((e * mt + r / 128) * kt + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4);
}

struct Case {
  W4Format format;
  int64_t n, k;
  std::vector<int> rows;  // per expert
  bool fp32_out;
  bool packed = false;  // FP4: B in packed word order (the reference reads the plain bytes)
};

int failures = 0;

void run_case(const Case& c, const qmoe::Tactic& tactic, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-2.f, 2.f);
  const int64_t E = c.rows.size(), N = c.n, K = c.k;
  std::vector<int32_t> offsets(E), sizes(3 * E);
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    offsets[e] = static_cast<int32_t>(total);
    sizes[3 * e] = static_cast<int32_t>(N);
    sizes[3 * e + 1] = c.rows[e];
    sizes[3 * e + 2] = static_cast<int32_t>(K);
    total += c.rows[e];
  }
  const int64_t R = total + 5;  // 5 rows after the last group must keep the poison
  std::vector<uint16_t> a(R * K);
  for (auto& v : a) v = qmoe::float_to_bf16(uni(rng));
  std::vector<uint8_t> b(E * N * K / 2);
  for (auto& v : b) v = static_cast<uint8_t>(rng());
  const bool int4 = c.format == W4Format::kInt4G128;
  const int64_t block = c.format == W4Format::kNvfp4 ? 16 : 32;
  const int64_t mt = (N + 127) / 128, kb = K / block, kt = (kb + 3) / 4;
  std::vector<uint8_t> scales;
  std::vector<float> wscale;  // logical [E, N, K/block] (FP4) or [E, N, K/128] (int4)
  const bool packed4 = int4 && K % 512 == 0;
  if (int4) {
    const int64_t g = K / 128;
    wscale.resize(E * N * g);
    std::vector<uint16_t> s16(E * N * g);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t gi = 0; gi < g; ++gi) {
          const uint16_t v = qmoe::float_to_bf16(uni(rng) * 0.05f);
          wscale[(e * N + n) * g + gi] = qmoe::bf16_to_float(v);
          const int64_t at = packed4 ? (e * (g / 4) + gi / 4) * 4 * N + 4 * n + gi % 4 : (e * g + gi) * N + n;
          s16[at] = v;
        }
    scales.resize(s16.size() * 2);
    std::memcpy(scales.data(), s16.data(), scales.size());
  } else {
    scales.assign(E * mt * 128 * kt * 4, c.format == W4Format::kNvfp4 ? 0x7F : 0xFF);  // NaN padding
    wscale.resize(E * N * kb);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < kb; ++j) {
          // MXFP4: 2^-9..2^4 (scales above 2^1 put a warp on the two-multiply decode), or on every other
          // seed 2^-17..2^1 (all <= 2^1: the one-multiply decode).
          const uint8_t code = c.format == W4Format::kNvfp4 ? static_cast<uint8_t>(0x08 + rng() % 0x60)   // 2^-6.. ~2^5
                               : seed % 2 ? static_cast<uint8_t>(118 + rng() % 14)
                                          : static_cast<uint8_t>(110 + rng() % 19);
          scales[swizzled_offset(e, n, j, mt, kt)] = code;
          wscale[(e * N + n) * kb + j] =
              c.format == W4Format::kNvfp4 ? qmoe::e4m3_to_float(code) : qmoe::ue8m0_to_float(code);
        }
  }
  std::vector<float> row_scales(R);
  for (auto& v : row_scales) v = 0.5f + 0.5f * std::fabs(uni(rng));

  // Host reference.
  std::vector<float> ref(total * N);
  std::vector<double> wrow(K);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* q = &b[(e * N + n) * K / 2];
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t nib = (k % 2 == 0) ? (q[k / 2] & 0xf) : (q[k / 2] >> 4);
        wrow[k] = int4 ? static_cast<double>(static_cast<int8_t>(nib << 4) >> 4)
                       : static_cast<double>(qmoe::e2m1_to_float(nib)) * wscale[(e * N + n) * kb + k / block];
      }
      for (int r = 0; r < c.rows[e]; ++r) {
        const int64_t row = offsets[e] + r;
        const uint16_t* x = &a[row * K];
        float acc = 0.f;
        if (int4) {
          for (int64_t g = 0; g < K / 128; ++g) {
            double s = 0;
            for (int64_t k = g * 128; k < g * 128 + 128; ++k) s += qmoe::bf16_to_float(x[k]) * wrow[k];
            acc = std::fma(wscale[(e * N + n) * (K / 128) + g], static_cast<float>(s), acc);
          }
        } else {
          double s = 0;
          for (int64_t k = 0; k < K; ++k) s += qmoe::bf16_to_float(x[k]) * wrow[k];
          acc = static_cast<float>(s);
        }
        float v = row_scales[row] * acc;
        if (!c.fp32_out) v = qmoe::round_bf16(v);
        ref[row * N + n] = v;
      }
    }

  const int64_t out_bytes = R * N * (c.fp32_out ? 4 : 2);
  void* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, out_bytes));
  CHECK_CUDA(cudaMemset(d, 0xFF, out_bytes));  // NaN in both output types
  uint16_t* da = upload(a);
  uint8_t* db = upload(c.packed ? packed_words(b) : b);
  uint8_t* ds = upload(scales);
  float* drs = upload(row_scales);
  int32_t* doff = upload(offsets);
  int32_t* dsz = upload(sizes);
  qmoe::cuda::Bf16W4GemmArgs args;
  args.a = da;
  args.b = db;
  args.b_scales = ds;
  args.format = c.format;
  args.b_packed = c.packed;
  args.row_scales = drs;
  args.d = d;
  args.d_fp32 = c.fp32_out;
  args.expert_offsets = doff;
  args.problem_sizes = dsz;
  args.num_experts = static_cast<int>(E);
  args.n = static_cast<int>(N);
  args.k = static_cast<int>(K);
  args.max_rows = R;
  std::string error;
  try {
    qmoe::cuda::bf16_w4_moe_mm(args, tactic, nullptr);
    CHECK_CUDA(cudaDeviceSynchronize());
  } catch (const std::exception& ex) {
    error = ex.what();
  }
  std::vector<uint8_t> out(out_bytes);
  CHECK_CUDA(cudaMemcpy(out.data(), d, out_bytes, cudaMemcpyDeviceToHost));
  auto at = [&](int64_t i) {
    if (c.fp32_out) {
      float f;
      std::memcpy(&f, &out[4 * i], 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, &out[2 * i], 2);
    return qmoe::bf16_to_float(h);
  };
  double num = 0, den = 0;
  int64_t nan_in = 0, written_after = 0;
  for (int64_t i = 0; i < total * N; ++i) {
    const float g = at(i);
    if (std::isnan(g)) ++nan_in;
    num += (double(g) - ref[i]) * (double(g) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  for (int64_t i = total * N; i < R * N; ++i) written_after += !std::isnan(at(i));
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  const double tol = c.fp32_out ? 1e-5 : 4e-3;
  const bool ok = error.empty() && nan_in == 0 && written_after == 0 && (total == 0 || rel <= tol);
  failures += ok ? 0 : 1;
  std::printf("%s %-6s N%-5lld K%-5lld E%-4lld rows%-6lld %s %-22s rel_rms %.2e nan %lld written_after %lld %s\n",
              ok ? "ok  " : "FAIL", format_name(c.format, c.packed), (long long)N, (long long)K, (long long)E, (long long)total,
              c.fp32_out ? "f32 " : "bf16", tactic.name().c_str(), rel, (long long)nan_in, (long long)written_after,
              error.c_str());
  for (void* p : std::initializer_list<void*>{d, da, db, ds, drs, doff, dsz}) CHECK_CUDA(cudaFree(p));
}

// The WGMMA (prefill) tiles have no fused-finalize scatter: asked for one, the op raises an error that names
// `scatter` before anything is launched (d keeps its poison). The pipeline never asks (decode tiles only).
void check_prefill_tiles_refuse_scatter() {
  const int N = 128, K = 128;
  std::vector<uint8_t> zeros(N * K, 0);
  std::vector<int32_t> offsets = {0}, sizes = {N, 1, K}, slot = {0};
  std::vector<float> weights = {1.f};
  uint8_t* da = upload(zeros);
  uint8_t* db = upload(zeros);
  uint8_t* ds = upload(zeros);
  int32_t* doff = upload(offsets);
  int32_t* dsz = upload(sizes);
  int32_t* dslot = upload(slot);
  float* dw = upload(weights);
  void *d = nullptr, *out = nullptr;
  CHECK_CUDA(cudaMalloc(&d, N * 2));
  CHECK_CUDA(cudaMalloc(&out, N * 2));
  CHECK_CUDA(cudaMemset(d, 0xFF, N * 2));
  qmoe::GemmProblem any;
  any.n = N, any.k = K, any.num_experts = 1, any.bf16_activations = true;
  for (const qmoe::Tactic& t : qmoe::valid_tactics(any)) {
    if (t.family != qmoe::Tactic::Family::kPrefill) continue;
    qmoe::cuda::Bf16W4GemmArgs args;
    args.a = da, args.b = db, args.b_scales = ds, args.format = W4Format::kNvfp4, args.d = d;
    args.expert_offsets = doff, args.problem_sizes = dsz, args.num_experts = 1, args.n = N, args.k = K;
    args.max_rows = 1;
    args.scatter.out = out, args.scatter.row_slot = dslot, args.scatter.topk_weights = dw, args.scatter.cols = N;
    std::string error;
    try {
      qmoe::cuda::bf16_w4_moe_mm(args, t, nullptr);
    } catch (const std::exception& ex) {
      error = ex.what();
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> got(N);
    CHECK_CUDA(cudaMemcpy(got.data(), d, N * 2, cudaMemcpyDeviceToHost));
    const bool untouched = std::all_of(got.begin(), got.end(), [](uint16_t v) { return v == 0xFFFF; });
    const bool ok = error.find("scatter") != std::string::npos && untouched;
    failures += ok ? 0 : 1;
    std::printf("%s scatter refused by %-22s %s\n", ok ? "ok  " : "FAIL", t.name().c_str(),
                error.empty() ? "(no error)" : "");
  }
  for (void* p : std::initializer_list<void*>{da, db, ds, doff, dsz, dslot, dw, d, out}) CHECK_CUDA(cudaFree(p));
}

__global__ void fill_random(uint8_t* p, int64_t n, uint32_t seed, uint8_t lo, uint8_t span) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = span == 0 ? static_cast<uint8_t>(h) : static_cast<uint8_t>(lo + h % span);
  }
}

int64_t bench_max_t = 4096;  // --bench [max T]

void bench(W4Format format, bool packed, const std::string& name, const BenchShape& shape,
           const std::vector<int>& tokens) {
  const int64_t E = shape.e, topk = shape.topk, N = shape.n, K = shape.k;
  const bool int4 = format == W4Format::kInt4G128;
  const int64_t block = format == W4Format::kNvfp4 ? 16 : 32;
  const int64_t w_bytes = E * N * K / 2;
  const int64_t s_bytes = int4 ? E * N * (K / 128) * 2 : E * ((N + 127) / 128 * 128) * ((K / block + 3) / 4 * 4);
  uint8_t *db, *ds, *da, *dd;
  float* drs;
  CHECK_CUDA(cudaMalloc(&db, w_bytes));
  CHECK_CUDA(cudaMalloc(&ds, s_bytes));
  fill_random<<<1024, 256>>>(db, w_bytes, 1, 0, 0);
  if (int4) {
    fill_random<<<1024, 256>>>(ds, s_bytes, 2, 0, 0);  // bf16 bytes; NaN-free enough for timing
  } else {
    fill_random<<<1024, 256>>>(ds, s_bytes, 2, format == W4Format::kNvfp4 ? 0x20 : 112, 16);  // MX: 2^-15..2^0
  }
  const int64_t max_t = tokens.empty() ? 0 : *std::max_element(tokens.begin(), tokens.end());
  const int64_t max_rows = std::max<int64_t>(max_t, 1) * topk;
  CHECK_CUDA(cudaMalloc(&da, max_rows * K * 2));
  CHECK_CUDA(cudaMalloc(&dd, max_rows * N * 4));
  CHECK_CUDA(cudaMalloc(&drs, max_rows * 4));
  fill_random<<<1024, 256>>>(da, max_rows * K * 2, 3, 0x30, 32);  // bf16 high bytes in a sane range
  CHECK_CUDA(cudaMemset(drs, 0, max_rows * 4));
  int32_t *doff, *dsz;
  CHECK_CUDA(cudaMalloc(&doff, 8 * E * 4));
  CHECK_CUDA(cudaMalloc(&dsz, 8 * E * 12));
  for (const int64_t T : tokens) {
    if (T > bench_max_t) continue;
    std::mt19937 rng(7);
    int64_t experts_hit = 0;
    for (int rot = 0; rot < 8; ++rot) {
      std::vector<int32_t> cnt(E, 0);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int> ids(E);
        for (int64_t e = 0; e < E; ++e) ids[e] = static_cast<int>(e);
        for (int64_t j = 0; j < topk; ++j) std::swap(ids[j], ids[j + rng() % (E - j)]), ++cnt[ids[j]];
      }
      std::vector<int32_t> off(E), sz(3 * E);
      int64_t run = 0;
      for (int64_t e = 0; e < E; ++e) {
        off[e] = run;
        sz[3 * e] = N, sz[3 * e + 1] = cnt[e], sz[3 * e + 2] = K;
        run += cnt[e];
        experts_hit += cnt[e] > 0;
      }
      CHECK_CUDA(cudaMemcpy(doff + rot * E, off.data(), E * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(dsz + rot * 3 * E, sz.data(), E * 12, cudaMemcpyHostToDevice));
    }
    const double bytes = double(experts_hit) / 8 * (N * K / 2 + double(s_bytes) / E) + double(T * topk) * K * 2;
    qmoe::GemmProblem prob;
    prob.n = N, prob.k = K, prob.total_rows = T * topk, prob.num_experts = E, prob.bf16_activations = true;
    const qmoe::Tactic chosen = qmoe::select_tactic(prob);
    for (const qmoe::Tactic& tac : qmoe::valid_tactics(prob)) {
      qmoe::cuda::Bf16W4GemmArgs args;
      args.a = da, args.b = db, args.b_scales = ds, args.format = format, args.row_scales = drs, args.d = dd;
      args.b_packed = packed;  // (random bytes: timing only)
      args.d_fp32 = false, args.num_experts = int(E), args.n = int(N), args.k = int(K), args.max_rows = T * topk;
      std::vector<float> times;
      cudaEvent_t e0, e1;
      CHECK_CUDA(cudaEventCreate(&e0));
      CHECK_CUDA(cudaEventCreate(&e1));
      for (int it = 0; it < 24; ++it) {
        args.expert_offsets = doff + (it % 8) * E;
        args.problem_sizes = dsz + (it % 8) * 3 * E;
        CHECK_CUDA(cudaEventRecord(e0));
        qmoe::cuda::bf16_w4_moe_mm(args, tac, nullptr);
        CHECK_CUDA(cudaEventRecord(e1));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 4) times.push_back(ms * 1000.f);
      }
      std::sort(times.begin(), times.end());
      const double us = times[times.size() / 2];
      const double flops = 2.0 * T * topk * N * K;
      std::printf("| %-6s | %-5s | %5lld | %-22s%s | %9.1f | %6.2f | %7.1f |\n", format_name(format, packed), name.c_str(), (long long)T,
                  tac.name().c_str(), tac == chosen ? "*" : " ", us, bytes / us * 1e-6, flops / us * 1e-6);
    }
  }
  for (void* p : std::initializer_list<void*>{db, ds, da, dd, drs, doff, dsz}) CHECK_CUDA(cudaFree(p));
}

}  // namespace

int main(int argc, char** argv) {
  const bool do_bench = argc > 1 && std::string(argv[1]).rfind("--bench", 0) == 0;
  const bool bench_only = argc > 1 && std::string(argv[1]) == "--bench-only";
  if (argc > 2) bench_max_t = std::atoll(argv[2]);
  std::vector<Case> cases;
  for (W4Format f : {W4Format::kNvfp4, W4Format::kMxfp4, W4Format::kInt4G128}) {
    const bool fp4 = f != W4Format::kInt4G128;
    cases.push_back({f, 256, 512, {0, 1, 3, 17, 64, 130, 0, 2}, true});
    cases.push_back({f, 200, fp4 ? 2880 : 1024, {5, 0, 33, 1}, true});
    cases.push_back({f, 136, fp4 ? 96 : 384, {9, 70, 0, 1}, true});
    cases.push_back({f, 264, fp4 ? 224 : 640, {1, 2, 40}, false});
    cases.push_back({f, 128, 256, std::vector<int>(1024, 0), true});
    cases.back().rows[1023] = 3;
    cases.back().rows[0] = 2;
    if (fp4)  // packed weights: the ragged, the K = 2880 and the bf16-out cases again
      for (int i : {0, 1, 3}) {
        Case p = cases[cases.size() - 5 + i];
        p.packed = true;
        cases.push_back(p);
      }
  }
  qmoe::GemmProblem any;
  any.n = 8, any.k = 128, any.num_experts = 1, any.bf16_activations = true;
  uint32_t seed = 1;
  for (const Case& c : cases)
    for (const qmoe::Tactic& t : qmoe::valid_tactics(any))
      if (!bench_only) run_case(c, t, seed++);
  if (!bench_only) check_prefill_tiles_refuse_scatter();
  std::printf("\ncorrectness: %s (%d failures)\n", failures == 0 ? "PASS" : "FAIL", failures);
  if (do_bench) {
    std::printf("\n| format | gemm  | T     | tactic (* = heuristic)  | us        | TB/s   | TFLOP/s |\n"
                "|---|---|---|---|---|---|---|\n");
    for (W4Format f : {W4Format::kNvfp4, W4Format::kMxfp4, W4Format::kInt4G128}) {
      if (bench_only && f == W4Format::kMxfp4 && std::getenv("QMOE_BENCH_MX") == nullptr) continue;
      const std::vector<BenchShape> shapes = bench_shapes({{256, 8, 4096, 7168}, {256, 8, 7168, 2048}});
      const std::vector<int> tokens = bench_tokens({1, 8, 64, 512, 4096});
      for (bool packed : {false, true}) {
        if (packed && f == W4Format::kInt4G128) continue;
        for (size_t i = 0; i < shapes.size(); ++i) bench(f, packed, "gemm" + std::to_string(i + 1), shapes[i], tokens);
      }
    }
  }
  return failures == 0 ? 0 : 1;
}
