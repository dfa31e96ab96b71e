// Compiled instead of src/cuda/ when QMOE_WITH_CUDA_KERNELS=OFF (fast CPU-only builds):
// every GPU entry raises a clear error instead of failing to link.
#include "cuda/launch.h"

namespace qmoe::cuda {

namespace {
[[noreturn]] void not_built(const char* op) {
  throw Error(op, "a qmoe build with CUDA kernels (QMOE_WITH_CUDA_KERNELS=ON)",
              "a CPU-only build; pass CPU tensors or rebuild", ErrorKind::kRuntime);
}
}  // namespace

bool kernels_built() { return false; }
void moe_mm_data(const TensorRef&, TensorRef, TensorRef, TensorRef, TensorRef, TensorRef, int64_t, int64_t, int64_t,
                 cudaStream_t, bool) {
  not_built("get_cutlass_w4a8_moe_mm_data");
}
void w4a8_moe_mm(const W4A8MoeMmArgs&, const Tactic&, cudaStream_t) { not_built("cutlass_w4a8_moe_mm"); }
void fused_moe_w4a8_int4(const FusedMoeParams&, const Tactic&, const Tactic&, void*, void*, cudaStream_t) {
  not_built("fused_moe");
}
void fused_moe_bf16_w4(const FusedMoeParams&, const Tactic&, const Tactic&, void*, void*, cudaStream_t) {
  not_built("fused_moe");
}
void moe_finalize(const MoeFinalizeParams&, cudaStream_t) { not_built("moe_finalize"); }
void ep_low_latency_row_index(const TensorRef&, int64_t, int, int64_t, TensorRef, cudaStream_t) {
  not_built("low_latency_layer");
}
void ep_broadcast_f32_rows(const float*, void*, int64_t, int64_t, cudaStream_t) { not_built("low_latency_layer"); }
void ep_gather_rows(void*, int64_t, const void*, int64_t, const int32_t*, int64_t, int64_t, cudaStream_t) {
  not_built("throughput_layer");
}
void ep_sum_partials(const void*, const int32_t*, int64_t, int64_t, TensorRef, cudaStream_t) {
  not_built("low_latency_layer");
}
void check_cuda(cudaError_t err, const char* what) {}

}  // namespace qmoe::cuda
