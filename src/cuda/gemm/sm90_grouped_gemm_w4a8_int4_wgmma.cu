// Hopper WGMMA prefill kernel of the W4A8 grouped GEMM (cutlass_w4a8_moe_mm), SGLang semantics:
//
//   D[r, o] = bf16( a_scale(r) * sum_g S[e, o, g] * (sum_{k in group g} A[r, k] * q[e, o, k]) )
//
// a fresh fp32 partial per 128-wide K group (four wgmma m64n128k32 with the first one not
// accumulating), then one fp32 FMA with the bf16 group scale into the main accumulator, g increasing.
//
// Structure: swap-AB. The wgmma M side (64 rows per warpgroup, 2 warpgroups = 128 rows per CTA
// tile) holds weight rows: int4 codes are turned into e4m3 in registers (every int4 value is exact
// in e4m3) and fed as the register A operand; the N side holds 128 token rows of activations, read
// by the tensor cores from shared memory (B operand, K-major, 128-byte swizzle). One pipeline stage
// is one K group: 16 KB of activations, 8 KB of weights, the tile's scales, loaded STAGES ahead, across
// tile boundaries. Two kernels (same math, same bits):
//   wgmma_ws       96-, 128- and 160-token tiles (m64n{96,128,160}k32): warp-specialized, a loading
//                  warpgroup (per-stage mbarriers) and two computing warpgroups that run out of step,
//                  6 stages (96 tokens: 8); the 96-token tile keeps two K groups in flight per computing
//                  warpgroup (kTwoGroupsInFlight: a second partial accumulator, which only fits at up to 96 tokens);
//   wgmma_prefill  64- and 32-token tiles (wgmma m64n64k32 / m64n32k32), for experts with fewer rows: all
//                  warps compute in step, two CTAs per SM.
// Both load a stage by TMA from one thread: the activation box, the weights and the scales as two 64-row
// halves each (WithTmaMaps).
// A persistent grid walks the (expert, feature tile, token tile)
// list built in shared memory from the device-side problem sizes, so empty experts cost nothing.
// Descriptors, barriers and epilogue stores: wgmma_building_blocks.cuh; the TMA stages: wgmma_tma.cuh.
// Limits (checked by the caller): K % 128 == 0, N % 8 == 0, E <= 1024, 16-byte aligned pointers.
#include <cuda_bf16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/common/int4_to_e4m3.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/common/store_out.cuh"
#include "cuda/gemm/grouped_tile_list.cuh"
#include "cuda/gemm/resident_ctas.h"
#include "cuda/gemm/sm90_grouped_gemm_w4a8_int4_wgmma.h"
#include "cuda/gemm/wgmma_building_blocks.cuh"
#include "cuda/gemm/wgmma_tma.cuh"
#include "qmoe/error.h"

