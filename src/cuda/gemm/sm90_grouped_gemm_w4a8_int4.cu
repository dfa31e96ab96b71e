// Host launcher of the W4A8 grouped GEMM (cutlass_w4a8_moe_mm semantics, DESIGN.md 3.1):
//
//   D[r, o] = out( a_scale(r) * sum_g S[e, o, g] * (sum_{k in group g} A[r, k] * q[e, o, k]) )
//
// out = bf16 rounding when d is bfloat16 (the public op, validated by validate_w4a8_moe_mm), or
// the fp32 value when d is float32 (only the fused MoE pipeline passes an fp32 d: its GEMM1 output
// feeds the activation unrounded, DESIGN.md 3b). Each tactic is compiled for both output types.
// The fused MoE's GEMM2 may pass a RowScatterAdd (grouped_gemm_epilogue.cuh): every tactic then adds
// its rows into the zeroed output instead of writing d (the fused finalize, DESIGN.md 5.2).
// w4a8_moe_mm_act_requant (w4a8_act_requant.h): the fused MoE's GEMM1 with the activation and the
// requantization as the epilogue (e4m3 A2 and s2 instead of fp32 h), mma.sync decode tactics only.
//
// Kernel: sm90_grouped_gemm_w4a8_int4.cuh (swap-AB mma.sync fp16, int4 -> biased fp16 in registers,
// one K group of 128 per pipeline stage, persistent CTAs over a device-side work list).
// This file maps a Tactic (src/tune/tactics.cpp) to one of the instantiations listed below, sizes
// the persistent grid and launches. Arguments are validated by the caller
// (qmoe::validate_w4a8_moe_mm); no allocation, no host sync: CUDA-graph capturable.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "cuda/gemm/sm90_grouped_gemm_w4a8_int4.cuh"
#include "cuda/gemm/resident_ctas.h"
#include "cuda/gemm/sm90_grouped_gemm_w4a8_int4_wgmma.h"
#include "cuda/gemm/w4a8_act_requant.h"
#include "cuda/launch.h"
#include "qmoe/error.h"
#include "cuda/common/pdl.cuh"

