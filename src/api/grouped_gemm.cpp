// Public entry of cutlass_w4a8_moe_mm (DESIGN.md 3.1 and 5.1, include/qmoe/grouped_gemm.h):
//
//   D[r, o] = bf16( a_scale(r) * sum_g S[e, o, g] * sum_{k in group g} A[r, k] * q[e, o, k] )
//
// validate_w4a8_moe_mm checks every argument before any work; cutlass_w4a8_moe_mm then runs the
// CPU reference (CPU tensors) or the Hopper kernel with a tactic (CUDA tensors).
//
// Where SGLang silently misbehaves, qmoe raises a qmoe::Error naming the argument:
//   K % 128 != 0 (SGLang returns wrong values), chunk_size != 128 (ignored upstream), an fp16 d
//   (upstream writes bf16 bit patterns into it), E > 1024 (upstream: illegal memory access),
//   int64 expert_offsets / problem_sizes (upstream: wrong values), N % 8 != 0 (TMA alignment of the
//   bf16 output rows). a_scales may hold one value (per tensor) or one per row of a (a qmoe
//   extension; SGLang silently reads element 0 only).
// Per-expert row counts live in problem_sizes, which is device memory on a GPU: their values (and
// the stride values) are checked on CPU tensors only, since reading them on a GPU would need a sync.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cuda/launch.h"
#include "qmoe/grouped_gemm.h"
#include "qmoe/routing.h"

