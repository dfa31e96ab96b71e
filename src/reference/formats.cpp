// CPU implementation of the array-level formats of include/qmoe/formats.h (DESIGN.md section 3):
// int4-g128 quantize / dequantize / pack and SGLang's two scale layouts, FP8 e4m3 per tensor and per
// token, NVFP4 (e4m3 per 16 + fp32 encode scale), MXFP4 / MXFP8 (ue8m0 per 32), the FlashInfer 128x4
// scale swizzle and its inverse, and the SGLang <-> FlashInfer gate/up row orders.
// Tensors are contiguous and row-major; the scalar codecs live (inline) in the header so GPU code
// rounds the same way. Every function validates everything (the checks here are shared by both
// devices) before writing any output; then CUDA tensors go to the launchers of
// src/cuda/quant/quant_launch.h on the caller's stream, CPU tensors to the loops below.
#include <cmath>
#include <cstring>
#include <string>

#include "core/fp4_weight_pack.h"
#include "cuda/quant/quant_launch.h"
#include "qmoe/formats.h"

namespace qmoe {

namespace {

constexpr int64_t kInt4Group = 128;
constexpr int64_t kNvfp4Block = 16;
constexpr int64_t kMxBlock = 32;
constexpr float kE4M3Max = 448.0f;
constexpr float kE2M1Max = 6.0f;

// ---- argument checks ------------------------------------------------------------------------

// For the functions that have no GPU version (pack / unpack, elementwise codecs).
void check_cpu(const TensorRef& t, const std::string& name) {
  check_arg(t.device == Device::kCPU, name, "a CPU tensor (this function has no GPU version)", "a CUDA tensor");
}

// A contiguous tensor (CPU or CUDA) of at least `min_ndim` axes, with a known device, at most
// kMaxDims axes and no negative size (numel and every offset below rely on these).
void check_basic(const TensorRef& t, const std::string& name, int min_ndim = 1) {
  check_arg(t.device == Device::kCPU || t.device == Device::kCUDA, name, "a CPU or CUDA tensor",
            "device value " + std::to_string(static_cast<int>(t.device)));
  check_arg(t.ndim >= 0 && t.ndim <= kMaxDims, name, "at most " + std::to_string(kMaxDims) + " axes",
            std::to_string(t.ndim) + " axes");
  for (int i = 0; i < t.ndim; ++i)
    check_arg(t.shape[i] >= 0, name, "non-negative sizes", "shape " + shape_string(t));
  check_arg(t.data != nullptr || t.numel() == 0, name, "a non-null data pointer", "nullptr");
  check_arg(t.ndim >= min_ndim, name, "a tensor of at least " + std::to_string(min_ndim) + " axes",
            std::to_string(t.ndim) + "-D tensor");
  check_contiguous(t, name);
}

// `out` has exactly the shape of `like`.
void check_shape_like(const TensorRef& out, const std::string& name, const TensorRef& like) {
  bool same = out.ndim == like.ndim;
  for (int i = 0; same && i < like.ndim; ++i) same = out.shape[i] == like.shape[i];
  check_arg(same, name, "shape " + shape_string(like), "shape " + shape_string(out));
}

const std::initializer_list<DType> kRealTypes = {DType::kFloat32, DType::kBFloat16};
const std::initializer_list<DType> kInt4Types = {DType::kInt4x2, DType::kInt8, DType::kUInt8};
const std::initializer_list<DType> kFp4Types = {DType::kFloat4E2M1x2, DType::kUInt8};
const std::initializer_list<DType> kE4M3Types = {DType::kFloat8E4M3, DType::kUInt8};
const std::initializer_list<DType> kUE8M0Types = {DType::kUE8M0, DType::kUInt8};

int64_t rows_of(const TensorRef& t) {
  int64_t r = 1;
  for (int i = 0; i + 1 < t.ndim; ++i) r *= t.shape[i];
  return r;
}

// `t` must have the leading axes of `like` and last axis `last`.
void check_like(const TensorRef& t, const std::string& name, const TensorRef& like, int64_t last) {
  bool ok = t.ndim == like.ndim && t.shape[t.ndim - 1] == last;
  for (int i = 0; ok && i + 1 < like.ndim; ++i) ok = t.shape[i] == like.shape[i];
  std::string want = "shape [";
  for (int i = 0; i + 1 < like.ndim; ++i) want += std::to_string(like.shape[i]) + ", ";
  want += std::to_string(last) + "]";
  check_arg(ok, name, want, "shape " + shape_string(t));
}

void check_divisible(int64_t k, int64_t by, const std::string& name) {
  check_arg(k % by == 0, name, "a last axis divisible by " + std::to_string(by), "last axis " + std::to_string(k));
}

// ---- element access ---------------------------------------------------------------------------

float load_real(const TensorRef& t, int64_t i) {
  if (t.dtype == DType::kFloat32) return t.ptr<const float>()[i];
  return bf16_to_float(t.ptr<const uint16_t>()[i]);
}
uint8_t* bytes(const TensorRef& t) { return static_cast<uint8_t*>(t.data); }
const uint8_t* cbytes(const TensorRef& t) { return static_cast<const uint8_t*>(t.data); }

// Round to the nearest integer, ties to even (|v| < 2^22; callers clamp first).
float rne_integer(float v) { return std::nearbyint(v); }

// amax over n values starting at x[i0]; NaN if any value is NaN.
float block_amax(const TensorRef& x, int64_t i0, int64_t n, bool* has_nan) {
  float amax = 0.0f;
  *has_nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load_real(x, i0 + i);
    if (std::isnan(v)) *has_nan = true;
    else amax = std::fmax(amax, std::fabs(v));
  }
  return *has_nan ? NAN : amax;
}

}  // namespace

