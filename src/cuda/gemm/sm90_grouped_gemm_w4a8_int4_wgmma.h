// Launcher of the WGMMA prefill kernel of the W4A8 grouped GEMM
// (sm90_grouped_gemm_w4a8_int4_wgmma.cu): 128 weight rows x tile_n (64 or 128) token rows per CTA tile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/gemm/w4a8_act_requant.h"  // ActRequantEpilogue
#include "cuda/launch.h"  // check_cuda

namespace qmoe::cuda {

struct WgmmaGemmParams {
  const uint8_t* a;               // e4m3 [R, K]
  const uint8_t* b;               // int4x2 [E, N, K/2]
  const __nv_bfloat16* b_scales;  // [E, K/512, 4N] (packed-4) or [E, K/128, N]
  const float* a_scales;          // [1] or [R]
  void* d;                        // [R, N], bf16 or fp32 (fp32: the fused MoE's GEMM1)
  const int32_t* expert_offsets;  // [E] start rows
  const int32_t* problem_sizes;   // [E, 3] (N, M_e, K)
  int num_experts, n, k;
  int a_scales_per_row;           // 1: a_scales[r]; 0: a_scales[0]
  int scales_packed4;             // 1: K % 512 == 0 layout
};

// rows: the rows of a (R).
void launch_w4a8_wgmma_prefill(const WgmmaGemmParams& params, int64_t rows, int tile_n, bool fp32_out,
                               cudaStream_t stream);

// GEMM1 of the fused w4a8_int4 pipeline with the activation and the requantization as the epilogue
// (w4a8_act_requant.h, act_requant_items.cuh): A2 and s2 instead of d. A separate struct, as for the
// mma.sync kernels: the plain kernels keep their parameter block.
struct WgmmaActGemmParams : WgmmaGemmParams {
  ActRequantEpilogue act_out;
};
void launch_w4a8_wgmma_act_requant(const WgmmaActGemmParams& params, int64_t rows, int tile_n, cudaStream_t stream);

}  // namespace qmoe::cuda