namespace qmoe::cuda {
namespace wgmma_two_groups {
// The order of a computing warpgroup's K groups when two are in flight (the warp-specialized kernel below): group 0
// converted and issued into `part`, group 1 converted; then step(next, it, a, a_next, pt, pt_next) per group,
// alternating the two operand and partial buffers; `next` (std::true_type) when group it + 1 exists and is issued
// inside the step.
template <int N, class WaitFull, class Convert, class Issue, class Step>
__device__ __forceinline__ void run(int total_iters, WaitFull&& wait_full, Convert&& convert, Issue&& issue, Step&& step,
                                    float (&part)[N], float (&part_b)[N]) {
  using Next = std::true_type;
  using Last = std::false_type;
  uint32_t a_even[4][4], a_odd[4][4];
  wait_full(0);
  convert(0, a_even);
  issue(0, a_even, part);
  if (total_iters > 1) {
    wait_full(1);
    convert(1, a_odd);
  }
  int it = 0;
  for (; it + 2 < total_iters; it += 2) {  // group it in flight in part at every iteration's start
    step(Next{}, it, a_even, a_odd, part, part_b);
    step(Next{}, it + 1, a_odd, a_even, part_b, part);
  }
  if (total_iters - it == 2) {
    step(Next{}, it, a_even, a_odd, part, part_b);
    step(Last{}, it + 1, a_odd, a_even, part_b, part);
  } else {
    step(Last{}, it, a_even, a_odd, part, part_b);
  }
}
}  // namespace wgmma_two_groups
namespace wgmma_prefill {

using namespace wgmma;  // (wgmma_building_blocks.cuh)

constexpr int kThreads = 256;  // two warpgroups, both load and compute
// The weight loads addressed by XOR on the shared address (stage_a_operand_xor): the 32-token tile's step falls from
// 613 to 591 SASS instructions and runs 2.2-4.2% faster at every shape measured (H200, A/B alternated twice,
// bench/results/2026-12-03_s35h_*); the 48- and 64-token tiles compile to the same step either way.
constexpr bool kXorAddress = true;
// The 32-token tile runs on biased operand codes (Int4PairToBiasedE4m3: a nibble spread of a row pair, 6 ALU
// instructions per 8 weights instead of 12) with one more wgmma per K step that cancels the bias in the same fp32
// partial, one K group in flight (with two, ptxas serializes every wgmma for want of registers). The tile is
// issue-bound (ncu s35b: ALU 61%, tensor 16%) and this removes ~45 of ~197 instructions per K group: 5-10% faster than
// the exact lookup with two groups in flight at 12-24 rows per expert (Qwen3-235B GEMM1 T = 256 337 -> 306 us, Mixtral
// GEMM1 / GEMM2 T = 64 197 -> 179 / 99 -> 89; DeepSeek-V3 and Kimi-K2 at 16 rows within +-1.5%, memory-bound there;
// H200, A/B alternated twice, bench/results/2026-12-03_s36a_*). Its bits differ from the other WGMMA tiles'
// (tune.mma_family), its relative RMS error vs the CPU reference is ~12% higher (8.4e-4 vs 7.5e-4 mean over the check's
// cases): the partial sums (q + 8) x - 8 x in the tensor cores' accumulation. The 48-token tile the same way (s36h):
// 6-8% faster at 32 rows per expert on the Qwen3 and Mixtral shapes (Qwen3-235B GEMM1 T = 512 380 -> 349 us, Mixtral
// GEMM1 T = 128 221 -> 205), DeepSeek-V3 within its run-to-run spread; the 64-token tile 2-4% slower (its tensor
// pipe is busier), so it keeps the exact lookup.
template <int TILE_N>
constexpr bool kBiasedOperands = TILE_N <= 48;
// Convert the next stage's weights while this stage's wgmmas run (else after their wait).
constexpr bool kOverlapConvert = true;

// TILE_N token rows per tile (the wgmma N: 128, or 64 for experts with fewer rows).
template <int TILE_N>
struct Shape {
  static_assert(TILE_N == 32 || TILE_N == 48 || TILE_N == 64 || TILE_N == 128,
                "wgmma m64n32k32, m64n48k32, m64n64k32 or m64n128k32");
  // Stages of 17 KB (64 tokens): 5, two CTAs per SM in 2 x 92 KB. With the overlapped conversion one stage
  // ahead is landed, the rest in flight. 32-token tiles (13 KB stages, chosen at 20-26 rows per expert: weight
  // streaming): 8 stages, more bytes in flight per SM.
  static constexpr int kStages = TILE_N == 32 ? 8 : TILE_N == 48 ? 6 : 5;
  static_assert(kStages >= 3, "the overlapped conversion needs stage it + 1 landed while it + 2.. load");
  static constexpr int kAcc = TILE_N / 2;                 // fp32 accumulator registers per thread
  static constexpr int kStageA = TILE_N * kGroup;         // activations, TILE_N rows x 128 bytes
  static constexpr int kStageBytes = kStageA + kStageW + kStageS;
  static_assert(kStageBytes % 1024 == 0, "every stage's activation tile stays 1024-byte aligned (128B swizzle)");
  static constexpr int kBarrierBytes = kStages * 8;  // the "full" mbarriers
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kBarrierBytes + kTileStartBytes;  // + alignment slack
  static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of one SM");
  static_assert(TILE_N == 128 || 2 * (kSmemBytes + 1024) <= 228 * 1024, "two CTAs per SM (+ 1 KB reserved each)");
};

// d (64 x 160 fp32 per warpgroup) (+)= A (64 x 32 e4m3, registers) * B^T (160 x 32 e4m3, smem).
__device__ __forceinline__ void wgmma_m64n160k32(float (&d)[80], uint32_t a0, uint32_t a1, uint32_t a2,
                                                 uint32_t a3, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %85, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n160k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, {%80, %81, %82, %83}, %84, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate));
}

// d (64 x 128 fp32 per warpgroup) (+)= A (64 x 32 e4m3, registers) * B^T (128 x 32 e4m3, smem).
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2,
                                                 uint32_t a3, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate));
}

// d (64 x 96 fp32 per warpgroup) (+)= A (64 x 32 e4m3, registers) * B^T (96 x 32 e4m3, smem).
__device__ __forceinline__ void wgmma_m64n96k32(float (&d)[48], uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate));
}

// d (64 x 64 fp32 per warpgroup) (+)= A (64 x 32 e4m3, registers) * B^T (64 x 32 e4m3, smem).
__device__ __forceinline__ void wgmma_m64n64k32(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate));
}

// d (64 x 48 fp32 per warpgroup) (+)= A (64 x 32 e4m3, registers) * B^T (48 x 32 e4m3, smem).
__device__ __forceinline__ void wgmma_m64n48k32(float (&d)[24], uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n48k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate));
}

// d (64 x 32 fp32 per warpgroup) (+)= A (64 x 32 e4m3, registers) * B^T (32 x 32 e4m3, smem).
__device__ __forceinline__ void wgmma_m64n32k32(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate));
}

template <int TILE_N>
__device__ __forceinline__ void wgmma_k32(float (&d)[TILE_N / 2], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint64_t desc_b, int accumulate) {
  if constexpr (TILE_N == 160) wgmma_m64n160k32(d, a0, a1, a2, a3, desc_b, accumulate);
  else if constexpr (TILE_N == 128) wgmma_m64n128k32(d, a0, a1, a2, a3, desc_b, accumulate);
  else if constexpr (TILE_N == 96) wgmma_m64n96k32(d, a0, a1, a2, a3, desc_b, accumulate);
  else if constexpr (TILE_N == 64) wgmma_m64n64k32(d, a0, a1, a2, a3, desc_b, accumulate);
  else if constexpr (TILE_N == 48) wgmma_m64n48k32(d, a0, a1, a2, a3, desc_b, accumulate);
  else wgmma_m64n32k32(d, a0, a1, a2, a3, desc_b, accumulate);
}

