// Public entry of get_cutlass_w4a8_moe_mm_data (DESIGN.md 5.1, include/qmoe/routing.h):
// validates every argument, then runs the CPU reference or the CUDA kernel on `stream`.
//
// Checked here because SGLang does not check them and silently computes wrong metadata:
// dtypes (an int64 topk_ids or int64 outputs gave wrong values upstream), exact output shapes,
// num_experts in [1, kMaxExperts] (SGLang's scan kernel has at most 1024 threads), n and k
// positive and small enough for the int32 problem sizes, one device, no output aliasing an input
// or another output. Nothing is written when a check fails.
#include <cstdint>
#include <limits>
#include <string>

#include "cuda/launch.h"
#include "qmoe/routing.h"

namespace qmoe {

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

void check_has_data(const TensorRef& t, const std::string& name) {
  QMOE_CHECK_ARG(t.numel() == 0 || t.data != nullptr, name, "a non-null data pointer", "nullptr");
}

void check_output(const TensorRef& t, const std::string& name, const TensorRef& topk_ids,
                  std::initializer_list<int64_t> shape) {
  check_dtype(t, name, DType::kInt32);
  check_shape(t, name, shape);
  check_contiguous(t, name);
  check_has_data(t, name);
  check_same_device(t, name, topk_ids, "topk_ids");
  check_no_alias(t, name, topk_ids, "topk_ids");
}

}  // namespace

void get_cutlass_w4a8_moe_mm_data(const TensorRef& topk_ids, TensorRef expert_offsets, TensorRef problem_sizes1,
                                  TensorRef problem_sizes2, TensorRef input_permutation,
                                  TensorRef output_permutation, int64_t num_experts, int64_t n, int64_t k,
                                  cudaStream_t stream) {
  check_dtype_in(topk_ids, "topk_ids", {DType::kInt32, DType::kInt64});
  check_contiguous(topk_ids, "topk_ids");
  check_has_data(topk_ids, "topk_ids");
  const int64_t slots = topk_ids.numel();
  // Permutation entries are int32 slot / row indices.
  QMOE_CHECK_ARG(slots <= kInt32Max, "topk_ids", "at most " + std::to_string(kInt32Max) + " elements",
            std::to_string(slots) + " elements");

  QMOE_CHECK_ARG(num_experts >= 1 && num_experts <= kMaxExperts, "num_experts",
            "a value in [1, " + std::to_string(kMaxExperts) + "]", std::to_string(num_experts));
  // problem_sizes1 holds 2n as int32.
  QMOE_CHECK_ARG(n > 0 && n <= kInt32Max / 2, "n", "a value in [1, " + std::to_string(kInt32Max / 2) + "]",
            std::to_string(n));
  QMOE_CHECK_ARG(k > 0 && k <= kInt32Max, "k", "a value in [1, " + std::to_string(kInt32Max) + "]", std::to_string(k));

  check_output(expert_offsets, "expert_offsets", topk_ids, {num_experts + 1});
  check_output(problem_sizes1, "problem_sizes1", topk_ids, {num_experts, 3});
  check_output(problem_sizes2, "problem_sizes2", topk_ids, {num_experts, 3});
  check_output(input_permutation, "input_permutation", topk_ids, {slots});
  check_output(output_permutation, "output_permutation", topk_ids, {slots});

  const TensorRef* outputs[] = {&expert_offsets, &problem_sizes1, &problem_sizes2, &input_permutation,
                                &output_permutation};
  const char* names[] = {"expert_offsets", "problem_sizes1", "problem_sizes2", "input_permutation",
                         "output_permutation"};
  for (int i = 0; i < 5; ++i)
    for (int j = i + 1; j < 5; ++j) check_no_alias(*outputs[j], names[j], *outputs[i], names[i]);

  if (topk_ids.is_cuda()) {
    cuda::moe_mm_data(topk_ids, expert_offsets, problem_sizes1, problem_sizes2, input_permutation,
                      output_permutation, num_experts, n, k, stream);
  } else {
    reference::moe_mm_data(topk_ids, expert_offsets, problem_sizes1, problem_sizes2, input_permutation,
                           output_permutation, num_experts, n, k);
  }
}

}  // namespace qmoe
