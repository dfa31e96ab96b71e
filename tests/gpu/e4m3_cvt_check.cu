// Brute-force check that the fused MoE's e4m3 encoder (src/cuda/fused/fused_moe_common.cuh: e4m3x2,
// e4m3x4, e4m3_of; the hardware cvt.rn.satfinite.e4m3x2.f32 plus a NaN fix-up) gives exactly the
// bits of qmoe::float_to_e4m3 (include/qmoe/formats.h, the CPU reference's codec) for EVERY fp32
// input: all 2^32 bit patterns (NaNs of both signs and all payloads, +-inf, |x| >= 448, the
// rounding ties, fp32 and e4m3 subnormals, +-0) in the low half, and in the high half with an
// unrelated partner value (so a swapped byte order fails too).
//
// Header-only (no library needed). Build and run on a Hopper GPU:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Iinclude -Isrc \
//        -o build/e4m3_cvt_check tests/gpu/e4m3_cvt_check.cu && build/e4m3_cvt_check
// Exit status 0 and "PASS" when every pattern agrees; otherwise the first mismatches are printed.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "cuda/fused/fused_moe_common.cuh"
#include "qmoe/formats.h"

namespace {

struct Mismatch {
  uint32_t bits;
  uint32_t got, want;  // got: the fused encoder, want: float_to_e4m3 (same packing)
  uint32_t which;      // 0: e4m3x2 (lo, partner), 1: e4m3x2 (partner, hi), 2: e4m3x4, 3: e4m3_of
};

constexpr int kMaxRecorded = 16;

__device__ uint32_t partner_of(uint32_t u) { return u * 2654435761u ^ 0x9e3779b9u; }  // any other pattern

__device__ void record(unsigned long long* count, Mismatch* out, uint32_t bits, uint32_t got, uint32_t want,
                       uint32_t which) {
  const unsigned long long i = atomicAdd(count, 1ull);
  if (i < kMaxRecorded) out[i] = Mismatch{bits, got, want, which};
}

// One thread per block of patterns; `base` selects the 2^32 / chunks slice of this launch.
__global__ void check_kernel(uint64_t base, uint64_t n, unsigned long long* count, Mismatch* out) {
  using namespace qmoe;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t u = static_cast<uint32_t>(base + i);
    const uint32_t p = partner_of(u);
    const float x = __uint_as_float(u), y = __uint_as_float(p);
    const uint32_t sx = float_to_e4m3(x), sy = float_to_e4m3(y);
    const uint32_t lo = cuda::fused::e4m3x2(x, y);
    if (lo != (sx | (sy << 8))) record(count, out, u, lo, sx | (sy << 8), 0);
    const uint32_t hi = cuda::fused::e4m3x2(y, x);
    if (hi != (sy | (sx << 8))) record(count, out, u, hi, sy | (sx << 8), 1);
    const uint32_t four = cuda::fused::e4m3x4(y, x, x, y);
    const uint32_t four_want = sy | (sx << 8) | (sx << 16) | (sy << 24);
    if (four != four_want) record(count, out, u, four, four_want, 2);
    const uint32_t one = cuda::fused::e4m3_of(x);
    if (one != sx) record(count, out, u, one, sx, 3);
  }
}

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return false;
}

}  // namespace

int main() {
  unsigned long long* count = nullptr;
  Mismatch* out = nullptr;
  if (!ok(cudaMalloc(&count, sizeof(*count)), "cudaMalloc") ||
      !ok(cudaMalloc(&out, sizeof(Mismatch) * kMaxRecorded), "cudaMalloc") ||
      !ok(cudaMemset(count, 0, sizeof(*count)), "cudaMemset"))
    return 2;
  constexpr uint64_t kTotal = uint64_t{1} << 32;
  constexpr uint64_t kSlice = uint64_t{1} << 30;
  for (uint64_t base = 0; base < kTotal; base += kSlice) check_kernel<<<132 * 16, 256>>>(base, kSlice, count, out);
  if (!ok(cudaGetLastError(), "launch") || !ok(cudaDeviceSynchronize(), "kernel")) return 2;
  unsigned long long mismatches = 0;
  Mismatch first[kMaxRecorded];
  if (!ok(cudaMemcpy(&mismatches, count, sizeof(mismatches), cudaMemcpyDeviceToHost), "copy") ||
      !ok(cudaMemcpy(first, out, sizeof(first), cudaMemcpyDeviceToHost), "copy"))
    return 2;
  std::printf("e4m3 encoder (%s path) vs qmoe::float_to_e4m3 over all 2^32 fp32 patterns: %llu mismatches\n",
              qmoe::cuda::fused::kHardwareE4m3 ? "hardware" : "software", mismatches);
  for (unsigned long long i = 0; i < mismatches && i < kMaxRecorded; ++i)
    std::printf("  input 0x%08x (check %u): got 0x%08x, want 0x%08x\n", first[i].bits, first[i].which, first[i].got,
                first[i].want);
  std::printf(mismatches == 0 ? "PASS\n" : "FAIL\n");
  return mismatches == 0 ? 0 : 1;
}