// ---- int4-g128 --------------------------------------------------------------------------------

void quantize_int4_g128(const TensorRef& w, TensorRef q, TensorRef scales, cudaStream_t stream) {
  check_basic(w, "w");
  check_dtype_in(w, "w", kRealTypes);
  const int64_t k = w.size(-1);
  check_divisible(k, kInt4Group, "w");
  check_basic(q, "q");
  check_dtype_in(q, "q", kInt4Types);
  check_like(q, "q", w, k / 2);
  check_basic(scales, "scales");
  check_dtype(scales, "scales", DType::kFloat32);
  check_like(scales, "scales", w, k / kInt4Group);
  check_same_device(w, "w", q, "q");
  check_same_device(scales, "scales", q, "q");
  check_no_alias(q, "q", w, "w");
  check_no_alias(scales, "scales", w, "w");
  check_no_alias(scales, "scales", q, "q");
  if (w.is_cuda()) {
    cuda::quantize_int4_g128(w, q, scales, stream);
    return;
  }

  const int64_t groups = rows_of(w) * (k / kInt4Group);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t i0 = g * kInt4Group;
    bool has_nan;
    const float amax = block_amax(w, i0, kInt4Group, &has_nan);
    const float s = amax == 0.0f ? 1.0f : amax / 7.0f;
    scales.ptr<float>()[g] = s;
    const bool finite = std::isfinite(s);
    for (int64_t i = 0; i < kInt4Group; i += 2) {
      int v[2] = {0, 0};
      for (int j = 0; j < 2 && finite; ++j) {
        const float r = rne_integer(load_real(w, i0 + i + j) / s);
        v[j] = static_cast<int>(std::fmin(std::fmax(r, -8.0f), 7.0f));
      }
      bytes(q)[(i0 + i) / 2] = pack_int4_pair(v[0], v[1]);
    }
  }
}

void dequantize_int4_g128(const TensorRef& q, const TensorRef& scales, TensorRef out, cudaStream_t stream) {
  check_basic(q, "q");
  check_dtype_in(q, "q", kInt4Types);
  const int64_t k = q.size(-1) * 2;
  check_divisible(k, kInt4Group, "q (unpacked)");
  check_basic(scales, "scales");
  check_dtype_in(scales, "scales", kRealTypes);
  check_like(scales, "scales", q, k / kInt4Group);
  check_basic(out, "out");
  check_dtype(out, "out", DType::kFloat32);
  check_like(out, "out", q, k);
  check_same_device(q, "q", out, "out");
  check_same_device(scales, "scales", out, "out");
  check_no_alias(out, "out", q, "q");
  check_no_alias(out, "out", scales, "scales");
  if (q.is_cuda()) {
    cuda::dequantize_int4_g128(q, scales, out, stream);
    return;
  }

  const int64_t n = rows_of(q) * k;
  for (int64_t i = 0; i < n; i += 2) {
    const uint8_t b = cbytes(q)[i / 2];
    const float s = load_real(scales, i / kInt4Group);
    out.ptr<float>()[i] = static_cast<float>(int4_low(b)) * s;
    out.ptr<float>()[i + 1] = static_cast<float>(int4_high(b)) * s;
  }
}

