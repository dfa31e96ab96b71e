// DeviceGuard: makes a tensor's device current for the launches of one call and restores the
// caller's device afterwards (the launchers take tensors on any GPU of the process).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/launch.h"  // check_cuda

namespace qmoe::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace qmoe::cuda
