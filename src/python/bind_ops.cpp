// Bindings of the MoE ops: routing data, W4A8 grouped GEMM, fused MoE (+ its workspace size), the
// per-slot rows + finalize halves of the deterministic layer (expert parallelism), tactics.
// Python passes tensors as _C.Arg and the caller framework's stream as an integer.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cuda/launch.h"
#include "python/tensor_arg.h"
#include "qmoe/expert_parallel_layer.h"
#include "qmoe/fused_moe.h"
#include "qmoe/grouped_gemm.h"
#include "qmoe/routing.h"
#include "qmoe/tactics.h"

namespace qmoe::python {

namespace {

std::optional<TensorRef> opt(const Arg* a) {
  if (a == nullptr) return std::nullopt;
  return a->ref;
}
cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

Activation activation_from_name(const std::string& name) {
  for (Activation a : {Activation::kSwiglu, Activation::kGegluTanh, Activation::kRelu2, Activation::kSitu})
    if (name == activation_name(a)) return a;
  throw Error("activation", "one of 'swiglu', 'geglu_tanh', 'relu2', 'situ'", "'" + name + "'");
}

GateUpLayout layout_from_name(const std::string& name) {
  if (name == "gate_up") return GateUpLayout::kGateUp;
  if (name == "up_gate_interleaved64") return GateUpLayout::kUpGateInterleaved64;
  throw Error("gate_up_layout", "'gate_up' (SGLang) or 'up_gate_interleaved64' (FlashInfer)", "'" + name + "'");
}

GemmProblem problem_of(int64_t n, int64_t k, int64_t total_rows, int64_t num_experts, int64_t topk,
                       bool bf16_activations = false, bool fp4_weights = false) {
  GemmProblem p;
  p.bf16_activations = bf16_activations;
  p.fp4_weights = fp4_weights;
  p.n = n;
  p.k = k;
  p.total_rows = total_rows;
  p.num_experts = num_experts;
  p.topk = topk;
  return p;
}

W4A8MoeMmArgs mm_args(const Arg& d, const Arg& a, const Arg& b, const Arg& a_scales, const Arg& b_scales,
                      const Arg& expert_offsets, const Arg& problem_sizes, const Arg* a_strides,
                      const Arg* b_strides, const Arg* d_strides, const Arg* s_strides, int64_t chunk_size,
                      int64_t topk) {
  W4A8MoeMmArgs args;
  args.d = d.ref;
  args.a = a.ref;
  args.b = b.ref;
  args.a_scales = a_scales.ref;
  args.b_scales = b_scales.ref;
  args.expert_offsets = expert_offsets.ref;
  args.problem_sizes = problem_sizes.ref;
  args.a_strides = opt(a_strides);
  args.b_strides = opt(b_strides);
  args.d_strides = opt(d_strides);
  args.s_strides = opt(s_strides);
  args.chunk_size = chunk_size;
  args.topk = topk;
  return args;
}

FusedMoeParams fused_params(const std::string& quant_mode, const Arg& x, const Arg* x_scale, const Arg& topk_ids,
                            const Arg& topk_weights, const Arg& w1, const Arg& w1_scale, const Arg* w1_alpha,
                            const Arg* fc2_input_scale, const Arg& w2, const Arg& w2_scale, const Arg* w2_alpha,
                            const Arg* per_token_scale, const Arg& output, int64_t num_experts,
                            int64_t num_local_experts, int64_t local_expert_offset, const std::string& activation,
                            float swiglu_alpha, float swiglu_beta, float swiglu_limit, float situ_beta,
                            std::optional<float> situ_linear_beta, const std::string& gate_up_layout,
                            bool deterministic, float routed_scaling_factor, const std::string& tactic) {
  FusedMoeParams p;
  check_arg(quant_mode_from_name(quant_mode, &p.quant_mode), "quant_mode",
            "one of 'w4a4', 'w4a8', 'w4a16', 'w4a8_int4', 'w4a16_int4'", "'" + quant_mode + "'");
  p.x = x.ref;
  p.x_scale = opt(x_scale);
  p.topk_ids = topk_ids.ref;
  p.topk_weights = topk_weights.ref;
  p.w1 = w1.ref;
  p.w1_scale = w1_scale.ref;
  p.w1_alpha = opt(w1_alpha);
  p.fc2_input_scale = opt(fc2_input_scale);
  p.w2 = w2.ref;
  p.w2_scale = w2_scale.ref;
  p.w2_alpha = opt(w2_alpha);
  p.per_token_scale = opt(per_token_scale);
  p.output = output.ref;
  p.num_experts = num_experts;
  p.num_local_experts = num_local_experts;
  p.local_expert_offset = local_expert_offset;
  p.activation = activation_from_name(activation);
  p.swiglu_alpha = swiglu_alpha;
  p.swiglu_beta = swiglu_beta;
  p.swiglu_limit = swiglu_limit;
  p.situ_beta = situ_beta;
  p.situ_linear_beta = situ_linear_beta;
  p.gate_up_layout = layout_from_name(gate_up_layout);
  p.deterministic = deterministic;
  p.routed_scaling_factor = routed_scaling_factor;
  p.tactic = tactic;
  return p;
}

// One fused-MoE layer call as Python hands it over: the parameters, plus the Python argument objects
// that own its tensors (so a LayerCall stays valid for as long as Python holds it). fused_moe,
// fused_moe_workspace_size and moe_expert_rows all take one.
struct LayerCall {
  FusedMoeParams params;
  std::vector<nb::object> owners;
};

// The argument names of LayerCall's constructor.
#define FUSED_MOE_ARGS                                                                                              \
  nb::arg("quant_mode"), nb::arg("x"), nb::arg("x_scale").none(), nb::arg("topk_ids"), nb::arg("topk_weights"),   \
      nb::arg("w1"), nb::arg("w1_scale"), nb::arg("w1_alpha").none(), nb::arg("fc2_input_scale").none(),          \
      nb::arg("w2"), nb::arg("w2_scale"), nb::arg("w2_alpha").none(), nb::arg("per_token_scale").none(),          \
      nb::arg("output"), nb::arg("num_experts"), nb::arg("num_local_experts"), nb::arg("local_expert_offset"),    \
      nb::arg("activation"), nb::arg("swiglu_alpha"), nb::arg("swiglu_beta"), nb::arg("swiglu_limit"),            \
      nb::arg("situ_beta"), nb::arg("situ_linear_beta").none(), nb::arg("gate_up_layout"),                        \
      nb::arg("deterministic"), nb::arg("routed_scaling_factor"), nb::arg("tactic")

}  // namespace

void bind_expert_parallel(nb::module_& m);  // src/python/bind_expert_parallel.cpp

void bind_ops(nb::module_& m) {
  bind_expert_parallel(m);
  m.def("kernels_built", &cuda::kernels_built, "True when this build holds the sm_90a kernels.");

  m.def(
      "moe_mm_data",
      [](const Arg& topk_ids, Arg& expert_offsets, Arg& problem_sizes1, Arg& problem_sizes2, Arg& input_permutation,
         Arg& output_permutation, int64_t num_experts, int64_t n, int64_t k, uintptr_t stream) {
        nb::gil_scoped_release release;
        get_cutlass_w4a8_moe_mm_data(topk_ids.ref, expert_offsets.ref, problem_sizes1.ref, problem_sizes2.ref,
                                     input_permutation.ref, output_permutation.ref, num_experts, n, k,
                                     as_stream(stream));
      },
      nb::arg("topk_ids"), nb::arg("expert_offsets"), nb::arg("problem_sizes1"), nb::arg("problem_sizes2"),
      nb::arg("input_permutation"), nb::arg("output_permutation"), nb::arg("num_experts"), nb::arg("n"),
      nb::arg("k"), nb::arg("stream") = 0);

  m.def(
      "w4a8_moe_mm",
      [](Arg& d, const Arg& a, const Arg& b, const Arg& a_scales, const Arg& b_scales, const Arg& expert_offsets,
         const Arg& problem_sizes, const Arg* a_strides, const Arg* b_strides, const Arg* d_strides,
         const Arg* s_strides, int64_t chunk_size, int64_t topk, uintptr_t stream,
         const std::optional<std::string>& tactic, Arg* a_slots) {
        W4A8MoeMmArgs args = mm_args(d, a, b, a_scales, b_scales, expert_offsets, problem_sizes, a_strides,
                                     b_strides, d_strides, s_strides, chunk_size, topk);
        if (a_slots != nullptr) args.a_slots = a_slots->ref;
        std::optional<Tactic> forced;
        if (tactic.has_value()) forced = parse_tactic(*tactic);
        nb::gil_scoped_release release;
        cutlass_w4a8_moe_mm(args, as_stream(stream), forced);
      },
      nb::arg("d"), nb::arg("a"), nb::arg("b"), nb::arg("a_scales"), nb::arg("b_scales"),
      nb::arg("expert_offsets"), nb::arg("problem_sizes"), nb::arg("a_strides").none(),
      nb::arg("b_strides").none(), nb::arg("d_strides").none(), nb::arg("s_strides").none(),
      nb::arg("chunk_size") = 128, nb::arg("topk") = 8, nb::arg("stream") = 0, nb::arg("tactic").none() = nb::none(),
      nb::arg("a_slots").none() = nb::none());
  // Whether cutlass_w4a8_moe_mm would use an a_slots scratch ([R, 2K + K/32] uint8) for this problem and tactic (the
  // forced one, else the heuristic's with the scratch given): the Python wrappers allocate one only then.
  m.def(
      "w4a8_activation_slots",
      [](int64_t n, int64_t k, int64_t total_rows, int64_t num_experts, int64_t topk,
         const std::optional<std::string>& tactic) {
        GemmProblem problem = problem_of(n, k, total_rows, num_experts, topk);
        problem.activation_slots = true;
        return activation_slots_pay(problem, tactic.has_value() ? parse_tactic(*tactic) : select_tactic(problem));
      },
      nb::arg("n"), nb::arg("k"), nb::arg("total_rows"), nb::arg("num_experts"), nb::arg("topk") = 8,
      nb::arg("tactic").none() = nb::none());

  m.def(
      "select_tactic",
      [](int64_t n, int64_t k, int64_t total_rows, int64_t num_experts, int64_t topk, bool bf16_activations,
         bool fp4_weights, bool activation_slots) {
        GemmProblem problem = problem_of(n, k, total_rows, num_experts, topk, bf16_activations, fp4_weights);
        problem.activation_slots = activation_slots;
        return select_tactic(problem).name();
      },
      nb::arg("n"), nb::arg("k"), nb::arg("total_rows"), nb::arg("num_experts"), nb::arg("topk") = 8,
      nb::arg("bf16_activations") = false, nb::arg("fp4_weights") = false, nb::arg("activation_slots") = false);
  m.def(
      "valid_tactics",
      [](int64_t n, int64_t k, int64_t total_rows, int64_t num_experts, int64_t topk, bool bf16_activations) {
        std::vector<std::string> names;
        for (const Tactic& t : valid_tactics(problem_of(n, k, total_rows, num_experts, topk, bf16_activations)))
          names.push_back(t.name());
        return names;
      },
      nb::arg("n"), nb::arg("k"), nb::arg("total_rows"), nb::arg("num_experts"), nb::arg("topk") = 8,
      nb::arg("bf16_activations") = false);

  nb::class_<LayerCall>(m, "LayerCall")
      .def(
          "__init__",
          [](LayerCall* self, const std::string& quant_mode, const Arg& x, const Arg* x_scale, const Arg& topk_ids,
             const Arg& topk_weights, const Arg& w1, const Arg& w1_scale, const Arg* w1_alpha,
             const Arg* fc2_input_scale, const Arg& w2, const Arg& w2_scale, const Arg* w2_alpha,
             const Arg* per_token_scale, const Arg& output, int64_t num_experts, int64_t num_local_experts,
             int64_t local_expert_offset, const std::string& activation, float swiglu_alpha, float swiglu_beta,
             float swiglu_limit, float situ_beta, std::optional<float> situ_linear_beta,
             const std::string& gate_up_layout, bool deterministic, float routed_scaling_factor,
             const std::string& tactic) {
            LayerCall call{fused_params(quant_mode, x, x_scale, topk_ids, topk_weights, w1, w1_scale, w1_alpha,
                                        fc2_input_scale, w2, w2_scale, w2_alpha, per_token_scale, output,
                                        num_experts, num_local_experts, local_expert_offset, activation,
                                        swiglu_alpha, swiglu_beta, swiglu_limit, situ_beta, situ_linear_beta,
                                        gate_up_layout, deterministic, routed_scaling_factor, tactic),
                           {}};
            for (const Arg* a : {&x, x_scale, &topk_ids, &topk_weights, &w1, &w1_scale, w1_alpha, fc2_input_scale,
                                 &w2, &w2_scale, w2_alpha, per_token_scale, &output})
              if (a != nullptr) call.owners.push_back(nb::find(a));
            new (self) LayerCall(std::move(call));
          },
          FUSED_MOE_ARGS)
      .def_prop_rw(
          "tactic", [](const LayerCall& c) { return c.params.tactic; },
          [](LayerCall& c, const std::string& tactic) { c.params.tactic = tactic; })
      .def_prop_rw(
          "enable_pdl", [](const LayerCall& c) { return c.params.enable_pdl; },
          [](LayerCall& c, bool on) { c.params.enable_pdl = on; })
      .def_prop_rw(
          "fp4_weights_packed", [](const LayerCall& c) { return c.params.fp4_weights_packed; },
          [](LayerCall& c, bool on) { c.params.fp4_weights_packed = on; })
      // The fused finalize's side stream for the output memset (raw cudaStream_t; 0: none).
      .def_prop_rw(
          "aux_stream", [](const LayerCall& c) { return reinterpret_cast<uintptr_t>(c.params.aux_stream); },
          [](LayerCall& c, uintptr_t s) { c.params.aux_stream = as_stream(s); });

  // Bytes of scratch the GPU pipeline needs (validates the whole call first, so a bad call fails
  // before anything is allocated); 0 on the CPU.
  // Scratch bytes of the GPU pipeline for any call of this layer with at most `tokens` tokens (the
  // size grows with T): what a wrapper pre-allocates once so that its calls can be graph-captured.
  // Scratch bytes for any call of this layer with at most `tokens` tokens (include/qmoe/fused_moe.h).
  m.def(
      "fused_moe_workspace_bound",
      [](const std::string& quant_mode, int64_t tokens, int64_t topk, int64_t local_experts, int64_t hidden,
         int64_t inter, bool gated) {
        QuantMode mode = QuantMode::kW4A4;
        QMOE_CHECK_ARG(quant_mode_from_name(quant_mode, &mode), "quant_mode",
                       "one of 'w4a4', 'w4a8', 'w4a16', 'w4a8_int4', 'w4a16_int4'", "'" + quant_mode + "'");
        return fused_moe_workspace_bound(mode, tokens, topk, local_experts, hidden, inter,
                                         gated ? Activation::kSwiglu : Activation::kRelu2);
      },
      nb::arg("quant_mode"), nb::arg("tokens"), nb::arg("topk"), nb::arg("local_experts"), nb::arg("hidden"),
      nb::arg("inter"), nb::arg("gated"));
  m.def("fused_moe_workspace_size", [](const LayerCall& c) { return fused_moe_workspace_size(c.params); },
        nb::arg("call"));

  m.def(
      "fused_moe",
      [](const LayerCall& c, const Arg* workspace, uintptr_t stream) {
        void* ws = workspace ? workspace->ref.data : nullptr;
        const int64_t ws_bytes = workspace ? workspace->ref.numel() * dtype_size(workspace->ref.dtype) : 0;
        nb::gil_scoped_release release;
        fused_moe(c.params, ws, ws_bytes, as_stream(stream));
      },
      nb::arg("call"), nb::arg("workspace").none(), nb::arg("stream"));

  // The call's `output` is rows bf16 [T*k, H], written per local slot (include/qmoe/fused_moe.h);
  // deterministic and routed_scaling_factor are not used. CUDA tensors: workspace of
  // moe_expert_rows_workspace_size bytes, work enqueued on `stream`.
  m.def("moe_expert_rows_workspace_size",
        [](const LayerCall& c) { return moe_expert_rows_workspace_size(c.params, c.params.output); },
        nb::arg("call"));
  m.def(
      "moe_expert_rows",
      [](const LayerCall& c, const Arg* workspace, uintptr_t stream) {
        void* ws = workspace ? workspace->ref.data : nullptr;
        const int64_t ws_bytes = workspace ? workspace->ref.numel() * dtype_size(workspace->ref.dtype) : 0;
        nb::gil_scoped_release release;
        moe_expert_rows(c.params, c.params.output, ws, ws_bytes, as_stream(stream));
      },
      nb::arg("call"), nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0);
  // The C++ low-latency expert-parallel layer (include/qmoe/expert_parallel_layer.h) on an NCCL
  // communicator (an int pointer, e.g. NcclTransport.comm): the call's tensors are this rank's (local
  // experts, deterministic), its output [T, H]; workspace of ep_low_latency_layer_workspace_size bytes.
  m.def(
      "ep_low_latency_layer_workspace_size",
      [](const LayerCall& c, int world_size, int rank, int64_t max_tokens_per_rank) {
        return ep::low_latency_layer_workspace_size(ep::LowLatencyLayer{c.params, world_size, rank, max_tokens_per_rank});
      },
      nb::arg("call"), nb::arg("world_size"), nb::arg("rank"), nb::arg("max_tokens_per_rank"));
  m.def(
      "ep_low_latency_layer",
      [](const LayerCall& c, int world_size, int rank, int64_t max_tokens_per_rank, uintptr_t comm,
         const Arg* workspace, uintptr_t stream) {
        void* ws = workspace ? workspace->ref.data : nullptr;
        const int64_t ws_bytes = workspace ? workspace->ref.numel() * dtype_size(workspace->ref.dtype) : 0;
        const ep::LowLatencyLayer layer{c.params, world_size, rank, max_tokens_per_rank};
        nb::gil_scoped_release release;
        ep::low_latency_layer(layer, ep::nccl_exchange(reinterpret_cast<void*>(comm)), ws, ws_bytes, as_stream(stream));
      },
      nb::arg("call"), nb::arg("world_size"), nb::arg("rank"), nb::arg("max_tokens_per_rank"), nb::arg("comm"),
      nb::arg("workspace").none(), nb::arg("stream"));
  // The C++ throughput layer (host plan, counts first; it allocates and waits on the host).
  m.def(
      "ep_throughput_layer",
      [](const LayerCall& c, int world_size, int rank, uintptr_t comm, uintptr_t stream) {
        const ep::ThroughputLayer layer{c.params, world_size, rank};
        nb::gil_scoped_release release;
        ep::throughput_layer(layer, ep::nccl_exchange(reinterpret_cast<void*>(comm)), as_stream(stream));
      },
      nb::arg("call"), nb::arg("world_size"), nb::arg("rank"), nb::arg("comm"), nb::arg("stream"));
#undef FUSED_MOE_ARGS

  m.def(
      "moe_finalize",
      [](const Arg& rows, const Arg& topk_ids, const Arg& topk_weights, Arg& output, int64_t num_experts,
         int64_t num_local_experts, int64_t local_expert_offset, float routed_scaling_factor, uintptr_t stream,
         const Arg* row_index) {
        MoeFinalizeParams p;
        p.rows = rows.ref;
        if (row_index) p.row_index = row_index->ref;
        p.topk_ids = topk_ids.ref;
        p.topk_weights = topk_weights.ref;
        p.output = output.ref;
        p.num_experts = num_experts;
        p.num_local_experts = num_local_experts;
        p.local_expert_offset = local_expert_offset;
        p.routed_scaling_factor = routed_scaling_factor;
        nb::gil_scoped_release release;
        moe_finalize(p, as_stream(stream));
      },
      nb::arg("rows"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("output"), nb::arg("num_experts"),
      nb::arg("num_local_experts"), nb::arg("local_expert_offset"), nb::arg("routed_scaling_factor"),
      nb::arg("stream") = 0, nb::arg("row_index").none() = nb::none());
}

}  // namespace qmoe::python
