// Public entry of the fused MoE (include/qmoe/fused_moe.h; DESIGN.md 1, 3b, 4, 5.2):
//
//   out[t] = rsf * sum over local slots j: w[t, j] * alpha2 * W2[e] . requant(act(alpha1 * W13[e] . x[t]))
//
// validate_fused_moe checks every dtype, shape, device, contiguity and mode/argument combination
// before any work, naming the first bad argument; fused_moe then runs the CPU reference
// (src/reference/fused_moe.cpp) on CPU tensors, or a GPU pipeline on CUDA tensors after the GPU-only
// checks below (local experts <= 1024; H % 32 == 0 and I % 32 == 0 for FP4 weights, the K step of
// the bf16 x 4-bit GEMM; 16-byte aligned weights, scales and, for the bf16 x 4-bit pipeline, x;
// tactic; workspace size, alignment and no overlap with any tensor of the call):
//   w4a8_int4                     src/cuda/fused/sm90_fused_moe_w4a8_int4.cu (int4 x e4m3 GEMMs)
//   w4a16, w4a16_int4, w4a4, w4a8 src/cuda/fused/sm90_fused_moe_bf16_w4.cu   (bf16 x 4-bit GEMMs)
// fused_moe_workspace_size returns the exact scratch bytes of the pipeline
// (src/cuda/fused/fused_moe_workspace.h), 0 for CPU tensors. p.aux_stream (the fused finalize's
// side stream for the output memset) is handed to the pipeline as is; the CPU path ignores it.
//
// Shapes (E_l = local experts, H = w2.size(1), I = 2 * w2.size(2), R1 = 2I gated / I for ReLU^2):
//   topk_ids int32 [T, k] (1 <= k <= 16), topk_weights f32 [T, k], output bf16/f16/f32 [T, H]
//   int4 modes (w4a8_int4, w4a16_int4): w1 int4x2 [E_l, R1, H/2], w2 int4x2 [E_l, H, I/2],
//     scales bf16 in SGLang's stored layout ([E_l, K/512, 4N] when K % 512 == 0, else [E_l, K/128, N]);
//     H % 128 == 0 and I % 128 == 0 (the int4 group size)
//   NVFP4 weights (w4a4, w4a16): w fp4x2, scales e4m3 swizzled [E_l, round_up(N,128), round_up(K/16,4)];
//     H % 16 == 0, I % 16 == 0
//   MXFP4 weights (w4a8): w fp4x2, scales ue8m0 swizzled [E_l, round_up(N,128), round_up(K/32,4)];
//     H % 32 == 0, I % 32 == 0
//   x / x_scale / fc2_input_scale / per_token_scale / alphas per mode: see the table in validate_mode.
// Packed and scale tensors also accept their uint8 (int4: int8) storage dtype, as FlashInfer and
// SGLang pass them; activations must carry their logical dtype.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cuda/fused/fused_moe_workspace.h"
#include "cuda/launch.h"
#include "qmoe/fused_moe.h"
#include "qmoe/routing.h"
#include "qmoe/tactics.h"

