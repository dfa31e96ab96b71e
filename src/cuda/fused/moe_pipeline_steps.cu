// The steps both GPU fused-MoE pipelines share (sm90_fused_moe_w4a8_int4.cu, sm90_fused_moe_bf16_w4.cu):
//   first: local expert ids of every slot, then the routing metadata over the local experts
//          (qmoe::cuda::moe_mm_data: offsets, problem sizes, permutations), all into the workspace
//          (local_routing, then route_rows; at decode the gather between them, when it finds its own
//          rows: gather_finds_rows);
//   last:  back to token order (the finalize into p.output), or for moe_expert_rows the GEMM2 rows
//          scattered to flat slot order without combining;
//   and the fused finalize's pieces: the RowScatterAdd GEMM2's epilogue runs with, and the zeroing of
//          the output before it (cudaMemsetAsync, forked onto aux_stream when given).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "cuda/fused/fused_moe_kernels.h"
#include "cuda/launch.h"

namespace qmoe::cuda::fused {

RowRouting local_routing(const FusedMoeParams& p, const RoutingBuffers& b, bool own_rows, cudaStream_t stream) {
  const int64_t topk = p.topk_ids.size(1), slots = p.topk_ids.size(0) * topk;
  const int64_t local = p.num_local_experts == 0 ? p.num_experts : p.num_local_experts;
  // Every expert local (no expert parallelism): the ids are their own local ids, and moe_mm_data drops
  // the out-of-range ones itself, so the shifting kernel (~1 us at decode) is skipped. The kernels
  // after it read local ids only of the slots the routing keeps, where both agree.
  const bool all_local = p.local_expert_offset == 0 && local == p.num_experts;
  int32_t* ids = all_local ? const_cast<int32_t*>(p.topk_ids.ptr<const int32_t>()) : b.local_ids;
  if (!all_local)
    local_expert_ids(p.topk_ids.ptr<const int32_t>(), b.local_ids, slots, p.num_experts, p.local_expert_offset, local,
                     stream);
  RowRouting r{ids, b.offsets, b.input_permutation, b.output_permutation, static_cast<int>(local),
               static_cast<int>(topk), slots};
  r.own_rows = own_rows;
  return r;
}

void route_rows(const FusedMoeParams& p, const RowRouting& r, const RoutingBuffers& b, int64_t hidden, int64_t inter,
                bool overlap_previous, cudaStream_t stream) {
  const int device = p.x.device_index;
  auto tensor = [device](int32_t* data, std::initializer_list<int64_t> shape) {
    return make_tensor(data, DType::kInt32, shape, Device::kCUDA, device);
  };
  const int64_t local = r.num_local;
  moe_mm_data(tensor(const_cast<int32_t*>(r.local_ids), {r.max_rows}), tensor(b.offsets, {local + 1}),
              tensor(b.sizes1, {local, 3}), tensor(b.sizes2, {local, 3}), tensor(b.input_permutation, {r.max_rows}),
              tensor(b.output_permutation, {r.max_rows}), local, inter, hidden, stream, overlap_previous);
}

bool gather_finds_rows(int64_t slots) {
  const char* v = std::getenv("QMOE_GATHER_OWN_ROWS");
  if (v != nullptr && v[0] == '0' && v[1] == '\0') return false;
  return slots > 0 && slots <= kOwnRowsMaxSlots;
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

bool gemm_pdl_wanted(int64_t tokens) {
  const char* v = std::getenv("QMOE_PDL_GEMMS");
  if (v != nullptr && (v[0] == '0' || v[0] == '1') && v[1] == '\0') return v[0] == '1';
  return tokens <= kGemmPdlMaxTokens;
}

bool fused_epilogue_allowed() {
  const char* v = std::getenv("QMOE_FUSED_EPILOGUE");
  return v == nullptr || !(v[0] == '0' && v[1] == '\0');
}

bool fused_epilogue_forced() {
  const char* v = std::getenv("QMOE_FUSED_EPILOGUE");
  return v != nullptr && v[0] == '1' && v[1] == '\0';
}

RowScatterAdd fused_finalize_scatter(const FusedMoeParams& p, const int32_t* input_permutation,
                                     const void* slot_rows, const Tactic& gemm2_tactic, bool pipeline_scatters) {
  RowScatterAdd sc;
  if (slot_rows != nullptr || p.deterministic) return sc;
  const char* v = std::getenv("QMOE_DECODE_SCATTER");
  const bool forced = v != nullptr && (v[0] == '0' || v[0] == '1') && v[1] == '\0';
  if (!(forced ? v[0] == '1' : pipeline_scatters)) return sc;
  // Only the decode tiles scatter. Measured on the H200 (bench/results/2026-11-30_s3_nvidia_h200_moe.md):
  // the WGMMA tiles' epilogue adds single 16-bit values and the layer ran 2.2x slower at DeepSeek-V3
  // T = 4096 than with y + the finalize kernel; the bf16 x 4-bit prefill tile 4-8% slower. Those take
  // the finalize kernel's "fused" mode instead (same rounding steps, order fixed).
  if (gemm2_tactic.family != Tactic::Family::kDecode) return sc;
  // Paired bf16 / f16 atomics are 32-bit: a 2-byte-aligned view (an odd storage offset) keeps the
  // finalize kernel, which needs no alignment (same arithmetic, in slot order).
  if (reinterpret_cast<uintptr_t>(p.output.data) % 4 != 0) return sc;
  sc.out = p.output.data;
  sc.out_dtype = p.output.dtype == DType::kFloat32   ? ScatterOut::kFloat32
                 : p.output.dtype == DType::kFloat16 ? ScatterOut::kFloat16
                                                      : ScatterOut::kBFloat16;
  sc.row_slot = input_permutation;
  sc.topk_weights = p.topk_weights.ptr<const float>();
  sc.topk = static_cast<int>(p.topk_ids.size(1));
  sc.routed_scaling_factor = p.routed_scaling_factor;
  sc.cols = p.output.size(1);
  return sc;
}

namespace {

// The fork and join events of this thread on one device, created on first use and kept for the
// thread's lifetime (an event belongs to the device that was current when it was created).
struct ForkJoinEvents {
  cudaEvent_t fork = nullptr, join = nullptr;
};

ForkJoinEvents& thread_events(int device) {
  struct PerThread {
    std::vector<ForkJoinEvents> by_device;
    ~PerThread() {  // errors ignored: at process exit the runtime may already be unloading
      for (const ForkJoinEvents& e : by_device) {
        if (e.fork != nullptr) cudaEventDestroy(e.fork);
        if (e.join != nullptr) cudaEventDestroy(e.join);
      }
    }
  };
  static thread_local PerThread events;
  if (static_cast<int>(events.by_device.size()) <= device) events.by_device.resize(device + 1);
  ForkJoinEvents& e = events.by_device[device];
  if (e.fork == nullptr)
    check_cuda(cudaEventCreateWithFlags(&e.fork, cudaEventDisableTiming), "cudaEventCreate(fused_moe fork)");
  if (e.join == nullptr)
    check_cuda(cudaEventCreateWithFlags(&e.join, cudaEventDisableTiming), "cudaEventCreate(fused_moe join)");
  return e;
}

}  // namespace

void zero_output_fork(const FusedMoeParams& p, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(p.output.numel()) * dtype_size(p.output.dtype);  // contiguous [T, H]
  if (p.aux_stream == nullptr) {
    check_cuda(cudaMemsetAsync(p.output.data, 0, bytes, stream), "cudaMemsetAsync(fused_moe output)");
    return;
  }
  const ForkJoinEvents& e = thread_events(p.x.device_index);
  check_cuda(cudaEventRecord(e.fork, stream), "cudaEventRecord(fused_moe fork)");
  check_cuda(cudaStreamWaitEvent(p.aux_stream, e.fork, 0), "cudaStreamWaitEvent(aux_stream)");
  check_cuda(cudaMemsetAsync(p.output.data, 0, bytes, p.aux_stream), "cudaMemsetAsync(fused_moe output, aux_stream)");
  check_cuda(cudaEventRecord(e.join, p.aux_stream), "cudaEventRecord(fused_moe join)");
}

void zero_output_join(const FusedMoeParams& p, cudaStream_t stream) {
  if (p.aux_stream == nullptr) return;
  check_cuda(cudaStreamWaitEvent(stream, thread_events(p.x.device_index).join, 0), "cudaStreamWaitEvent(stream)");
}

}  // namespace qmoe::cuda::fused
