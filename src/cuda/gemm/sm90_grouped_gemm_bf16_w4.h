// Launcher of the bf16 x 4-bit grouped GEMM (sm90_grouped_gemm_bf16_w4.cu): the GEMM of the fused
// MoE's w4a16, w4a16_int4, w4a4 and w4a8 (MX) modes. Hopper has no FP4 tensor cores, so every
// operand is decoded to bf16 (exactly: DESIGN.md 3, "exactness facts") and multiplied by bf16
// tensor-core MMAs with fp32 accumulation (mma.sync decode tiles; WGMMA prefill tiles,
// sm90_grouped_gemm_bf16_w4_wgmma.cu):
//
//   int4-g128 : D[r, n] = out( s[r] * sum_g S[e, n, g] * (sum_{k in g} A[r, k] * q[e, n, k]) )
//               (SGLang's group promotion, g increasing; S bf16 in SGLang's stored layout, 3.1)
//   NVFP4     : D[r, n] = out( s[r] * sum_k A[r, k] * (e2m1[e, n, k] * e4m3 sf[e, n, k / 16]) )
//   MXFP4     : D[r, n] = out( s[r] * sum_k A[r, k] * (e2m1[e, n, k] * ue8m0 sf[e, n, k / 32]) )
//
// A bf16 [R, K] row-major, rows in expert order (the caller dequantizes NVFP4 / MXFP8
// activations to bf16 first: exact). B [E, N, K/2] packed (even k in the low nibble; FP4 with b_packed: each
// 32-bit word's bits in qmoe's packed order, core/fp4_weight_pack.h). FP4 scales in
// the 128x4 swizzled layout (DESIGN.md 3.3: [E, round_up(N, 128), round_up(K / block, 4)] bytes).
// s = row_scales[r] (fp32, nullptr = 1). out = fp32 value (d_fp32) or bf16 RNE.
// Expert e owns rows [expert_offsets[e], + problem_sizes[e][1]), both read on the device.
// Limits: K % 128 == 0 for int4, K % 32 == 0 for FP4; N % 8 == 0; E <= 1024; 16-byte aligned bases.
// scatter.out set (d bf16 only; the fused MoE's GEMM2 with the fused finalize): D is not written, the
// fp32 value v goes to out[slot / topk, n] += bf16(rsf * w[slot] * v) atomically
// (grouped_gemm_epilogue.cuh; out zeroed by the caller, 4-byte aligned, N even).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/gemm/grouped_gemm_epilogue.cuh"  // RowScatterAdd
#include "qmoe/tactics.h"

namespace qmoe::cuda {

enum class W4Format { kInt4G128, kNvfp4, kMxfp4 };

struct Bf16W4GemmArgs {
  const void* a = nullptr;                 // bf16 [max_rows, K]
  const uint8_t* b = nullptr;              // packed 4-bit [E, N, K/2]
  const void* b_scales = nullptr;          // bf16 (int4) or e4m3 / ue8m0 bytes (FP4, swizzled)
  W4Format format = W4Format::kNvfp4;
  bool b_packed = false;                   // FP4: B words in qmoe's packed order (pack_fp4_weights)
  const float* row_scales = nullptr;       // [max_rows] or nullptr (= 1)
  void* d = nullptr;                       // fp32 or bf16 [max_rows, N]
  bool d_fp32 = false;
  const int32_t* expert_offsets = nullptr; // [E] start rows (device)
  const int32_t* problem_sizes = nullptr;  // [E, 3]; [e][1] = rows of expert e (device)
  int num_experts = 0, n = 0, k = 0;
  int64_t max_rows = 0;                    // bound on the rows of all experts (sizes the grid)
  RowScatterAdd scatter;                   // out set: the fused finalize instead of d (d bf16 only)
};

// Throws qmoe::Error (kValue) when the tactic is not one of valid_tactics({..., bf16_activations =
// true}) or the limits above are not met, kRuntime on a launch error. No allocation, no host sync.
void bf16_w4_moe_mm(const Bf16W4GemmArgs& args, const Tactic& tactic, cudaStream_t stream);

}  // namespace qmoe::cuda