namespace qmoe {

namespace {

const std::initializer_list<DType> kInt4Storage = {DType::kInt4x2, DType::kInt8, DType::kUInt8};
const std::initializer_list<DType> kFp4Storage = {DType::kFloat4E2M1x2, DType::kUInt8};
const std::initializer_list<DType> kE4M3Storage = {DType::kFloat8E4M3, DType::kUInt8};
const std::initializer_list<DType> kUE8M0Storage = {DType::kUE8M0, DType::kUInt8};

constexpr int64_t kInt4Group = 128;
constexpr int64_t kNvfp4Block = 16;
constexpr int64_t kMxBlock = 32;
constexpr int64_t kGateUpGroup = 64;  // FlashInfer's gate/up interleave granularity

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }
std::string str(int64_t v) { return std::to_string(v); }
std::string fstr(float v) { return std::to_string(v); }

void check_has_data(const TensorRef& t, const std::string& name) {
  QMOE_CHECK_ARG(t.numel() == 0 || t.data != nullptr, name, "a non-null data pointer", "nullptr");
}

// dtype, shape, contiguity, data and device of one tensor.
void check_tensor(const TensorRef& t, const std::string& name, std::initializer_list<DType> dtypes,
                  std::initializer_list<int64_t> shape, const TensorRef& x) {
  check_dtype_in(t, name, dtypes);
  check_shape(t, name, shape);
  check_contiguous(t, name);
  check_has_data(t, name);
  check_same_device(t, name, x, "x");
}

void check_absent(const std::optional<TensorRef>& t, const std::string& name, const std::string& why) {
  QMOE_CHECK_ARG(!t.has_value(), name, "None (" + why + ")", "a tensor");
}

// An f32 [n] tensor, or [1] / [n] when per_tensor_ok.
void check_f32_vector(const TensorRef& t, const std::string& name, int64_t n, bool per_tensor_ok, const TensorRef& x) {
  check_dtype(t, name, DType::kFloat32);
  const bool ok = t.ndim == 1 && (t.size(0) == n || (per_tensor_ok && t.size(0) == 1));
  QMOE_CHECK_ARG(ok, name, per_tensor_ok ? "shape [1] or [" + str(n) + "]" : "shape [" + str(n) + "]",
            "shape " + shape_string(t));
  check_contiguous(t, name);
  check_has_data(t, name);
  check_same_device(t, name, x, "x");
}

bool is_int4_mode(QuantMode m) { return m == QuantMode::kW4A8Int4 || m == QuantMode::kW4A16Int4; }

// Weight scale shape of an N x K matrix per expert.
void check_weight_scale(const TensorRef& s, const std::string& name, QuantMode mode, int64_t experts, int64_t n,
                        int64_t k, const TensorRef& x) {
  if (is_int4_mode(mode)) {
    const int64_t g = k / kInt4Group;
    if (g % 4 == 0) {
      check_tensor(s, name, {DType::kBFloat16}, {experts, g / 4, 4 * n}, x);
    } else {
      check_tensor(s, name, {DType::kBFloat16}, {experts, g, n}, x);
    }
  } else if (mode == QuantMode::kW4A8Mx) {
    check_tensor(s, name, kUE8M0Storage, {experts, round_up(n, 128), round_up(k / kMxBlock, 4)}, x);
  } else {
    check_tensor(s, name, kE4M3Storage, {experts, round_up(n, 128), round_up(k / kNvfp4Block, 4)}, x);
  }
}

// Mode-dependent activation inputs and the scalar scales.
void validate_mode(const FusedMoeParams& p, int64_t tokens, int64_t hidden, int64_t local) {
  const TensorRef& x = p.x;
  const std::string mode = std::string("quant_mode '") + quant_mode_name(p.quant_mode) + "'";
  //            x                      x_scale              fc2_input_scale   per_token  w*_alpha
  // w4a8_int4  bf16|e4m3 [T,H]        f32 [1]|[T]|None(*)  f32 [1] | None    no         optional
  // w4a16_int4 bf16 [T,H]             no                   no                no         optional
  // w4a4       fp4x2 [T,H/2]          e4m3 [T,H/16]        f32 [1] required  f32 [T]    required
  // w4a8       e4m3 [T,H]             ue8m0 [T,H/32]       no                no         optional
  // w4a16      bf16 [T,H]             no                   no                no         required
  // (*) None = dynamic amax / 448, only for a bf16 x.
  switch (p.quant_mode) {
    case QuantMode::kW4A8Int4:
      check_dtype_in(x, "x", {DType::kBFloat16, DType::kFloat8E4M3});
      check_shape(x, "x", {tokens, hidden});
      if (p.x_scale) {
        check_f32_vector(*p.x_scale, "x_scale", tokens, true, x);
      } else {
        QMOE_CHECK_ARG(x.dtype == DType::kBFloat16, "x_scale",
                  "a f32 [1] or [T] dequant scale a1 (required when x is already float8_e4m3fn; "
                  "None means dynamic quantization of a bfloat16 x)",
                  "None");
      }
      if (p.fc2_input_scale) check_f32_vector(*p.fc2_input_scale, "fc2_input_scale", 1, true, x);
      check_absent(p.per_token_scale, "per_token_scale", "only quant_mode 'w4a4' takes a per-token scale");
      break;
    case QuantMode::kW4A16Int4:
    case QuantMode::kW4A16:
      check_dtype(x, "x", DType::kBFloat16);
      check_shape(x, "x", {tokens, hidden});
      check_absent(p.x_scale, "x_scale", mode + " takes a bfloat16 x without scales");
      check_absent(p.fc2_input_scale, "fc2_input_scale", mode + " keeps a bfloat16 intermediate");
      check_absent(p.per_token_scale, "per_token_scale", "only quant_mode 'w4a4' takes a per-token scale");
      break;
    case QuantMode::kW4A4:
      check_dtype_in(x, "x", kFp4Storage);
      check_shape(x, "x", {tokens, hidden / 2});
      QMOE_CHECK_ARG(p.x_scale.has_value(), "x_scale", "e4m3 block scales [T, H/16] (required by " + mode + ")", "None");
      check_tensor(*p.x_scale, "x_scale", kE4M3Storage, {tokens, hidden / kNvfp4Block}, x);
      QMOE_CHECK_ARG(p.fc2_input_scale.has_value(), "fc2_input_scale",
                "a f32 [1] encode scale of the intermediate (required by " + mode + ")", "None");
      check_f32_vector(*p.fc2_input_scale, "fc2_input_scale", 1, false, x);
      if (p.per_token_scale) check_f32_vector(*p.per_token_scale, "per_token_scale", tokens, false, x);
      break;
    case QuantMode::kW4A8Mx:
      check_dtype(x, "x", DType::kFloat8E4M3);
      check_shape(x, "x", {tokens, hidden});
      QMOE_CHECK_ARG(p.x_scale.has_value(), "x_scale", "ue8m0 block scales [T, H/32] (required by " + mode + ")", "None");
      check_tensor(*p.x_scale, "x_scale", kUE8M0Storage, {tokens, hidden / kMxBlock}, x);
      check_absent(p.fc2_input_scale, "fc2_input_scale", mode + " requantizes to MXFP8, which needs no global scale");
      check_absent(p.per_token_scale, "per_token_scale", "only quant_mode 'w4a4' takes a per-token scale");
      break;
  }
  check_contiguous(x, "x");
  check_has_data(x, "x");

  // NVFP4 weights carry their global decode scale in the alphas: without them the result is wrong.
  const bool alphas_required = p.quant_mode == QuantMode::kW4A4 || p.quant_mode == QuantMode::kW4A16;
  QMOE_CHECK_ARG(!alphas_required || p.w1_alpha.has_value(), "w1_alpha",
            "a f32 [E_l] per-expert GEMM1 scale (required by " + mode + ")", "None");
  QMOE_CHECK_ARG(!alphas_required || p.w2_alpha.has_value(), "w2_alpha",
            "a f32 [E_l] per-expert GEMM2 scale (required by " + mode + ")", "None");
  if (p.w1_alpha) check_f32_vector(*p.w1_alpha, "w1_alpha", local, false, x);
  if (p.w2_alpha) check_f32_vector(*p.w2_alpha, "w2_alpha", local, false, x);
}

void validate_activation(const FusedMoeParams& p, int64_t inter) {
  const bool swiglu = p.activation == Activation::kSwiglu;
  const bool situ = p.activation == Activation::kSitu;
  const std::string act = std::string("activation '") + activation_name(p.activation) + "'";
  // Parameters of another activation are refused rather than silently ignored.
  QMOE_CHECK_ARG(swiglu || p.swiglu_alpha == 1.0f, "swiglu_alpha", "1 (it only applies to activation 'swiglu')",
            fstr(p.swiglu_alpha) + " with " + act);
  QMOE_CHECK_ARG(swiglu || p.swiglu_beta == 0.0f, "swiglu_beta", "0 (it only applies to activation 'swiglu')",
            fstr(p.swiglu_beta) + " with " + act);
  QMOE_CHECK_ARG(swiglu || p.swiglu_limit == std::numeric_limits<float>::max(), "swiglu_limit",
            "FLT_MAX (it only applies to activation 'swiglu')", fstr(p.swiglu_limit) + " with " + act);
  QMOE_CHECK_ARG(std::isfinite(p.swiglu_alpha), "swiglu_alpha", "a finite value", fstr(p.swiglu_alpha));
  QMOE_CHECK_ARG(std::isfinite(p.swiglu_beta), "swiglu_beta", "a finite value", fstr(p.swiglu_beta));
  QMOE_CHECK_ARG(p.swiglu_limit > 0.0f, "swiglu_limit", "a value > 0", fstr(p.swiglu_limit));
  QMOE_CHECK_ARG(situ || p.situ_beta == 1.0f, "situ_beta", "1 (it only applies to activation 'situ')",
            fstr(p.situ_beta) + " with " + act);
  QMOE_CHECK_ARG(situ || !p.situ_linear_beta.has_value(), "situ_linear_beta",
            "None (it only applies to activation 'situ')", fstr(p.situ_linear_beta.value_or(0.0f)) + " with " + act);
  QMOE_CHECK_ARG(std::isfinite(p.situ_beta) && p.situ_beta > 0.0f, "situ_beta", "a finite value > 0", fstr(p.situ_beta));
  if (p.situ_linear_beta) {
    const float lb = *p.situ_linear_beta;
    QMOE_CHECK_ARG(std::isfinite(lb) && lb > 0.0f, "situ_linear_beta", "a finite value > 0", fstr(lb));
  }
  // The interleaved gate/up layout pairs 64-row groups; ReLU^2 has no gate/up split, so any layout is fine.
  if (p.activation != Activation::kRelu2 && p.gate_up_layout == GateUpLayout::kUpGateInterleaved64) {
    QMOE_CHECK_ARG(inter % kGateUpGroup == 0, "gate_up_layout",
              "intermediate size I % 64 == 0 for the [up; gate] 64-row interleaved layout", "I = " + str(inter));
  }
}

}  // namespace