namespace qmoe::cuda {

namespace {

using w4a8::Config;
using w4a8::sm90_grouped_gemm_w4a8_int4_kernel;


template <class OutT, int WARPS_M, int WARPS_N, int MF, int NF, int GPS, int STAGES, int WARPS_K, int MIN_BLOCKS,
          int A_BYTES = 1>
void launch_typed(const W4A8ParamsOf<OutT>& params, int64_t rows, int device, cudaStream_t stream) {
  using Cfg = Config<WARPS_M, WARPS_N, MF, NF, GPS, STAGES, WARPS_K, A_BYTES>;
  constexpr auto kernel =
      sm90_grouped_gemm_w4a8_int4_kernel<OutT, WARPS_M, WARPS_N, MF, NF, GPS, STAGES, WARPS_K, MIN_BLOCKS, A_BYTES>;
  const int fit = resident_ctas<kernel>(Cfg::kThreads, Cfg::kSmemBytes, device, "occupancy of the w4a8 grouped gemm");
  // Upper bound of the tiles (the real count is only known on the device): every expert may add
  // one partial token tile.
  const int64_t n_tiles = (params.n + Cfg::kTileM - 1) / Cfg::kTileM;
  const int64_t max_tiles = (rows / Cfg::kTileN + params.num_experts) * n_tiles;
  const int64_t grid = max_tiles < fit ? (max_tiles > 0 ? max_tiles : 1) : fit;
  launch_kernel(kernel, static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmemBytes, stream, params);
  check_cuda(cudaGetLastError(), "launch of sm90_grouped_gemm_w4a8_int4");
}

// The output type is a runtime property of d; the tile configuration is the same for both.
template <int WARPS_M, int WARPS_N, int MF, int NF, int GPS, int STAGES, int WARPS_K, int MIN_BLOCKS>
void launch(const W4A8GemmParams& params, bool fp32_out, int64_t rows, int device, cudaStream_t stream) {
  if (fp32_out) {
    launch_typed<float, WARPS_M, WARPS_N, MF, NF, GPS, STAGES, WARPS_K, MIN_BLOCKS>(params, rows, device, stream);
  } else {
    launch_typed<__nv_bfloat16, WARPS_M, WARPS_N, MF, NF, GPS, STAGES, WARPS_K, MIN_BLOCKS>(params, rows, device, stream);
  }
}

// The kernel parameters of a call (arguments validated by the caller; the launch-level checks here).
struct Prepared {
  W4A8GemmParams params;
  bool fp32_out;
  int64_t rows;
  int device;
};

Prepared prepare(const W4A8MoeMmArgs& args, const RowScatterAdd& scatter) {
  W4A8GemmParams params;
  params.a = args.a.ptr<const uint8_t>();
  params.b = args.b.ptr<const uint8_t>();
  params.b_scales = args.b_scales.ptr<const __nv_bfloat16>();
  params.a_scales = args.a_scales.ptr<const float>();
  QMOE_CHECK_ARG(args.d.dtype == DType::kBFloat16 || args.d.dtype == DType::kFloat32, "d",
            "a bfloat16 (or, inside the fused MoE, float32) output", dtype_name(args.d.dtype));
  const bool fp32_out = args.d.dtype == DType::kFloat32;
  params.d = args.d.data;
  params.expert_offsets = args.expert_offsets.ptr<const int32_t>();
  params.problem_sizes = args.problem_sizes.ptr<const int32_t>();
  params.num_experts = static_cast<int>(args.expert_offsets.size(0));
  params.n = static_cast<int>(args.d.size(1));
  params.k = static_cast<int>(args.a.size(1));
  const int64_t rows = args.a.size(0);
  params.a_scales_per_row = args.a_scales.numel() > 1 ? 1 : 0;
  params.scales_packed4 = params.k % 512 == 0 ? 1 : 0;
  params.scatter = scatter;
  if (scatter.out != nullptr)  // a pipeline bug, not a user error: GEMM1 (fp32) never scatters
    QMOE_CHECK_ARG(!fp32_out && reinterpret_cast<uintptr_t>(scatter.out) % 4 == 0 && params.n % 2 == 0, "scatter",
                   "a 4-byte aligned output of a bf16 GEMM", "an fp32 GEMM or a misaligned output");
  // 16-byte copies need 16-byte aligned bases (row strides are multiples of 16 by the limits).
  for (const auto& [t, name] : {std::pair<const TensorRef*, const char*>{&args.a, "a"}, {&args.b, "b"},
                                {&args.b_scales, "b_scales"}, {&args.d, "d"}}) {
    QMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(t->data) % 16 == 0, name, "a 16-byte aligned data pointer",
              "an address that is not 16-byte aligned");
  }
  return Prepared{params, fp32_out, rows, args.a.device_index};
}

// The 16-token tile reads the activations from args.a_slots in fp16 K slots (grouped_gemm.h, activation_slots_pay).
bool uses_activation_slots(const W4A8MoeMmArgs& args, const Tactic& tactic) {
  GemmProblem problem;
  problem.n = args.d.size(1);
  problem.k = args.a.size(1);
  problem.activation_slots = args.a_slots.has_value();
  return activation_slots_pay(problem, tactic);
}

bool is_tactic(const Tactic& tactic, Tactic::Family f, int m, int n, int k) {
  return tactic.family == f && tactic.tile_m == m && tactic.tile_n == n && tactic.tile_k == k && tactic.split_k == 1;
}

// The WGMMA tactics (prefill_m128_n{160,128,96,64,48,32}_k128: sm90_grouped_gemm_w4a8_int4_wgmma.cu).
bool is_wgmma(const Tactic& tactic) {
  return is_tactic(tactic, Tactic::Family::kPrefill, 128, 160, 128) ||
         is_tactic(tactic, Tactic::Family::kPrefill, 128, 128, 128) ||
         is_tactic(tactic, Tactic::Family::kPrefill, 128, 96, 128) ||
         is_tactic(tactic, Tactic::Family::kPrefill, 128, 64, 128) ||
         is_tactic(tactic, Tactic::Family::kPrefill, 128, 48, 128) ||
         is_tactic(tactic, Tactic::Family::kPrefill, 128, 32, 128);
}

WgmmaGemmParams wgmma_params(const W4A8GemmParams& params) {
  WgmmaGemmParams w;
  w.a = params.a;
  w.b = params.b;
  w.b_scales = params.b_scales;
  w.a_scales = params.a_scales;
  w.d = params.d;
  w.expert_offsets = params.expert_offsets;
  w.problem_sizes = params.problem_sizes;
  w.num_experts = params.num_experts;
  w.n = params.n;
  w.k = params.k;
  w.a_scales_per_row = params.a_scales_per_row;
  w.scales_packed4 = params.scales_packed4;
  return w;
}

// QMOE_WGMMA_FUSED_EPILOGUE=1: GEMM1's fused activation epilogue also on the WGMMA tiles (read per call).
// Opt-in: correct on the H200 but slower per prefill layer (w4a8_act_requant.h act_requant_pays;
// tests/python/test_gpu_fused_epilogue.py).
bool wgmma_fused_epilogue_enabled() {
  const char* v = std::getenv("QMOE_WGMMA_FUSED_EPILOGUE");
  return v != nullptr && v[0] == '1' && v[1] == '\0';
}

}  // namespace

