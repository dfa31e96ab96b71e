// The K warps of a tile meet at its end (sm90_grouped_gemm_w4a8_int4.cuh, sm90_grouped_gemm_bf16_w4.cuh):
// WARPS_K warps split the K groups of every stage (warp k takes the groups g with g % WARPS_K == k);
// warps k > 0 park their fp32 sums in shared memory (`park`, (WARPS_K - 1) * MF * NF * 4 * MN_THREADS
// floats) and zero them, the block waits, and warp k = 0 adds them in k order: a fixed order, the same
// for every tactic of the kernel, so their results stay bitwise equal.
#pragma once

namespace qmoe::cuda {

// Every thread of the block calls it (it holds a __syncthreads). Returns true for the warps that go on
// to the epilogue (k = 0); the others must skip it. The caller's next barrier retires `park`.
template <int WARPS_K, int MF, int NF, int MN_THREADS>
__device__ __forceinline__ bool meet_k_warps(float (&acc)[MF][NF][4], float* park, int warp_k, int mn_tid) {
  constexpr int kAccs = MF * NF * 4;
  if (warp_k > 0) {
#pragma unroll
    for (int i = 0; i < MF; ++i)
#pragma unroll
      for (int j = 0; j < NF; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          park[((warp_k - 1) * kAccs + (i * NF + j) * 4 + c) * MN_THREADS + mn_tid] = acc[i][j][c];
          acc[i][j][c] = 0.f;
        }
  }
  __syncthreads();
  if (warp_k > 0) return false;
#pragma unroll
  for (int k = 1; k < WARPS_K; ++k)
#pragma unroll
    for (int i = 0; i < MF; ++i)
#pragma unroll
      for (int j = 0; j < NF; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          acc[i][j][c] += park[((k - 1) * kAccs + (i * NF + j) * 4 + c) * MN_THREADS + mn_tid];
  return true;
}

}  // namespace qmoe::cuda
