// One expert-parallel MoE layer from C++ (docs/expert-parallel.md), in the low-latency mode (below) or
// the throughput mode (at the end): the caller's communicator (through an Exchange) and stream; every
// rank calls it with its own tokens.
//
// W ranks, E experts, rank r owns experts [r*E/W, (r+1)*E/W) and holds only their weights. Each
// rank has T <= C tokens (C = max_tokens_per_rank, the same on every rank) and gets the MoE output of
// its tokens:
//
//   1. home: the payload of each token (x quantized as the mode needs: e4m3 + a1 for w4a8_int4,
//      else x and its scales as given; then its topk_ids row) is packed into one row;
//   2. dispatch: rank r sends rows [0, C) to every peer: token t at position t (positions T..C-1 are
//      pad rows whose ids are -1). A peer skips the slots whose experts it does not own, so no
//      data-dependent selection is needed, and the exchange has a fixed size (no host sync);
//   3. owner: moe_expert_rows over the W*C received tokens (its local experts only) gives one bf16
//      row per owned slot: row (h*C + t)*k + j for token t of home rank h;
//   4. combine: the owner sends block h of those rows (C*k rows) back to rank h;
//   5. home: moe_finalize reads the row of slot (t, j), owned by d, at d*C*k + t*k + j (row_index),
//      with the routing weights, in slot order: the result equals fused_moe(deterministic = true)
//      over all experts on this rank's tokens, bit for bit, when every owner runs the same tactic.
//
// moe.deterministic = false selects the reduced combine (fewer bytes: one row per token and owner
// instead of one per slot, k / W times less for top-k routing spread over W ranks): the routing
// weights travel with the payload, each owner runs fused_moe over the received tokens with its local
// experts (its own finalize, routed_scaling_factor included) into one partial row per token (zero when
// it owns no slot of it), the combine returns block h of those partial rows (C rows, the output's
// dtype) to rank h, and home sums the W partials in rank order in fp32, rounded once. Run-to-run
// reproducible on a fixed tactic when the owners' finalize is (it is fused, atomic, on the GPU); not
// bitwise equal to one GPU (the slots are summed in two levels, each partial rounded to the output
// dtype): within the fused finalize's tolerance.
//
// Every step only enqueues work on `stream` (CUDA tensors): no allocation (the caller's workspace),
// no host sync, CUDA-graph capturable when the Exchange is (NCCL send/recv is). CPU tensors run the
// reference engine with the same data movement (tests use an in-process Exchange).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "qmoe/fused_moe.h"
#include "qmoe/nccl_transport.h"  // PeerTransfer

namespace qmoe::ep {

// One all-to-all: peers[p] for every rank p (this rank included), sizes agreed by both sides.
using Exchange = std::function<void(const std::vector<PeerTransfer>& peers, cudaStream_t stream)>;

// The NCCL exchange on a communicator from nccl_comm_init_rank (or the caller's ncclComm_t).
Exchange nccl_exchange(void* comm);

struct LowLatencyLayer {
  // This rank's layer: x, topk_ids [T, k], topk_weights, the scales of x, output [T, H]; the weights
  // of its E/W local experts with num_local_experts = E/W and local_expert_offset = rank*E/W;
  // deterministic = true: per-slot combine and the fixed-order finalize at home (bitwise == one GPU);
  // false: the reduced combine (above). w4a8_int4 needs a static fc2_input_scale (a dynamic a2 would
  // differ per owner).
  FusedMoeParams moe;
  int world_size = 1;
  int rank = 0;
  int64_t max_tokens_per_rank = 0;  // C, the same on every rank; T > C is an error
};

// Throws qmoe::Error naming the first bad argument (max_tokens_per_rank, world_size, rank, the
// fused-MoE arguments); nothing is exchanged.
void validate_low_latency_layer(const LowLatencyLayer& layer);
// Scratch bytes of a CUDA call (0 for CPU tensors, which allocate their own).
int64_t low_latency_layer_workspace_size(const LowLatencyLayer& layer);
// Validates, then runs the five steps; every rank must call it (the exchanges pair up).
void low_latency_layer(const LowLatencyLayer& layer, const Exchange& exchange, void* workspace = nullptr,
                       int64_t workspace_bytes = 0, cudaStream_t stream = nullptr);

// ---- The throughput mode (prefill sizes) -----------------------------------------------------------
// Only the tokens a peer owns a slot of travel to it, and only the owned slots' rows come back: the
// plan of include/qmoe/expert_parallel.h, computed on the host. The host waits three times (for the
// routing, for the exchanged counts, for the received routing), so this mode is not graph-capturable;
// its buffers are sized by the counts and allocated per call (stream-ordered cudaMallocAsync / free).
// Same result as the low-latency layer and as fused_moe(deterministic = true), bit for bit; with
// deterministic = false the reduced combine as above (partial rows return in receive order; no host
// wait for the received routing: two host waits).
struct ThroughputLayer {
  FusedMoeParams moe;  // as LowLatencyLayer::moe
  int world_size = 1;
  int rank = 0;
};
void validate_throughput_layer(const ThroughputLayer& layer);
void throughput_layer(const ThroughputLayer& layer, const Exchange& exchange, cudaStream_t stream = nullptr);

}  // namespace qmoe::ep