void w4a8_moe_mm(const W4A8MoeMmArgs& args, const Tactic& tactic, cudaStream_t stream) {
  w4a8_moe_mm(args, tactic, stream, RowScatterAdd{});
}

void w4a8_moe_mm(const W4A8MoeMmArgs& args, const Tactic& tactic, cudaStream_t stream, const RowScatterAdd& scatter) {
  const Prepared prep = prepare(args, scatter);
  const W4A8GemmParams& params = prep.params;
  const bool fp32_out = prep.fp32_out;
  const int64_t rows = prep.rows;
  const int device = prep.device;
  if (rows == 0) return;  // no rows: nothing to read or write

  using Family = Tactic::Family;
  auto is = [&](Family f, int m, int n, int k) { return is_tactic(tactic, f, m, n, k); };
  // NOTE: the instantiation list. Keep it in step with compiled() in src/tune/tactics.cpp.
  // Template arguments: warps along weight rows, warps along tokens, 16-row fragments per warp,
  // 8-token fragments per warp, K groups (of 128) per pipeline stage, stages, warps splitting the
  // groups of a stage (2 for every tactic: the order of the fp32 sums depends on it, so one value
  // keeps all mma.sync tactics bitwise identical), CTAs per SM.
  // Measured on H200 (A/B runs of tests/gpu/w4a8_gemm_check.cu, bench/results/2026-11-30_s4d_*):
  //   decode n8/n16: 2 M-warps of 64 rows (4 fragments: the activation unpack and the bias MMA are
  //                  paid once per 64 rows) x 2 K warps, 2 groups per stage, 4 stages, 2 CTAs per SM;
  //                  (n8 with many tiles: 3 stages, 3 CTAs per SM, n8_tiles_fill_three_per_sm); 10-19%
  //                  faster than 4 M-warps of 32 rows. 5 stages, 4 groups per stage, or n16 with 3 stages
  //                  x 3 CTAs: slower.
  //   decode m64 n8: for grids below one CTA per SM: 2 M-warps of 32 rows x 2 K warps, 4 groups per
  //                  stage (256-byte runs of each weight row), 4 stages: Mixtral GEMM2 T = 1 64 -> 44 us.
  //   decode m128 n24: 128 rows x 24 tokens (three token fragments), 4 stages, 252 registers, no spill:
  //                  1.10-1.27x faster than n16 / n32 at 16-20 rows per expert (bench/results/2026-11-30_s11f_*).
  //   decode m128 n32: 128 rows x 32 tokens (n16's warps with 4 token fragments), 3 stages so that two
  //                  CTAs fit: 1.10-1.25x faster than n16 or the WGMMA n64 tile at 24 rows per expert
  //                  (bench/results/2026-11-30_s11b_nvidia_h200_n32_sweep.md).
  //   decode m32 n8: grids of few 64-row tiles along a long K: 2 M-warps of 16 rows x 2 K warps, 6 stages:
  //                  Mixtral GEMM2 T = 1 40.7 -> 31.2 us (bench/results/2026-12-03_s28d_*).
  //   decode n32   : 64 rows x 32 tokens, 4 groups per stage, 3 stages (not chosen by the
  //                  heuristic: measured slower than n16 or prefill; kept for forcing/tuning).
  //   prefill n64  : 2 x 2 warps of 64 rows x 32 tokens (converted weights serve 32 columns),
  //                  2 groups per stage, 3 stages, one CTA per SM (not chosen by the heuristic).
  if (is(Family::kDecode, 128, 8, 256)) {
    if (n8_tiles_fill_three_per_sm(rows, params.num_experts, params.n, device))
      launch<2, 1, 4, 1, 2, 3, 2, 3>(params, fp32_out, rows, device, stream);
    else
      launch<2, 1, 4, 1, 2, 4, 2, 2>(params, fp32_out, rows, device, stream);
  } else if (is(Family::kDecode, 128, 16, 256) && uses_activation_slots(args, tactic) && !fp32_out &&
             scatter.out == nullptr) {
    // The activations once into their fp16 K slots with their bias sums (args.a_slots), then the n16 tile without
    // its per-warp unpack and bias MMAs: the same MMA operands and sums, the same bits (e4m3_to_f16_slots.h).
    uint8_t* slots = args.a_slots->ptr<uint8_t>();
    e4m3_to_f16_slots(params.a, slots, rows, params.k, stream);
    W4A8GemmParams with_slots = params;
    with_slots.a = slots;
    launch_typed<__nv_bfloat16, 2, 1, 4, 2, 2, 4, 2, 2, /*A_BYTES=*/2>(with_slots, rows, device, stream);
  } else if (is(Family::kDecode, 128, 16, 256)) {
    launch<2, 1, 4, 2, 2, 4, 2, 2>(params, fp32_out, rows, device, stream);
  } else if (is(Family::kDecode, 128, 24, 256)) {
    launch<2, 1, 4, 3, 2, 4, 2, 2>(params, fp32_out, rows, device, stream);
  } else if (is(Family::kDecode, 128, 32, 256)) {
    launch<2, 1, 4, 4, 2, 3, 2, 2>(params, fp32_out, rows, device, stream);  // 3 stages: two CTAs fit (~95 KB each)
  } else if (is(Family::kDecode, 64, 8, 512)) {
    launch<2, 1, 2, 1, 4, 4, 2, 2>(params, fp32_out, rows, device, stream);  // n8 at half height
  } else if (is(Family::kDecode, 32, 8, 512)) {
    launch<2, 1, 1, 1, 4, 6, 2, 2>(params, fp32_out, rows, device, stream);  // n8 at quarter height, 6 stages
  } else if (is(Family::kDecode, 64, 32, 512)) {
    launch<4, 1, 1, 4, 4, 3, 2, 2>(params, fp32_out, rows, device, stream);
  } else if (is(Family::kPrefill, 128, 64, 256)) {
    launch<2, 2, 4, 4, 2, 3, 2, 1>(params, fp32_out, rows, device, stream);  // 8 warps x ~170 registers: one CTA per SM
  } else if (is_wgmma(tactic)) {
    // WGMMA kernel (sm90_grouped_gemm_w4a8_int4_wgmma.cu): 128 weight rows x 160, 128, 96, 64 or 32 tokens.
    // The pipeline scatters only with decode tiles (moe_pipeline_steps.cu fused_finalize_scatter).
    QMOE_CHECK_ARG(scatter.out == nullptr, "scatter", "no scatter with a WGMMA tactic", tactic.name());
    launch_w4a8_wgmma_prefill(wgmma_params(params), rows, tactic.tile_n, fp32_out, stream);
  } else {
    throw Error("tactic", "a tactic compiled into this build (see valid_tactics)", tactic.name());
  }
}

