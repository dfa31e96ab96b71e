// e4m3 activations -> the fp16 K slots of the W4A8 mma.sync decode tiles (int4_to_f16.cuh), once per call
// instead of once per warp and feature tile:
//
//   out[r, 8 m .. 8 m + 7] (16 bytes) = (a0, a4), (a2, a6), (a1 / 16, a5 / 16), (a3 / 16, a7 / 16)   a_i = A[r, 8 m + i]
//
// as fp16 pairs (low half first), exactly e4m3x8_to_f16_slots of the kernel, so the MMAs see the same operands
// and give the same bits. out: [rows, 2 K] bytes. Limits: K % 16 == 0, 16-byte aligned a and out.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace qmoe::cuda {

void e4m3_to_f16_slots(const uint8_t* a, uint8_t* out, int64_t rows, int64_t k, cudaStream_t stream);

}  // namespace qmoe::cuda
