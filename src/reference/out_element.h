// One element of a bf16 / fp16 / fp32 output on the host, as the CPU engines write their outputs and
// read their own partial rows back (the reference finalize, the EP reduced combine's sum): bf16 and
// fp16 round to nearest even from fp32 (float_to_bf16, float_to_half_bits); reading is exact.
#pragma once

#include <cstdint>

#include "qmoe/formats.h"
#include "qmoe/tensor.h"
#include "reference/f16_bits.h"

namespace qmoe {

// dtype: bf16, fp16 or fp32 (any other dtype is read and written as fp32: callers validated it).
inline float load_out_element(DType dtype, const void* data, int64_t index) {
  switch (dtype) {
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(data)[index]);
    case DType::kFloat16: return half_bits_to_float(static_cast<const uint16_t*>(data)[index]);
    default: return static_cast<const float*>(data)[index];
  }
}

inline void store_out_element(DType dtype, void* data, int64_t index, float v) {
  switch (dtype) {
    case DType::kBFloat16: static_cast<uint16_t*>(data)[index] = float_to_bf16(v); break;
    case DType::kFloat16: static_cast<uint16_t*>(data)[index] = float_to_half_bits(v); break;
    default: static_cast<float*>(data)[index] = v; break;
  }
}

}  // namespace qmoe