bool act_requant_supported(const Tactic& tactic, int64_t n, int64_t inter, Activation activation) {
  using Family = Tactic::Family;
  const bool decode = is_tactic(tactic, Family::kDecode, 128, 8, 256) || is_tactic(tactic, Family::kDecode, 128, 16, 256) ||
                      is_tactic(tactic, Family::kDecode, 128, 24, 256) || is_tactic(tactic, Family::kDecode, 128, 32, 256) ||
                      is_tactic(tactic, Family::kDecode, 64, 8, 512) || is_tactic(tactic, Family::kDecode, 64, 32, 512);
  if (!(decode || is_wgmma(tactic)) || inter <= 0) return false;
  // The WGMMA tiles' epilogue (in registers, wgmma_building_blocks.cuh) is for gated activations only.
  if (is_wgmma(tactic) && activation == Activation::kRelu2) return false;
  // Gated: a tile's F = TILE_M / 2 (64 or 32) features never straddle I nor an interleaved 64-group.
  if (activation != Activation::kRelu2) return n == 2 * inter && inter % 64 == 0;
  return n == inter && inter % 2 == 0;  // 2-byte stores of feature pairs
}

bool act_requant_pays(const Tactic& tactic, int64_t rows, int64_t num_experts, int64_t n, int device) {
  if (is_wgmma(tactic)) return wgmma_fused_epilogue_enabled();
  return !is_tactic(tactic, Tactic::Family::kDecode, 128, 8, 256) ||
         !n8_tiles_fill_three_per_sm(rows, num_experts, n, device) ||
         n8_tile_bound(rows, num_experts, n) <= kFusedActN8MaxTilesPerSm * usable_sms(device);
}

