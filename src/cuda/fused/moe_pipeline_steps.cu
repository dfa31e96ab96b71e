// The steps both GPU fused-MoE pipelines share (sm90_fused_moe_w4a8_int4.cu, sm90_fused_moe_bf16_w4.cu):
//   first: local expert ids of every slot, then the routing metadata over the local experts
//          (qmoe::cuda::moe_mm_data: offsets, problem sizes, permutations), all into the workspace;
//   last:  back to token order (the finalize into p.output), or for moe_expert_rows the GEMM2 rows
//          scattered to flat slot order without combining.
#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/launch.h"

namespace qmoe::cuda::fused {

RowRouting route_local_experts(const FusedMoeParams& p, const RoutingBuffers& b, int64_t hidden, int64_t inter,
                               cudaStream_t stream) {
  const int64_t topk = p.topk_ids.size(1), slots = p.topk_ids.size(0) * topk;
  const int64_t local = p.num_local_experts == 0 ? p.num_experts : p.num_local_experts;
  const int device = p.x.device_index;
  auto tensor = [device](int32_t* data, std::initializer_list<int64_t> shape) {
    return make_tensor(data, DType::kInt32, shape, Device::kCUDA, device);
  };
  local_expert_ids(p.topk_ids.ptr<const int32_t>(), b.local_ids, slots, p.num_experts, p.local_expert_offset, local,
                   stream);
  moe_mm_data(tensor(b.local_ids, {slots}), tensor(b.offsets, {local + 1}), tensor(b.sizes1, {local, 3}),
              tensor(b.sizes2, {local, 3}), tensor(b.input_permutation, {slots}),
              tensor(b.output_permutation, {slots}), local, inter, hidden, stream);
  return RowRouting{b.local_ids, b.offsets, b.input_permutation, static_cast<int>(local), static_cast<int>(topk),
                    slots};
}

void finish_rows(const FusedMoeParams& p, const uint16_t* y, const int32_t* output_permutation, int64_t hidden,
                 void* slot_rows, cudaStream_t stream) {
  const int64_t tokens = p.topk_ids.size(0), topk = p.topk_ids.size(1);
  if (slot_rows != nullptr) {
    scatter_slot_rows(y, output_permutation, tokens * topk, hidden, static_cast<uint16_t*>(slot_rows), stream);
    return;
  }
  finalize(y, output_permutation, p.topk_weights.ptr<const float>(), tokens, static_cast<int>(topk), hidden,
           p.routed_scaling_factor, p.deterministic, p.output.dtype, p.output.data, stream);
}

}  // namespace qmoe::cuda::fused
