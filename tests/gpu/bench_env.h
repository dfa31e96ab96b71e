// The GEMM check programs' benchmark options from the environment (tests/gpu/*_gemm_check.cu --bench):
//   QMOE_BENCH_SHAPES="E:topk:N:K,..."  the model GEMM shapes to time (default: the program's own)
//   QMOE_BENCH_T="t1,t2,..."            token counts (default: the program's own list)
// Used by the tactic sweeps (scripts/device_tactic_sweep.sh) and the kernel A/B runs.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

struct BenchShape {
  int64_t e, topk, n, k;
};

inline std::vector<BenchShape> bench_shapes(std::vector<BenchShape> defaults) {
  const char* env = std::getenv("QMOE_BENCH_SHAPES");
  if (env == nullptr) return defaults;
  std::vector<BenchShape> out;
  const std::string s(env);
  for (size_t pos = 0; pos < s.size();) {
    const size_t end = s.find(',', pos) == std::string::npos ? s.size() : s.find(',', pos);
    BenchShape x{};
    if (std::sscanf(s.substr(pos, end - pos).c_str(), "%ld:%ld:%ld:%ld", &x.e, &x.topk, &x.n, &x.k) == 4) out.push_back(x);
    pos = end + 1;
  }
  return out;
}

inline std::vector<int> bench_tokens(std::vector<int> defaults) {
  const char* env = std::getenv("QMOE_BENCH_T");
  if (env == nullptr) return defaults;
  std::vector<int> out;
  for (const char* p = env; *p;) {
    char* end = nullptr;
    const long v = std::strtol(p, &end, 10);
    if (end == p) break;
    if (v > 0) out.push_back(static_cast<int>(v));
    p = *end == ',' ? end + 1 : end;
  }
  return out;
}