const char* quant_mode_name(QuantMode m) {
  switch (m) {
    case QuantMode::kW4A4: return "w4a4";
    case QuantMode::kW4A8Mx: return "w4a8";
    case QuantMode::kW4A16: return "w4a16";
    case QuantMode::kW4A8Int4: return "w4a8_int4";
    case QuantMode::kW4A16Int4: return "w4a16_int4";
  }
  return "unknown";
}

bool quant_mode_from_name(const std::string& name, QuantMode* out) {
  for (QuantMode m : {QuantMode::kW4A4, QuantMode::kW4A8Mx, QuantMode::kW4A16, QuantMode::kW4A8Int4,
                      QuantMode::kW4A16Int4}) {
    if (name == quant_mode_name(m)) {
      *out = m;
      return true;
    }
  }
  return false;
}

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::kSwiglu: return "swiglu";
    case Activation::kGegluTanh: return "geglu_tanh";
    case Activation::kRelu2: return "relu2";
    case Activation::kSitu: return "situ";
  }
  return "unknown";
}

namespace {

// Every input of the layer (all but the output); shared by fused_moe and moe_expert_rows.
void validate_inputs(const FusedMoeParams& p) {
  // Enums may come from integers across the binding.
  const int mode_value = static_cast<int>(p.quant_mode);
  QMOE_CHECK_ARG(mode_value >= 0 && mode_value <= static_cast<int>(QuantMode::kW4A16Int4), "quant_mode",
            "one of w4a4, w4a8, w4a16, w4a8_int4, w4a16_int4", "value " + str(mode_value));
  const int act_value = static_cast<int>(p.activation);
  QMOE_CHECK_ARG(act_value >= 0 && act_value <= static_cast<int>(Activation::kSitu), "activation",
            "one of swiglu, geglu_tanh, relu2, situ", "value " + str(act_value));
  const int layout_value = static_cast<int>(p.gate_up_layout);
  QMOE_CHECK_ARG(layout_value == 0 || layout_value == 1, "gate_up_layout", "kGateUp or kUpGateInterleaved64",
            "value " + str(layout_value));

  // Routing.
  const TensorRef& x = p.x;
  check_dtype(p.topk_ids, "topk_ids", DType::kInt32);
  check_ndim(p.topk_ids, "topk_ids", 2);
  const int64_t tokens = p.topk_ids.size(0), topk = p.topk_ids.size(1);
  QMOE_CHECK_ARG(topk >= 1 && topk <= kMaxTopK, "topk_ids", "top_k = topk_ids.size(1) in [1, 16]", "top_k = " + str(topk));
  check_tensor(p.topk_ids, "topk_ids", {DType::kInt32}, {tokens, topk}, x);
  check_tensor(p.topk_weights, "topk_weights", {DType::kFloat32}, {tokens, topk}, x);

  // Experts.
  QMOE_CHECK_ARG(p.num_experts >= 1, "num_experts", "a value >= 1", str(p.num_experts));
  const int64_t local = p.num_local_experts == 0 ? p.num_experts : p.num_local_experts;
  QMOE_CHECK_ARG(local >= 1, "num_local_experts", "a value >= 1 (0 means num_experts)", str(p.num_local_experts));
  QMOE_CHECK_ARG(p.local_expert_offset >= 0, "local_expert_offset", "a value >= 0", str(p.local_expert_offset));
  QMOE_CHECK_ARG(local <= p.num_experts && p.local_expert_offset <= p.num_experts - local, "num_local_experts",
            "local_expert_offset + num_local_experts <= num_experts = " + str(p.num_experts),
            str(p.local_expert_offset) + " + " + str(local));

  // Weights: w2 [E_l, H, I/2] defines H and I; w1 [E_l, R1, H/2].
  const QuantMode mode = p.quant_mode;
  const auto weight_types = is_int4_mode(mode) ? kInt4Storage : kFp4Storage;
  check_dtype_in(p.w2, "w2", weight_types);
  check_ndim(p.w2, "w2", 3);
  const int64_t hidden = p.w2.size(1), inter = 2 * p.w2.size(2);
  QMOE_CHECK_ARG(hidden > 0 && inter > 0, "w2", "a non-empty [E_l, H, I/2] tensor", "shape " + shape_string(p.w2));
  const int64_t block = is_int4_mode(mode) ? kInt4Group : mode == QuantMode::kW4A8Mx ? kMxBlock : kNvfp4Block;
  const std::string block_why = is_int4_mode(mode) ? "the int4 weight group size"
                                : mode == QuantMode::kW4A8Mx ? "the MX block size"
                                                             : "the NVFP4 block size";
  QMOE_CHECK_ARG(hidden % block == 0, "w2", "hidden size H = w2.size(1) divisible by " + str(block) + " (" + block_why + ")",
            "H = " + str(hidden));
  QMOE_CHECK_ARG(inter % block == 0, "w2",
            "intermediate size I = 2 * w2.size(2) divisible by " + str(block) + " (" + block_why + ")",
            "I = " + str(inter));
  check_tensor(p.w2, "w2", weight_types, {local, hidden, inter / 2}, x);
  const bool gated = p.activation != Activation::kRelu2;
  const int64_t rows1 = gated ? 2 * inter : inter;
  check_tensor(p.w1, "w1", weight_types, {local, rows1, hidden / 2}, x);
  check_weight_scale(p.w1_scale, "w1_scale", mode, local, rows1, hidden, x);
  check_weight_scale(p.w2_scale, "w2_scale", mode, local, hidden, inter, x);
  QMOE_CHECK_ARG(!p.fp4_weights_packed || !is_int4_mode(mode), "fp4_weights_packed",
                 "false for int4 weights (packed words are an FP4 weight layout)",
                 std::string("true with quant_mode ") + quant_mode_name(mode));

  validate_mode(p, tokens, hidden, local);
  validate_activation(p, inter);
  QMOE_CHECK_ARG(std::isfinite(p.routed_scaling_factor), "routed_scaling_factor", "a finite value",
            fstr(p.routed_scaling_factor));
}

// An output (written, never read) must not overlap any input.
void check_output_no_alias(const FusedMoeParams& p, const TensorRef& out, const char* out_name) {
  std::vector<std::pair<const TensorRef*, const char*>> inputs = {
      {&p.x, "x"},   {&p.topk_ids, "topk_ids"}, {&p.topk_weights, "topk_weights"}, {&p.w1, "w1"},
      {&p.w1_scale, "w1_scale"}, {&p.w2, "w2"}, {&p.w2_scale, "w2_scale"}};
  const std::pair<const std::optional<TensorRef>*, const char*> optionals[] = {
      {&p.x_scale, "x_scale"}, {&p.w1_alpha, "w1_alpha"}, {&p.fc2_input_scale, "fc2_input_scale"},
      {&p.w2_alpha, "w2_alpha"}, {&p.per_token_scale, "per_token_scale"}};
  for (const auto& [t, name] : optionals)
    if (t->has_value()) inputs.emplace_back(&t->value(), name);
  for (const auto& [t, name] : inputs) check_no_alias(out, out_name, *t, name);
}

}  // namespace

