// Bindings of include/qmoe/formats.h: every array-level quantize / dequantize / pack / layout
// function, taking _C.Arg tensors with outputs preallocated by Python (python/qmoe/quant.py), plus
// the scalar codecs over arrays (for bit-exact tests). Only marshalling here; the C++ checks all.
// Functions with a GPU version take `stream` (the caller's raw cudaStream_t as an int, 0 = the
// default stream; ignored for CPU tensors). They run with the GIL released: they touch only the
// arrays the Args keep alive, and GPU calls only enqueue work.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <tuple>

#include "python/tensor_arg.h"
#include "qmoe/formats.h"

namespace qmoe::python {

namespace {

using NoGil = nb::call_guard<nb::gil_scoped_release>;

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

ScalarCodec codec_from_name(const std::string& name) {
  if (name == "bf16") return ScalarCodec::kBF16;
  if (name == "e4m3") return ScalarCodec::kE4M3;
  if (name == "e2m1") return ScalarCodec::kE2M1;
  if (name == "ue8m0_ceil") return ScalarCodec::kUE8M0Ceil;
  throw Error("codec", "one of 'bf16', 'e4m3', 'e2m1', 'ue8m0_ceil'", "'" + name + "'");
}

}  // namespace

void bind_formats(nb::module_& m) {
  // int4-g128
  m.def(
      "quantize_int4_g128",
      [](const Arg& w, Arg& q, Arg& scales, uintptr_t stream) {
        quantize_int4_g128(w.ref, q.ref, scales.ref, as_stream(stream));
      },
      nb::arg("w"), nb::arg("q"), nb::arg("scales"), nb::arg("stream") = 0, NoGil());
  m.def(
      "dequantize_int4_g128",
      [](const Arg& q, const Arg& scales, Arg& out, uintptr_t stream) {
        dequantize_int4_g128(q.ref, scales.ref, out.ref, as_stream(stream));
      },
      nb::arg("q"), nb::arg("scales"), nb::arg("out"), nb::arg("stream") = 0, NoGil());
  m.def(
      "pack_int4", [](const Arg& values, Arg& packed) { pack_int4(values.ref, packed.ref); }, nb::arg("values"),
      nb::arg("packed"), NoGil());
  m.def(
      "unpack_int4", [](const Arg& packed, Arg& values) { unpack_int4(packed.ref, values.ref); }, nb::arg("packed"),
      nb::arg("values"), NoGil());
  m.def(
      "interleave_int4_scales",
      [](const Arg& scales, Arg& out, uintptr_t stream) {
        interleave_int4_scales(scales.ref, out.ref, as_stream(stream));
      },
      nb::arg("scales"), nb::arg("out"), nb::arg("stream") = 0, NoGil());
  m.def(
      "deinterleave_int4_scales",
      [](const Arg& stored, Arg& scales, uintptr_t stream) {
        deinterleave_int4_scales(stored.ref, scales.ref, as_stream(stream));
      },
      nb::arg("stored"), nb::arg("scales"), nb::arg("stream") = 0, NoGil());
  m.def(
      "int4_scale_layout_shape",
      [](int64_t experts, int64_t n, int64_t k) {
        int64_t s[3];
        int4_scale_layout_shape(experts, n, k, s);
        return std::make_tuple(s[0], s[1], s[2]);
      },
      nb::arg("experts"), nb::arg("n"), nb::arg("k"));

  // FP8 e4m3
  m.def(
      "quantize_fp8",
      [](const Arg& x, const Arg& scale, Arg& q, uintptr_t stream) {
        quantize_fp8(x.ref, scale.ref, q.ref, as_stream(stream));
      },
      nb::arg("x"), nb::arg("scale"), nb::arg("q"), nb::arg("stream") = 0, NoGil());
  m.def(
      "fp8_dynamic_scale",
      [](const Arg& x, Arg& scale, uintptr_t stream) { fp8_dynamic_scale(x.ref, scale.ref, as_stream(stream)); },
      nb::arg("x"), nb::arg("scale"), nb::arg("stream") = 0, NoGil());
  m.def(
      "dequantize_fp8",
      [](const Arg& q, const Arg& scale, Arg& out, uintptr_t stream) {
        dequantize_fp8(q.ref, scale.ref, out.ref, as_stream(stream));
      },
      nb::arg("q"), nb::arg("scale"), nb::arg("out"), nb::arg("stream") = 0, NoGil());

  // NVFP4 / MX
  m.def(
      "quantize_nvfp4",
      [](const Arg& x, float global_scale, Arg& q, Arg& sf, uintptr_t stream) {
        quantize_nvfp4(x.ref, global_scale, q.ref, sf.ref, as_stream(stream));
      },
      nb::arg("x"), nb::arg("global_scale"), nb::arg("q"), nb::arg("sf"), nb::arg("stream") = 0, NoGil());
  m.def(
      "dequantize_nvfp4",
      [](const Arg& q, const Arg& sf, float global_scale, Arg& out, uintptr_t stream) {
        dequantize_nvfp4(q.ref, sf.ref, global_scale, out.ref, as_stream(stream));
      },
      nb::arg("q"), nb::arg("sf"), nb::arg("global_scale"), nb::arg("out"), nb::arg("stream") = 0, NoGil());
  m.def(
      "quantize_mxfp4",
      [](const Arg& x, Arg& q, Arg& sf, uintptr_t stream) { quantize_mxfp4(x.ref, q.ref, sf.ref, as_stream(stream)); },
      nb::arg("x"), nb::arg("q"), nb::arg("sf"), nb::arg("stream") = 0, NoGil());
  m.def(
      "dequantize_mxfp4",
      [](const Arg& q, const Arg& sf, Arg& out, uintptr_t stream) {
        dequantize_mxfp4(q.ref, sf.ref, out.ref, as_stream(stream));
      },
      nb::arg("q"), nb::arg("sf"), nb::arg("out"), nb::arg("stream") = 0, NoGil());
  m.def(
      "quantize_mxfp8",
      [](const Arg& x, Arg& q, Arg& sf, uintptr_t stream) { quantize_mxfp8(x.ref, q.ref, sf.ref, as_stream(stream)); },
      nb::arg("x"), nb::arg("q"), nb::arg("sf"), nb::arg("stream") = 0, NoGil());
  m.def(
      "dequantize_mxfp8",
      [](const Arg& q, const Arg& sf, Arg& out, uintptr_t stream) {
        dequantize_mxfp8(q.ref, sf.ref, out.ref, as_stream(stream));
      },
      nb::arg("q"), nb::arg("sf"), nb::arg("out"), nb::arg("stream") = 0, NoGil());

  // Layout helpers
  m.def("swizzled_offset", &swizzled_offset, nb::arg("expert"), nb::arg("row"), nb::arg("col"), nb::arg("row_tiles"),
        nb::arg("col_tiles"));
  m.def(
      "pack_fp4_weights",
      [](const Arg& w, Arg& out, uintptr_t stream) { pack_fp4_weights(w.ref, out.ref, as_stream(stream)); },
      nb::arg("w"), nb::arg("out"), nb::arg("stream") = 0);
  m.def(
      "unpack_fp4_weights",
      [](const Arg& packed, Arg& out, uintptr_t stream) { unpack_fp4_weights(packed.ref, out.ref, as_stream(stream)); },
      nb::arg("packed"), nb::arg("out"), nb::arg("stream") = 0);
  m.def(
      "swizzle_scales_128x4",
      [](const Arg& sf, Arg& out, uintptr_t stream) { swizzle_scales_128x4(sf.ref, out.ref, as_stream(stream)); },
      nb::arg("sf"), nb::arg("out"), nb::arg("stream") = 0, NoGil());
  m.def(
      "unswizzle_scales_128x4",
      [](const Arg& swizzled, Arg& sf, uintptr_t stream) {
        unswizzle_scales_128x4(swizzled.ref, sf.ref, as_stream(stream));
      },
      nb::arg("swizzled"), nb::arg("sf"), nb::arg("stream") = 0, NoGil());
  m.def(
      "gate_up_sglang_to_flashinfer",
      [](const Arg& w, Arg& out, uintptr_t stream) { gate_up_sglang_to_flashinfer(w.ref, out.ref, as_stream(stream)); },
      nb::arg("w"), nb::arg("out"), nb::arg("stream") = 0, NoGil());
  m.def(
      "gate_up_flashinfer_to_sglang",
      [](const Arg& w, Arg& out, uintptr_t stream) { gate_up_flashinfer_to_sglang(w.ref, out.ref, as_stream(stream)); },
      nb::arg("w"), nb::arg("out"), nb::arg("stream") = 0, NoGil());

  // Scalar codecs over arrays: codec in {'bf16', 'e4m3', 'e2m1', 'ue8m0_ceil'}.
  m.def(
      "encode_elementwise",
      [](const Arg& x, const std::string& codec, Arg& codes) {
        encode_elementwise(x.ref, codec_from_name(codec), codes.ref);
      },
      nb::arg("x"), nb::arg("codec"), nb::arg("codes"));
  m.def(
      "decode_elementwise",
      [](const Arg& codes, const std::string& codec, Arg& out) {
        decode_elementwise(codes.ref, codec_from_name(codec), out.ref);
      },
      nb::arg("codes"), nb::arg("codec"), nb::arg("out"));
}

}  // namespace qmoe::python