void pack_int4(const TensorRef& values, TensorRef packed) {
  check_cpu(values, "values");
  check_cpu(packed, "packed");
  check_basic(values, "values");
  check_dtype(values, "values", DType::kInt8);
  const int64_t k = values.size(-1);
  check_divisible(k, 2, "values");
  check_basic(packed, "packed");
  check_dtype_in(packed, "packed", kInt4Types);
  check_like(packed, "packed", values, k / 2);
  check_no_alias(packed, "packed", values, "values");
  const int64_t n = values.numel();
  const int8_t* v = values.ptr<const int8_t>();
  for (int64_t i = 0; i < n; ++i) {
    check_arg(v[i] >= -8 && v[i] <= 7, "values", "int4 values in [-8, 7]",
              std::to_string(v[i]) + " at flat index " + std::to_string(i));
  }
  for (int64_t i = 0; i < n; i += 2) bytes(packed)[i / 2] = pack_int4_pair(v[i], v[i + 1]);
}

void unpack_int4(const TensorRef& packed, TensorRef values) {
  check_cpu(packed, "packed");
  check_cpu(values, "values");
  check_basic(packed, "packed");
  check_dtype_in(packed, "packed", kInt4Types);
  check_basic(values, "values");
  check_dtype(values, "values", DType::kInt8);
  check_like(values, "values", packed, packed.size(-1) * 2);
  check_no_alias(values, "values", packed, "packed");
  const int64_t n = packed.numel();
  int8_t* v = values.ptr<int8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t b = cbytes(packed)[i];
    v[2 * i] = static_cast<int8_t>(int4_low(b));
    v[2 * i + 1] = static_cast<int8_t>(int4_high(b));
  }
}

void int4_scale_layout_shape(int64_t experts, int64_t n, int64_t k, int64_t out_shape[3]) {
  check_arg(experts >= 0, "experts", "a non-negative count", std::to_string(experts));
  check_arg(n >= 0, "n", "a non-negative size", std::to_string(n));
  check_arg(k >= 0 && k % kInt4Group == 0, "k", "a non-negative multiple of 128", std::to_string(k));
  const int64_t g = k / kInt4Group;
  out_shape[0] = experts;
  if (g % 4 == 0) {
    out_shape[1] = g / 4;
    out_shape[2] = 4 * n;
  } else {
    out_shape[1] = g;
    out_shape[2] = n;
  }
}

namespace {
// Flat index into the stored layout of logical S[e, n, g] (DESIGN.md 3.1).
inline int64_t stored_index(int64_t e, int64_t n, int64_t g, int64_t num_n, int64_t num_g) {
  if (num_g % 4 == 0) return (e * (num_g / 4) + g / 4) * (4 * num_n) + 4 * n + (g % 4);
  return (e * num_g + g) * num_n + n;
}

void check_scale_pair(const TensorRef& logical, const std::string& lname, const TensorRef& stored,
                      const std::string& sname) {
  check_basic(logical, lname, 3);
  check_ndim(logical, lname, 3);
  check_dtype_in(logical, lname, kRealTypes);
  check_basic(stored, sname, 3);
  check_ndim(stored, sname, 3);
  check_dtype(stored, sname, logical.dtype);
  const int64_t e = logical.shape[0], n = logical.shape[1], g = logical.shape[2];
  if (g % 4 == 0) check_shape(stored, sname, {e, g / 4, 4 * n});
  else check_shape(stored, sname, {e, g, n});
}
}  // namespace

void interleave_int4_scales(const TensorRef& scales, TensorRef out, cudaStream_t stream) {
  check_scale_pair(scales, "scales", out, "out");
  check_same_device(scales, "scales", out, "out");
  check_no_alias(out, "out", scales, "scales");
  if (scales.is_cuda()) {
    cuda::interleave_int4_scales(scales, out, true, stream);
    return;
  }
  const int64_t experts = scales.shape[0], n = scales.shape[1], g = scales.shape[2];
  const int size = dtype_size(scales.dtype);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < g; ++j)
        std::memcpy(bytes(out) + stored_index(e, i, j, n, g) * size, cbytes(scales) + ((e * n + i) * g + j) * size,
                    size);
}

void deinterleave_int4_scales(const TensorRef& stored, TensorRef scales, cudaStream_t stream) {
  check_scale_pair(scales, "scales", stored, "stored");
  check_same_device(stored, "stored", scales, "scales");
  check_no_alias(scales, "scales", stored, "stored");
  if (stored.is_cuda()) {
    cuda::interleave_int4_scales(scales, stored, false, stream);
    return;
  }
  const int64_t experts = scales.shape[0], n = scales.shape[1], g = scales.shape[2];
  const int size = dtype_size(scales.dtype);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < g; ++j)
        std::memcpy(bytes(scales) + ((e * n + i) * g + j) * size, cbytes(stored) + stored_index(e, i, j, n, g) * size,
                    size);
}

