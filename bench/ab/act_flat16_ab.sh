#!/usr/bin/env bash
# Session 30: the fp8 flat activation kernel with 16-feature items (16-byte stores) vs 8 (QMOE_ACT_FLAT8=1, a
# temporary switch of this A/B), Qwen3 shapes at T = 4096, plus the fused GPU tests on the 16-feature kernel.
# Ran in session 30 (bench/results/2026-12-03_s30e_*): 20% slower, not kept; apply bench/ab/act_flat16.patch first.
set -e
bash scripts/device_build.sh > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
export PYTHONPATH=$PWD/build/device/pkg
for rep in 1 2; do
  for v in 8 16; do
    if [ $v = 8 ]; then export QMOE_ACT_FLAT8=1; else unset QMOE_ACT_FLAT8; fi
    python3 bench/profile_layer.py qwen3_30b_a3b:4096 qwen3_235b_a22b:4096 > $OUT/prof_${v}_$rep.log 2>&1
    echo "flat$v rep $rep: $(grep -E 'activation_requant' $OUT/prof_${v}_$rep.log | awk '{print $2}' | tr '\n' ' ')"
  done
done
unset QMOE_ACT_FLAT8
timeout 100 python3 -m pytest -q -m gpu tests/python/test_gpu_fused_moe.py tests/python/test_gpu_fused_epilogue.py 2>&1 | tail -2
