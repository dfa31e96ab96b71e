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
// Algorithm: one launch of C CTAs x 1024 threads (32 warps), no workspace, cost O(S + C*E):
//   pass 1  CTA c owns a contiguous slot range, warp w of it a contiguous part; each warp counts
//           its part into its private shared histogram hist[w][*]. Lanes holding the same id
//           find each other with __match_any_sync; the lowest lane of each peer group adds the
//           group size. Only warp w touches row w, and distinct groups have distinct ids, so no
//           atomics are needed.
//   C > 1   (S > 2048) CTA counts go to an exchange buffer, a grid barrier (cooperative launch,
//           all CTAs co-resident, C <= #SMs), each CTA sums the counts of all CTAs and of the
//           CTAs before it, a second barrier. One CTA (S <= 2048) skips this.
//   scan    thread e has cnt[e]; a block scan gives off[e]; thread e then turns hist[w][e] into
//           the first row of (CTA c, warp w, expert e): off[e] + (CTAs before c) + (warps before w).
//           This expert-major, then CTA, then warp order makes the placement stable by slot.
//   pass 2  each warp re-walks its part in the same order; a slot's row is
//           base[w][id] + (number of lower lanes of its peer group); the group leader then
//           advances base[w][id] by the group size.
//   fill    input_permutation[r] = -1 for r in [off[E], S) (grid-stride).
//   Parts are whole tiles of 256 slots (32 lanes x kUnroll keys loaded ahead), and only the warps that own
//   slots (used = ceil(CTA slots / part size)) keep a histogram: the zeroing, the per-expert count and the
//   base loops touch `used` rows, 1 at decode (8 slots) and 8 at 2048 slots per CTA (32 when parts were
//   64 slots: 1.1-1.7 us slower at 2K-256K slots, H200 s32c).
// Shared memory: 32 * E int32 per CTA (128 KB at E = 1024; the opt-in limit is raised on launch).
// The exchange buffer is output_permutation itself (C * E <= S is kept): the SGLang signature
// has no workspace argument, and output_permutation is fully rewritten after the last barrier.
// Limits: 1 <= E <= 1024 (one scan thread per expert), S < 2^31.
// Measured on an H200 (CUDA-graph replay, int32 ids; int64 within 0.5 us): E = 256: 4 us at 8
// slots, 8.3 us at 2048 (one CTA), 11.9 us at 32K, 12.3 us at 64K; E = 1024: 19 us at 256K (s32c).
// One CTA alone took 560 us at 256K slots (E = 256): hence the multi-CTA path.
// Overlap (one CTA, PDL on, `overlap_previous`): a caller whose previous kernel in the stream writes
// nothing this kernel reads or writes (the fused MoE at decode, where the gather before it finds its
// rows itself) lets it start at once and wait for that kernel only at its end, so that its completion
// still implies the previous kernel's (the next kernel's griddepcontrol.wait covers both).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "cuda/common/device_guard.h"
#include "cuda/launch.h"
#include "qmoe/routing.h"
#include "cuda/common/pdl.cuh"

