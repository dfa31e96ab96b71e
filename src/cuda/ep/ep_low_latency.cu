// The two kernels of the low-latency expert-parallel layer (src/api/expert_parallel_layer.cpp):
//   row index:  index[t*k + j] = d*C*k + t*k + j for slot (t, j) owned by rank d = id / (E / W), -1 for
//               an invalid id (outside [0, E)): where the combine delivers the slot's row;
//   broadcast:  a per-tensor a1 (a device float) into the a1 field of every payload row.
// Both elementwise, one thread per output; no host sync.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/launch.h"

namespace qmoe::cuda {

namespace {

__global__ void row_index_kernel(const int32_t* ids, int64_t slots, int64_t topk, int64_t num_experts,
                                 int64_t per_rank, int64_t capacity, int32_t* index) {
  const int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (s >= slots) return;
  const int64_t e = ids[s];
  const int64_t t = s / topk, j = s % topk;
  index[s] = e >= 0 && e < num_experts ? static_cast<int32_t>((e / per_rank) * capacity * topk + t * topk + j) : -1;
}

__global__ void broadcast_kernel(const float* value, uint8_t* rows, int64_t pitch, int64_t count) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r < count) *reinterpret_cast<float*>(rows + r * pitch) = *value;
}

}  // namespace

void ep_low_latency_row_index(const TensorRef& topk_ids, int64_t num_experts, int world_size, int64_t capacity,
                              TensorRef index, cudaStream_t stream) {
  const int64_t slots = topk_ids.numel();
  if (slots == 0) return;
  constexpr int kThreads = 256;
  row_index_kernel<<<static_cast<unsigned>((slots + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      topk_ids.ptr<const int32_t>(), slots, topk_ids.size(1), num_experts, num_experts / world_size, capacity,
      index.ptr<int32_t>());
  check_cuda(cudaGetLastError(), "launch of the expert-parallel row index");
}

void ep_broadcast_f32_rows(const float* value, void* rows, int64_t pitch, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  constexpr int kThreads = 256;
  broadcast_kernel<<<static_cast<unsigned>((count + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      value, static_cast<uint8_t*>(rows), pitch, count);
  check_cuda(cudaGetLastError(), "launch of the expert-parallel a1 broadcast");
}

}  // namespace qmoe::cuda