// The A operand of one stage (both kernels): this thread's int4 weights, rows r0 and r1 of the stage's
// weight tile at sw (64 bytes a row), as e4m3. K step k (32 K = 16 bytes of a row): the A registers hold
// K 4 tig..+3 (bytes 2 tig, 2 tig + 1) and K 16 + 4 tig..+3 (bytes 8 + 2 tig, 9 + 2 tig), rows r0 then
// r1: the accumulator rows gid and gid + 8. Plain tiles: r1 = r0 + 1 (the thread's two features are adjacent,
// so the epilogue stores them as one pair); the fused activation epilogue: r1 = r0 + 64 (a feature's gate and
// up rows, operand_row0). Each 16-bit piece is its own 2-byte load: no extraction shift
// and select in the conversion chain (1-4% faster, bench/results/2026-12-01_s15b_*).
// The weight boxes land with the 64-byte swizzle (wgmma_tma_maps.cu): K step k of row r sits in 16-byte
// chunk k ^ ((r >> 1) & 3); rows r0 and r1 share the order (r1 = r0 + 1 with r0 even, or r0 + 64).
// The K steps' offsets in row r0 are loop-invariant: one value holds row r0's offset with the chunk order's bits
// (AOperandOffset; step k: offset ^ 16 k). Left to the compiler it is recomputed from the row and lane before every step
// (~20 instructions per K group of the 32-token tile); kOpaque makes it a register ptxas cannot recompute. Measured
// (H200, A/B alternated twice, bench/results/2026-12-03_s35f_*): the warp-specialized tiles (168 registers, no spill)
// 0.3-3% faster (96 tokens at Qwen3-235B GEMM1 T = 1024: 488 -> 474 us); the two-CTA tiles (128-register cap: the
// 32-token one then spills 16 bytes) -2.7% to +1.7%, so they leave it to the compiler.
struct AOperandOffset {
  uint32_t row0;  // r0 * 64 + 2 tig + 16 ((r0 >> 1) & 3): K step k's first 2-byte piece is at row0 ^ (16 k)
};
template <bool kOpaque>
__device__ __forceinline__ AOperandOffset a_operand_offset(int r0, int tig) {
  const uint32_t v = r0 * (kGroup / 2) + 2 * tig + 16 * ((r0 >> 1) & 3);  // bits 4-5 hold the chunk order alone
  // NOTE: through a shuffle to itself, which ptxas does not re-execute: it folds an identity mov or prmt and then
  // recomputes v from r0 and the lane before every step.
  if constexpr (kOpaque) return {__shfl_sync(0xffffffffu, v, static_cast<int>(threadIdx.x & 31))};
  return {v};
}
// The fused activation epilogue's kernels (r1 = r0 + 64) keep the loads addressed from the rows: with the offset
// register their spills grew (the 64-token kernel's from 40 to 72 bytes).
__device__ __forceinline__ void stage_a_operand(const uint8_t* sw, int r0, int r1, int tig, uint32_t (&a)[4][4],
                                                const Int4ToE4m3& cvt) {
  const int x = (r0 >> 1) & 3;
  const uint8_t* row0 = sw + r0 * (kGroup / 2) + 2 * tig;
  const uint8_t* row1 = sw + r1 * (kGroup / 2) + 2 * tig;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int chunk = 16 * (k ^ x);
    a[k][0] = cvt(*reinterpret_cast<const uint16_t*>(row0 + chunk));
    a[k][1] = cvt(*reinterpret_cast<const uint16_t*>(row1 + chunk));
    a[k][2] = cvt(*reinterpret_cast<const uint16_t*>(row0 + chunk + 8));
    a[k][3] = cvt(*reinterpret_cast<const uint16_t*>(row1 + chunk + 8));
  }
}
__device__ __forceinline__ uint32_t ld_shared_u16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}
// XOR on the shared address itself: the weight tile starts 64-byte aligned (1024: after TILE_N x 128 activation bytes
// of a 1024-aligned stage), so no carry leaves bits 0-5 of sw + row0 and (sw + row0) ^ 16 k = sw + (row0 ^ 16 k).
// step(r0_lo, r1_lo, r0_hi, r1_hi, a[k]): K step k's four 16-bit pieces (rows r0 and r1 = r0 + kRowStep, K 4 tig..+3
// and 16 + 4 tig..+3) into its four A registers.
template <int kRowStep, class Step>
__device__ __forceinline__ void stage_a_operand_xor(uint32_t sw, AOperandOffset o, uint32_t (&a)[4][4], Step&& step) {
  const uint32_t base = sw + o.row0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t row0 = base ^ (16 * k), row1 = row0 + kRowStep * (kGroup / 2);
    step(ld_shared_u16(row0), ld_shared_u16(row1), ld_shared_u16(row0 + 8), ld_shared_u16(row1 + 8), a[k]);
  }
}
// The exact codes: each piece through the lookup (Int4ToE4m3).
struct ExactCodesStep {
  const Int4ToE4m3& cvt;
  __device__ __forceinline__ void operator()(uint32_t r0_lo, uint32_t r1_lo, uint32_t r0_hi, uint32_t r1_hi,
                                             uint32_t (&a)[4]) const {
    a[0] = cvt(r0_lo);
    a[1] = cvt(r1_lo);
    a[2] = cvt(r0_hi);
    a[3] = cvt(r1_hi);
  }
};
// The biased codes: the two rows' pieces spread at once (Int4PairToBiasedE4m3).
struct BiasedCodesStep {
  const Int4PairToBiasedE4m3& spread;
  __device__ __forceinline__ void operator()(uint32_t r0_lo, uint32_t r1_lo, uint32_t r0_hi, uint32_t r1_hi,
                                             uint32_t (&a)[4]) const {
    spread(prmt(r0_lo, r1_lo, 0x5410u), a[0], a[1]);
    spread(prmt(r0_hi, r1_hi, 0x5410u), a[2], a[3]);
  }
};
template <int kRowStep>  // r1 - r0
__device__ __forceinline__ void stage_a_operand(const uint8_t* sw, AOperandOffset o, uint32_t (&a)[4][4],
                                                const Int4ToE4m3& cvt) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint8_t* row0 = sw + (o.row0 ^ (16 * k));
    const uint8_t* row1 = row0 + kRowStep * (kGroup / 2);
    a[k][0] = cvt(*reinterpret_cast<const uint16_t*>(row0));
    a[k][1] = cvt(*reinterpret_cast<const uint16_t*>(row1));
    a[k][2] = cvt(*reinterpret_cast<const uint16_t*>(row0 + 8));
    a[k][3] = cvt(*reinterpret_cast<const uint16_t*>(row1 + 8));
  }
}