namespace qmoe::cuda {

namespace {

constexpr int kWarps = 32;
constexpr int kThreads = kWarps * 32;  // one thread per expert in the scan: E <= 1024
// Slots a lane loads ahead of processing: independent loads in flight hide the memory latency
// that a single CTA would otherwise pay once per 32 slots.
constexpr int kUnroll = 8;
static_assert(kThreads >= kMaxExperts, "the scan gives each expert one thread");
// Up to this many slots one CTA does everything (no grid barrier; measured ~9 us at E = 256).
constexpr int64_t kSingleCtaSlots = 2048;
// Beyond it, slots per CTA: small enough that each warp walks only a few tiles, large enough
// that reading the [ctas][experts] exchange buffer stays cheap.
constexpr int64_t kSlotsPerCta = 2048;

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
    moe_mm_data_kernel(const Id* __restrict__ ids, int64_t slots, int64_t cta_range, int experts, int n, int k,
                       int32_t* __restrict__ offsets, int32_t* __restrict__ sizes1, int32_t* __restrict__ sizes2,
                       int32_t* __restrict__ input_perm, int32_t* __restrict__ output_perm, bool overlap_previous) {
  if (overlap_previous) pdl_release();  // waits at the end instead (header)
  else pdl_wait_then_release();  // first: see cuda/common/pdl.cuh
  extern __shared__ int hist[];  // [kWarps][experts]: counts after pass 1, running bases in pass 2
  __shared__ int warp_sums[kWarps];
  __shared__ int total_rows;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned lanes_below = (1u << lane) - 1u;
  const int ctas = static_cast<int>(gridDim.x), cta = static_cast<int>(blockIdx.x);

  // CTA c owns slots [c * cta_range, (c+1) * cta_range), warp w a contiguous 32-multiple part of it.
  const int64_t cta_begin = cta * cta_range;
  const int64_t cta_end = cta_begin + cta_range < slots ? cta_begin + cta_range : slots;
  const int64_t cta_slots = cta_end > cta_begin ? cta_end - cta_begin : 0;
  // Parts are whole tiles of 32 * kUnroll slots (a warp walks its part tile by tile), so that few warps own slots
  // (8 at 2048 slots per CTA) and the per-expert loops over their histograms below stay short (header).
  constexpr int64_t kTile = 32 * kUnroll;
  const int64_t range = ((cta_slots + kWarps - 1) / kWarps + kTile - 1) / kTile * kTile;
  const int64_t begin = cta_begin + warp * range;
  const int64_t end = begin + range < cta_end ? begin + range : cta_end;
  int* my_hist = hist + warp * experts;
  // Warps [0, used) own slots; the others' parts are empty, so their histograms are never zeroed,
  // summed or read (at decode, 8 slots: one warp instead of 32 -> 32x fewer shared-memory steps).
  const int used = range > 0 ? static_cast<int>((cta_slots + range - 1) / range) : 0;
  for (int i = threadIdx.x; i < used * experts; i += kThreads) hist[i] = 0;
  __syncthreads();

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

  // Counts of this CTA, then (multi-CTA) the counts of the CTAs before it and of all CTAs.
  const int e = threadIdx.x;
  int cta_count = 0;
  if (e < experts)
    for (int w = 0; w < used; ++w) cta_count += hist[w * experts + e];
  int before = 0, count = cta_count;
  if (ctas > 1) {
    // NOTE: output_permutation doubles as the [ctas][experts] exchange buffer (the launcher
    // guarantees ctas * experts <= slots). Every CTA reads all of it between the two grid
    // barriers, and pass 2 overwrites it only after the second one.
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    if (e < experts) output_perm[static_cast<int64_t>(cta) * experts + e] = cta_count;
    grid.sync();
    if (e < experts) {
      count = 0;
#pragma unroll 8
      for (int c = 0; c < ctas; ++c) {
        const int v = output_perm[static_cast<int64_t>(c) * experts + e];
        if (c < cta) before += v;
        count += v;
      }
    }
    grid.sync();
  }

  // Offsets over all CTAs (each CTA computes the same scan), problem sizes, per-(warp, expert) bases.
  const int inclusive = block_inclusive_scan(count, warp_sums);
  if (e < experts) {
    const int exclusive = inclusive - count;
    if (cta == 0) {
      offsets[e] = exclusive;
      if (e == experts - 1) offsets[experts] = inclusive;
      sizes1[3 * e + 0] = 2 * n;
      sizes1[3 * e + 1] = count;
      sizes1[3 * e + 2] = k;
      sizes2[3 * e + 0] = k;
      sizes2[3 * e + 1] = count;
      sizes2[3 * e + 2] = n;
    }
    if (e == experts - 1) total_rows = inclusive;
    int running = exclusive + before;
    for (int w = 0; w < used; ++w) {
      const int c = hist[w * experts + e];
      hist[w * experts + e] = running;
      running += c;
    }
  }
  __syncthreads();

  // Rows past the valid ones hold -1 (a different set of addresses from pass 2's rows).
  for (int64_t r = int64_t{total_rows} + static_cast<int64_t>(cta) * kThreads + threadIdx.x; r < slots;
       r += static_cast<int64_t>(ctas) * kThreads)
    input_perm[r] = -1;

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
  if (overlap_previous) pdl_wait();
}

// SM count of each device, cached: the launch path must stay cheap and capture-safe.
int sm_count(int device) {
  static std::atomic<int> cache[64];
  if (device >= 0 && device < 64) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int count = 0;
  check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  if (device >= 0 && device < 64) cache[device].store(count, std::memory_order_relaxed);
  return count;
}

// CTAs for `slots` slots: 1 up to kSingleCtaSlots; beyond, about kSlotsPerCta slots each, at most
// one per SM (all must be co-resident for the grid barrier), and ctas * experts <= slots (the
// exchange buffer lives in output_permutation).
int choose_ctas(int64_t slots, int experts, int device) {
  if (slots <= kSingleCtaSlots) return 1;
  int64_t ctas = (slots + kSlotsPerCta - 1) / kSlotsPerCta;
  ctas = std::min<int64_t>(ctas, sm_count(device));
  ctas = std::min<int64_t>(ctas, slots / experts);
  return static_cast<int>(std::max<int64_t>(ctas, 1));
}

template <class Id>
void launch(const TensorRef& topk_ids, int32_t* offsets, int32_t* sizes1, int32_t* sizes2, int32_t* input_perm,
            int32_t* output_perm, int experts, int n, int k, bool overlap_previous, cudaStream_t stream) {
  const size_t smem = sizeof(int) * kWarps * static_cast<size_t>(experts);
  auto kernel = moe_mm_data_kernel<Id>;
  // Static + dynamic shared memory above 48 KB needs the opt-in limit (the static part is ~150
  // bytes, so E = 384 already crosses it). Setting it is a host-side attribute, legal during
  // stream capture; the margin keeps small E on the default path.
  if (smem > 32 * 1024)
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
               "cudaFuncSetAttribute(moe_mm_data)");
  const int64_t slots = topk_ids.numel();
  const int ctas = choose_ctas(slots, experts, topk_ids.device_index);
  const int64_t cta_range = ctas == 1 ? slots : (slots + ctas - 1) / ctas;
  const Id* ids = topk_ids.ptr<const Id>();

  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  if (ctas > 1) {
    attribute[0].id = cudaLaunchAttributeCooperative;
    attribute[0].val.cooperative = 1;
  } else {
    // One CTA never reaches the grid barrier, so it launches as an ordinary kernel, and may be a
    // programmatic dependent launch inside a fused MoE with PDL on (cuda/common/pdl.cuh).
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
  }
  config.attrs = attribute;
  config.numAttrs = ctas > 1 || pdl_enabled() ? 1 : 0;
  // The grid barrier's CTAs launch cooperatively, never as dependents: they wait first.
  const bool overlap = overlap_previous && ctas == 1 && pdl_enabled();
  check_cuda(cudaLaunchKernelEx(&config, kernel, ids, slots, cta_range, experts, n, k, offsets, sizes1, sizes2,
                                input_perm, output_perm, overlap),
             "moe_mm_data kernel launch");
}

}  // namespace

