// Host-side launchers of the Hopper kernels, called by src/api/* after validation.
// Every launcher takes validated TensorRefs on one CUDA device and a stream, allocates nothing,
// never synchronizes, and throws qmoe::Error (kind kRuntime) on a CUDA launch error.
#pragma once

#include <cuda_runtime_api.h>

#include "qmoe/fused_moe.h"
#include "qmoe/grouped_gemm.h"
#include "qmoe/tactics.h"
#include "qmoe/tensor.h"

namespace qmoe::cuda {

// True when this build contains the sm_90a kernels (QMOE_WITH_CUDA_KERNELS=ON).
bool kernels_built();

// overlap_previous: the previous kernel in the stream writes nothing this one reads or writes, so with PDL on
// (and one CTA: up to 2048 slots) it runs alongside that kernel and waits for it only at its end.
void moe_mm_data(const TensorRef& topk_ids, TensorRef expert_offsets, TensorRef problem_sizes1,
                 TensorRef problem_sizes2, TensorRef input_permutation, TensorRef output_permutation,
                 int64_t num_experts, int64_t n, int64_t k, cudaStream_t stream, bool overlap_previous = false);

// d bfloat16 (the public op) or float32 (fp32 epilogue, used by the fused MoE's GEMM1 only).
void w4a8_moe_mm(const W4A8MoeMmArgs& args, const Tactic& tactic, cudaStream_t stream);

// The fused MoE pipelines. p validated, num_local_experts <= 1024, weights and scales 16-byte
// aligned; workspace: at least the bytes of its layout (src/cuda/fused/fused_moe_workspace.h),
// 256-byte aligned. slot_rows == nullptr: finalize into p.output (fused_moe); otherwise bf16
// [T*k, H] rows per valid local slot, other slots untouched (moe_expert_rows).
// w4a8_int4 (src/cuda/fused/sm90_fused_moe_w4a8_int4.cu):
void fused_moe_w4a8_int4(const FusedMoeParams& p, const Tactic& gemm1_tactic, const Tactic& gemm2_tactic,
                         void* workspace, void* slot_rows, cudaStream_t stream);
// w4a16, w4a16_int4, w4a4, w4a8 (src/cuda/fused/sm90_fused_moe_bf16_w4.cu): bf16 x 4-bit GEMMs.
void fused_moe_bf16_w4(const FusedMoeParams& p, const Tactic& gemm1_tactic, const Tactic& gemm2_tactic,
                       void* workspace, void* slot_rows, cudaStream_t stream);

// moe_finalize on CUDA tensors (src/cuda/fused/moe_finalize.cu): p validated.
void moe_finalize(const MoeFinalizeParams& p, cudaStream_t stream);

// The expert-parallel layers' kernels (src/cuda/ep/ep_layer_kernels.cu):
// index[t*k + j] = (id / (E / W)) * C * k + t*k + j, or -1 for an id outside [0, E);
void ep_low_latency_row_index(const TensorRef& topk_ids, int64_t num_experts, int world_size, int64_t capacity,
                              TensorRef index, cudaStream_t stream);
// *value (device float) into the first 4 bytes of `count` rows `pitch` bytes apart.
void ep_broadcast_f32_rows(const float* value, void* rows, int64_t pitch, int64_t count, cudaStream_t stream);
// dst row i (dst_pitch bytes apart) = src row index[i] (src_pitch apart), `width` bytes, count rows.
void ep_gather_rows(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch, const int32_t* index,
                    int64_t count, int64_t width, cudaStream_t stream);
// The reduced combine: output[t] = sum over d = 0..W-1, in that order, of the partial row of token t
// from rank d, in fp32, rounded once to the output dtype. The row: partials[index[d*T + t]] (-1: none),
// or with index == nullptr partials[d*C + t]. output and partials: [.., H] of output.dtype.
void ep_sum_partials(const void* partials, const int32_t* index, int64_t world, int64_t capacity, TensorRef output,
                     cudaStream_t stream);

// Throws kRuntime qmoe::Error with the CUDA error string when err != cudaSuccess.
void check_cuda(cudaError_t err, const char* what);

}  // namespace qmoe::cuda
