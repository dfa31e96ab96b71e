#!/usr/bin/env bash
# Device side of bench/ab/w4a8_wgmma_ws_biased.txt: each warp-specialized tile forced at its own rows per expert, base /
# noc / corr alternated twice (us per launch, 32 back-to-back launches over 8 routings). No check: noc and corr compute
# wrong sums by design.
cd .dev/ab/w4a8_wgmma_ws_biased || exit 2
export QMOE_BENCH_BATCH=1
run() {  # tactic, shapes, T list
  for rep in 1 2; do
    for b in base noc corr; do
      echo "$1 $b: $(QMOE_BENCH_SHAPES=$2 QMOE_BENCH_T=$3 QMOE_BENCH_TACTIC=$1 timeout 120 "./chk_$b" --bench-only 2>&1 |
        grep -E '^  gemm[0-9] N' | awk '{printf "%s/%s %s; ", $1, $4, $6}')"
    done
  done
}
run prefill_m128_n96_k128 128:8:3072:4096,128:8:4096:1536,128:8:1536:2048,128:8:2048:768 1024
run prefill_m128_n96_k128 8:2:28672:4096,8:2:4096:14336 256
run prefill_m128_n160_k128 256:8:4096:7168,256:8:7168:2048 4096
run prefill_m128_n160_k128 128:8:3072:4096,128:8:4096:1536 2048
run prefill_m128_n128_k128 128:8:1536:2048,128:8:2048:768 16384
run prefill_m128_n128_k128 8:2:28672:4096,8:2:4096:14336 4096