void validate_fused_moe(const FusedMoeParams& p) {
  validate_inputs(p);
  const int64_t tokens = p.topk_ids.size(0), hidden = p.w2.size(1);
  check_dtype_in(p.output, "output", {DType::kBFloat16, DType::kFloat16, DType::kFloat32});
  check_tensor(p.output, "output", {DType::kBFloat16, DType::kFloat16, DType::kFloat32}, {tokens, hidden}, p.x);
  check_output_no_alias(p, p.output, "output");
}

void validate_moe_expert_rows(const FusedMoeParams& p, const TensorRef& rows) {
  validate_inputs(p);
  const int64_t slots = p.topk_ids.size(0) * p.topk_ids.size(1), hidden = p.w2.size(1);
  check_tensor(rows, "rows", {DType::kBFloat16}, {slots, hidden}, p.x);
  check_output_no_alias(p, rows, "rows");
}

// moe_expert_rows and moe_expert_rows_workspace_size: at the end of this file (they use the GPU checks).

namespace {

using GpuDims = cuda::FusedMoeDims;  // sizes of one validated problem, as the GPU pipeline sees them
GpuDims gpu_dims(const FusedMoeParams& p) { return cuda::fused_moe_dims(p); }

// Every quant mode has a GPU pipeline: w4a8_int4 its own (int4 x e4m3 GEMMs), the others the
// bf16 x 4-bit one.
bool has_gpu_path(const FusedMoeParams& p) { return p.x.is_cuda(); }
bool uses_bf16_pipeline(const FusedMoeParams& p) { return p.quant_mode != QuantMode::kW4A8Int4; }

int64_t gpu_workspace_bytes(const FusedMoeParams& p, const GpuDims& d) {
  if (uses_bf16_pipeline(p))
    return cuda::fused_moe_bf16_w4_workspace_layout(d.slots, d.local, d.hidden, d.inter, d.rows1).total;
  return cuda::fused_moe_workspace_layout(d.slots, d.local, d.hidden, d.inter, d.rows1).total;
}

void check_aligned16(const TensorRef& t, const std::string& name) {
  QMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(t.data) % 16 == 0, name,
            "a 16-byte aligned data pointer (the GPU kernels copy 16-byte chunks)",
            "an address that is not 16-byte aligned");
}