namespace qmoe {

namespace {

constexpr int64_t kGroupSize = 128;  // int4 weight scale group along K (the only one supported)
constexpr int64_t kOutputAlign = 8;  // bf16 output rows must be 16-byte aligned for the TMA store
constexpr int kTmaAlignBytes = 16;   // TMA base addresses

void check_has_data(const TensorRef& t, const std::string& name) {
  QMOE_CHECK_ARG(t.numel() == 0 || t.data != nullptr, name, "a non-null data pointer", "nullptr");
}

std::string dim_string(const char* what, int64_t value) { return std::string(what) + " = " + std::to_string(value); }

// Stride tensors: SGLang passes int64 [E, 3] filled with the leading dimension; qmoe accepts them
// for compatibility and checks that they agree with the tensors (values on CPU only).
void check_strides(const std::optional<TensorRef>& strides, const std::string& name, int64_t experts,
                   int64_t leading_dim, const char* leading_name, const TensorRef& a) {
  if (!strides.has_value()) return;
  const TensorRef& s = *strides;
  check_dtype(s, name, DType::kInt64);
  check_shape(s, name, {experts, 3});
  check_contiguous(s, name);
  check_has_data(s, name);
  check_same_device(s, name, a, "a");
  if (s.is_cuda()) return;
  const int64_t* v = s.ptr<const int64_t>();
  for (int64_t i = 0; i < experts * 3; ++i) {
    QMOE_CHECK_ARG(v[i] == leading_dim, name,
              "every entry equal to the leading dimension " + std::string(leading_name) + " = " +
                  std::to_string(leading_dim),
              "entry [" + std::to_string(i / 3) + ", " + std::to_string(i % 3) + "] = " + std::to_string(v[i]));
  }
}

}  // namespace

void validate_w4a8_moe_mm(const W4A8MoeMmArgs& args) {
  const TensorRef& d = args.d;
  const TensorRef& a = args.a;
  const TensorRef& b = args.b;
  const TensorRef& a_scales = args.a_scales;
  const TensorRef& b_scales = args.b_scales;
  const TensorRef& offsets = args.expert_offsets;
  const TensorRef& sizes = args.problem_sizes;

  // Scalars.
  QMOE_CHECK_ARG(args.chunk_size == kGroupSize, "chunk_size",
            "128 (the int4 weight group size along K; the only one supported)", std::to_string(args.chunk_size));
  QMOE_CHECK_ARG(args.topk >= 1, "topk", "a value >= 1", std::to_string(args.topk));

  // a: e4m3 [R, K]; K drives the scale layout and must be a whole number of weight groups.
  check_dtype(a, "a", DType::kFloat8E4M3);
  QMOE_CHECK_ARG(a.ndim == 2, "a", "a 2-D tensor [R, K] (the 3-D masked layout is not supported)",
            std::to_string(a.ndim) + "-D tensor of shape " + shape_string(a));
  check_contiguous(a, "a");
  check_has_data(a, "a");
  const int64_t rows = a.size(0), k = a.size(1);
  QMOE_CHECK_ARG(k > 0 && k % kGroupSize == 0, "a",
            "K = a.size(1) a positive multiple of 128 (the int4 weight group size)", dim_string("K", k));

  // d: bf16 [R, N]. fp16 is refused explicitly: SGLang used to write it and overflowed (issue #8493).
  if (d.dtype == DType::kFloat16) {
    throw Error("d", "dtype bfloat16 (the only output dtype of this GEMM; float16 is not supported)",
                "dtype float16", ErrorKind::kType);
  }
  check_dtype(d, "d", DType::kBFloat16);
  check_ndim(d, "d", 2);
  QMOE_CHECK_ARG(d.size(0) == rows, "d", "R = " + std::to_string(rows) + " rows (a.size(0))",
            "shape " + shape_string(d));
  check_contiguous(d, "d");
  check_has_data(d, "d");
  const int64_t n = d.size(1);
  QMOE_CHECK_ARG(n > 0 && n % kOutputAlign == 0, "d",
            "N = d.size(1) a positive multiple of 8 (16-byte aligned bf16 output rows)", dim_string("N", n));

  // expert_offsets: int32 [E], start row of each expert; its length defines E.
  check_dtype(offsets, "expert_offsets", DType::kInt32);
  check_ndim(offsets, "expert_offsets", 1);
  const int64_t experts = offsets.size(0);
  QMOE_CHECK_ARG(experts >= 1 && experts <= kMaxExperts, "expert_offsets",
            "E = expert_offsets.size(0) in [1, " + std::to_string(kMaxExperts) + "]", dim_string("E", experts));
  check_contiguous(offsets, "expert_offsets");
  check_has_data(offsets, "expert_offsets");

  // b: packed int4 [E, N, K/2] in any 1-byte storage dtype.
  check_dtype_in(b, "b", {DType::kInt8, DType::kInt4x2, DType::kUInt8});
  check_shape(b, "b", {experts, n, k / 2});
  check_contiguous(b, "b");
  check_has_data(b, "b");

  // a_scales: fp32 [1] (per tensor) or [R] (per row).
  check_dtype(a_scales, "a_scales", DType::kFloat32);
  QMOE_CHECK_ARG(a_scales.ndim == 1 && (a_scales.size(0) == 1 || a_scales.size(0) == rows), "a_scales",
            "shape [1] (per tensor) or [" + std::to_string(rows) + "] (one scale per row of a)",
            "shape " + shape_string(a_scales));
  check_contiguous(a_scales, "a_scales");
  check_has_data(a_scales, "a_scales");

  // b_scales: bf16 in SGLang's stored layout, which K selects.
  check_dtype(b_scales, "b_scales", DType::kBFloat16);
  if (k % 512 == 0) {
    check_shape(b_scales, "b_scales", {experts, k / 512, 4 * n});
  } else {
    check_shape(b_scales, "b_scales", {experts, k / kGroupSize, n});
  }
  check_contiguous(b_scales, "b_scales");
  check_has_data(b_scales, "b_scales");

  // problem_sizes: int32 [E, 3], rows (N, M_e, K).
  check_dtype(sizes, "problem_sizes", DType::kInt32);
  check_shape(sizes, "problem_sizes", {experts, 3});
  check_contiguous(sizes, "problem_sizes");
  check_has_data(sizes, "problem_sizes");

  // One device for everything.
  check_same_device(d, "d", a, "a");
  check_same_device(b, "b", a, "a");
  check_same_device(a_scales, "a_scales", a, "a");
  check_same_device(b_scales, "b_scales", a, "a");
  check_same_device(offsets, "expert_offsets", a, "a");
  check_same_device(sizes, "problem_sizes", a, "a");

  check_strides(args.a_strides, "a_strides", experts, k, "K", a);
  check_strides(args.b_strides, "b_strides", experts, k, "K", a);
  check_strides(args.d_strides, "d_strides", experts, n, "N", a);
  check_strides(args.s_strides, "s_strides", experts, n, "N", a);

  // The output must not overlap any input.
  check_no_alias(d, "d", a, "a");
  check_no_alias(d, "d", b, "b");
  check_no_alias(d, "d", a_scales, "a_scales");
  check_no_alias(d, "d", b_scales, "b_scales");
  check_no_alias(d, "d", offsets, "expert_offsets");
  check_no_alias(d, "d", sizes, "problem_sizes");
  // The stride tensors too: they are only read here, but an output that overlaps them would make
  // the call's inputs depend on its own result (found by tests/python/test_hostile_inputs.py).
  const std::pair<const std::optional<TensorRef>*, const char*> strides[] = {
      {&args.a_strides, "a_strides"}, {&args.b_strides, "b_strides"}, {&args.d_strides, "d_strides"},
      {&args.s_strides, "s_strides"}};
  for (const auto& [s, name] : strides)
    if (s->has_value()) check_no_alias(d, "d", **s, name);

  // a_slots (a qmoe extension): uint8 [R, 2K + K/32] scratch that the op writes, so it overlaps no other argument.
  if (args.a_slots.has_value()) {
    const TensorRef& slots = *args.a_slots;
    check_dtype_in(slots, "a_slots", {DType::kUInt8, DType::kInt8});
    check_shape(slots, "a_slots", {rows, 2 * k + k / 32});
    check_contiguous(slots, "a_slots");
    check_has_data(slots, "a_slots");
    check_same_device(slots, "a_slots", a, "a");
    const std::pair<const TensorRef*, const char*> inputs[] = {{&d, "d"},           {&a, "a"},
                                                               {&b, "b"},           {&a_scales, "a_scales"},
                                                               {&b_scales, "b_scales"}, {&offsets, "expert_offsets"},
                                                               {&sizes, "problem_sizes"}};
    for (const auto& [t, name] : inputs) check_no_alias(slots, "a_slots", *t, name);
    for (const auto& [s, name] : strides)
      if (s->has_value()) check_no_alias(slots, "a_slots", **s, name);
  }

  if (a.is_cuda()) {
    // TMA loads and stores need 16-byte aligned base addresses (row pitches are aligned by the
    // K and N rules above).
    check_aligned(a, "a", kTmaAlignBytes);
    check_aligned(b, "b", kTmaAlignBytes);
    check_aligned(b_scales, "b_scales", kTmaAlignBytes);
    check_aligned(d, "d", kTmaAlignBytes);
    if (args.a_slots.has_value()) check_aligned(*args.a_slots, "a_slots", kTmaAlignBytes);
    return;
  }

  // CPU: the per-expert groups can be read, so check them: (N, M_e, K) with M_e >= 0, the block
  // [offset, offset + M_e) inside [0, R), and no two non-empty blocks overlapping (a row computed
  // twice would be a race and an ambiguous result).
  const int32_t* off = offsets.ptr<const int32_t>();
  const int32_t* ps = sizes.ptr<const int32_t>();
  std::vector<std::pair<int64_t, int64_t>> blocks;  // non-empty [begin, end) row blocks
  std::vector<int64_t> block_expert;                // their experts, for the error message
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t pn = ps[3 * e], m = ps[3 * e + 1], pk = ps[3 * e + 2];
    const std::string row = "problem_sizes[" + std::to_string(e) + "] = (" + std::to_string(pn) + ", " +
                            std::to_string(m) + ", " + std::to_string(pk) + ")";
    QMOE_CHECK_ARG(pn == n && pk == k && m >= 0, "problem_sizes",
              "rows (N, M_e, K) = (" + std::to_string(n) + ", M_e >= 0, " + std::to_string(k) + ")", row);
    if (m == 0) continue;
    const int64_t begin = off[e];
    QMOE_CHECK_ARG(begin >= 0 && begin + m <= rows, "expert_offsets",
              "each expert's rows [expert_offsets[e], expert_offsets[e] + M_e) within [0, R = " +
                  std::to_string(rows) + ")",
              "expert " + std::to_string(e) + ": rows [" + std::to_string(begin) + ", " +
                  std::to_string(begin + m) + ")");
    blocks.emplace_back(begin, begin + m);
    block_expert.push_back(e);
  }
  std::vector<size_t> order(blocks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return blocks[x] < blocks[y]; });
  for (size_t i = 1; i < order.size(); ++i) {
    const auto& prev = blocks[order[i - 1]];
    const auto& cur = blocks[order[i]];
    QMOE_CHECK_ARG(cur.first >= prev.second, "expert_offsets", "disjoint row blocks for the experts",
              "experts " + std::to_string(block_expert[order[i - 1]]) + " and " +
                  std::to_string(block_expert[order[i]]) + " overlapping at row " + std::to_string(cur.first));
  }
}

