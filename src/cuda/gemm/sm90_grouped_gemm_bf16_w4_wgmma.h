// Launcher of the WGMMA tiles of the bf16 x 4-bit grouped GEMM (sm90_grouped_gemm_bf16_w4_wgmma.cu): 128
// weight rows x 64, 128 or 160 tokens per CTA tile (tactics prefill_m128_n{64,128,160}_k128). Same
// formula, layouts and limits as the mma.sync tiles (sm90_grouped_gemm_bf16_w4.h); no fused-finalize scatter
// (the pipeline scatters from decode tiles only).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/gemm/sm90_grouped_gemm_bf16_w4.h"

namespace qmoe::cuda::bf16w4 {

struct Bf16W4Params;

// tile_n: 64, 128 or 160 tokens. rows: the rows of A (the bound on every expert's rows). Throws qmoe::Error when
// params.scatter is set.
template <W4Format F>
void launch_wgmma(const Bf16W4Params& params, int tile_n, bool fp32_out, int64_t rows, cudaStream_t stream);

}  // namespace qmoe::cuda::bf16w4
