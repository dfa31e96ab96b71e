// Routing metadata: from topk_ids to the expert-sorted row order the grouped GEMMs use.
//
// Worked example: E = 3 experts, T = 2 tokens, k = 2, topk_ids = [[2, 0], [0, 5]] (5 is out of
// range and dropped). Flat slots s = t*k + j: s0 -> 2, s1 -> 0, s2 -> 0, s3 -> dropped.
//   counts            = [2, 0, 1]
//   expert_offsets    = [0, 2, 2, 3]            exclusive prefix sum, [E+1]; last = valid rows
//   problem_sizes1[e] = (2n, counts[e], k)      swapped-AB (M = weight rows, N = tokens, K)
//   problem_sizes2[e] = (k, counts[e], n)
//   input_permutation = [1, 2, 0, -1]           row of the sorted matrix -> flat slot, stable by slot;
//                                               rows past expert_offsets[E] hold -1
//   output_permutation= [2, 0, 1, -1]           flat slot -> row, -1 for dropped slots (its inverse)
#pragma once

#include <cuda_runtime_api.h>

#include "qmoe/tensor.h"

namespace qmoe {

constexpr int64_t kMaxExperts = 1024;
constexpr int64_t kMaxTopK = 16;

// SGLang's get_cutlass_w4a8_moe_mm_data (DESIGN.md 5.1), with the permutations filled.
// topk_ids int32 or int64, any shape, contiguous (numel = slots). Outputs int32, contiguous:
// expert_offsets [E+1], problem_sizes1/2 [E, 3], input_permutation/output_permutation [numel].
// num_experts in [1, 1024]. CPU tensors run the reference; CUDA tensors run on `stream`.
void get_cutlass_w4a8_moe_mm_data(const TensorRef& topk_ids, TensorRef expert_offsets, TensorRef problem_sizes1,
                                  TensorRef problem_sizes2, TensorRef input_permutation,
                                  TensorRef output_permutation, int64_t num_experts, int64_t n, int64_t k,
                                  cudaStream_t stream = nullptr);

namespace reference {
void moe_mm_data(const TensorRef& topk_ids, TensorRef expert_offsets, TensorRef problem_sizes1,
                 TensorRef problem_sizes2, TensorRef input_permutation, TensorRef output_permutation,
                 int64_t num_experts, int64_t n, int64_t k);
}  // namespace reference

}  // namespace qmoe
