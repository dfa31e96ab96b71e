// TensorRef helpers and the argument checks shared by every entry point.
#include "qmoe/tensor.h"

#include <cstring>

namespace qmoe {

namespace {
struct DTypeInfo {
  DType dtype;
  const char* name;
  int size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kFloat32, "float32", 4},       {DType::kFloat16, "float16", 2},    {DType::kBFloat16, "bfloat16", 2},
    {DType::kFloat8E4M3, "float8_e4m3fn", 1}, {DType::kUE8M0, "float8_e8m0fnu", 1}, {DType::kInt4x2, "int4x2", 1},
    {DType::kFloat4E2M1x2, "float4_e2m1fn_x2", 1}, {DType::kInt8, "int8", 1}, {DType::kUInt8, "uint8", 1},
    {DType::kInt32, "int32", 4},          {DType::kInt64, "int64", 8},
};
const DTypeInfo& info(DType d) {
  for (const auto& i : kDTypes)
    if (i.dtype == d) return i;
  return kDTypes[0];
}
}  // namespace

TensorRef make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device, int device_index) {
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.device_index = device_index;
  check_arg(static_cast<int>(shape.size()) <= kMaxDims, "shape", "at most 8 dimensions",
            std::to_string(shape.size()));
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

const char* dtype_name(DType dtype) { return info(dtype).name; }
int dtype_size(DType dtype) { return info(dtype).size; }

bool dtype_from_name(const std::string& name, DType* out) {
  for (const auto& i : kDTypes) {
    if (name == i.name) {
      *out = i.dtype;
      return true;
    }
  }
  return false;
}

std::string shape_string(const TensorRef& t) {
  // NOTE: no iostreams in the library: a host toolchain that links libstdc++ statically into
  // the extension leaves the stream locale uninitialised beside torch (seen: a crash here).
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

void check_dtype(const TensorRef& t, const std::string& name, DType expected) {
  check_arg(t.dtype == expected, name, std::string("dtype ") + dtype_name(expected),
            std::string("dtype ") + dtype_name(t.dtype), ErrorKind::kType);
}

void check_dtype_in(const TensorRef& t, const std::string& name, std::initializer_list<DType> allowed) {
  std::string expected = "dtype ";
  bool first = true;
  for (DType d : allowed) {
    if (d == t.dtype) return;
    expected += (first ? "" : " or ") + std::string(dtype_name(d));
    first = false;
  }
  throw Error(name, expected, std::string("dtype ") + dtype_name(t.dtype), ErrorKind::kType);
}

void check_ndim(const TensorRef& t, const std::string& name, int ndim) {
  check_arg(t.ndim == ndim, name, std::to_string(ndim) + "-D tensor",
            std::to_string(t.ndim) + "-D tensor of shape " + shape_string(t));
}

void check_shape(const TensorRef& t, const std::string& name, std::initializer_list<int64_t> expected) {
  bool ok = t.ndim == static_cast<int>(expected.size());
  std::string want = "shape [";
  int i = 0;
  for (int64_t e : expected) {
    want += (i ? ", " : "") + (e < 0 ? std::string("*") : std::to_string(e));
    if (ok && e >= 0 && t.shape[i] != e) ok = false;
    ++i;
  }
  want += "]";
  check_arg(ok, name, want, "shape " + shape_string(t));
}

void check_contiguous(const TensorRef& t, const std::string& name) {
  check_arg(t.is_contiguous(), name, "a contiguous (row-major) tensor", "strides that are not row-major");
}

void check_same_device(const TensorRef& t, const std::string& name, const TensorRef& reference,
                       const std::string& reference_name) {
  auto where = [](const TensorRef& x) {
    return x.device == Device::kCPU ? std::string("cpu") : "cuda:" + std::to_string(x.device_index);
  };
  check_arg(t.device == reference.device && (t.device == Device::kCPU || t.device_index == reference.device_index),
            name, "a tensor on " + where(reference) + " (the device of '" + reference_name + "')", where(t));
}

void check_aligned(const TensorRef& t, const std::string& name, int bytes) {
  check_arg(reinterpret_cast<uintptr_t>(t.data) % bytes == 0, name,
            "a data pointer aligned to " + std::to_string(bytes) + " bytes", "a misaligned pointer");
}

void check_no_alias(const TensorRef& out, const std::string& out_name, const TensorRef& in,
                    const std::string& in_name) {
  if (out.data == nullptr || in.data == nullptr) return;
  auto lo_o = reinterpret_cast<uintptr_t>(out.data);
  auto hi_o = lo_o + static_cast<uintptr_t>(out.numel()) * dtype_size(out.dtype);
  auto lo_i = reinterpret_cast<uintptr_t>(in.data);
  auto hi_i = lo_i + static_cast<uintptr_t>(in.numel()) * dtype_size(in.dtype);
  check_arg(hi_o <= lo_i || hi_i <= lo_o, out_name, "memory that does not overlap input '" + in_name + "'",
            "an output that aliases '" + in_name + "'");
}

}  // namespace qmoe