// OutT ActE4m3: the fused activation epilogue (A2 and s2 instead of d; act_store_tile, in registers).
// Thread 0 issues each stage's TMA boxes; per-stage mbarriers say when they landed.
template <class OutT, int TILE_N>
__global__ void __launch_bounds__(kThreads, TILE_N <= 64 ? 2 : 1) kernel(const __grid_constant__ ParamsOf<OutT> p) {
  pdl_wait();  // first; no early release (cuda/common/pdl.cuh)
  constexpr bool kAct = std::is_same<OutT, ActE4m3>::value;
  using S = Shape<TILE_N>;
  constexpr int kTileN = TILE_N;
  constexpr int kStages = S::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_1024(smem_raw);  // the swizzled activation tiles need 1024-byte alignment
  uint8_t* stages = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * S::kStageBytes);
  int32_t* tile_start = reinterpret_cast<int32_t*>(smem + kStages * S::kStageBytes + S::kBarrierBytes);
  int32_t* warp_total = tile_start + kMaxExperts + 1;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0)
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1);  // thread 0's arrival + the boxes' bytes
  const int E = p.num_experts;
  const int n_tiles = (p.n + kTileM - 1) / kTileM;
  const int groups = p.k / kGroup;

  // ---- Work list (grouped_tile_list.cuh; its barriers also publish the mbarrier initialisation).
  const auto tiles =
      cta_tiles<kThreads, kTileM, kTileN>(p.problem_sizes, p.expert_offsets, E, n_tiles, tile_start, warp_total);
  if (tiles.empty()) return;
  const int total_iters = tiles.count * groups;

  // ---- Producer (thread 0 only): stage `it`'s boxes. Calls come in order (it = 0, 1, ...): the group
  // and tile are counted, not divided out, and the next tile is located one tile ahead
  // (grouped_tile_list.cuh: LocatedTile).
  TmaTile boxes{};
  TileStep load_at;
  LocatedTile load_ahead = tiles.locate(0);
  auto issue_loads = [&](int it) {
    const int g = load_at.k;
    if (g == 0) boxes = tma_tile<OutT>(p, tiles.take(load_ahead, load_at.tile));
    load_at.advance(groups);
    uint64_t* bar = &full[it % kStages];
    mbar_arrive_expect_tx(bar, tma_stage_bytes<kTileN>(p));
    tma_load_stage<kTileN>(p, boxes, g, smem_u32(stages + (it % kStages) * S::kStageBytes), bar);
  };

  // ---- Consumer: warp w of warpgroup wg owns weight rows wg*64 + w*16 + {2 gid, 2 gid + 1}; with the fused
  // activation epilogue a feature's gate and up rows (operand_row0).
  const int gid = lane >> 2, tig = lane & 3;
  const int r0 = operand_row0<kAct>(warp >> 2, warp & 3, gid), r1 = r0 + kOperandRowStep<kAct>;
  const AOperandOffset a_offset = a_operand_offset<false>(r0, tig);
  float acc[S::kAcc], part[S::kAcc];
