#!/usr/bin/env bash
# Device side of bench/ab/w4a8_wgmma_producer_warp.txt (prepared in session 36): the check of pw32 (every tactic vs the
# CPU reference), then the 32-token tile forced at 16 rows per expert (and 12 / 24), base / pw32 alternated twice.
source bench/ab/forced_tactic_ab.sh w4a8_wgmma_producer_warp pw32
run prefill_m128_n32_k128 128:8:3072:4096,128:8:4096:1536,128:8:1536:2048,128:8:2048:768 192,256,384
run prefill_m128_n32_k128 8:2:28672:4096,8:2:4096:14336 48,64,96
run prefill_m128_n32_k128 256:8:4096:7168,256:8:7168:2048 512