// ---- FP8 e4m3 ---------------------------------------------------------------------------------

namespace {
// Per-tensor (returns false) or per-row (true) scale for x [..., K].
bool check_fp8_scale(const TensorRef& scale, const std::string& name, const TensorRef& x) {
  check_basic(scale, name, 0);
  check_dtype(scale, name, DType::kFloat32);
  if (scale.numel() == 1 && scale.ndim <= 1) return false;
  const int64_t rows = rows_of(x);
  bool ok = scale.numel() == rows && (scale.ndim == 1 || scale.ndim == x.ndim - 1);
  for (int i = 0; ok && scale.ndim > 1 && i < scale.ndim; ++i) ok = scale.shape[i] == x.shape[i];
  check_arg(ok, name, "one element (per tensor) or " + std::to_string(rows) + " (one per row of " + shape_string(x) + ")",
            "shape " + shape_string(scale));
  return true;
}
}  // namespace

void quantize_fp8(const TensorRef& x, const TensorRef& scale, TensorRef q, cudaStream_t stream) {
  check_basic(x, "x");
  check_dtype_in(x, "x", kRealTypes);
  const bool per_row = check_fp8_scale(scale, "scale", x);
  check_basic(q, "q");
  check_dtype_in(q, "q", kE4M3Types);
  check_like(q, "q", x, x.size(-1));
  check_same_device(x, "x", q, "q");
  check_same_device(scale, "scale", q, "q");
  check_no_alias(q, "q", x, "x");
  check_no_alias(q, "q", scale, "scale");
  if (x.is_cuda()) {
    cuda::quantize_fp8(x, scale, per_row, q, stream);
    return;
  }
  const int64_t k = x.size(-1), n = x.numel();
  for (int64_t i = 0; i < n; ++i) {
    const float s = scale.ptr<const float>()[per_row ? i / k : 0];
    const float v = load_real(x, i);
    // A NaN keeps the sign of x (not of whatever x / s produces).
    bytes(q)[i] = std::isnan(v) ? static_cast<uint8_t>(0x7f | (std::signbit(v) ? 0x80 : 0)) : float_to_e4m3(v / s);
  }
}

void fp8_dynamic_scale(const TensorRef& x, TensorRef scale, cudaStream_t stream) {
  check_basic(x, "x");
  check_dtype_in(x, "x", kRealTypes);
  const bool per_row = check_fp8_scale(scale, "scale", x);
  check_same_device(x, "x", scale, "scale");
  check_no_alias(scale, "scale", x, "x");
  if (x.is_cuda()) {
    cuda::fp8_dynamic_scale(x, per_row, scale, stream);
    return;
  }
  const int64_t k = x.size(-1);
  const int64_t blocks = per_row ? rows_of(x) : 1;
  const int64_t len = per_row ? k : x.numel();
  for (int64_t b = 0; b < blocks; ++b) {
    bool has_nan;
    const float amax = block_amax(x, b * len, len, &has_nan);
    scale.ptr<float>()[b] = amax == 0.0f ? 1.0f : amax / kE4M3Max;
  }
}

void dequantize_fp8(const TensorRef& q, const TensorRef& scale, TensorRef out, cudaStream_t stream) {
  check_basic(q, "q");
  check_dtype_in(q, "q", kE4M3Types);
  const bool per_row = check_fp8_scale(scale, "scale", q);
  check_basic(out, "out");
  check_dtype(out, "out", DType::kFloat32);
  check_like(out, "out", q, q.size(-1));
  check_same_device(q, "q", out, "out");
  check_same_device(scale, "scale", out, "out");
  check_no_alias(out, "out", q, "q");
  check_no_alias(out, "out", scale, "scale");
  if (q.is_cuda()) {
    cuda::dequantize_fp8(q, scale, per_row, out, stream);
    return;
  }
  const int64_t k = q.size(-1), n = q.numel();
  for (int64_t i = 0; i < n; ++i)
    out.ptr<float>()[i] = e4m3_to_float(cbytes(q)[i]) * scale.ptr<const float>()[per_row ? i / k : 0];
}

// ---- NVFP4 / MXFP4 / MXFP8 --------------------------------------------------------------------

