#!/usr/bin/env bash
# Device side of bench/ab/w4a8_wgmma_xor_address.txt (session 35): the check of the variant, then the 32- and 48-token tiles
# forced at the rows per expert they serve, base / xor alternated twice (us, 32 back-to-back launches, 8 routings).
cd .dev/ab/w4a8_wgmma_xor_address || exit 2
echo "== check xor: $(timeout 200 ./chk_xor 2>&1 | grep -iE '^correctness' | head -1)"
export QMOE_BENCH_BATCH=1
run() {  # tactic, shapes, T list
  for rep in 1 2; do
    for b in base xor; do
      echo "$1 $b: $(QMOE_BENCH_SHAPES=$2 QMOE_BENCH_T=$3 QMOE_BENCH_TACTIC=$1 timeout 120 ./chk_$b --bench-only 2>&1 |
        grep -E '^  gemm[0-9] N' | awk '{printf "%s/%s %s; ", $1, $4, $6}')"
    done
  done
}
# 16 rows per expert: Qwen3-235B GEMM1 / GEMM2 (T 256), Mixtral GEMM1 / GEMM2 (T 64), DeepSeek-V3 GEMM1 (T 512)
run prefill_m128_n32_k128 128:8:3072:4096,128:8:4096:1536,8:2:28672:4096,8:2:4096:14336,128:8:2048:768 64,256
run prefill_m128_n32_k128 256:8:4096:7168 512
run prefill_m128_n48_k128 256:8:7168:2048 1024