void moe_mm_data(const TensorRef& topk_ids, TensorRef expert_offsets, TensorRef problem_sizes1,
                 TensorRef problem_sizes2, TensorRef input_permutation, TensorRef output_permutation,
                 int64_t num_experts, int64_t n, int64_t k, cudaStream_t stream, bool overlap_previous) {
  // The public entry validates; these guard the kernel's own limits in case of a new caller.
  QMOE_CHECK_ARG(num_experts >= 1 && num_experts <= kMaxExperts, "num_experts", "a value in [1, 1024]",
            std::to_string(num_experts));
  QMOE_CHECK_ARG(topk_ids.numel() < (int64_t{1} << 31), "topk_ids", "fewer than 2^31 slots",
            std::to_string(topk_ids.numel()));
  QMOE_CHECK_ARG(n >= 0 && 2 * n <= INT32_MAX && k >= 0 && k <= INT32_MAX, "n, k", "values whose problem sizes fit int32",
            std::to_string(n) + ", " + std::to_string(k));
  DeviceGuard guard(topk_ids.device_index);
  int32_t* offsets = expert_offsets.ptr<int32_t>();
  int32_t* sizes1 = problem_sizes1.ptr<int32_t>();
  int32_t* sizes2 = problem_sizes2.ptr<int32_t>();
  int32_t* in_perm = input_permutation.ptr<int32_t>();
  int32_t* out_perm = output_permutation.ptr<int32_t>();
  const int e = static_cast<int>(num_experts), nn = static_cast<int>(n), kk = static_cast<int>(k);
  if (topk_ids.dtype == DType::kInt64)
    launch<int64_t>(topk_ids, offsets, sizes1, sizes2, in_perm, out_perm, e, nn, kk, overlap_previous, stream);
  else
    launch<int32_t>(topk_ids, offsets, sizes1, sizes2, in_perm, out_perm, e, nn, kk, overlap_previous, stream);
}

}  // namespace qmoe::cuda
