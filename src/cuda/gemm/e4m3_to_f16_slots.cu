// e4m3 activations -> fp16 K slots (e4m3_to_f16_slots.h): one thread per 16 input bytes (two 8-K blocks).
#include "cuda/gemm/e4m3_to_f16_slots.h"

#include <cuda_runtime.h>

#include "cuda/common/int4_to_f16.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/launch.h"

namespace qmoe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) e4m3_to_f16_slots_kernel(const uint4* a, uint4* out, int64_t words) {
  pdl_wait_then_release();
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < words; i += int64_t{gridDim.x} * kThreads) {
    const uint4 x = a[i];
    uint4 lo, hi;
    e4m3x8_to_f16_slots(x.x, x.y, lo.x, lo.y, lo.z, lo.w);
    e4m3x8_to_f16_slots(x.z, x.w, hi.x, hi.y, hi.z, hi.w);
    out[2 * i] = lo;
    out[2 * i + 1] = hi;
  }
}

}  // namespace

void e4m3_to_f16_slots(const uint8_t* a, uint8_t* out, int64_t rows, int64_t k, cudaStream_t stream) {
  const int64_t words = rows * k / 16;
  if (words == 0) return;
  const int64_t blocks = (words + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 4096 ? blocks : 4096);
  launch_kernel(e4m3_to_f16_slots_kernel, grid, kThreads, 0, stream, reinterpret_cast<const uint4*>(a),
                reinterpret_cast<uint4*>(out), words);
  check_cuda(cudaGetLastError(), "launch of e4m3_to_f16_slots");
}

}  // namespace qmoe::cuda
