// Expert parallelism (EP): the pure planning of dispatch and combine (docs/expert-parallel.md).
//
// W ranks; E experts split evenly: rank r owns experts [r*E/W, (r+1)*E/W) (E % W == 0). Every rank
// holds its own tokens x[T, H] and routing topk_ids[T, k] / topk_weights[T, k] and wants the full MoE
// output of its tokens. A slot (t, j) is valid when 0 <= topk_ids[t, j] < E (fused_moe's rule); its
// owner is topk_ids[t, j] / (E/W).
//
// Dispatch: token t goes ONCE to each rank that owns at least one of its valid slots (its activation
// row, its a1 scale and its whole topk_ids row). Combine: the owner sends back one bf16 row per
// valid slot it owns (alpha2 * GEMM2 row, no routing weight); the home rank finalizes.
//
// Worked example: W = 2, E = 4 (rank 0: experts 0,1; rank 1: 2,3), k = 2,
//   topk_ids = [[0, 3], [1, 0], [2, 9]]   (9 is invalid: skipped)
//   send_counts    = [2, 2]         token 0 -> ranks 0,1; token 1 -> rank 0; token 2 -> rank 1
//   send_offsets   = [0, 2, 4]
//   send_tokens    = [0, 1, 0, 2]   grouped by destination, ascending token order within a group
//   return_counts  = [3, 2]         slots owned by rank 0: (0,0) (1,0) (1,1); by rank 1: (0,1) (2,0)
//   return_offsets = [0, 3, 5]
//   return_slots   = [0, 2, 3, 1, 4]  flat slot t*k + j of each returned row, grouped by owner,
//                                     in (destination-list position, j) order = (t, j) order
// On the owner, the rows it returns to source rank s are those of the received tokens from s in
// receive order, for their locally owned slots in j order (owner_return_slots): the same order, so
// rows need no index on the wire.
//
// Low-latency mode: fixed per-peer capacity C = max_tokens_per_rank. A rank sends at most T tokens
// to a peer, so T <= C guarantees no overflow with no data-dependent check (no host sync; CUDA-graph
// capturable); T > C is an error naming max_tokens_per_rank, never a silent drop. Buffers are
// [W, C, ...]: token i of the list for destination d sits at d*C + i; unused positions carry
// topk_ids = -1 so the owner's engine skips them. Returned rows are [W, C*k, H]: the row of received
// position p, slot j at p*k + j.
#pragma once

#include <cstdint>
#include <vector>

#include "qmoe/tensor.h"

namespace qmoe::ep {

struct DispatchPlan {
  int64_t world_size = 0, num_experts = 0, num_tokens = 0, topk = 0;
  std::vector<int64_t> send_counts;     // [W] tokens sent to each rank (this rank included)
  std::vector<int64_t> send_offsets;    // [W+1] exclusive prefix sum of send_counts
  std::vector<int64_t> send_tokens;     // [send_offsets[W]] token index, grouped by destination
  std::vector<int64_t> return_counts;   // [W] rows each rank sends back = valid slots it owns
  std::vector<int64_t> return_offsets;  // [W+1]
  std::vector<int64_t> return_slots;    // [return_offsets[W]] flat slot t*k + j, grouped by owner
};

// Throws qmoe::Error naming num_experts / world_size when E % W != 0 or a value is < 1.
int64_t experts_per_rank(int64_t num_experts, int64_t world_size);

// topk_ids: CPU int32 [T, k] (T may be 0). Validates every argument first.
DispatchPlan plan_dispatch(const TensorRef& topk_ids, int64_t num_experts, int64_t world_size);

// Receive side offsets [W+1] from the counts each peer announced.
std::vector<int64_t> exclusive_offsets(const std::vector<int64_t>& counts);

// Owner side: flat slots i*k + j of the received routing recv_ids [N, k] whose expert this rank
// owns, in flat order (which is grouped by source rank, since received tokens are).
std::vector<int64_t> owner_return_slots(const TensorRef& recv_ids, int64_t num_experts, int64_t world_size,
                                        int64_t rank);

// Low-latency mode: throws qmoe::Error naming max_tokens_per_rank when num_tokens > it (or it < 1).
void check_low_latency_capacity(int64_t num_tokens, int64_t max_tokens_per_rank);
// Position in the [W, C] send buffer of each entry of plan.send_tokens: d*C + (index within d's list).
std::vector<int64_t> low_latency_send_positions(const DispatchPlan& plan, int64_t max_tokens_per_rank);

}  // namespace qmoe::ep
