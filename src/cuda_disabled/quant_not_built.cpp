// Compiled instead of src/cuda/quant/ when QMOE_WITH_CUDA_KERNELS=OFF (fast CPU-only builds): the GPU
// quantizer launchers of cuda/quant/quant_launch.h throw a clear error (kind kRuntime) instead of
// failing to link. CPU tensors never reach them.
#include "cuda/quant/quant_launch.h"

namespace qmoe::cuda {

namespace {
[[noreturn]] void quant_not_built(const char* op) {
  throw Error(op, "a qmoe build with CUDA kernels (QMOE_WITH_CUDA_KERNELS=ON)",
              "a CPU-only build; pass CPU tensors or rebuild", ErrorKind::kRuntime);
}
}  // namespace

void quantize_fp8(const TensorRef&, const TensorRef&, bool, TensorRef, cudaStream_t) { quant_not_built("quantize_fp8"); }
void fp8_dynamic_scale(const TensorRef&, bool, TensorRef, cudaStream_t) { quant_not_built("fp8_dynamic_scale"); }
void dequantize_fp8(const TensorRef&, const TensorRef&, bool, TensorRef, cudaStream_t) {
  quant_not_built("dequantize_fp8");
}
void quantize_nvfp4(const TensorRef&, float, TensorRef, TensorRef, cudaStream_t) { quant_not_built("quantize_nvfp4"); }
void dequantize_nvfp4(const TensorRef&, const TensorRef&, float, TensorRef, cudaStream_t) {
  quant_not_built("dequantize_nvfp4");
}
void quantize_mx(const TensorRef&, TensorRef, TensorRef, bool fp4, cudaStream_t) {
  quant_not_built(fp4 ? "quantize_mxfp4" : "quantize_mxfp8");
}
void dequantize_mx(const TensorRef&, const TensorRef&, TensorRef, bool fp4, cudaStream_t) {
  quant_not_built(fp4 ? "dequantize_mxfp4" : "dequantize_mxfp8");
}
void quantize_int4_g128(const TensorRef&, TensorRef, TensorRef, cudaStream_t) { quant_not_built("quantize_int4_g128"); }
void dequantize_int4_g128(const TensorRef&, const TensorRef&, TensorRef, cudaStream_t) {
  quant_not_built("dequantize_int4_g128");
}
void swizzle_scales_128x4(const TensorRef&, TensorRef, int64_t, int64_t, int64_t, cudaStream_t) {
  quant_not_built("swizzle_scales_128x4");
}
void unswizzle_scales_128x4(const TensorRef&, TensorRef, int64_t, int64_t, int64_t, cudaStream_t) {
  quant_not_built("unswizzle_scales_128x4");
}
void interleave_int4_scales(const TensorRef&, TensorRef, bool to_stored, cudaStream_t) {
  quant_not_built(to_stored ? "interleave_int4_scales" : "deinterleave_int4_scales");
}
void convert_fp4_words(const TensorRef&, TensorRef, bool pack, cudaStream_t) {
  quant_not_built(pack ? "pack_fp4_weights" : "unpack_fp4_weights");
}
void reorder_gate_up(const TensorRef&, TensorRef, bool to_flashinfer, cudaStream_t) {
  quant_not_built(to_flashinfer ? "gate_up_sglang_to_flashinfer" : "gate_up_flashinfer_to_sglang");
}

}  // namespace qmoe::cuda
