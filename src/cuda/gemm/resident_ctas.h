// CTAs of one kernel configuration that fit on a device at once (SMs x occupancy): the size of a
// persistent grid, on at most sm_limit() SMs when this thread set a limit (include/qmoe/sm_limit.h).
// SM count and occupancy are queried once per (kernel, device) and cached: cheap host calls that are
// legal while a stream is being captured. The cache is atomic because two host threads may launch the
// same configuration for the first time at once (both compute the same value).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "cuda/common/pdl.cuh"  // launch_kernel
#include "cuda/launch.h"  // check_cuda
#include "qmoe/error.h"
#include "qmoe/sm_limit.h"

namespace qmoe::cuda {

// kKernel: the kernel (a __global__ function). Also raises its dynamic shared memory limit to smem_bytes.
template <auto kKernel>
int resident_ctas(int threads, int smem_bytes, int device, const char* what) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache_sms[kMaxDevices] = {}, cache_per_sm[kMaxDevices] = {};
  QMOE_CHECK_ARG(device >= 0 && device < kMaxDevices, "device", "a CUDA device index below 64", std::to_string(device));
  int sms = cache_sms[device].load(std::memory_order_acquire);
  int per_sm = cache_per_sm[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    check_cuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes), what);
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, smem_bytes), what);
    per_sm = per_sm > 0 ? per_sm : 1;
    cache_per_sm[device].store(per_sm, std::memory_order_relaxed);
    cache_sms[device].store(sms, std::memory_order_release);  // last: a reader that sees it sees per_sm too
  }
  const int limit = sm_limit();
  return per_sm * (limit > 0 && limit < sms ? limit : sms);
}

// A persistent grid of kKernel on this thread's current device: as many CTAs as fit at once.
// what: the kernel in words, for the errors.
template <auto kKernel, class Params>
void launch_persistent(int threads, int smem_bytes, cudaStream_t stream, const Params& params, const char* what) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const int fit = resident_ctas<kKernel>(threads, smem_bytes, device, what);
  launch_kernel(kKernel, dim3(fit), dim3(threads), smem_bytes, stream, params);
  check_cuda(cudaGetLastError(), what);
}

// SMs a persistent grid may use on a device: its SM count (queried once, cached), capped by this
// thread's sm_limit().
inline int usable_sms(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  QMOE_CHECK_ARG(device >= 0 && device < kMaxDevices, "device", "a CUDA device index below 64", std::to_string(device));
  int sms = cache[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    cache[device].store(sms, std::memory_order_relaxed);
  }
  const int limit = sm_limit();
  return limit > 0 && limit < sms ? limit : sms;
}

// The n8 decode tiles (128 weight rows x 8 tokens) come in two pipeline shapes with the same
// arithmetic (same bits): 4 stages x 2 CTAs per SM (more copies in flight per CTA) and 3 stages x 3
// CTAs per SM (more CTAs in flight per SM). Measured on H200 (bench/results/2026-11-30_s4d_* and
// 2026-11-30_s5a_*): the 3-CTA shape is 5-12% faster at T = 8-64 and up to 28% slower at T = 1, where
// the grid is small. Rule: the 3-CTA shape when the tile bound covers two waves of it (6 x SMs). The
// bound: every token-tile of 8 rows, plus one partial tile for every expert hit.
inline int64_t n8_tile_bound(int64_t rows, int64_t num_experts, int64_t n) {
  const int64_t hit = rows < num_experts ? rows : num_experts;
  return (rows / 8 + hit) * ((n + 127) / 128);
}
inline bool n8_tiles_fill_three_per_sm(int64_t rows, int64_t num_experts, int64_t n, int device) {
  return n8_tile_bound(rows, num_experts, n) >= 6 * static_cast<int64_t>(usable_sms(device));
}

}  // namespace qmoe::cuda
