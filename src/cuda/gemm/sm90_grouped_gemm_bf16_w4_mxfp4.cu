// Instantiations of the bf16 x 4-bit grouped GEMM for mxfp4 weights (sm90_grouped_gemm_bf16_w4_launch.cuh).
#include "cuda/gemm/sm90_grouped_gemm_bf16_w4_launch.cuh"

namespace qmoe::cuda::bf16w4 {
template void launch_format<W4Format::kMxfp4>(const Bf16W4Params&, const Tactic&, OutKind, int64_t, int, cudaStream_t);
}  // namespace qmoe::cuda::bf16w4