#pragma unroll
  for (int i = 0; i < S::kAcc; ++i) acc[i] = 0.f;

  // The A operand: this thread's int4 weights of stage `it` as e4m3.
  const Int4ToE4m3 cvt = Int4ToE4m3::make();
  constexpr bool kBiased = kBiasedOperands<TILE_N>;  // with or without the fused epilogue: one set of bits
  const Int4PairToBiasedE4m3 spread = kBiased ? Int4PairToBiasedE4m3::make() : Int4PairToBiasedE4m3{};
  auto convert = [&](int it, uint32_t(&a)[4][4]) {
    const uint8_t* sw = stages + (it % kStages) * S::kStageBytes + S::kStageA;
    if constexpr (kBiased)
      stage_a_operand_xor<kOperandRowStep<kAct>>(smem_u32(sw), a_offset, a, BiasedCodesStep{spread});
    else if constexpr (kAct) stage_a_operand(sw, r0, r1, tig, a, cvt);
    else if constexpr (kXorAddress) stage_a_operand_xor<1>(smem_u32(sw), a_offset, a, ExactCodesStep{cvt});
    else stage_a_operand<1>(sw, a_offset, a, cvt);
  };
  // Stage `it` has landed (its transaction completed: visible to this thread and to the tensor cores).
  auto wait_full = [&](int it) { mbar_wait(&full[it % kStages], (it / kStages) & 1); };
  // Tile t's accumulators out: D, or A2 and s2 (the fused activation epilogue, in registers).
  auto epilogue = [&](const GroupedTile& t) {
    float sc[kTileN / 4];
    load_tile_scales<kTileN>(p, t, tig, sc);
    if constexpr (kAct) act_store_tile<kTileN>(act_out_of(p), t, acc, sc, r0, lane);
    else store_tile<OutT, kTileN>(p, t, acc, sc, r0, tig);
  };

  if (tid == 0)
    for (int s = 0; s < kStages - 1 && s < total_iters; ++s) issue_loads(s);
  constexpr float kOperandScale = kBiased ? kBiasedOperandScale : 1.f;  // biased codes count in 2^-9
  TileStep step_at;  // the group and tile the next step computes
  // One K group. kOverlapConvert: stage it + 1 is awaited with stage it, and its weights become
  // `a_next` while stage it's wgmmas (on `a`, converted one step earlier) run.
  auto step = [&](int it, uint32_t(&a)[4][4], uint32_t(&a_next)[4][4]) {
    // Every thread is past step it - 1: the stage it used may be refilled.
    __syncthreads();
    if (tid == 0 && it + kStages - 1 < total_iters) issue_loads(it + kStages - 1);
    if (kOverlapConvert && it + 1 < total_iters) wait_full(it + 1);
    if (!kOverlapConvert) wait_full(it);

    const uint8_t* st = stages + (it % kStages) * S::kStageBytes;
    const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(st + S::kStageA + kStageW);
    const int g = step_at.k, tile_index = step_at.tile;
    step_at.advance(groups);
    if constexpr (!kOverlapConvert) convert(it, a);
    const float s0 = kOperandScale * wgmma::group_scale(ss, p.scales_packed4, r0, g);
    const float s1 = kOperandScale * wgmma::group_scale(ss, p.scales_packed4, r1, g);
    const uint64_t desc = make_desc_sw128(smem_u32(st));
    wgmma_fence();
    fence_operands(part);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      wgmma_k32<kTileN>(part, a[k][0], a[k][1], a[k][2], a[k][3], desc + 2 * k, k > 0);
      if constexpr (kBiased) {  // cancels the codes' bias 8 in the same fp32 partial
        const uint32_t(&m)[4] = spread.minus_eight;
        wgmma_k32<kTileN>(part, m[0], m[1], m[2], m[3], desc + 2 * k, 1);
      }
    }
    wgmma_commit();
    if (kOverlapConvert && it + 1 < total_iters) convert(it + 1, a_next);
    wgmma_wait_all();
    fence_operands(part);
    promote_group(acc, part, s0, s1);  // fp32 FMA with the bf16 scale of the row, g increasing

    if (g == groups - 1) {
      epilogue(tiles[tile_index]);
    }
  };
  // Two A buffers, swapped by unrolling two steps (a runtime index would put them in local memory).
  uint32_t a_even[4][4], a_odd[4][4];
  if constexpr (kOverlapConvert) {
    wait_full(0);
    convert(0, a_even);
  }
  for (int it = 0; it < total_iters; it += 2) {
    step(it, a_even, a_odd);
    if (it + 1 < total_iters) step(it + 1, a_odd, a_even);
  }
}

}  // namespace wgmma_prefill

// Warp-specialized variant: warpgroup 0 only loads (TMA boxes from its thread 0; completion signalled on a
// per-stage "full" mbarrier; its other threads exit), warpgroups 1
// and 2 only compute (64 weight rows each) and hand a stage back on its "empty" mbarrier. The two compute warpgroups are not tied together by __syncthreads, so one's
// int4 -> e4m3 conversion and group promotion run while the other's wgmmas use the tensor cores, and
// each converts the next stage's weights while its own wgmmas run.
//
namespace wgmma_ws {

using namespace wgmma;  // (wgmma_building_blocks.cuh)
constexpr int kConsumers = 2;                     // compute warpgroups, 64 weight rows each
constexpr int kThreads = 128 * (1 + kConsumers);  // + the loading warpgroup
constexpr int kProducerRegs = 56, kConsumerRegs = 224;  // setmaxnreg: 128 * 56 + 256 * 224 = 384 * 168
// NOTE: setmaxnreg only moves registers within the CTA's launch allocation (kThreads x the launch bound's per-thread
// maximum, 168 at 384 threads); a split above it makes setmaxnreg.inc wait forever (an A/B run hung so, session 25).
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * (65536 / kThreads / 8 * 8),
              "setmaxnreg split within the launch allocation");
// Convert the next stage's weights while this stage's wgmmas run (else after their wait).
constexpr bool kOverlapConvert = true;
// Two K groups in flight per computing warpgroup (tiles of up to 96 tokens: acc + two partials + two operands fit
// the registers): group g + 1's wgmmas are issued before group g's are waited for, so the wait, the stage release,
// the next conversion and the promotion of g run while g + 1 is on the tensor cores. Same bits as one group in
// flight; 4-8% faster at 64 rows per expert (bench/results/2026-12-02_s24d_*).
constexpr bool kTwoGroupsInFlight = true;
// A/B (session 37, bench/ab/w4a8_wgmma_ws_biased.txt): 0 exact codes; 1 biased codes without the bias correction
// (wrong sums: the bound of the cheaper conversion); 2 biased codes + the scales gathered into a bf16 A fragment per
// 16 groups + three stand-in wgmmas per 16 groups into acc (the tensor cost of a correction by precomputed sums).
constexpr int kBiasedAb = 0;

template <int TILE_N>
struct Shape {
  static constexpr int kAcc = TILE_N / 2;
  static constexpr int kStageA = TILE_N * kGroup;
  static constexpr int kStageBytes = kStageA + kStageW + kStageS;
  // 128-token tiles: 6 stages (H200, bench/results/2026-11-30_s5a_*: 1-4% faster than 8 at T = 4096, the
  // same at 256-1024); 160-token tiles: 6 (29 KB each); 96-token tiles: 8 (21 KB); 64-token tiles: 12.
  static_assert(TILE_N == 64 || TILE_N == 96 || TILE_N == 128 || TILE_N == 160, "wgmma N");
  static constexpr int kStages = TILE_N >= 128 ? 6 : TILE_N == 96 ? 8 : 12;
  static_assert(kStageBytes % 1024 == 0, "every stage's activation tile stays 1024-byte aligned (128B swizzle)");
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kBarrierBytes + kTileStartBytes;
  static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of one SM");
};

