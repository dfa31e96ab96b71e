// Host-side launchers of the GPU quantizers and layout helpers (include/qmoe/formats.h), called by
// src/reference/formats.cpp after it has validated every argument (shapes, dtypes, one CUDA device,
// contiguity, no aliasing). Each launcher takes CUDA TensorRefs and a stream, allocates nothing,
// never synchronizes the host (CUDA-graph capturable), and throws qmoe::Error (kind kRuntime) when a
// launch fails. Results are bit-identical to the CPU functions of the same name (the kernels use
// the QMOE_HD scalar codecs of formats.h); see each .cu file for its mapping of threads to data.
// In CPU-only builds (QMOE_WITH_CUDA_KERNELS=OFF) src/cuda_disabled/quant_not_built.cpp defines
// them as functions that throw.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "qmoe/tensor.h"

namespace qmoe::cuda {

// ---- quantize_fp8.cu ----
// per_row: scale has one element per row of x (else one element).
void quantize_fp8(const TensorRef& x, const TensorRef& scale, bool per_row, TensorRef q, cudaStream_t stream);
void fp8_dynamic_scale(const TensorRef& x, bool per_row, TensorRef scale, cudaStream_t stream);
void dequantize_fp8(const TensorRef& q, const TensorRef& scale, bool per_row, TensorRef out, cudaStream_t stream);

// ---- quantize_block_scaled.cu ----
void quantize_nvfp4(const TensorRef& x, float global_scale, TensorRef q, TensorRef sf, cudaStream_t stream);
void dequantize_nvfp4(const TensorRef& q, const TensorRef& sf, float global_scale, TensorRef out,
                      cudaStream_t stream);
// fp4: MXFP4 (e2m1 elements), else MXFP8 (e4m3 elements).
void quantize_mx(const TensorRef& x, TensorRef q, TensorRef sf, bool fp4, cudaStream_t stream);
void dequantize_mx(const TensorRef& q, const TensorRef& sf, TensorRef out, bool fp4, cudaStream_t stream);
void quantize_int4_g128(const TensorRef& w, TensorRef q, TensorRef scales, cudaStream_t stream);
void dequantize_int4_g128(const TensorRef& q, const TensorRef& scales, TensorRef out, cudaStream_t stream);

// ---- scale_layouts.cu ----
// plain [E, rows, cols] (E = 1 for 2-D) <-> swizzled [E, round_up(rows,128), round_up(cols,4)].
void swizzle_scales_128x4(const TensorRef& sf, TensorRef out, int64_t experts, int64_t rows, int64_t cols,
                          cudaStream_t stream);
void unswizzle_scales_128x4(const TensorRef& swizzled, TensorRef sf, int64_t experts, int64_t rows, int64_t cols,
                            cudaStream_t stream);
// logical [E, N, G] <-> SGLang's stored layout (to_stored: logical -> stored).
void interleave_int4_scales(const TensorRef& logical, TensorRef stored, bool to_stored, cudaStream_t stream);
// W13 [E, 2I, C] row-block reorder (to_flashinfer: SGLang -> FlashInfer).
void reorder_gate_up(const TensorRef& w, TensorRef out, bool to_flashinfer, cudaStream_t stream);
// FP4 weight words to (pack) or from qmoe's packed order (core/fp4_weight_pack.h); numel % 4 == 0.
void convert_fp4_words(const TensorRef& w, TensorRef out, bool pack, cudaStream_t stream);

}  // namespace qmoe::cuda
