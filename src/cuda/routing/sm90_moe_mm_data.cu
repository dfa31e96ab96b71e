// moe_mm_data on the GPU: SGLang's get_cutlass_w4a8_moe_mm_data with both permutations filled
// (contract and worked example: include/qmoe/routing.h; DESIGN.md 5.1).
//
// From S = numel(topk_ids) slots (int32 or int64 ids, slot s = t*k + j) and E experts:
//   cnt[e]                = #{s : ids[s] == e}, e in [0, E); ids outside [0, E) are dropped
//   expert_offsets[e]     = cnt[0] + ... + cnt[e-1]                        [E+1]
//   problem_sizes1[e]     = (2n, cnt[e], k),  problem_sizes2[e] = (k, cnt[e], n)
//   input_permutation[r]  = slot at row r of the expert-sorted matrix, stable by slot; -1 for r >= off[E]
//   output_permutation[s] = row of slot s (the inverse), -1 for a dropped slot
//
// Algorithm: ONE CTA of 1024 threads (32 warps), one launch, no workspace, cost O(S + E):
//   pass 1  warp w owns the contiguous slot range [w*R, (w+1)*R) and counts it into its private
//           shared histogram hist[w][*]. Lanes holding the same id find each other with
//           __match_any_sync; the lowest lane of each peer group adds the group size. Only warp w
//           touches row w, and the ids of distinct groups differ, so no atomics are needed.
//   scan    thread e sums column e (over warps), a block scan gives off[e]; thread e then turns
//           hist[w][e] into the first row of (warp w, expert e): off[e] + sum_{w' < w} hist[w'][e].
//           This (expert-major, warp-minor) order is what makes the placement stable by slot.
//   pass 2  each warp re-walks its range in the same order; a slot's row is
//           base[w][id] + (number of lower lanes of its peer group); the group leader then
//           advances base[w][id] by the group size.
//   fill    input_permutation[r] = -1 for r in [off[E], S).
// Shared memory: 32 * E int32 (128 KB at E = 1024; the opt-in limit is raised on launch).
// Limits: 1 <= E <= 1024 (one scan thread per expert), S < 2^31. Measured cost on an H200 is in
// the file's test notes (tests/python/test_gpu_w4a8.py::test_routing_timing prints it); one CTA
// is chosen because S <= 256K slots reads at most 2 MB and a multi-CTA version would need a
// global workspace the SGLang signature does not provide.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/launch.h"
#include "qmoe/routing.h"

namespace qmoe::cuda {

namespace {

constexpr int kWarps = 32;
constexpr int kThreads = kWarps * 32;  // one thread per expert in the scan: E <= 1024
// Slots a lane loads ahead of processing: independent loads in flight hide the memory latency
// that a single CTA would otherwise pay once per 32 slots.
constexpr int kUnroll = 8;
static_assert(kThreads >= kMaxExperts, "the scan gives each expert one thread");

// Expert id of slot s, or E (the "dropped" key) for ids outside [0, E) and slots past the end.
template <class Id>
__device__ __forceinline__ int load_key(const Id* __restrict__ ids, int64_t s, int64_t end, int experts) {
  if (s >= end) return experts;
  const Id id = ids[s];
  return (id >= 0 && static_cast<int64_t>(id) < experts) ? static_cast<int>(id) : experts;
}

// Inclusive block scan of one int per thread (1024 threads). Uses warp_sums[32].
__device__ __forceinline__ int block_inclusive_scan(int value, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, value, d);
    if (lane >= d) value += other;
  }
  if (lane == 31) warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    int total = warp_sums[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, total, d);
      if (lane >= d) total += other;
    }
    warp_sums[lane] = total;  // inclusive over warps
  }
  __syncthreads();
  return value + (warp > 0 ? warp_sums[warp - 1] : 0);
}

