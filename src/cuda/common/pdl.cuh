// Programmatic dependent launch (PDL) between the kernels of one fused-MoE call (FlashInfer's
// enable_pdl): with it, kernel i + 1 may be scheduled while kernel i drains, instead of after it.
//
// Device side: every glue kernel of the pipeline starts with pdl_wait_then_release(): griddepcontrol.wait
// blocks until the previous kernel in the stream has completed and its writes are visible (a no-op
// when the kernel was not launched as a dependent), then launch_dependents lets the next kernel
// start its own launch. The GEMMs start with pdl_wait() only: their dependents launch as their CTAs
// exit. Released early, the next kernel's CTAs sat beside the GEMM's main loop and Qwen3-30B T = 64
// ran 11% slower than without PDL; with the late release, on vs off (H200, session 8, two runs
// each): T = 1 2-8% faster on four models, T = 8 / 64 from -3.5% to +5% (bench/results/
// 2026-11-30_s8a_nvidia_h200_pdl_ab.md). Because every kernel waits before its first global access,
// each one runs after all earlier ones have completed: the pipeline's read-after-write and
// write-after-read orders (e.g. GEMM2's output reusing GEMM1's input bytes) hold exactly as without PDL.
// Host side: launch_kernel() is `kernel<<<grid, block, smem, stream>>>(args...)`, with the
// programmatic-stream-serialization attribute when the calling thread is inside a PdlScope(true).
// Errors are left for the caller's check_cuda(cudaGetLastError(), ...), as after <<<...>>>.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace qmoe::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}

// Lets the next kernel start its launch without waiting for the previous one (a kernel that reads nothing
// the previous kernel writes; it must still pdl_wait() before it exits, so that its completion implies the
// previous kernel's).
__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}

// The calling thread's PDL switch (thread-local: concurrent calls from other threads are unaffected).
inline bool& pdl_enabled() {
  static thread_local bool enabled = false;
  return enabled;
}

// Turns PDL on or off for the launches of this thread until the scope ends.
class PdlScope {
 public:
  explicit PdlScope(bool on) : previous_(pdl_enabled()) { pdl_enabled() = on; }
  ~PdlScope() { pdl_enabled() = previous_; }
  PdlScope(const PdlScope&) = delete;
  PdlScope& operator=(const PdlScope&) = delete;

 private:
  bool previous_;
};

template <class... KernelArgs, class... Args>
void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  (void)cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);  // error: cudaGetLastError()
}

}  // namespace qmoe::cuda