namespace {
// Checks x real [..., K] (K % block == 0), q [..., K / per_byte] of q_types, sf [..., K / block].
void check_block_quant(const TensorRef& x, const TensorRef& q, std::initializer_list<DType> q_types, int per_byte,
                       const TensorRef& sf, std::initializer_list<DType> sf_types, int64_t block) {
  check_basic(x, "x");
  check_dtype_in(x, "x", kRealTypes);
  const int64_t k = x.size(-1);
  check_divisible(k, block, "x");
  check_basic(q, "q");
  check_dtype_in(q, "q", q_types);
  check_like(q, "q", x, k / per_byte);
  check_basic(sf, "sf");
  check_dtype_in(sf, "sf", sf_types);
  check_like(sf, "sf", x, k / block);
  check_same_device(x, "x", q, "q");
  check_same_device(sf, "sf", q, "q");
  check_no_alias(q, "q", x, "x");
  check_no_alias(sf, "sf", x, "x");
  check_no_alias(sf, "sf", q, "q");
}

// Checks q [..., Kq] of q_types (K = Kq * per_byte, K % block == 0), sf [..., K / block], out f32 [..., K].
void check_block_dequant(const TensorRef& q, std::initializer_list<DType> q_types, int per_byte, const TensorRef& sf,
                         std::initializer_list<DType> sf_types, int64_t block, const TensorRef& out) {
  check_basic(q, "q");
  check_dtype_in(q, "q", q_types);
  const int64_t k = q.size(-1) * per_byte;
  check_divisible(k, block, per_byte == 2 ? "q (unpacked)" : "q");
  check_basic(sf, "sf");
  check_dtype_in(sf, "sf", sf_types);
  check_like(sf, "sf", q, k / block);
  check_basic(out, "out");
  check_dtype(out, "out", DType::kFloat32);
  check_like(out, "out", q, k);
  check_same_device(q, "q", out, "out");
  check_same_device(sf, "sf", out, "out");
  check_no_alias(out, "out", q, "q");
  check_no_alias(out, "out", sf, "sf");
}

void check_global_scale(float gs) {
  check_arg(std::isfinite(gs) && gs > 0.0f, "global_scale", "a finite value > 0", std::to_string(gs));
}

// MX quantization shared by MXFP4 (fp4 = true) and MXFP8.
void quantize_mx(const TensorRef& x, TensorRef q, TensorRef sf, bool fp4) {
  const float max_code = fp4 ? kE2M1Max : kE4M3Max;
  const int64_t blocks = x.numel() / kMxBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = b * kMxBlock;
    bool has_nan;
    const float amax = block_amax(x, i0, kMxBlock, &has_nan);
    const uint8_t code = has_nan ? 0xff : ue8m0_ceil(amax / max_code);
    bytes(sf)[b] = code;
    const float scale = ue8m0_to_float(code);
    for (int64_t i = 0; i < kMxBlock; ++i) {
      const float v = has_nan ? NAN : load_real(x, i0 + i) / scale;
      if (fp4) {
        const uint8_t c = float_to_e2m1(v);  // NaN -> 0x7
        uint8_t& byte = bytes(q)[(i0 + i) / 2];
        byte = (i % 2 == 0) ? c : static_cast<uint8_t>(byte | (c << 4));
      } else {
        bytes(q)[i0 + i] = has_nan ? 0x7f : float_to_e4m3(v);
      }
    }
  }
}

void dequantize_mx(const TensorRef& q, const TensorRef& sf, TensorRef out, bool fp4) {
  const int64_t n = out.numel();
  for (int64_t i = 0; i < n; ++i) {
    const float scale = ue8m0_to_float(cbytes(sf)[i / kMxBlock]);
    const float element = fp4 ? e2m1_to_float(i % 2 == 0 ? cbytes(q)[i / 2] & 0xf : cbytes(q)[i / 2] >> 4)
                              : e4m3_to_float(cbytes(q)[i]);
    out.ptr<float>()[i] = element * scale;
  }
}
}  // namespace

