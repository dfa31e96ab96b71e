#!/usr/bin/env bash
# Device side of bench/ab/w4a8_wgmma_a_offset.txt (session 35): the check of the variant, then forced WGMMA tactics at
# the rows per expert each serves, base / opaque alternated twice (us, 32 back-to-back launches, 8 routings).
source bench/ab/forced_tactic_ab.sh w4a8_wgmma_a_offset opaque
# 16 rows per expert: Qwen3-235B GEMM1 / GEMM2 (T 256), Mixtral GEMM1 / GEMM2 (T 64), DeepSeek-V3 GEMM1 (T 512)
run prefill_m128_n32_k128 128:8:3072:4096,128:8:4096:1536,8:2:28672:4096,8:2:4096:14336 64,256
run prefill_m128_n32_k128 256:8:4096:7168 512
run prefill_m128_n48_k128 256:8:4096:7168,256:8:7168:2048 1024
run prefill_m128_n64_k128 128:8:3072:4096 768
run prefill_m128_n96_k128 128:8:3072:4096 1024
run prefill_m128_n160_k128 256:8:4096:7168,8:2:28672:4096 4096