template <class Id>
__global__ void __launch_bounds__(kThreads, 1)
    moe_mm_data_kernel(const Id* __restrict__ ids, int64_t slots, int experts, int n, int k,
                       int32_t* __restrict__ offsets, int32_t* __restrict__ sizes1, int32_t* __restrict__ sizes2,
                       int32_t* __restrict__ input_perm, int32_t* __restrict__ output_perm) {
  extern __shared__ int hist[];  // [kWarps][experts]: counts after pass 1, running bases in pass 2
  __shared__ int warp_sums[kWarps];
  __shared__ int total_rows;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int i = threadIdx.x; i < kWarps * experts; i += kThreads) hist[i] = 0;
  __syncthreads();

  // Warp ranges are multiples of 32 slots so every warp load is one aligned-ish 128-byte line.
  const int64_t range = ((slots + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int64_t begin = warp * range;
  const int64_t end = begin + range < slots ? begin + range : slots;
  int* my_hist = hist + warp * experts;

  // Pass 1: per-warp histogram.
  for (int64_t tile = begin; tile < end; tile += 32 * kUnroll) {
    int key[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) key[u] = load_key(ids, tile + u * 32 + lane, end, experts);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const unsigned peers = __match_any_sync(0xffffffffu, key[u]);
      if (key[u] < experts && (peers & lanes_below) == 0) my_hist[key[u]] += __popc(peers);
      __syncwarp();  // NOTE: the next sub-tile's leader may update the same counter
    }
  }
  __syncthreads();

  // Scan: counts per expert, offsets, problem sizes, and per-(warp, expert) bases.
  const int e = threadIdx.x;
  int count = 0;
  if (e < experts)
    for (int w = 0; w < kWarps; ++w) count += hist[w * experts + e];
  const int inclusive = block_inclusive_scan(count, warp_sums);
  if (e < experts) {
    const int exclusive = inclusive - count;
    offsets[e] = exclusive;
    if (e == experts - 1) {
      offsets[experts] = inclusive;
      total_rows = inclusive;
    }
    sizes1[3 * e + 0] = 2 * n;
    sizes1[3 * e + 1] = count;
    sizes1[3 * e + 2] = k;
    sizes2[3 * e + 0] = k;
    sizes2[3 * e + 1] = count;
    sizes2[3 * e + 2] = n;
    int running = exclusive;
    for (int w = 0; w < kWarps; ++w) {
      const int c = hist[w * experts + e];
      hist[w * experts + e] = running;
      running += c;
    }
  }
  __syncthreads();

  // Rows past the valid ones hold -1 (a different set of addresses from pass 2's rows).
  for (int64_t r = int64_t{total_rows} + threadIdx.x; r < slots; r += kThreads) input_perm[r] = -1;

  // Pass 2: same walk, same order; rank inside the peer group keeps slot order.
  for (int64_t tile = begin; tile < end; tile += 32 * kUnroll) {
    int key[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) key[u] = load_key(ids, tile + u * 32 + lane, end, experts);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t s = tile + u * 32 + lane;
      const unsigned peers = __match_any_sync(0xffffffffu, key[u]);
      if (key[u] < experts) {
        const int row = my_hist[key[u]] + __popc(peers & lanes_below);
        input_perm[row] = static_cast<int32_t>(s);
        output_perm[s] = row;
      } else if (s < end) {
        output_perm[s] = -1;
      }
      // NOTE: every lane reads the base before its leader advances it, and the next sub-tile
      // reads it after; the two __syncwarp()s order those shared-memory accesses.
      __syncwarp();
      if (key[u] < experts && (peers & lanes_below) == 0) my_hist[key[u]] += __popc(peers);
      __syncwarp();
    }
  }
}

// Makes `device` current for the launch and restores the caller's device afterwards.
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

template <class Id>
void launch(const TensorRef& topk_ids, int32_t* offsets, int32_t* sizes1, int32_t* sizes2, int32_t* input_perm,
            int32_t* output_perm, int experts, int n, int k, cudaStream_t stream) {
  const size_t smem = sizeof(int) * kWarps * static_cast<size_t>(experts);
  auto kernel = moe_mm_data_kernel<Id>;
  // Above 48 KB the kernel needs the opt-in limit. Setting it is a host-side attribute, legal
  // during stream capture.
  if (smem > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
               "cudaFuncSetAttribute(moe_mm_data)");
  kernel<<<1, kThreads, smem, stream>>>(topk_ids.ptr<const Id>(), topk_ids.numel(), experts, n, k, offsets, sizes1,
                                        sizes2, input_perm, output_perm);
  check_cuda(cudaGetLastError(), "moe_mm_data kernel launch");
}

}  // namespace

void moe_mm_data(const TensorRef& topk_ids, TensorRef expert_offsets, TensorRef problem_sizes1,
                 TensorRef problem_sizes2, TensorRef input_permutation, TensorRef output_permutation,
                 int64_t num_experts, int64_t n, int64_t k, cudaStream_t stream) {
  // The public entry validates; these guard the kernel's own limits in case of a new caller.
  check_arg(num_experts >= 1 && num_experts <= kMaxExperts, "num_experts", "a value in [1, 1024]",
            std::to_string(num_experts));
  check_arg(topk_ids.numel() < (int64_t{1} << 31), "topk_ids", "fewer than 2^31 slots",
            std::to_string(topk_ids.numel()));
  check_arg(n >= 0 && 2 * n <= INT32_MAX && k >= 0 && k <= INT32_MAX, "n, k", "values whose problem sizes fit int32",
            std::to_string(n) + ", " + std::to_string(k));
  DeviceGuard guard(topk_ids.device_index);
  int32_t* offsets = expert_offsets.ptr<int32_t>();
  int32_t* sizes1 = problem_sizes1.ptr<int32_t>();
  int32_t* sizes2 = problem_sizes2.ptr<int32_t>();
  int32_t* in_perm = input_permutation.ptr<int32_t>();
  int32_t* out_perm = output_permutation.ptr<int32_t>();
  const int e = static_cast<int>(num_experts), nn = static_cast<int>(n), kk = static_cast<int>(k);
  if (topk_ids.dtype == DType::kInt64)
    launch<int64_t>(topk_ids, offsets, sizes1, sizes2, in_perm, out_perm, e, nn, kk, stream);
  else
    launch<int32_t>(topk_ids, offsets, sizes1, sizes2, in_perm, out_perm, e, nn, kk, stream);
}

}  // namespace qmoe::cuda
