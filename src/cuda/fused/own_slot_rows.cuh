// Rows of a token's slots found by the gather kernels themselves at decode (RowRouting::own_rows,
// gather_finds_rows: up to kOwnRowsMaxSlots slots), so that they need not wait for the routing kernel.
// The placement is moe_mm_data's (routing/sm90_moe_mm_data.cu): expert-sorted, stable by slot, ids outside
// [0, E_l) dropped:
//   row(s) = #{s' : valid(s'), id(s') < id(s)} + #{s' < s : id(s') == id(s)}        (-1 when s is dropped)
// The S ids are staged once per CTA in shared memory (dropped ones as E_l, which sorts after every expert);
// one warp counts one slot's row over them: O(S / 32) steps per slot.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/fused/fused_moe_kernels.h"
#include "qmoe/error.h"

namespace qmoe::cuda::fused {

// Host side, before a gather launches in this mode: the sizes its shared-memory arrays hold (an internal
// invariant: gather_finds_rows and fused_moe's top_k limit keep every pipeline call inside them).
inline void check_own_rows_fit(const RowRouting& rt) {
  QMOE_CHECK_ARG(rt.max_rows <= kOwnRowsMaxSlots && rt.topk >= 1 && rt.topk <= kMaxTopk, "topk_ids",
                 "at most " + std::to_string(kOwnRowsMaxSlots) + " slots and 1 <= top-k <= 16 for the own-rows gather",
                 std::to_string(rt.max_rows) + " slots, top-k " + std::to_string(rt.topk));
}

// keys[s] = local id of slot s, or E_l when dropped; s < rt.max_rows <= kOwnRowsMaxSlots. Every thread
// of the block calls it; the caller syncs before reading keys.
template <int kThreads>
__device__ __forceinline__ void stage_slot_keys(const RowRouting& rt, int32_t* keys) {
  for (int64_t s = threadIdx.x; s < rt.max_rows; s += kThreads) {
    const int32_t id = rt.local_ids[s];
    keys[s] = id >= 0 && id < rt.num_local ? id : rt.num_local;
  }
}

// rows[j] = row of slot t * k + j for j < k (-1: dropped), from the staged keys. Every thread of the
// block calls it with the same t; the caller syncs before and after (keys staged / rows read).
template <int kThreads>
__device__ __forceinline__ void own_slot_rows(const RowRouting& rt, const int32_t* keys, int64_t t, int32_t* rows) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int j = warp; j < rt.topk; j += kThreads / 32) {
    const int64_t s = t * rt.topk + j;
    const int32_t key = keys[s];
    int before = 0;
    for (int64_t q = lane; q < rt.max_rows; q += 32) {
      const int32_t other = keys[q];
      before += other < key || (other == key && q < s);
    }
    before = __reduce_add_sync(0xffffffffu, before);
    if (lane == 0) rows[j] = key < rt.num_local ? before : -1;
  }
}

}  // namespace qmoe::cuda::fused
