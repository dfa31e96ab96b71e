#!/usr/bin/env bash
# Device side of bench/ab/w4a8_wgmma_groups_in_flight.txt (prepared in session 34): checks, then forced tactics at the
# rows per expert each tile serves, alternated base / variant twice (us, 32 back-to-back launches, 8 routings).
cd .dev/ab/w4a8_wgmma_groups_in_flight || exit 2
for b in ws32 ws48 ws64; do echo "== check $b: $(timeout 200 ./chk_$b 2>&1 | grep -iE '^correctness' | head -1)"; done
export QMOE_BENCH_BATCH=1
run() {  # tactic, variant, shapes, T list
  for rep in 1 2; do
    for b in base $2; do
      echo "$1 $b: $(QMOE_BENCH_SHAPES=$3 QMOE_BENCH_T=$4 QMOE_BENCH_TACTIC=$1 timeout 120 ./chk_$b --bench-only 2>&1 |
        grep -E '^  gemm[0-9] N' | awk '{printf "%s/%s %s; ", $1, $4, $6}')"
    done
  done
}
# 16-26 rows per expert: Qwen3-235B GEMM1 / GEMM2, Mixtral GEMM1 / GEMM2 (T 256 / 64), Qwen3-30B GEMM1, Kimi-K2 GEMM1
run prefill_m128_n32_k128 ws32 128:8:3072:4096,128:8:4096:1536,8:2:28672:4096,8:2:4096:14336,128:8:1536:2048 64,256,384
run prefill_m128_n32_k128 ws32 384:8:4096:7168 1024
# 27-48 rows: DeepSeek-V3 GEMM1 / GEMM2 (T 1024), Qwen3-235B GEMM1 (T 512)
run prefill_m128_n48_k128 ws48 256:8:4096:7168,256:8:7168:2048,128:8:3072:4096 512,1024
run prefill_m128_n64_k128 ws64 256:8:4096:7168,256:8:7168:2048,128:8:3072:4096 512,1024,1536
