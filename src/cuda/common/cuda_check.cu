// Small host helpers of the CUDA build: kernels_built() (true: this translation unit only exists
// in builds with QMOE_WITH_CUDA_KERNELS=ON) and check_cuda, which turns a CUDA error code into a
// qmoe::Error of kind kRuntime naming the failed operation and CUDA's message.
// Test hook: QMOE_TEST_FAIL_LAUNCH=<n> (n >= 1) in the environment at the first check makes every
// n-th check_cuda call of the process (n, 2n, ...) throw as if its CUDA call had failed, so the
// tests (tests/python/test_gpu_reliability_runtime.py) can fail any stage of any op. Unset: off.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda/launch.h"
#include "qmoe/error.h"

namespace qmoe::cuda {

bool kernels_built() { return true; }

namespace {

int64_t injection_period() {
  static const int64_t period = [] {
    const char* v = std::getenv("QMOE_TEST_FAIL_LAUNCH");
    return v != nullptr ? std::max<int64_t>(0, std::atoll(v)) : int64_t{0};
  }();
  return period;
}
std::atomic<int64_t> checks_seen{0};

}  // namespace

void check_cuda(cudaError_t err, const char* what) {
  const int64_t period = injection_period();
  if (period > 0 && (checks_seen.fetch_add(1, std::memory_order_relaxed) + 1) % period == 0 && err == cudaSuccess) {
    throw Error(what, "a successful CUDA call", "an error injected by QMOE_TEST_FAIL_LAUNCH (test hook)",
                ErrorKind::kRuntime);
  }
  if (err == cudaSuccess) return;
  // Clear a sticky-free launch error so the next call does not report it again.
  (void)cudaGetLastError();
  throw Error(what, "a successful CUDA call", std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err),
              ErrorKind::kRuntime);
}

}  // namespace qmoe::cuda