// OutT ActE4m3: the fused activation epilogue, in the computing warpgroups' registers (act_store_tile). The
// earlier versions parked h in shared memory for an items loop (session 6: in the computing warpgroups between
// named barriers; sessions 8 and 14: in the loading warpgroup): bitwise right but 10-20% slower per prefill layer.
template <class OutT, int TILE_N>
__global__ void __launch_bounds__(kThreads, 1) kernel(const __grid_constant__ ParamsOf<OutT> p) {
  pdl_wait();  // first; no early release (cuda/common/pdl.cuh)
  constexpr bool kAct = std::is_same<OutT, ActE4m3>::value;
  using S = Shape<TILE_N>;
  constexpr int kStages = S::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = wgmma::align_1024(smem_raw);
  uint8_t* stages = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * S::kStageBytes);
  uint64_t* empty = full + kStages;
  int32_t* tile_start = reinterpret_cast<int32_t*>(empty + kStages);
  int32_t* warp_total = tile_start + kMaxExperts + 1;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);                  // thread 0's arrival + the boxes' bytes
      mbar_init(&empty[s], 128 * kConsumers);  // every computing thread, after its wgmmas read the stage
    }
  }
  const int E = p.num_experts;
  const int n_tiles = (p.n + kTileM - 1) / kTileM;
  const int groups = p.k / kGroup;
  // (its barriers also publish the mbarrier initialisation)
  const auto tiles =
      cta_tiles<kThreads, kTileM, TILE_N>(p.problem_sizes, p.expert_offsets, E, n_tiles, tile_start, warp_total);
  if (tiles.empty()) return;
  const int total_iters = tiles.count * groups;

  if (wg == 0) {
    // ---- Loading warpgroup: stage it % kStages once the computing warpgroups released it.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (tid != 0) return;  // thread 0 issues the boxes
    // The group and tile are counted (no division per stage); the next tile is located one tile ahead.
    TileStep at;
    LocatedTile ahead = tiles.locate(0);
    TmaTile boxes{};
    for (int it = 0; it < total_iters; ++it) {
      const int g = at.k, s = it % kStages;
      if (g == 0) boxes = tma_tile<OutT>(p, tiles.take(ahead, at.tile));
      mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
      mbar_arrive_expect_tx(&full[s], tma_stage_bytes<TILE_N>(p));
      tma_load_stage<TILE_N>(p, boxes, g, smem_u32(stages + s * S::kStageBytes), &full[s]);
      at.advance(groups);
    }
    return;
  }

  // ---- Computing warpgroups: warp w of warpgroup c owns weight rows 64 c + 16 (w % 4) + {2 gid, 2 gid + 1}; the
  // fused activation epilogue: a feature's gate and up rows (operand_row0).
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int gid = lane >> 2, tig = lane & 3;
  const int r0 = wgmma::operand_row0<kAct>(wg - 1, warp & 3, gid), r1 = r0 + wgmma::kOperandRowStep<kAct>;
  const wgmma_prefill::AOperandOffset a_offset =
      wgmma_prefill::a_operand_offset<!kAct>(r0, tig);
  float acc[S::kAcc], part[S::kAcc];
