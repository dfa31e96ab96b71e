// Small host helpers of the CUDA build: kernels_built() (true: this translation unit only exists
// in builds with QMOE_WITH_CUDA_KERNELS=ON) and check_cuda, which turns a CUDA error code into a
// qmoe::Error of kind kRuntime naming the failed operation and CUDA's message.
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/launch.h"
#include "qmoe/error.h"

namespace qmoe::cuda {

bool kernels_built() { return true; }

void check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  // Clear a sticky-free launch error so the next call does not report it again.
  (void)cudaGetLastError();
  throw Error(what, "a successful CUDA call", std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err),
              ErrorKind::kRuntime);
}

}  // namespace qmoe::cuda
