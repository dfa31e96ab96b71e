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
bool known_dtype(DType d) {
  for (const auto& i : kDTypes)
    if (i.dtype == d) return true;
  return false;
}
}  // namespace

// Every check below starts here: a TensorRef is a plain struct a C++ caller fills by hand, so its
// fields are checked before any of them is used (ndim indexes shape[], sizes feed numel(), the
// byte size feeds the alias check). Limits: 0 <= ndim <= 8, sizes >= 0, and numel * itemsize below
// 2^62 bytes, so that no size computation in the library overflows int64.
static void check_well_formed(const TensorRef& t, const std::string& name) {
  QMOE_CHECK_ARG(t.ndim >= 0 && t.ndim <= kMaxDims, name, "a tensor of 0 to " + std::to_string(kMaxDims) + " dimensions",
            "ndim = " + std::to_string(t.ndim));
  QMOE_CHECK_ARG(known_dtype(t.dtype), name, "a qmoe dtype", "dtype value " + std::to_string(static_cast<int>(t.dtype)),
            ErrorKind::kType);
  QMOE_CHECK_ARG(t.device == Device::kCPU || t.device == Device::kCUDA, name, "a CPU or CUDA tensor",
            "device value " + std::to_string(static_cast<int>(t.device)));
  QMOE_CHECK_ARG(t.device == Device::kCPU || t.device_index >= 0, name, "a CUDA device index >= 0",
            "device index " + std::to_string(t.device_index));
  constexpr int64_t kMaxBytes = int64_t{1} << 62;
  int64_t bytes = info(t.dtype).size;
  bool empty = false;
  for (int i = 0; i < t.ndim; ++i) {
    QMOE_CHECK_ARG(t.shape[i] >= 0, name, "sizes >= 0", "shape " + shape_string(t));
    if (t.shape[i] == 0) empty = true;
  }
  for (int i = 0; i < t.ndim && !empty; ++i) {
    QMOE_CHECK_ARG(t.shape[i] <= kMaxBytes / bytes, name, "at most 2^62 bytes", "shape " + shape_string(t));
    bytes *= t.shape[i];
  }
}

TensorRef make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device, int device_index) {
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.device_index = device_index;
  QMOE_CHECK_ARG(static_cast<int>(shape.size()) <= kMaxDims, "shape", "at most 8 dimensions",
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
  if (t.ndim < 0 || t.ndim > kMaxDims) return "[ndim = " + std::to_string(t.ndim) + "]";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

void check_dtype(const TensorRef& t, const std::string& name, DType expected) {
  check_well_formed(t, name);
  QMOE_CHECK_ARG(t.dtype == expected, name, std::string("dtype ") + dtype_name(expected),
            std::string("dtype ") + dtype_name(t.dtype), ErrorKind::kType);
}

void check_dtype_in(const TensorRef& t, const std::string& name, std::initializer_list<DType> allowed) {
  check_well_formed(t, name);
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
  check_well_formed(t, name);
  QMOE_CHECK_ARG(t.ndim == ndim, name, std::to_string(ndim) + "-D tensor",
            std::to_string(t.ndim) + "-D tensor of shape " + shape_string(t));
}

void check_shape(const TensorRef& t, const std::string& name, std::initializer_list<int64_t> expected) {
  check_well_formed(t, name);
  bool ok = t.ndim == static_cast<int>(expected.size());
  std::string want = "shape [";
  int i = 0;
  for (int64_t e : expected) {
    want += (i ? ", " : "") + (e < 0 ? std::string("*") : std::to_string(e));
    if (ok && e >= 0 && t.shape[i] != e) ok = false;
    ++i;
  }
  want += "]";
  QMOE_CHECK_ARG(ok, name, want, "shape " + shape_string(t));
}

void check_contiguous(const TensorRef& t, const std::string& name) {
  check_well_formed(t, name);
  QMOE_CHECK_ARG(t.is_contiguous(), name, "a contiguous (row-major) tensor", "strides that are not row-major");
}

void check_same_device(const TensorRef& t, const std::string& name, const TensorRef& reference,
                       const std::string& reference_name) {
  check_well_formed(t, name);
  check_well_formed(reference, reference_name);
  auto where = [](const TensorRef& x) {
    return x.device == Device::kCPU ? std::string("cpu") : "cuda:" + std::to_string(x.device_index);
  };
  QMOE_CHECK_ARG(t.device == reference.device && (t.device == Device::kCPU || t.device_index == reference.device_index),
            name, "a tensor on " + where(reference) + " (the device of '" + reference_name + "')", where(t));
}

void check_aligned(const TensorRef& t, const std::string& name, int bytes) {
  check_well_formed(t, name);
  QMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(t.data) % bytes == 0, name,
            "a data pointer aligned to " + std::to_string(bytes) + " bytes", "a misaligned pointer");
}

void check_no_alias(const TensorRef& out, const std::string& out_name, const TensorRef& in,
                    const std::string& in_name) {
  check_well_formed(out, out_name);
  check_well_formed(in, in_name);
  if (out.data == nullptr || in.data == nullptr) return;
  auto lo_o = reinterpret_cast<uintptr_t>(out.data);
  auto hi_o = lo_o + static_cast<uintptr_t>(out.numel()) * dtype_size(out.dtype);
  auto lo_i = reinterpret_cast<uintptr_t>(in.data);
  auto hi_i = lo_i + static_cast<uintptr_t>(in.numel()) * dtype_size(in.dtype);
  QMOE_CHECK_ARG(hi_o <= lo_i || hi_i <= lo_o, out_name, "memory that does not overlap input '" + in_name + "'",
            "an output that aliases '" + in_name + "'");
}

}  // namespace qmoe