void quantize_nvfp4(const TensorRef& x, float global_scale, TensorRef q, TensorRef sf, cudaStream_t stream) {
  check_block_quant(x, q, kFp4Types, 2, sf, kE4M3Types, kNvfp4Block);
  check_global_scale(global_scale);
  if (x.is_cuda()) {
    cuda::quantize_nvfp4(x, global_scale, q, sf, stream);
    return;
  }
  const int64_t blocks = x.numel() / kNvfp4Block;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = b * kNvfp4Block;
    bool has_nan;
    const float amax = block_amax(x, i0, kNvfp4Block, &has_nan);
    const uint8_t code = has_nan ? 0x7f : float_to_e4m3(global_scale * amax / kE2M1Max);
    bytes(sf)[b] = code;
    const float sf_value = e4m3_to_float(code);
    for (int64_t i = 0; i < kNvfp4Block; i += 2) {
      uint8_t c[2];
      for (int j = 0; j < 2; ++j) {
        const float v = load_real(x, i0 + i + j);
        c[j] = has_nan ? 0x7 : sf_value == 0.0f ? 0 : float_to_e2m1(v * global_scale / sf_value);
      }
      bytes(q)[(i0 + i) / 2] = static_cast<uint8_t>(c[0] | (c[1] << 4));
    }
  }
}

void dequantize_nvfp4(const TensorRef& q, const TensorRef& sf, float global_scale, TensorRef out,
                      cudaStream_t stream) {
  check_block_dequant(q, kFp4Types, 2, sf, kE4M3Types, kNvfp4Block, out);
  check_global_scale(global_scale);
  if (q.is_cuda()) {
    cuda::dequantize_nvfp4(q, sf, global_scale, out, stream);
    return;
  }
  const int64_t n = out.numel();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t b = cbytes(q)[i / 2];
    const float element = e2m1_to_float(i % 2 == 0 ? b & 0xf : b >> 4);
    out.ptr<float>()[i] = element * e4m3_to_float(cbytes(sf)[i / kNvfp4Block]) / global_scale;
  }
}

void quantize_mxfp4(const TensorRef& x, TensorRef q, TensorRef sf, cudaStream_t stream) {
  check_block_quant(x, q, kFp4Types, 2, sf, kUE8M0Types, kMxBlock);
  if (x.is_cuda()) cuda::quantize_mx(x, q, sf, true, stream);
  else quantize_mx(x, q, sf, true);
}
void dequantize_mxfp4(const TensorRef& q, const TensorRef& sf, TensorRef out, cudaStream_t stream) {
  check_block_dequant(q, kFp4Types, 2, sf, kUE8M0Types, kMxBlock, out);
  if (q.is_cuda()) cuda::dequantize_mx(q, sf, out, true, stream);
  else dequantize_mx(q, sf, out, true);
}
void quantize_mxfp8(const TensorRef& x, TensorRef q, TensorRef sf, cudaStream_t stream) {
  check_block_quant(x, q, kE4M3Types, 1, sf, kUE8M0Types, kMxBlock);
  if (x.is_cuda()) cuda::quantize_mx(x, q, sf, false, stream);
  else quantize_mx(x, q, sf, false);
}
void dequantize_mxfp8(const TensorRef& q, const TensorRef& sf, TensorRef out, cudaStream_t stream) {
  check_block_dequant(q, kE4M3Types, 1, sf, kUE8M0Types, kMxBlock, out);
  if (q.is_cuda()) cuda::dequantize_mx(q, sf, out, false, stream);
  else dequantize_mx(q, sf, out, false);
}

// ---- 128x4 scale swizzle ------------------------------------------------------------------------

int64_t swizzled_offset(int64_t expert, int64_t row, int64_t col, int64_t row_tiles, int64_t col_tiles) {
  // A 128x4 tile is 512 bytes: rows r, r+32, r+64, r+96 share one 16-byte line, 4 columns each.
  return ((expert * row_tiles + row / 128) * col_tiles + col / 4) * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 +
         (col % 4);
}

namespace {
const std::initializer_list<DType> kByteTypes = {DType::kUInt8, DType::kInt8, DType::kFloat8E4M3, DType::kUE8M0};

// Checks the (plain, swizzled) pair; returns E, rows, cols of the plain tensor.
void check_swizzle_pair(const TensorRef& plain, const std::string& pname, const TensorRef& swz,
                        const std::string& sname, int64_t* experts, int64_t* rows, int64_t* cols) {
  check_basic(plain, pname, 2);
  check_arg(plain.ndim <= 3, pname, "a 2-D [rows, cols] or 3-D [E, rows, cols] tensor",
            std::to_string(plain.ndim) + "-D tensor");
  check_dtype_in(plain, pname, kByteTypes);
  check_basic(swz, sname, 2);
  check_dtype_in(swz, sname, kByteTypes);
  check_arg(swz.dtype == plain.dtype || swz.dtype == DType::kUInt8 || plain.dtype == DType::kUInt8, sname,
            std::string("dtype ") + dtype_name(plain.dtype) + " or uint8 (the dtype of '" + pname + "')",
            std::string("dtype ") + dtype_name(swz.dtype), ErrorKind::kType);
  *experts = plain.ndim == 3 ? plain.shape[0] : 1;
  *rows = plain.size(-2);
  *cols = plain.size(-1);
  const int64_t rp = (*rows + 127) / 128 * 128, cp = (*cols + 3) / 4 * 4;
  if (plain.ndim == 3) check_shape(swz, sname, {*experts, rp, cp});
  else check_shape(swz, sname, {rp, cp});
  check_no_alias(swz, sname, plain, pname);
}
}  // namespace