// Limits of the GPU pipelines that validate_fused_moe (device independent) does not impose; checked
// by fused_moe_workspace_size too, so a call the GPU cannot run fails before anything is allocated.
void check_gpu_limits(const FusedMoeParams& p, const GpuDims& d) {
  QMOE_CHECK_ARG(d.local <= kMaxExperts, "num_local_experts",
            "at most " + std::to_string(kMaxExperts) + " local experts on the GPU (routing scan and GEMM work list)",
            str(d.local));
  if (!is_int4_mode(p.quant_mode)) {
    // The bf16 x 4-bit GEMM decodes FP4 weights 32 K-values at a time (one MX block, two NVFP4
    // blocks), and the requant kernel maps 16/32-blocks of I onto warp lanes: K = H for GEMM1 and
    // K = I for GEMM2 must be multiples of 32 (validation asks only 16 of NVFP4 weights).
    constexpr int64_t kGpuKStep = 32;
    QMOE_CHECK_ARG(d.hidden % kGpuKStep == 0, "w2",
              "hidden size H = w2.size(1) divisible by 32 on the GPU (the K step of its FP4 GEMM)",
              "H = " + str(d.hidden));
    QMOE_CHECK_ARG(d.inter % kGpuKStep == 0, "w2",
              "intermediate size I = 2 * w2.size(2) divisible by 32 on the GPU (the K step of its FP4 GEMM)",
              "I = " + str(d.inter));
  }
  for (const auto& [t, name] : {std::pair<const TensorRef*, const char*>{&p.w1, "w1"}, {&p.w1_scale, "w1_scale"},
                                {&p.w2, "w2"}, {&p.w2_scale, "w2_scale"}})
    check_aligned16(*t, name);
  // The bf16 x 4-bit pipeline gathers x in 16-byte chunks (rows stay aligned: H % 32 == 0).
  if (uses_bf16_pipeline(p)) check_aligned16(p.x, "x");
}

