// CPU reference of get_cutlass_w4a8_moe_mm_data (DESIGN.md 5.1, include/qmoe/routing.h).
//
// From topk_ids (int32 or int64, flattened: slot s = t*k + j) and E = num_experts:
//   counts[e]            = #{s : topk_ids[s] == e}, e in [0, E); other ids are dropped
//   expert_offsets[e]    = counts[0] + ... + counts[e-1]            ([E+1], exclusive prefix sum)
//   problem_sizes1[e]    = (2n, counts[e], k),  problem_sizes2[e] = (k, counts[e], n)
//   input_permutation[r] = the slot placed at row r of the expert-sorted matrix (rows of one expert
//                          in increasing slot order, i.e. a stable sort by expert id);
//                          rows r >= expert_offsets[E] hold -1
//   output_permutation[s]= the row of slot s (the inverse), -1 for a dropped slot
// Arguments are assumed validated by qmoe::get_cutlass_w4a8_moe_mm_data (src/api/routing.cpp).
#include <cstdint>
#include <vector>

#include "qmoe/routing.h"

namespace qmoe::reference {

namespace {

template <class Id>
void moe_mm_data_impl(const Id* ids, int64_t slots, int32_t* offsets, int32_t* sizes1, int32_t* sizes2,
                      int32_t* input_perm, int32_t* output_perm, int64_t experts, int64_t n, int64_t k) {
  auto valid = [experts](Id id) { return id >= 0 && static_cast<int64_t>(id) < experts; };

  std::vector<int64_t> counts(static_cast<size_t>(experts), 0);
  for (int64_t s = 0; s < slots; ++s)
    if (valid(ids[s])) ++counts[static_cast<size_t>(ids[s])];

  offsets[0] = 0;
  for (int64_t e = 0; e < experts; ++e) {
    offsets[e + 1] = static_cast<int32_t>(offsets[e] + counts[static_cast<size_t>(e)]);
    const int32_t cnt = static_cast<int32_t>(counts[static_cast<size_t>(e)]);
    sizes1[3 * e + 0] = static_cast<int32_t>(2 * n);
    sizes1[3 * e + 1] = cnt;
    sizes1[3 * e + 2] = static_cast<int32_t>(k);
    sizes2[3 * e + 0] = static_cast<int32_t>(k);
    sizes2[3 * e + 1] = cnt;
    sizes2[3 * e + 2] = static_cast<int32_t>(n);
  }

  // Scanning slots in increasing order and appending each to its expert's block makes the
  // placement stable by slot, as the callers' stable sort of the flattened ids does.
  std::vector<int64_t> next(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) next[static_cast<size_t>(e)] = offsets[e];
  const int64_t valid_rows = offsets[experts];
  for (int64_t r = valid_rows; r < slots; ++r) input_perm[r] = -1;
  for (int64_t s = 0; s < slots; ++s) {
    if (!valid(ids[s])) {
      output_perm[s] = -1;
      continue;
    }
    const int64_t row = next[static_cast<size_t>(ids[s])]++;
    input_perm[row] = static_cast<int32_t>(s);
    output_perm[s] = static_cast<int32_t>(row);
  }
}

}  // namespace

void moe_mm_data(const TensorRef& topk_ids, TensorRef expert_offsets, TensorRef problem_sizes1,
                 TensorRef problem_sizes2, TensorRef input_permutation, TensorRef output_permutation,
                 int64_t num_experts, int64_t n, int64_t k) {
  const int64_t slots = topk_ids.numel();
  int32_t* offsets = expert_offsets.ptr<int32_t>();
  int32_t* sizes1 = problem_sizes1.ptr<int32_t>();
  int32_t* sizes2 = problem_sizes2.ptr<int32_t>();
  int32_t* input_perm = input_permutation.ptr<int32_t>();
  int32_t* output_perm = output_permutation.ptr<int32_t>();
  if (topk_ids.dtype == DType::kInt64) {
    moe_mm_data_impl(topk_ids.ptr<const int64_t>(), slots, offsets, sizes1, sizes2, input_perm, output_perm,
                     num_experts, n, k);
  } else {
    moe_mm_data_impl(topk_ids.ptr<const int32_t>(), slots, offsets, sizes1, sizes2, input_perm, output_perm,
                     num_experts, n, k);
  }
}

}  // namespace qmoe::reference