void swizzle_scales_128x4(const TensorRef& sf, TensorRef out, cudaStream_t stream) {
  int64_t experts, rows, cols;
  check_swizzle_pair(sf, "sf", out, "out", &experts, &rows, &cols);
  check_same_device(sf, "sf", out, "out");
  if (sf.is_cuda()) {
    cuda::swizzle_scales_128x4(sf, out, experts, rows, cols, stream);
    return;
  }
  const int64_t mt = (rows + 127) / 128, kt = (cols + 3) / 4;
  std::memset(out.data, 0, static_cast<size_t>(experts * mt * kt * 512));
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        bytes(out)[swizzled_offset(e, r, c, mt, kt)] = cbytes(sf)[(e * rows + r) * cols + c];
}

void unswizzle_scales_128x4(const TensorRef& swizzled, TensorRef sf, cudaStream_t stream) {
  int64_t experts, rows, cols;
  check_swizzle_pair(sf, "sf", swizzled, "swizzled", &experts, &rows, &cols);
  check_same_device(swizzled, "swizzled", sf, "sf");
  if (sf.is_cuda()) {
    cuda::unswizzle_scales_128x4(swizzled, sf, experts, rows, cols, stream);
    return;
  }
  const int64_t mt = (rows + 127) / 128, kt = (cols + 3) / 4;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        bytes(sf)[(e * rows + r) * cols + c] = cbytes(swizzled)[swizzled_offset(e, r, c, mt, kt)];
}

// ---- gate/up row orders ---------------------------------------------------------------------------

namespace {
constexpr int64_t kGateUpGroup = 64;

// Copies rows between conventions. to_flashinfer: out row block 2j = up block j, 2j+1 = gate block j.
void reorder_gate_up(const TensorRef& w, TensorRef out, bool to_flashinfer, cudaStream_t stream) {
  check_basic(w, "w", 2);
  check_arg(w.ndim <= 3, "w", "a 2-D [2I, C] or 3-D [E, 2I, C] tensor", std::to_string(w.ndim) + "-D tensor");
  const int64_t two_i = w.size(-2);
  check_arg(two_i % (2 * kGateUpGroup) == 0, "w", "2I rows with I a multiple of 64",
            std::to_string(two_i) + " rows");
  check_basic(out, "out", 2);
  check_dtype(out, "out", w.dtype);
  check_shape_like(out, "out", w);
  check_same_device(w, "w", out, "out");
  check_no_alias(out, "out", w, "w");
  if (w.is_cuda()) {
    cuda::reorder_gate_up(w, out, to_flashinfer, stream);
    return;
  }

  const int64_t experts = w.ndim == 3 ? w.shape[0] : 1;
  const int64_t inter = two_i / 2;
  const int64_t row_bytes = w.size(-1) * dtype_size(w.dtype);
  const int64_t block_bytes = kGateUpGroup * row_bytes;
  for (int64_t e = 0; e < experts; ++e) {
    const uint8_t* src = cbytes(w) + e * two_i * row_bytes;
    uint8_t* dst = bytes(out) + e * two_i * row_bytes;
    for (int64_t j = 0; j < inter / kGateUpGroup; ++j) {
      const int64_t gate = j * block_bytes, up = (inter + j * kGateUpGroup) * row_bytes;  // SGLang offsets
      const int64_t fi_up = 2 * j * block_bytes, fi_gate = (2 * j + 1) * block_bytes;  // FlashInfer offsets
      if (to_flashinfer) {
        std::memcpy(dst + fi_up, src + up, block_bytes);
        std::memcpy(dst + fi_gate, src + gate, block_bytes);
      } else {
        std::memcpy(dst + up, src + fi_up, block_bytes);
        std::memcpy(dst + gate, src + fi_gate, block_bytes);
      }
    }
  }
}
}  // namespace