// The tactic of one of the two GEMMs: the forced one (checked against the problem) or the heuristic's.
Tactic gemm_tactic(const FusedMoeParams& p, const GpuDims& d, int64_t n, int64_t k) {
  GemmProblem problem;
  problem.n = n;
  problem.k = k;
  problem.total_rows = d.slots;  // an upper bound: the local rows are only known on the device
  problem.num_experts = d.local;
  problem.topk = d.topk;
  problem.bf16_activations = uses_bf16_pipeline(p);  // the other kernel, with its own tactic list
  problem.fp4_weights = problem.bf16_activations && p.quant_mode != QuantMode::kW4A16Int4;
  if (p.tactic.empty()) return select_tactic(problem);
  const Tactic forced = parse_tactic(p.tactic);
  const std::vector<Tactic> valid = valid_tactics(problem);
  bool ok = false;
  std::string names;
  for (const Tactic& t : valid) {
    ok = ok || t == forced;
    names += (names.empty() ? "" : ", ") + t.name();
  }
  QMOE_CHECK_ARG(ok, "tactic", "one of the tactics valid for both GEMMs: [" + names + "]", "'" + p.tactic + "'");
  return forced;
}

}  // namespace

namespace {

// Scratch bytes of a validated call: 0 on the CPU (the reference allocates its own). A call the GPU
// cannot run fails here already, so a caller never allocates for it.
int64_t workspace_bytes_of(const FusedMoeParams& p) {
  if (!has_gpu_path(p)) return 0;
  const GpuDims d = gpu_dims(p);
  check_gpu_limits(p, d);
  return gpu_workspace_bytes(p, d);
}

// A forced tactic names a GPU kernel configuration; the reference has none to honour.
void check_no_cpu_tactic(const FusedMoeParams& p) {
  QMOE_CHECK_ARG(p.tactic.empty(), "tactic", "empty on CPU tensors (the CPU reference has no tactics)",
            "'" + p.tactic + "'");
}

// The GPU pipeline of a validated call on CUDA tensors, after the GPU-only checks: `out` is the
// tensor it writes (fused_moe's output, or moe_expert_rows' rows when slot_rows is given), named
// `out_name`; `op` and `size_fn` name the entry point and its workspace-size function in errors.
void run_gpu_pipeline(const FusedMoeParams& p, const TensorRef& out, const char* out_name, const char* op,
                      const char* size_fn, void* workspace, int64_t workspace_bytes, void* slot_rows,
                      cudaStream_t stream) {
  const GpuDims d = gpu_dims(p);
  check_gpu_limits(p, d);  // before the build check: a call the GPU cannot run is refused by name
  if (!cuda::kernels_built()) {
    throw Error(op, "a qmoe build with CUDA kernels (QMOE_WITH_CUDA_KERNELS=ON)",
                "a CPU-only build; pass CPU tensors or rebuild", ErrorKind::kRuntime);
  }
  const Tactic gemm1 = gemm_tactic(p, d, d.rows1, d.hidden);
  const Tactic gemm2 = gemm_tactic(p, d, d.hidden, d.inter);
  const int64_t need = gpu_workspace_bytes(p, d);
  QMOE_CHECK_ARG(workspace != nullptr && workspace_bytes >= need, "workspace",
            "a CUDA buffer of at least " + str(need) + " bytes (" + size_fn + ")",
            workspace == nullptr ? std::string("nullptr") : str(workspace_bytes) + " bytes");
  QMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(workspace) % cuda::FusedMoeWorkspaceLayout::kAlign == 0, "workspace",
            "a " + str(cuda::FusedMoeWorkspaceLayout::kAlign) + "-byte aligned pointer (as cudaMalloc returns)",
            "an address that is not " + str(cuda::FusedMoeWorkspaceLayout::kAlign) + "-byte aligned");
  // The pipeline writes every byte of the workspace: it must not overlap any tensor of the call.
  TensorRef ws = out;
  ws.data = workspace;
  ws.dtype = DType::kUInt8;
  ws.ndim = 1;
  ws.shape[0] = workspace_bytes;
  ws.strides[0] = 1;
  check_no_alias(ws, "workspace", out, out_name);
  check_output_no_alias(p, ws, "workspace");  // every input, optional ones included
  if (uses_bf16_pipeline(p)) {
    cuda::fused_moe_bf16_w4(p, gemm1, gemm2, workspace, slot_rows, stream);
  } else {
    cuda::fused_moe_w4a8_int4(p, gemm1, gemm2, workspace, slot_rows, stream);
  }
}

}  // namespace

