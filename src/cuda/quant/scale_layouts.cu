// Layout helpers on the GPU (include/qmoe/formats.h, DESIGN.md 3.1 and 3.3; CPU twin in
// src/reference/formats.cpp). Pure data movement, so the outputs are byte-identical to the CPU's.
//   swizzle_scales_128x4   out byte at swizzled_offset(e, r, c) = sf[e, r, c]; padding bytes = 0.
//                          One thread per OUTPUT byte, which inverts the offset formula
//                          ((e*Mt + r/128)*Kt + c/4)*512 + (r%32)*16 + ((r%128)/32)*4 + c%4, so every
//                          byte (padding included) is written exactly once: no memset, no races.
//   unswizzle_scales_128x4 one thread per plain byte, reading its swizzled offset.
//   (de)interleave_int4_scales  one thread per logical element S[e, n, g] (2 or 4 bytes), stored at
//                          [e, g/4, 4n + g%4] when G % 4 == 0, else [e, g, n].
//   gate_up reorders       64-row blocks of W13 [E, 2I, C] move whole; one thread per 16-byte unit
//                          when both pointers are 16-byte aligned (a block is 64 rows, so its byte
//                          size is a multiple of 16), else per byte.
// Limits: none beyond memory; indices are int64.
#include <cuda_runtime.h>

#include "cuda/quant/quant_common.cuh"
#include "cuda/quant/quant_launch.h"
#include "core/fp4_weight_pack.h"

