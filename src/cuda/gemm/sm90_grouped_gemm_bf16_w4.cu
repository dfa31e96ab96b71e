// Entry of the bf16 x 4-bit grouped GEMM (formula, layouts, limits: sm90_grouped_gemm_bf16_w4.h) and of its
// GEMM1 form with the fused activation epilogue (bf16_act_requant.h):
// checks the limits, builds the kernel parameters and hands them to the weight format's
// instantiations (sm90_grouped_gemm_bf16_w4_{int4,nvfp4,mxfp4}.cu).
#include <cstdint>
#include <string>

#include "cuda/gemm/bf16_act_requant.h"
#include "cuda/gemm/resident_ctas.h"  // n8_tiles_fill_three_per_sm
#include "cuda/gemm/sm90_grouped_gemm_bf16_w4.cuh"
#include "cuda/launch.h"
#include "qmoe/error.h"

namespace qmoe::cuda {

namespace bf16w4 {
// Defined in sm90_grouped_gemm_bf16_w4_launch.cuh, instantiated once per format.
template <W4Format F>
void launch_format(const Bf16W4Params& params, const Tactic& tactic, OutKind out, int64_t rows, int device,
                   cudaStream_t stream);
}  // namespace bf16w4

namespace {

// Checks the limits, builds the kernel parameters and launches the format's configuration.
void run(const Bf16W4GemmArgs& args, const Tactic& tactic, bf16w4::OutKind out, const Bf16ActEpilogue& act,
         cudaStream_t stream) {
  const bool int4 = args.format == W4Format::kInt4G128;
  const int k_step = int4 ? 128 : 32;
  QMOE_CHECK_ARG(args.k > 0 && args.k % k_step == 0, "k", "K % " + std::to_string(k_step) + " == 0 for this weight format",
            std::to_string(args.k));
  QMOE_CHECK_ARG(args.n > 0 && args.n % 8 == 0, "n", "N % 8 == 0", std::to_string(args.n));
  QMOE_CHECK_ARG(args.num_experts > 0 && args.num_experts <= kTileListMaxExperts, "num_experts",
            "1..1024 experts", std::to_string(args.num_experts));
  const void* d = out == bf16w4::OutKind::kAct ? act.a2 : args.d;  // the fused epilogue writes A2, not d
  for (const auto& [ptr, name] : {std::pair<const void*, const char*>{args.a, "a"}, {args.b, "b"},
                                  {args.b_scales, "b_scales"}, {d, "d"}})
    QMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, name, "a 16-byte aligned data pointer",
              "an address that is not 16-byte aligned");
  if (args.scatter.out != nullptr && out != bf16w4::OutKind::kAct)  // a pipeline bug, not a user error
    QMOE_CHECK_ARG(!args.d_fp32 && reinterpret_cast<uintptr_t>(args.scatter.out) % 4 == 0 && args.n % 2 == 0,
                   "scatter", "a 4-byte aligned output of a bf16 GEMM", "an fp32 GEMM or a misaligned output");
  QMOE_CHECK_ARG(!args.b_packed || !int4, "b_packed", "FP4 weights (int4-g128 has no packed word order)",
                 "int4-g128 weights");
  if (args.max_rows == 0) return;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");

  bf16w4::Bf16W4Params p;
  p.a = static_cast<const __nv_bfloat16*>(args.a);
  p.b = args.b;
  p.b_scales = static_cast<const uint8_t*>(args.b_scales);
  p.row_scales = args.row_scales;
  p.d = args.d;
  p.expert_offsets = args.expert_offsets;
  p.problem_sizes = args.problem_sizes;
  p.num_experts = args.num_experts;
  p.n = args.n;
  p.k = args.k;
  p.scales_packed4 = int4 && args.k % 512 == 0 ? 1 : 0;
  const int block = args.format == W4Format::kNvfp4 ? 16 : 32;
  p.scale_blocks = int4 ? 0 : args.k / block;
  p.scale_col_chunks = int4 ? 0 : (p.scale_blocks + 3) / 4;
  p.fp4_packed = args.b_packed ? 1 : 0;
  p.scatter = out == bf16w4::OutKind::kAct ? RowScatterAdd{} : args.scatter;
  p.act = act;
  switch (args.format) {
    case W4Format::kInt4G128:
      bf16w4::launch_format<W4Format::kInt4G128>(p, tactic, out, args.max_rows, device, stream);
      break;
    case W4Format::kNvfp4:
      bf16w4::launch_format<W4Format::kNvfp4>(p, tactic, out, args.max_rows, device, stream);
      break;
    case W4Format::kMxfp4:
      bf16w4::launch_format<W4Format::kMxfp4>(p, tactic, out, args.max_rows, device, stream);
      break;
  }
}

}  // namespace

void bf16_w4_moe_mm(const Bf16W4GemmArgs& args, const Tactic& tactic, cudaStream_t stream) {
  run(args, tactic, args.d_fp32 ? bf16w4::OutKind::kFp32 : bf16w4::OutKind::kBf16, Bf16ActEpilogue{}, stream);
}

bool bf16_act_pays(const Tactic& tactic, int64_t rows, int64_t num_experts, int64_t n, int device) {
  const bool n8 = tactic.family == Tactic::Family::kDecode && tactic.tile_m == 128 && tactic.tile_n == 8;
  return !n8 || !n8_tiles_fill_three_per_sm(rows, num_experts, n, device) ||
         n8_tile_bound(rows, num_experts, n) <= kBf16FusedActN8MaxTilesPerSm * usable_sms(device);
}

void bf16_w4_moe_mm_act(const Bf16W4GemmArgs& args, const Tactic& tactic, cudaStream_t stream,
                        const Bf16ActEpilogue& ep) {
  if (!bf16_act_supported(tactic, args.n, ep.inter, ep.act, ep.requant))  // a pipeline bug, not a user error
    throw Error("tactic", "a tactic and sizes that take the fused activation epilogue (bf16_act_supported)",
                tactic.name(), ErrorKind::kRuntime);
  QMOE_CHECK_ARG(ep.a2 != nullptr && ep.s2 != nullptr && (ep.requant != fused::Bf16Requant::kNvfp4 ||
                                                          ep.fc2_input_scale != nullptr),
                 "act", "A2, s2 (and fc2_input_scale for NVFP4)", "a null pointer");
  run(args, tactic, bf16w4::OutKind::kAct, ep, stream);
}

}  // namespace qmoe::cuda
