// TensorRef: a non-owning view of a tensor (pointer, logical dtype, shape, element strides,
// device). Plain C++; the Python binding fills it from DLPack, C++ users fill it by hand.
//
// Packed 4-bit dtypes (kInt4x2, kFloat4E2M1x2) count one element per BYTE (two values):
// a [N, K] int4 matrix is a TensorRef of shape [N, K/2] and dtype kInt4x2.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "qmoe/error.h"

namespace qmoe {

enum class DType : uint8_t {
  kFloat32, kFloat16, kBFloat16,
  kFloat8E4M3,     // e4m3fn: no inf, NaN = 0x7F/0xFF, max 448
  kUE8M0,          // unsigned exponent scale: value 2^(code-127), 0xFF = NaN
  kInt4x2,         // two signed int4 per byte, even K index in the low nibble
  kFloat4E2M1x2,   // two e2m1 per byte, even K index in the low nibble
  kInt8, kUInt8, kInt32, kInt64,
};

enum class Device : uint8_t { kCPU, kCUDA };

constexpr int kMaxDims = 8;

struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device = Device::kCPU;
  int device_index = 0;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements (bytes for packed dtypes)

  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  bool is_contiguous() const {
    if (numel() == 0) return true;  // frameworks report arbitrary strides for empty tensors
    int64_t expected = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expected) return false;
      expected *= shape[i];
    }
    return true;
  }
  bool is_cuda() const { return device == Device::kCUDA; }
  template <class T> T* ptr() const { return static_cast<T*>(data); }
};

// Builds a contiguous TensorRef (C++ users and tests).
TensorRef make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = Device::kCPU,
                      int device_index = 0);

const char* dtype_name(DType dtype);
int dtype_size(DType dtype);  // bytes per stored element
bool dtype_from_name(const std::string& name, DType* out);
std::string shape_string(const TensorRef& t);

// Checks used by every entry point; each throws qmoe::Error naming `name`.
void check_dtype(const TensorRef& t, const std::string& name, DType expected);
void check_dtype_in(const TensorRef& t, const std::string& name, std::initializer_list<DType> allowed);
// -1 in `expected` matches any size.
void check_shape(const TensorRef& t, const std::string& name, std::initializer_list<int64_t> expected);
void check_ndim(const TensorRef& t, const std::string& name, int ndim);
void check_contiguous(const TensorRef& t, const std::string& name);
void check_same_device(const TensorRef& t, const std::string& name, const TensorRef& reference,
                       const std::string& reference_name);
void check_aligned(const TensorRef& t, const std::string& name, int bytes);
// Output must not share memory with an input.
void check_no_alias(const TensorRef& out, const std::string& out_name, const TensorRef& in, const std::string& in_name);

}  // namespace qmoe