namespace qmoe::cuda {

namespace {

using quant::kThreads;

#define QMOE_GRID_STRIDE(i, n)                                                                \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

constexpr int64_t kTileBytes = 512;  // a 128x4 tile of 1-byte scales

__device__ __forceinline__ int64_t swizzled_offset_device(int64_t e, int64_t r, int64_t c, int64_t row_tiles,
                                                          int64_t col_tiles) {
  return ((e * row_tiles + r / 128) * col_tiles + c / 4) * kTileBytes + (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4);
}

__global__ void swizzle_kernel(const uint8_t* __restrict__ sf, int64_t rows, int64_t cols, int64_t row_tiles,
                               int64_t col_tiles, int64_t total, uint8_t* __restrict__ out) {
  QMOE_GRID_STRIDE(o, total) {
    // Invert the offset: tile index, then (r % 32) = line, ((r % 128) / 32) and (c % 4) in the line.
    const int64_t tile = o / kTileBytes, in_tile = o % kTileBytes;
    const int64_t line = in_tile / 16, in_line = in_tile % 16;
    const int64_t col_tile = tile % col_tiles, row_tile = (tile / col_tiles) % row_tiles;
    const int64_t e = tile / (col_tiles * row_tiles);
    const int64_t r = row_tile * 128 + (in_line / 4) * 32 + line;
    const int64_t c = col_tile * 4 + in_line % 4;
    out[o] = (r < rows && c < cols) ? sf[(e * rows + r) * cols + c] : 0;
  }
}

__global__ void unswizzle_kernel(const uint8_t* __restrict__ swizzled, int64_t rows, int64_t cols, int64_t row_tiles,
                                 int64_t col_tiles, int64_t total, uint8_t* __restrict__ sf) {
  QMOE_GRID_STRIDE(i, total) {
    const int64_t c = i % cols, r = (i / cols) % rows, e = i / (cols * rows);
    sf[i] = swizzled[swizzled_offset_device(e, r, c, row_tiles, col_tiles)];
  }
}

__device__ __forceinline__ int64_t stored_index(int64_t e, int64_t n, int64_t g, int64_t num_n, int64_t num_g) {
  if (num_g % 4 == 0) return (e * (num_g / 4) + g / 4) * (4 * num_n) + 4 * n + (g % 4);
  return (e * num_g + g) * num_n + n;
}

template <class T>
__global__ void interleave_kernel(T* __restrict__ logical, T* __restrict__ stored, int64_t num_n, int64_t num_g,
                                  int64_t total, bool to_stored) {
  QMOE_GRID_STRIDE(i, total) {
    const int64_t g = i % num_g, n = (i / num_g) % num_n, e = i / (num_g * num_n);
    const int64_t s = stored_index(e, n, g, num_n, num_g);
    if (to_stored) stored[s] = logical[i];
    else logical[i] = stored[s];
  }
}

// Unit = uint4 (16 bytes) or uint8_t. Sizes are in units. Output unit u of expert e sits in
// output block ob; the source block follows the two conventions of formats.h.
template <class Unit>
__global__ void gate_up_kernel(const Unit* __restrict__ w, Unit* __restrict__ out, int64_t expert_units,
                               int64_t block_units, int64_t half_blocks, int64_t total, bool to_flashinfer) {
  QMOE_GRID_STRIDE(u, total) {
    const int64_t e = u / expert_units, within = u % expert_units;
    const int64_t ob = within / block_units, offset = within % block_units;
    int64_t src_block;
    if (to_flashinfer) src_block = (ob % 2 == 0) ? half_blocks + ob / 2 : ob / 2;  // [up j, gate j] pairs
    else src_block = ob < half_blocks ? 2 * ob + 1 : 2 * (ob - half_blocks);     // gate j, then up j
    out[u] = w[e * expert_units + src_block * block_units + offset];
  }
}

#undef QMOE_GRID_STRIDE

}  // namespace

void swizzle_scales_128x4(const TensorRef& sf, TensorRef out, int64_t experts, int64_t rows, int64_t cols,
                          cudaStream_t stream) {
  const int64_t row_tiles = (rows + 127) / 128, col_tiles = (cols + 3) / 4;
  const int64_t total = experts * row_tiles * col_tiles * kTileBytes;
  if (total == 0) return;
  DeviceGuard guard(sf.device_index);
  swizzle_kernel<<<quant::grid_for(total), kThreads, 0, stream>>>(quant::data<const uint8_t>(sf), rows, cols,
                                                                  row_tiles, col_tiles, total,
                                                                  quant::data<uint8_t>(out));
  quant::check_launch("qmoe::swizzle_scales_128x4 (CUDA launch)");
}

void unswizzle_scales_128x4(const TensorRef& swizzled, TensorRef sf, int64_t experts, int64_t rows, int64_t cols,
                            cudaStream_t stream) {
  const int64_t total = experts * rows * cols;
  if (total == 0) return;
  const int64_t row_tiles = (rows + 127) / 128, col_tiles = (cols + 3) / 4;
  DeviceGuard guard(sf.device_index);
  unswizzle_kernel<<<quant::grid_for(total), kThreads, 0, stream>>>(quant::data<const uint8_t>(swizzled), rows, cols,
                                                                    row_tiles, col_tiles, total,
                                                                    quant::data<uint8_t>(sf));
  quant::check_launch("qmoe::unswizzle_scales_128x4 (CUDA launch)");
}

void interleave_int4_scales(const TensorRef& logical, TensorRef stored, bool to_stored, cudaStream_t stream) {
  const int64_t total = logical.numel();
  if (total == 0) return;
  const int64_t num_n = logical.shape[1], num_g = logical.shape[2];
  DeviceGuard guard(logical.device_index);
  const unsigned grid = quant::grid_for(total);
  // Only bytes move: float32 as uint32_t, bfloat16 as uint16_t (the two dtypes formats.cpp accepts).
  if (dtype_size(logical.dtype) == 4)
    interleave_kernel<<<grid, kThreads, 0, stream>>>(quant::data<uint32_t>(logical), quant::data<uint32_t>(stored),
                                                     num_n, num_g, total, to_stored);
  else
    interleave_kernel<<<grid, kThreads, 0, stream>>>(quant::data<uint16_t>(logical), quant::data<uint16_t>(stored),
                                                     num_n, num_g, total, to_stored);
  quant::check_launch(to_stored ? "qmoe::interleave_int4_scales (CUDA launch)"
                                : "qmoe::deinterleave_int4_scales (CUDA launch)");
}

void reorder_gate_up(const TensorRef& w, TensorRef out, bool to_flashinfer, cudaStream_t stream) {
  const int64_t experts = w.ndim == 3 ? w.shape[0] : 1;
  const int64_t two_i = w.size(-2);
  const int64_t row_bytes = w.size(-1) * dtype_size(w.dtype);
  const int64_t block_bytes = 64 * row_bytes;  // 64-row groups (formats.h)
  const int64_t expert_bytes = two_i * row_bytes;
  const int64_t total_bytes = experts * expert_bytes;
  if (total_bytes == 0) return;
  const int64_t half_blocks = two_i / 128;
  DeviceGuard guard(w.device_index);
  const bool vec = reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && reinterpret_cast<uintptr_t>(out.data) % 16 == 0;
  if (vec) {
    // block_bytes = 64 * row_bytes is a multiple of 16, and so are expert_bytes and total_bytes.
    const int64_t total = total_bytes / 16;
    gate_up_kernel<<<quant::grid_for(total), kThreads, 0, stream>>>(
        quant::data<const uint4>(w), quant::data<uint4>(out), expert_bytes / 16, block_bytes / 16, half_blocks, total,
        to_flashinfer);
  } else {
    gate_up_kernel<<<quant::grid_for(total_bytes), kThreads, 0, stream>>>(
        quant::data<const uint8_t>(w), quant::data<uint8_t>(out), expert_bytes, block_bytes, half_blocks, total_bytes,
        to_flashinfer);
  }
  quant::check_launch(to_flashinfer ? "qmoe::gate_up_sglang_to_flashinfer (CUDA launch)"
                                    : "qmoe::gate_up_flashinfer_to_sglang (CUDA launch)");
}

// One 32-bit word per thread (grid-stride). The bit permutation is a 32-iteration loop over constants: this
// runs once per weight load, not per forward.
__global__ void fp4_words_kernel(const uint32_t* __restrict__ in, uint32_t* __restrict__ out, int64_t words,
                                 bool pack) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = pack ? fp4pack::pack_word(in[i]) : fp4pack::unpack_word(in[i]);
}

void convert_fp4_words(const TensorRef& w, TensorRef out, bool pack, cudaStream_t stream) {
  const int64_t words = w.numel() / 4;
  if (words == 0) return;
  DeviceGuard guard(w.device_index);
  QMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(w.data) % 4 == 0 && reinterpret_cast<uintptr_t>(out.data) % 4 == 0,
                 pack ? "w" : "packed", "4-byte aligned data (and out)", "an address that is not 4-byte aligned");
  fp4_words_kernel<<<quant::grid_for(words), kThreads, 0, stream>>>(quant::data<const uint32_t>(w),
                                                                    quant::data<uint32_t>(out), words, pack);
  quant::check_launch(pack ? "qmoe::pack_fp4_weights (CUDA launch)" : "qmoe::unpack_fp4_weights (CUDA launch)");
}

}  // namespace qmoe::cuda
