#!/usr/bin/env bash
# Device side of bench/ab/w4a8_wgmma_release.txt (session 36): both lag variants checked (every tactic vs the CPU
# reference), then the 32 / 48 / 64-token tiles forced, base / variant alternated twice, for lag1 and lag2.
source bench/ab/forced_tactic_ab.sh w4a8_wgmma_release lag1
echo "== check lag2: $(timeout 200 ./chk_lag2 2>&1 | grep -iE '^correctness' | head -1)"
for AB_VARIANT in lag1 lag2; do
  run prefill_m128_n32_k128 128:8:3072:4096,128:8:4096:1536 256
  run prefill_m128_n32_k128 8:2:28672:4096,8:2:4096:14336 64
  run prefill_m128_n32_k128 256:8:4096:7168 512
  run prefill_m128_n48_k128 256:8:4096:7168,256:8:7168:2048 1024
  run prefill_m128_n48_k128 128:8:3072:4096 512
  run prefill_m128_n64_k128 128:8:3072:4096 640
  run prefill_m128_n64_k128 8:2:28672:4096 160
done
