// The kernels of the expert-parallel layers (src/api/expert_parallel_layer.cpp):
//   row index:  index[t*k + j] = d*C*k + t*k + j for slot (t, j) owned by rank d = id / (E / W), -1 for
//               an invalid id (outside [0, E)): where the low-latency combine delivers the slot's row;
//   broadcast:  a per-tensor a1 (a device float) into the a1 field of every payload row;
//   gather:     dst row i = src row index[i] (the throughput mode's send and return orders);
//   sum:        the reduced combine (deterministic = false): output[t] = sum_d partial_d[t] in rank order.
// All elementwise; no host sync.
#include <cuda_runtime_api.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <type_traits>

#include "cuda/common/store_out.cuh"
#include "cuda/launch.h"

namespace qmoe::cuda {

namespace {

__global__ void row_index_kernel(const int32_t* ids, int64_t slots, int64_t topk, int64_t num_experts, int64_t per_rank,
                                 int64_t capacity, int32_t* index) {
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

// One thread per (row, word) with words of W bytes (16, 4 or 1, the widest that divides every offset).
template <class Word>
__global__ void gather_kernel(uint8_t* dst, int64_t dst_pitch, const uint8_t* src, int64_t src_pitch,
                              const int32_t* index, int64_t count, int64_t words) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count * words) return;
  const int64_t row = i / words, w = i % words;
  const Word* from = reinterpret_cast<const Word*>(src + static_cast<int64_t>(index[row]) * src_pitch);
  reinterpret_cast<Word*>(dst + row * dst_pitch)[w] = from[w];
}

__device__ inline float to_f32(float v) { return v; }
__device__ inline float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_f32(__half v) { return __half2float(v); }

// One thread per (token, VEC consecutive features); a token no rank returned a row for is zero.
template <class T, int VEC>
__global__ void sum_partials_kernel(const T* partials, const int32_t* index, int64_t world, int64_t capacity,
                                    int64_t tokens, int64_t hidden, T* out) {
  const int64_t groups = hidden / VEC;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * groups) return;
  const int64_t t = i / groups, c = (i % groups) * VEC;
  float acc[VEC] = {};
  for (int64_t d = 0; d < world; ++d) {
    const int64_t row = index != nullptr ? index[d * tokens + t] : d * capacity + t;
    if (row < 0) continue;
    const T* src = partials + row * hidden + c;
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] += to_f32(src[v]);
  }
#pragma unroll
  for (int v = 0; v < VEC; ++v) store_out(out + t * hidden + c + v, acc[v]);
}

}  // namespace

void ep_sum_partials(const void* partials, const int32_t* index, int64_t world, int64_t capacity, TensorRef output,
                     cudaStream_t stream) {
  const int64_t tokens = output.size(0), hidden = output.size(1);
  if (tokens == 0 || hidden == 0) return;
  constexpr int kThreads = 256;
  auto launch = [&](auto zero, auto vec) {
    using T = decltype(zero);
    constexpr int kVec = decltype(vec)::value;
    const int64_t threads = tokens * (hidden / kVec);
    sum_partials_kernel<T, kVec><<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(partials), index, world, capacity, tokens, hidden, output.ptr<T>());
  };
  using V4 = std::integral_constant<int, 4>;
  using V1 = std::integral_constant<int, 1>;
  const bool by4 = hidden % 4 == 0;  // 4 features per thread: 8-16 byte accesses, rows stay aligned
  switch (output.dtype) {
    case DType::kBFloat16: by4 ? launch(__nv_bfloat16{}, V4{}) : launch(__nv_bfloat16{}, V1{}); break;
    case DType::kFloat16: by4 ? launch(__half{}, V4{}) : launch(__half{}, V1{}); break;
    default: by4 ? launch(float{}, V4{}) : launch(float{}, V1{}); break;
  }
  check_cuda(cudaGetLastError(), "launch of the expert-parallel partial sum");
}

void ep_gather_rows(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch, const int32_t* index,
                    int64_t count, int64_t width, cudaStream_t stream) {
  if (count <= 0 || width <= 0) return;
  constexpr int kThreads = 256;
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         static_cast<uintptr_t>(dst_pitch) | static_cast<uintptr_t>(src_pitch) |
                         static_cast<uintptr_t>(width);
  auto launch = [&](auto word) {
    using Word = decltype(word);
    const int64_t words = width / static_cast<int64_t>(sizeof(Word));
    const int64_t threads = count * words;
    gather_kernel<Word><<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        static_cast<uint8_t*>(dst), dst_pitch, static_cast<const uint8_t*>(src), src_pitch, index, count, words);
  };
  if (bits % 16 == 0)
    launch(uint4{});
  else if (bits % 4 == 0)
    launch(uint32_t{});
  else
    launch(uint8_t{});
  check_cuda(cudaGetLastError(), "launch of the expert-parallel row gather");
}

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
