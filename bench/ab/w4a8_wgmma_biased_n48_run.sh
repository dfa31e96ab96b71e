#!/usr/bin/env bash
# Device side of bench/ab/w4a8_wgmma_biased_n48.txt (session 36): both variants checked, then the 48-token tile forced
# (base / b48) and the 64-token tile forced (base / b64) at 32 and 40 rows per expert, alternated twice.
source bench/ab/forced_tactic_ab.sh w4a8_wgmma_biased_n48 b48
echo "== check b64: $(timeout 200 ./chk_b64 2>&1 | grep -iE '^correctness' | head -1)"
run prefill_m128_n48_k128 256:8:4096:7168,256:8:7168:2048 1024
run prefill_m128_n48_k128 128:8:3072:4096,128:8:4096:1536,128:8:1536:2048 512
run prefill_m128_n48_k128 8:2:28672:4096,8:2:4096:14336 128
AB_VARIANT=b64
run prefill_m128_n64_k128 128:8:3072:4096,128:8:4096:1536 640
run prefill_m128_n64_k128 8:2:28672:4096 160