int64_t fused_moe_workspace_size(const FusedMoeParams& p) {
  validate_fused_moe(p);
  return workspace_bytes_of(p);
}

int64_t fused_moe_workspace_bound(QuantMode mode, int64_t max_tokens, int64_t topk, int64_t local_experts,
                                  int64_t hidden, int64_t inter, Activation activation) {
  QMOE_CHECK_ARG(max_tokens >= 0 && max_tokens <= (int64_t{1} << 31), "max_num_tokens", "a count in [0, 2^31]",
                 str(max_tokens));
  QMOE_CHECK_ARG(topk >= 1 && topk <= 16, "top_k", "1..16", str(topk));
  QMOE_CHECK_ARG(local_experts >= 1 && local_experts <= kMaxExperts, "num_local_experts", "1..1024",
                 str(local_experts));
  QMOE_CHECK_ARG(hidden > 0 && inter > 0, "hidden_size", "positive hidden and intermediate sizes",
                 str(hidden) + ", " + str(inter));
  const int64_t slots = max_tokens * topk, rows1 = activation != Activation::kRelu2 ? 2 * inter : inter;
  // The layouts are sums of per-buffer sizes that grow with the slot count: the bound is the size at max_tokens.
  return mode == QuantMode::kW4A8Int4
             ? cuda::fused_moe_workspace_layout(slots, local_experts, hidden, inter, rows1).total
             : cuda::fused_moe_bf16_w4_workspace_layout(slots, local_experts, hidden, inter, rows1).total;
}