#pragma unroll
  for (int i = 0; i < S::kAcc; ++i) acc[i] = 0.f;

  // Stage `it` has landed (its transaction completed: visible to this thread and to the tensor cores).
  auto wait_full = [&](int it) { mbar_wait(&full[it % kStages], (it / kStages) & 1); };
  // The A operand: this thread's int4 weights of stage `it` as e4m3.
  const Int4ToE4m3 cvt = Int4ToE4m3::make();
  constexpr bool kBiased = kBiasedAb > 0 && !kAct;
  const Int4PairToBiasedE4m3 spread = [] {
    if constexpr (kBiased) return Int4PairToBiasedE4m3::make();
    else return Int4PairToBiasedE4m3::constants();
  }();
  auto convert = [&](int it, uint32_t (&out)[4][4]) {
    const uint8_t* sw = stages + (it % kStages) * S::kStageBytes + S::kStageA;
    if constexpr (kAct) wgmma_prefill::stage_a_operand(sw, r0, r1, tig, out, cvt);
    else if constexpr (kBiased)
      wgmma_prefill::stage_a_operand_xor<1>(wgmma::smem_u32(sw), a_offset, out, wgmma_prefill::BiasedCodesStep{spread});
    else wgmma_prefill::stage_a_operand<1>(sw, a_offset, out, cvt);
  };
  constexpr float kScaleOf = kBiased ? kBiasedOperandScale : 1.f;
  constexpr bool kCorrect = kBiased && kBiasedAb == 2;
  // Stand-in correction per 16 groups: the A fragment of their scales (rows r0 / r1 = gid / gid + 8 x groups 2 tig,
  // 2 tig + 1 and 2 tig + 8, 2 tig + 9) by eight 2-byte shared loads (here: of the stage's scale tile, which a real
  // version would get as a box of 16 groups), then three wgmmas of a bf16 m64nNk16's tensor cost (fp8 k32 on the
  // stage's activations) into the promoted partial pt, retired at once and added to acc (into acc itself, ptxas
  // serializes every wgmma of the 128- and 160-token tiles for want of registers).
  auto correct = [&](int g, int s, float (&pt)[S::kAcc]) {
    if ((g & 15) != 15 && g != groups - 1) return;
    const uint32_t ss = wgmma::smem_u32(stages + s * S::kStageBytes + S::kStageA + kStageW) + 4 * tig;
    uint32_t sf[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t at = ss + 256 * (i & 1) + 32 * (i >> 1) + 2 * r0;
      sf[i] = prmt(wgmma_prefill::ld_shared_u16(at), wgmma_prefill::ld_shared_u16(at + 2), 0x5410u);
    }
    const uint64_t desc = wgmma::make_desc_sw128(wgmma::smem_u32(stages + s * S::kStageBytes));
    wgmma::wgmma_fence();
    wgmma::fence_operands(pt);
#pragma unroll
    for (int k = 0; k < 3; ++k) wgmma_prefill::wgmma_k32<TILE_N>(pt, sf[0], sf[1], sf[2], sf[3], desc + 2 * k, k > 0);
    wgmma::wgmma_commit();
    wgmma::wgmma_wait_all();
    wgmma::fence_operands(pt);
#pragma unroll
    for (int i = 0; i < S::kAcc; ++i) acc[i] += pt[i];
  };

  GroupedTile t{0, 0, 0, 0};
  if constexpr (kTwoGroupsInFlight && TILE_N <= 96) {
    float part_b[S::kAcc];
#pragma unroll
    for (int i = 0; i < S::kAcc; ++i) part[i] = part_b[i] = 0.f;  // defined before any wgmma
    // Group `it`'s wgmmas on `a` into `pt` (its stage has landed).
    auto issue = [&](int it, uint32_t(&a)[4][4], float(&pt)[S::kAcc]) {
      const uint64_t desc = wgmma::make_desc_sw128(wgmma::smem_u32(stages + (it % kStages) * S::kStageBytes));
      wgmma::wgmma_fence();
      wgmma::fence_operands(pt);
#pragma unroll
      for (int k = 0; k < 4; ++k)
        wgmma_prefill::wgmma_k32<TILE_N>(pt, a[k][0], a[k][1], a[k][2], a[k][3], desc + 2 * k, k > 0);
      wgmma::wgmma_commit();  // (pt is not touched again before the wait that retires this group)
    };
    TileStep step_at;
    // Step it: group it is in flight into pt on a; group it + 1's operand is in a_next (its stage landed).
    // kNext (compile time, so that every path of the loop has the same groups in flight): issue group it + 1.
    auto step = [&](auto next, int it, uint32_t(&a)[4][4], uint32_t(&a_next)[4][4], float(&pt)[S::kAcc],
                    float(&pt_next)[S::kAcc]) {
      constexpr bool kNext = decltype(next)::value;
      const int g = step_at.k, tile_index = step_at.tile, s = it % kStages;
      if (g == 0) t = tiles[tile_index];
      step_at.advance(groups);
      const __nv_bfloat16* ss =
          reinterpret_cast<const __nv_bfloat16*>(stages + s * S::kStageBytes + S::kStageA + kStageW);
      const float s0 = kScaleOf * wgmma::group_scale(ss, p.scales_packed4, r0, g);
      const float s1 = kScaleOf * wgmma::group_scale(ss, p.scales_packed4, r1, g);
      if constexpr (kNext) {
        issue(it + 1, a_next, pt_next);
        wgmma::wgmma_wait<1>();
      } else {
        wgmma::wgmma_wait_all();
      }
      wgmma::fence_operands(pt);
      mbar_arrive(&empty[s]);  // group it's wgmmas are done; its weights and scales are in registers
      if (it + 2 < total_iters) {
        wait_full(it + 2);
        convert(it + 2, a);  // a is free: group it's wgmmas have completed
      }
      wgmma::promote_group(acc, pt, s0, s1);
      if constexpr (kCorrect) correct(g, s, pt);
      if (g == groups - 1) {
        float sc[TILE_N / 4];
        wgmma::load_tile_scales<TILE_N>(p, t, tig, sc);
        if constexpr (kAct) wgmma::act_store_tile<TILE_N>(act_out_of(p), t, acc, sc, r0, lane);
        else wgmma::store_tile<OutT, TILE_N>(p, t, acc, sc, r0, tig);
      }
    };
    // (total_iters > 0 always: the list is not empty and K has a group)
    if (total_iters > 0) wgmma_two_groups::run(total_iters, wait_full, convert, issue, step, part, part_b);
    return;
  }
  // One K group: its wgmmas on the A operand `a` (converted earlier); while they run, the next
  // stage's weights become `a_next` (kOverlapConvert), then the promotion. Stage it + 1 is waited for
  // before the wgmmas are issued: inside the window there are only shared-memory loads and ALU work.
  TileStep step_at;  // the group and tile the next step computes
  auto step = [&](int it, uint32_t(&a)[4][4], uint32_t(&a_next)[4][4]) {
    const int g = step_at.k, tile_index = step_at.tile, s = it % kStages;
    if (g == 0) t = tiles[tile_index];  // (first used by the epilogue: the loads have the whole tile to land)
    step_at.advance(groups);
    const uint8_t* st = stages + s * S::kStageBytes;
    const uint64_t desc = wgmma::make_desc_sw128(wgmma::smem_u32(st));
    const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(st + S::kStageA + kStageW);
    const float s0 = kScaleOf * wgmma::group_scale(ss, p.scales_packed4, r0, g);
    const float s1 = kScaleOf * wgmma::group_scale(ss, p.scales_packed4, r1, g);
    const bool more = it + 1 < total_iters;
    if (kOverlapConvert && more) wait_full(it + 1);
    wgmma::wgmma_fence();
    wgmma::fence_operands(part);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      wgmma_prefill::wgmma_k32<TILE_N>(part, a[k][0], a[k][1], a[k][2], a[k][3], desc + 2 * k, k > 0);
    wgmma::wgmma_commit();
    // The epilogue's a_scales, loaded while the tile's last wgmmas run (the 128-token tile; the 160-token
    // tile's acc + part + two operands leave no registers for them).
    constexpr bool kEarlyScales = TILE_N == 128;
    const bool last = g == groups - 1;
    float sc[TILE_N / 4];
    if (kEarlyScales && last) wgmma::load_tile_scales<TILE_N>(p, t, tig, sc);
    if (kOverlapConvert && more) convert(it + 1, a_next);
    wgmma::wgmma_wait_all();
    wgmma::fence_operands(part);
    mbar_arrive(&empty[s]);  // this thread is done with stage s (weights and scales in registers)
    if (!kOverlapConvert && more) {
      wait_full(it + 1);
      convert(it + 1, a_next);
    }
    wgmma::promote_group(acc, part, s0, s1);
    if constexpr (kCorrect) correct(g, s, part);
    if (last) {
      if (!kEarlyScales) wgmma::load_tile_scales<TILE_N>(p, t, tig, sc);
      if constexpr (kAct) wgmma::act_store_tile<TILE_N>(act_out_of(p), t, acc, sc, r0, lane);
      else wgmma::store_tile<OutT, TILE_N>(p, t, acc, sc, r0, tig);
    }
  };
  // Two A buffers, swapped by unrolling two steps (a runtime index would put them in local memory).
  uint32_t a_even[4][4], a_odd[4][4];
  if (total_iters > 0) {
    wait_full(0);
    convert(0, a_even);
  }
  for (int it = 0; it < total_iters; it += 2) {
    step(it, a_even, a_odd);
    if (it + 1 < total_iters) step(it + 1, a_odd, a_even);
  }
}

}  // namespace wgmma_ws