void w4a8_moe_mm_act_requant(const W4A8MoeMmArgs& args, const Tactic& tactic, cudaStream_t stream,
                             const ActRequantEpilogue& ep) {
  Prepared prep = prepare(args, RowScatterAdd{});
  // Caller bugs, not user errors: the pipeline checks act_requant_supported first.
  QMOE_CHECK_ARG(prep.fp32_out && act_requant_supported(tactic, prep.params.n, ep.inter, ep.act.activation), "tactic",
                 "a tactic with the fused activation epilogue (act_requant_supported)", tactic.name());
  QMOE_CHECK_ARG(ep.a2 != nullptr && ep.s2 != nullptr && ep.a2_scale != nullptr && reinterpret_cast<uintptr_t>(ep.a2) % 2 == 0,
                 "act_out", "A2 (2-byte aligned), s2 and a2 device pointers", "a null or misaligned pointer");
  W4A8ActGemmParams params;
  static_cast<W4A8GemmParams&>(params) = prep.params;
  params.act_out = ep;
  const int64_t rows = prep.rows;
  const int device = prep.device;
  if (rows == 0) return;
  using Family = Tactic::Family;
  // The same instantiations as w4a8_moe_mm's tactics (same accumulation, so the same h bits), with the
  // ActE4m3 epilogue.
  if (is_wgmma(tactic)) {
    WgmmaActGemmParams w;
    static_cast<WgmmaGemmParams&>(w) = wgmma_params(params);
    w.d = nullptr;  // A2 and s2 only
    w.act_out = ep;
    launch_w4a8_wgmma_act_requant(w, rows, tactic.tile_n, stream);
  } else if (is_tactic(tactic, Family::kDecode, 128, 8, 256)) {
    // The plain n8 tile's two shapes (n8_tiles_fill_three_per_sm: 3 stages, 3 CTAs per SM with many tiles).
    if (n8_tiles_fill_three_per_sm(rows, params.num_experts, params.n, device))
      launch_typed<ActE4m3, 2, 1, 4, 1, 2, 3, 2, 3>(params, rows, device, stream);
    else
      launch_typed<ActE4m3, 2, 1, 4, 1, 2, 4, 2, 2>(params, rows, device, stream);
  } else if (is_tactic(tactic, Family::kDecode, 128, 16, 256)) {
    launch_typed<ActE4m3, 2, 1, 4, 2, 2, 4, 2, 2>(params, rows, device, stream);
  } else if (is_tactic(tactic, Family::kDecode, 128, 24, 256)) {
    launch_typed<ActE4m3, 2, 1, 4, 3, 2, 4, 2, 2>(params, rows, device, stream);
  } else if (is_tactic(tactic, Family::kDecode, 128, 32, 256)) {
    launch_typed<ActE4m3, 2, 1, 4, 4, 2, 3, 2, 2>(params, rows, device, stream);
  } else if (is_tactic(tactic, Family::kDecode, 64, 8, 512)) {
    launch_typed<ActE4m3, 2, 1, 2, 1, 4, 4, 2, 2>(params, rows, device, stream);
  } else {
    launch_typed<ActE4m3, 4, 1, 1, 4, 4, 3, 2, 2>(params, rows, device, stream);
  }
}

}  // namespace qmoe::cuda
