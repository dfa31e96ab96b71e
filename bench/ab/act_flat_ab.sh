#!/usr/bin/env bash
# Ran in session 30 (bench/results/2026-12-03_s30b_*); the patch landed in 9fd8fde (with a rule: only where I / 8
# is not a multiple of 128).
# Prepared in session 29 (compile-checked with nvcc -Xptxas -v: 61 registers, no spill; not run). A/B of the
# flattened activation kernel (bench/ab/act_flat.patch: the (row, chunk) items of all rows over a persistent grid, so
# that no lane idles at I = 768 / 1536; same arithmetic and bits) against the tree, on the device (carry .dev/cutlass):
#   bash bench/ab/act_flat_ab.sh
# Prints the activation kernel's us per layer call (Qwen3-30B, Qwen3-235B, Mixtral, DeepSeek-V3 at T = 4096), base and
# flat alternated twice, then the fused MoE GPU tests on the flat build. Keep it if it is faster on the Qwen3 shapes
# and no slower elsewhere (s29c base: 77.7 / 163.0 / ~325 / ~199 us).
set -e
bash bench/ab/build_pair.sh bench/ab/act_flat.patch flat
for rep in 1 2; do
  for pkg in base flat; do
    echo "=== $pkg rep $rep"
    PYTHONPATH=/tmp/pkg_$pkg python3 bench/profile_layer.py qwen3_30b_a3b:4096 qwen3_235b_a22b:4096 mixtral_8x7b:4096 \
      deepseek_v3:4096 2>&1 | grep -E "activation_requant" | awk '{print $2}' | tr '\n' ' '; echo
  done
done
PYTHONPATH=/tmp/pkg_flat timeout 200 python3 -m pytest -q -m gpu tests/python/test_gpu_fused_moe.py \
  tests/python/test_gpu_fused_epilogue.py -x 2>&1 | tail -2
