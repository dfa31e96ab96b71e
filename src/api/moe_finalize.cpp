// Public entry of the deterministic finalize on per-slot rows (include/qmoe/fused_moe.h, DESIGN.md 3b):
//
//   out[t] = round_out(rsf * sum_j fp32(w[t, j] * row(t*k + j)))    fp32 sum in slot order j = 0..k-1
//
// over the slots whose id e satisfies 0 <= e < num_experts and e - local_expert_offset in
// [0, num_local_experts); rows of other slots are never read. row(s) = rows[s] (rows bf16 [T*k, H]),
// or rows[row_index[s]] with the optional row_index int32 [T*k] / [T, k] (rows bf16 [R, H], any R;
// an index outside [0, R) drops the slot: index values live on the device and are not checked
// here, the kernels apply the rule instead, as they do for topk_ids). topk_ids int32
// [T, k] (1 <= k <= 16), topk_weights f32 [T, k], output bf16/f16/f32 [T, H] (written, must not overlap
// an input). The rows come from moe_expert_rows, on this rank or (expert parallelism) on the ranks
// that own the experts; the result then equals fused_moe(deterministic = true) bit for bit.
// CPU tensors run the reference (src/reference/fused_moe.cpp); CUDA tensors the GPU kernel
// (src/cuda/fused/moe_finalize.cu, the same arithmetic, bit-identical) on `stream`.
#include <cmath>
#include <string>

#include "cuda/launch.h"
#include "qmoe/fused_moe.h"
#include "qmoe/routing.h"

namespace qmoe {

namespace {

void check_plain(const TensorRef& t, const std::string& name, std::initializer_list<DType> dtypes,
                 std::initializer_list<int64_t> shape, const TensorRef& rows) {
  check_dtype_in(t, name, dtypes);
  check_shape(t, name, shape);
  check_contiguous(t, name);
  QMOE_CHECK_ARG(t.numel() == 0 || t.data != nullptr, name, "a non-null data pointer", "nullptr");
  check_same_device(t, name, rows, "rows");
}

}  // namespace

void validate_moe_finalize(const MoeFinalizeParams& p) {
  check_dtype(p.topk_ids, "topk_ids", DType::kInt32);
  check_ndim(p.topk_ids, "topk_ids", 2);
  const int64_t tokens = p.topk_ids.size(0), topk = p.topk_ids.size(1);
  QMOE_CHECK_ARG(topk >= 1 && topk <= kMaxTopK, "topk_ids", "top_k = topk_ids.size(1) in [1, 16]",
            "top_k = " + std::to_string(topk));
  check_dtype(p.rows, "rows", DType::kBFloat16);
  check_ndim(p.rows, "rows", 2);
  const int64_t hidden = p.rows.size(1);
  QMOE_CHECK_ARG(hidden >= 1, "rows", "a [T*k, H] tensor with H >= 1", "shape " + shape_string(p.rows));
  // With a row index, rows is the caller's buffer of any length (R rows, possibly 0).
  check_plain(p.rows, "rows", {DType::kBFloat16}, {p.row_index ? -1 : tokens * topk, hidden}, p.rows);
  if (p.row_index) {
    const TensorRef& index = *p.row_index;
    check_dtype(index, "row_index", DType::kInt32);
    const bool flat = index.ndim == 1 && index.size(0) == tokens * topk;
    const bool square = index.ndim == 2 && index.size(0) == tokens && index.size(1) == topk;
    QMOE_CHECK_ARG(flat || square, "row_index",
                   "int32 [T*k] = [" + std::to_string(tokens * topk) + "] or [T, k] = [" + std::to_string(tokens) +
                       ", " + std::to_string(topk) + "]",
                   "shape " + shape_string(index));
    check_contiguous(index, "row_index");
    QMOE_CHECK_ARG(index.numel() == 0 || index.data != nullptr, "row_index", "a non-null data pointer", "nullptr");
    check_same_device(index, "row_index", p.rows, "rows");
  }
  check_plain(p.topk_ids, "topk_ids", {DType::kInt32}, {tokens, topk}, p.rows);
  check_plain(p.topk_weights, "topk_weights", {DType::kFloat32}, {tokens, topk}, p.rows);
  check_plain(p.output, "output", {DType::kBFloat16, DType::kFloat16, DType::kFloat32}, {tokens, hidden}, p.rows);

  QMOE_CHECK_ARG(p.num_experts >= 1, "num_experts", "a value >= 1", std::to_string(p.num_experts));
  const int64_t local = p.num_local_experts == 0 ? p.num_experts : p.num_local_experts;
  QMOE_CHECK_ARG(local >= 1, "num_local_experts", "a value >= 1 (0 means num_experts)",
            std::to_string(p.num_local_experts));
  QMOE_CHECK_ARG(p.local_expert_offset >= 0, "local_expert_offset", "a value >= 0", std::to_string(p.local_expert_offset));
  QMOE_CHECK_ARG(local <= p.num_experts && p.local_expert_offset <= p.num_experts - local, "num_local_experts",
            "local_expert_offset + num_local_experts <= num_experts = " + std::to_string(p.num_experts),
            std::to_string(p.local_expert_offset) + " + " + std::to_string(local));
  QMOE_CHECK_ARG(std::isfinite(p.routed_scaling_factor), "routed_scaling_factor", "a finite value",
            std::to_string(p.routed_scaling_factor));

  check_no_alias(p.output, "output", p.rows, "rows");
  check_no_alias(p.output, "output", p.topk_ids, "topk_ids");
  check_no_alias(p.output, "output", p.topk_weights, "topk_weights");
  if (p.row_index) check_no_alias(p.output, "output", *p.row_index, "row_index");
}

void moe_finalize(const MoeFinalizeParams& p, cudaStream_t stream) {
  validate_moe_finalize(p);
  if (p.rows.is_cuda()) {
    if (!cuda::kernels_built()) {
      throw Error("moe_finalize", "a qmoe build with CUDA kernels (QMOE_WITH_CUDA_KERNELS=ON)",
                  "a CPU-only build; pass CPU tensors or rebuild", ErrorKind::kRuntime);
    }
    cuda::moe_finalize(p, stream);
    return;
  }
  reference::moe_finalize(p);
}

}  // namespace qmoe