void gate_up_sglang_to_flashinfer(const TensorRef& w, TensorRef out, cudaStream_t stream) {
  reorder_gate_up(w, out, true, stream);
}
void gate_up_flashinfer_to_sglang(const TensorRef& w, TensorRef out, cudaStream_t stream) {
  reorder_gate_up(w, out, false, stream);
}

// ---- qmoe's packed FP4 weight words ---------------------------------------------------------------

namespace {
void convert_fp4_words(const TensorRef& w, TensorRef out, bool pack, cudaStream_t stream) {
  const std::string in = pack ? "w" : "packed";
  check_basic(w, in, 1);
  check_dtype_in(w, in, kFp4Types);
  check_arg(w.size(-1) % 4 == 0, in, "rows of whole 32-bit words (last axis K/2 bytes with K % 8 == 0)",
            "shape " + shape_string(w));
  check_basic(out, "out", 1);
  check_dtype(out, "out", w.dtype);
  check_shape_like(out, "out", w);
  check_same_device(w, in, out, "out");
  check_no_alias(out, "out", w, in);
  if (w.is_cuda()) {
    cuda::convert_fp4_words(w, out, pack, stream);
    return;
  }
  const int64_t words = w.numel() / 4;
  for (int64_t i = 0; i < words; ++i) {
    uint32_t v;
    std::memcpy(&v, cbytes(w) + 4 * i, 4);
    v = pack ? fp4pack::pack_word(v) : fp4pack::unpack_word(v);
    std::memcpy(bytes(out) + 4 * i, &v, 4);
  }
}
}  // namespace

void pack_fp4_weights(const TensorRef& w, TensorRef out, cudaStream_t stream) { convert_fp4_words(w, out, true, stream); }
void unpack_fp4_weights(const TensorRef& packed, TensorRef out, cudaStream_t stream) {
  convert_fp4_words(packed, out, false, stream);
}

// ---- elementwise codecs -------------------------------------------------------------------------

namespace {
DType code_dtype(ScalarCodec codec) { return codec == ScalarCodec::kBF16 ? DType::kBFloat16 : DType::kUInt8; }
}  // namespace

void encode_elementwise(const TensorRef& x, ScalarCodec codec, TensorRef codes) {
  check_cpu(x, "x");
  check_cpu(codes, "codes");
  check_basic(x, "x", 0);
  check_dtype(x, "x", DType::kFloat32);
  check_basic(codes, "codes", 0);
  check_dtype(codes, "codes", code_dtype(codec));
  check_arg(codes.numel() == x.numel(), "codes", std::to_string(x.numel()) + " elements (as 'x')",
            std::to_string(codes.numel()));
  check_no_alias(codes, "codes", x, "x");
  const int64_t n = x.numel();
  const float* v = x.ptr<const float>();
  for (int64_t i = 0; i < n; ++i) {
    switch (codec) {
      case ScalarCodec::kBF16: codes.ptr<uint16_t>()[i] = float_to_bf16(v[i]); break;
      case ScalarCodec::kE4M3: bytes(codes)[i] = float_to_e4m3(v[i]); break;
      case ScalarCodec::kE2M1: bytes(codes)[i] = float_to_e2m1(v[i]); break;
      case ScalarCodec::kUE8M0Ceil: bytes(codes)[i] = ue8m0_ceil(v[i]); break;
    }
  }
}

void decode_elementwise(const TensorRef& codes, ScalarCodec codec, TensorRef out) {
  check_cpu(codes, "codes");
  check_cpu(out, "out");
  check_basic(codes, "codes", 0);
  check_dtype(codes, "codes", code_dtype(codec));
  check_basic(out, "out", 0);
  check_dtype(out, "out", DType::kFloat32);
  check_arg(out.numel() == codes.numel(), "out", std::to_string(codes.numel()) + " elements (as 'codes')",
            std::to_string(out.numel()));
  check_no_alias(out, "out", codes, "codes");
  const int64_t n = codes.numel();
  for (int64_t i = 0; i < n; ++i) {
    float v = 0.0f;
    switch (codec) {
      case ScalarCodec::kBF16: v = bf16_to_float(codes.ptr<const uint16_t>()[i]); break;
      case ScalarCodec::kE4M3: v = e4m3_to_float(cbytes(codes)[i]); break;
      case ScalarCodec::kE2M1: v = e2m1_to_float(cbytes(codes)[i] & 0xf); break;
      case ScalarCodec::kUE8M0Ceil: v = ue8m0_to_float(cbytes(codes)[i]); break;
    }
    out.ptr<float>()[i] = v;
  }
}

}  // namespace qmoe
