#!/usr/bin/env bash
# Device side of bench/ab/w4a8_f16_slots.txt (session 34, s34b): checks of both variants, then forced-tactic timings
# alternated base / f16 / base / f16 (carry .dev/ab/w4a8_f16_slots).
cd .dev/ab/w4a8_f16_slots
for b in f16 f16n24s4; do echo "== check $b"; timeout 200 ./chk_$b 2>&1 | grep -iE "^correctness|fail" | head -5; done
export QMOE_BENCH_BATCH=1 QMOE_BENCH_T=64,256,384
export QMOE_BENCH_SHAPES=256:8:4096:7168,256:8:7168:2048,128:8:3072:4096,8:2:28672:4096,8:2:4096:14336,128:8:2048:768
for tac in decode_m128_n16_k256 decode_m128_n24_k256; do
  for b in base f16 f16n24s4 base f16; do
    [[ $tac == decode_m128_n16_k256 && $b == f16n24s4 ]] && continue
    echo "$tac $b: $(QMOE_BENCH_TACTIC=$tac timeout 120 ./chk_$b --bench-only 2>&1 | grep -E '^  gemm[0-9] N' | awk '{printf "%s/%s %s; ", $1, $4, $6}')"
  done
done