void fused_moe(const FusedMoeParams& p, void* workspace, int64_t workspace_bytes, cudaStream_t stream) {
  validate_fused_moe(p);
  if (p.x.is_cuda()) {
    run_gpu_pipeline(p, p.output, "output", "fused_moe", "fused_moe_workspace_size", workspace, workspace_bytes,
                     nullptr, stream);
    return;
  }
  check_no_cpu_tactic(p);
  reference::fused_moe(p);
}

// ---- moe_expert_rows (expert parallelism): fused_moe's pipeline up to GEMM2, rows per flat slot ----
// The workspace and every pre-launch check are fused_moe's (the pipelines are the same up to GEMM2).

int64_t moe_expert_rows_workspace_size(const FusedMoeParams& p, const TensorRef& rows) {
  validate_moe_expert_rows(p, rows);
  return workspace_bytes_of(p);
}

void moe_expert_rows(const FusedMoeParams& p, const TensorRef& rows, void* workspace, int64_t workspace_bytes,
                     cudaStream_t stream) {
  validate_moe_expert_rows(p, rows);
  if (p.x.is_cuda()) {
    run_gpu_pipeline(p, rows, "rows", "moe_expert_rows", "moe_expert_rows_workspace_size", workspace,
                     workspace_bytes, rows.data, stream);
    return;
  }
  check_no_cpu_tactic(p);
  reference::moe_expert_rows(p, rows);
}

}  // namespace qmoe
