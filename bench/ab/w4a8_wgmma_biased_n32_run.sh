#!/usr/bin/env bash
# Device side of bench/ab/w4a8_wgmma_biased_n32.txt (prepared in session 35): the check of the biased variant (every
# tactic vs the CPU reference), then the 32-token tile forced at 12-24 rows per expert, base / biased alternated twice.
source bench/ab/forced_tactic_ab.sh w4a8_wgmma_biased_n32 biased
# 16 rows per expert (Qwen3-235B GEMM1 / GEMM2, Qwen3-30B GEMM1 / GEMM2 at T 256; Mixtral GEMM1 / GEMM2 at T 64) and
# 12 / 24 rows (T 192 / 384; Mixtral T 48 / 96)
run prefill_m128_n32_k128 128:8:3072:4096,128:8:4096:1536,128:8:1536:2048,128:8:2048:768 192,256,384
run prefill_m128_n32_k128 8:2:28672:4096,8:2:4096:14336 48,64,96
# DeepSeek-V3 GEMM1 / GEMM2 and Kimi-K2 GEMM1 at 16 rows
run prefill_m128_n32_k128 256:8:4096:7168,256:8:7168:2048 512
run prefill_m128_n32_k128 384:8:4096:7168 768