void cutlass_w4a8_moe_mm(const W4A8MoeMmArgs& args, cudaStream_t stream, std::optional<Tactic> tactic) {
  validate_w4a8_moe_mm(args);
  GemmProblem problem;
  problem.n = args.d.size(1);
  problem.k = args.a.size(1);
  problem.total_rows = args.a.size(0);
  problem.num_experts = args.expert_offsets.size(0);
  problem.topk = args.topk;
  problem.activation_slots = args.a_slots.has_value();

  // A forced tactic is checked on every device, so a bad one fails the same way on CPU and GPU
  // (never a silent fallback); the CPU reference computes what every tactic computes.
  Tactic chosen;
  if (tactic.has_value()) {
    const std::vector<Tactic> valid = valid_tactics(problem);
    if (std::find(valid.begin(), valid.end(), *tactic) == valid.end()) {
      std::string names;
      for (const Tactic& t : valid) names += (names.empty() ? "" : ", ") + t.name();
      throw Error("tactic", "one of the tactics valid for this problem: [" + names + "]", tactic->name());
    }
    chosen = *tactic;
  } else if (args.a.is_cuda()) {
    chosen = select_tactic(problem);
  }

  if (args.a.is_cuda()) {
    cuda::w4a8_moe_mm(args, chosen, stream);
  } else {
    reference::w4a8_moe_mm(args);
  }
}

}  // namespace qmoe
