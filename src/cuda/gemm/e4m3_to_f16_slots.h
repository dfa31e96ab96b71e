// e4m3 activations -> the operands of the W4A8 mma.sync decode tiles (int4_to_f16.cuh), once per call instead of
// once per warp and feature tile. Row r of out (pitch 2K + K / 32 bytes):
//
//   bytes [16 m, 16 m + 16)  = (a0, a4), (a2, a6), (a1 / 16, a5 / 16), (a3 / 16, a7 / 16)   a_i = A[r, 8 m + i]
//                              as fp16 pairs (low half first): the B registers of the tiles' K step, as they are;
//   bytes [2K + 4 g, + 4)    = fp32 bias sum of group g, the chain of bias_mma_step over the group's 16 steps
//                              (sum_k A[r, k] x (-8 2^-24) as the tensor cores add it up),
//
// exactly what the tiles compute from e4m3 themselves (the same instructions), so they give the same bits.
// Limits: K % 512 == 0 (16-byte aligned row pitch), 16-byte aligned a and out.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace qmoe::cuda {

// Bytes of one output row.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t f16_slots_row_bytes(int64_t k) { return 2 * k + k / 32; }

void e4m3_to_f16_slots(const uint8_t* a, uint8_t* out, int64_t rows, int64_t k, cudaStream_t stream);

}  // namespace qmoe::cuda
