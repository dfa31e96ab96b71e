// e4m3 activations -> fp16 K slots and bias sums (e4m3_to_f16_slots.h). One warp per 8 rows and K group: lane
// (gid, tig) converts row 8 w + gid, K [32 tig, 32 tig + 32) of the group, as a decode tile's lane does, and runs the
// tile's bias chain on it; the chain's row 0 (all rows alike) holds the sums of rows 2 tig and 2 tig + 1.
#include "cuda/gemm/e4m3_to_f16_slots.h"

#include <cuda_runtime.h>

#include "cuda/common/int4_to_f16.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/launch.h"

namespace qmoe::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kGroup = 128;

__global__ void __launch_bounds__(kWarps * 32) e4m3_to_f16_slots_kernel(const uint8_t* a, uint8_t* out, int64_t rows,
                                                                        int k) {
  pdl_wait_then_release();
  const int groups = k / kGroup;
  const int64_t pitch = f16_slots_row_bytes(k);
  const int64_t warp = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32;
  const int64_t block = warp / groups;  // 8 rows
  const int g = static_cast<int>(warp % groups);
  if (block * 8 >= rows) return;  // (whole warps: the MMAs below need all 32 lanes)
  const int lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
  const int64_t row = block * 8 + gid;
  const bool valid = row < rows;
  uint4 x[2] = {};
  if (valid) {
    const uint4* src = reinterpret_cast<const uint4*>(a + row * k + g * kGroup + 32 * tig);
    x[0] = src[0];
    x[1] = src[1];
  }
  float bias[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint4& w = x[j / 2];
    uint4 slots;
    e4m3x8_to_f16_slots(j % 2 == 0 ? w.x : w.z, j % 2 == 0 ? w.y : w.w, slots.x, slots.y, slots.z, slots.w);
    bias_mma_step(bias, slots.x, slots.y, slots.z, slots.w);
    if (valid) *reinterpret_cast<uint4*>(out + row * pitch + (g * 16 + tig * 4 + j) * 16) = slots;
  }
  if (gid == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = block * 8 + 2 * tig + h;
      if (r < rows) *reinterpret_cast<float*>(out + r * pitch + 2 * int64_t{k} + 4 * g) = bias[h];
    }
  }
}

}  // namespace

void e4m3_to_f16_slots(const uint8_t* a, uint8_t* out, int64_t rows, int64_t k, cudaStream_t stream) {
  const int64_t warps = (rows + 7) / 8 * (k / kGroup);
  if (warps == 0) return;
  launch_kernel(e4m3_to_f16_slots_kernel, static_cast<unsigned>((warps + kWarps - 1) / kWarps), kWarps * 32, 0, stream,
                a, out, rows, static_cast<int>(k));
  check_cuda(cudaGetLastError(), "launch of e4m3_to_f16_slots");
}

}  // namespace qmoe::cuda
