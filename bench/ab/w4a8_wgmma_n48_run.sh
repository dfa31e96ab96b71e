#!/usr/bin/env bash
# Session 34: the two-CTA WGMMA kernel with 48-token tiles (m64n48k32, 6 stages) against the 64- and 32-token tiles
# at 20-48 rows per expert. Binary: QMOE_LIB=build/ab_lib/libqmoe.a bash tests/gpu/build_w4a8_check.sh
# .dev/ab/n48/chk_n48 on the tree with the tile (carry .dev/ab/n48). Check first (every tactic vs the CPU reference).
cd .dev/ab/n48 || exit 2
timeout 200 ./chk_n48 2>&1 | grep -iE "^correctness|fail" | head -5
export QMOE_BENCH_BATCH=1
run() {  # shapes, T list, tactics
  export QMOE_BENCH_SHAPES=$1 QMOE_BENCH_T=$2
  for rep in 1 2; do
    for tac in $3; do
      echo "$tac: $(QMOE_BENCH_TACTIC=$tac timeout 120 ./chk_n48 --bench-only 2>&1 | grep -E '^  gemm[0-9] N' | awk '{printf "%s/%s %s; ", $1, $4, $6}')"
    done
  done
}
# DeepSeek-V3 G1/G2 (T 1024: 32 rows, 1536: 48), Kimi-K2 G1 (T 1536: 32 rows), Qwen3-235B G1/G2 and Qwen3-30B G1 (T 512: 32
# rows, 768: 48), GLM-4.5 G1 (T 1024: 51 rows)
run 256:8:4096:7168,256:8:7168:2048,384:8:4096:7168 1024,1536 "prefill_m128_n64_k128 prefill_m128_n48_k128 prefill_m128_n32_k128"
run 128:8:3072:4096,128:8:4096:1536,128:8:1536:2048,160:8:3072:5120 384,512,768 "prefill_m128_n64_k128 prefill_m128_n48_k128"
