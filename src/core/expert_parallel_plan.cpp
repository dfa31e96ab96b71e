// Dispatch / combine planning of expert parallelism (include/qmoe/expert_parallel.h): which tokens
// go to which rank, and in which order the per-slot rows come back. Pure host functions over CPU
// int32 routing; O(T*k*W) time at most, no allocation beyond the returned vectors.
#include <string>

#include "qmoe/expert_parallel.h"

namespace qmoe::ep {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

// The owner rank of expert e, or -1 for an invalid id (skipped, as fused_moe skips it).
int64_t owner_of(int64_t e, int64_t num_experts, int64_t per_rank) {
  return e >= 0 && e < num_experts ? e / per_rank : -1;
}

void check_routing(const TensorRef& topk_ids, const std::string& name) {
  check_dtype(topk_ids, name, DType::kInt32);
  check_ndim(topk_ids, name, 2);
  check_contiguous(topk_ids, name);
  QMOE_CHECK_ARG(!topk_ids.is_cuda(), name, "a CPU tensor (the plan is computed on the host)", "a CUDA tensor");
  QMOE_CHECK_ARG(topk_ids.size(1) >= 1, name, "top_k = topk_ids.size(1) >= 1", "top_k = " + str(topk_ids.size(1)));
  QMOE_CHECK_ARG(topk_ids.numel() == 0 || topk_ids.data != nullptr, name, "a non-null data pointer", "nullptr");
}

}  // namespace

int64_t experts_per_rank(int64_t num_experts, int64_t world_size) {
  QMOE_CHECK_ARG(world_size >= 1, "world_size", "a value >= 1", str(world_size));
  QMOE_CHECK_ARG(num_experts >= 1, "num_experts", "a value >= 1", str(num_experts));
  QMOE_CHECK_ARG(num_experts % world_size == 0, "num_experts",
            "a multiple of world_size = " + str(world_size) + " (experts are split evenly over the ranks)",
            str(num_experts));
  return num_experts / world_size;
}

std::vector<int64_t> exclusive_offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) {
    QMOE_CHECK_ARG(counts[i] >= 0, "counts", "values >= 0", str(counts[i]) + " at index " + str(static_cast<int64_t>(i)));
    offsets[i + 1] = offsets[i] + counts[i];
  }
  return offsets;
}

DispatchPlan plan_dispatch(const TensorRef& topk_ids, int64_t num_experts, int64_t world_size) {
  check_routing(topk_ids, "topk_ids");
  const int64_t per_rank = experts_per_rank(num_experts, world_size);
  DispatchPlan plan;
  plan.world_size = world_size;
  plan.num_experts = num_experts;
  plan.num_tokens = topk_ids.size(0);
  plan.topk = topk_ids.size(1);
  const int64_t T = plan.num_tokens, k = plan.topk, W = world_size;
  const int32_t* ids = topk_ids.ptr<const int32_t>();

  // Per destination: its token list (once per token) and the slots it owns, both in (t, j) order.
  std::vector<std::vector<int64_t>> tokens(static_cast<size_t>(W)), slots(static_cast<size_t>(W));
  std::vector<int64_t> last_token(static_cast<size_t>(W), -1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t d = owner_of(ids[t * k + j], num_experts, per_rank);
      if (d < 0) continue;
      if (last_token[static_cast<size_t>(d)] != t) {  // a token goes once to each owner
        last_token[static_cast<size_t>(d)] = t;
        tokens[static_cast<size_t>(d)].push_back(t);
      }
      slots[static_cast<size_t>(d)].push_back(t * k + j);
    }
  }
  for (int64_t d = 0; d < W; ++d) {
    plan.send_counts.push_back(static_cast<int64_t>(tokens[static_cast<size_t>(d)].size()));
    plan.return_counts.push_back(static_cast<int64_t>(slots[static_cast<size_t>(d)].size()));
    plan.send_tokens.insert(plan.send_tokens.end(), tokens[static_cast<size_t>(d)].begin(),
                            tokens[static_cast<size_t>(d)].end());
    plan.return_slots.insert(plan.return_slots.end(), slots[static_cast<size_t>(d)].begin(),
                             slots[static_cast<size_t>(d)].end());
  }
  plan.send_offsets = exclusive_offsets(plan.send_counts);
  plan.return_offsets = exclusive_offsets(plan.return_counts);
  return plan;
}

std::vector<int64_t> owner_return_slots(const TensorRef& recv_ids, int64_t num_experts, int64_t world_size,
                                        int64_t rank) {
  check_routing(recv_ids, "recv_ids");
  const int64_t per_rank = experts_per_rank(num_experts, world_size);
  QMOE_CHECK_ARG(rank >= 0 && rank < world_size, "rank", "a value in [0, world_size = " + str(world_size) + ")",
            str(rank));
  const int32_t* ids = recv_ids.ptr<const int32_t>();
  std::vector<int64_t> out;
  for (int64_t s = 0; s < recv_ids.numel(); ++s)
    if (owner_of(ids[s], num_experts, per_rank) == rank) out.push_back(s);
  return out;
}

void check_low_latency_capacity(int64_t num_tokens, int64_t max_tokens_per_rank) {
  QMOE_CHECK_ARG(max_tokens_per_rank >= 1, "max_tokens_per_rank", "a value >= 1", str(max_tokens_per_rank));
  QMOE_CHECK_ARG(num_tokens <= max_tokens_per_rank, "max_tokens_per_rank",
            "at least the number of tokens on this rank (T = " + str(num_tokens) +
                "): the low-latency mode gives each peer a fixed capacity and never drops a token",
            str(max_tokens_per_rank));
}

std::vector<int64_t> low_latency_send_positions(const DispatchPlan& plan, int64_t max_tokens_per_rank) {
  check_low_latency_capacity(plan.num_tokens, max_tokens_per_rank);
  std::vector<int64_t> positions;
  positions.reserve(plan.send_tokens.size());
  for (int64_t d = 0; d < plan.world_size; ++d)
    for (int64_t i = 0; i < plan.send_counts[static_cast<size_t>(d)]; ++i) positions.push_back(d * max_tokens_per_rank + i);
  return positions;
}

}  // namespace qmoe::ep