namespace {

// 96-, 128- and 160-token tiles: the warp-specialized kernel (1.1-1.25x faster on the H200 at DeepSeek-V3,
// Mixtral and Qwen3-235B prefill shapes, bench/results/2026-11-30_s3_h200_wgmma_ws.md); 64- and 32-token
// tiles keep the two-CTAs-per-SM kernel, which measured 1-5% faster at 64 (127 registers and ~90 KB: two
// CTAs fit on an SM, and both are used; its warp-specialized version was 4-13% slower, s13b).
template <class OutT, int TILE_N, class Base>
void launch_typed(const Base& params, int64_t rows, cudaStream_t stream) {
  const auto tp = tma_params(params, rows, TILE_N);
  if constexpr (TILE_N >= 96) {
    launch_persistent<wgmma_ws::kernel<OutT, TILE_N>>(wgmma_ws::kThreads, wgmma_ws::Shape<TILE_N>::kSmemBytes, stream,
                                                      tp, "w4a8 wgmma prefill");
  } else {
    launch_persistent<wgmma_prefill::kernel<OutT, TILE_N>>(wgmma_prefill::kThreads,
                                                           wgmma_prefill::Shape<TILE_N>::kSmemBytes, stream, tp,
                                                           "w4a8 wgmma prefill");
  }
}

}  // namespace

void launch_w4a8_wgmma_prefill(const WgmmaGemmParams& params, int64_t rows, int tile_n, bool fp32_out,
                               cudaStream_t stream) {
  QMOE_CHECK_ARG(tile_n == 32 || tile_n == 48 || tile_n == 64 || tile_n == 96 || tile_n == 128 || tile_n == 160, "tactic",
                 "a WGMMA token tile of 32, 48, 64, 96, 128 or 160", std::to_string(tile_n));
  auto launch = [&](auto tile) {
    constexpr int kTileN = decltype(tile)::value;
    if (fp32_out) launch_typed<float, kTileN>(params, rows, stream);
    else launch_typed<__nv_bfloat16, kTileN>(params, rows, stream);
  };
  if (tile_n == 160) launch(std::integral_constant<int, 160>{});
  else if (tile_n == 128) launch(std::integral_constant<int, 128>{});
  else if (tile_n == 96) launch(std::integral_constant<int, 96>{});
  else if (tile_n == 64) launch(std::integral_constant<int, 64>{});
  else if (tile_n == 48) launch(std::integral_constant<int, 48>{});
  else launch(std::integral_constant<int, 32>{});
}

void launch_w4a8_wgmma_act_requant(const WgmmaActGemmParams& params, int64_t rows, int tile_n, cudaStream_t stream) {
  QMOE_CHECK_ARG(tile_n == 32 || tile_n == 48 || tile_n == 64 || tile_n == 96 || tile_n == 128 || tile_n == 160, "tactic",
                 "a WGMMA token tile of 32, 48, 64, 96, 128 or 160", std::to_string(tile_n));
  if (tile_n == 160) launch_typed<ActE4m3, 160>(params, rows, stream);
  else if (tile_n == 128) launch_typed<ActE4m3, 128>(params, rows, stream);
  else if (tile_n == 96) launch_typed<ActE4m3, 96>(params, rows, stream);
  else if (tile_n == 64) launch_typed<ActE4m3, 64>(params, rows, stream);
  else if (tile_n == 48) launch_typed<ActE4m3, 48>(params, rows, stream);
  else launch_typed<ActE4m3, 32>(params, rows, stream);
}

}  // namespace qmoe::cuda
