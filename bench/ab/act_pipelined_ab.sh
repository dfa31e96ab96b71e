#!/usr/bin/env bash
# A/B of the cp.async-pipelined activation kernel (bench/ab/act_pipelined.patch) on the device: base = the tree,
# then variants (kPipeRows, kPipeCtasPerSm) built one after the other; profile_layer for each, alternated twice.
set -e
F=src/cuda/fused/moe_activation_requant.cu
bash scripts/device_build.sh > /tmp/b0.log 2>&1 || { tail -30 /tmp/b0.log; exit 1; }
cp -r build/device/pkg /tmp/pkg_base
patch -p1 < bench/ab/act_pipelined.patch > /dev/null
# variants: kPipeRows kPipeCtasPerSm kCoalescedCopy kCacheL1
for v in "4 16 false true" "4 16 true false" "4 16 true true" "6 8 true true"; do
  set -- $v
  sed -i "s/^constexpr int kPipeRows = [0-9]*;/constexpr int kPipeRows = $1;/; s/^constexpr int64_t kPipeCtasPerSm = [0-9]*;/constexpr int64_t kPipeCtasPerSm = $2;/" $F
  sed -i "s/^constexpr bool kCoalescedCopy = [a-z]*;/constexpr bool kCoalescedCopy = $3;/; s/^constexpr bool kCacheL1 = [a-z]*;/constexpr bool kCacheL1 = $4;/" $F
  bash scripts/device_build.sh > /tmp/bv.log 2>&1 || { tail -30 /tmp/bv.log; exit 1; }
  rm -rf /tmp/pkg_$1_$2_$3_$4 && cp -r build/device/pkg /tmp/pkg_$1_$2_$3_$4
done
for rep in 1 2; do
  for pkg in base 4_16_false_true 4_16_true_false 4_16_true_true 6_8_true_true; do
    echo "=== $pkg rep $rep"
    PYTHONPATH=/tmp/pkg_$pkg python3 bench/profile_layer.py qwen3_30b_a3b:4096 qwen3_235b_a22b:4096 mixtral_8x7b:4096 deepseek_v3:4096 2>&1 \
      | grep -E "activation_requant" | awk '{print $2}' | tr '\n' ' '; echo
  done
done
# correctness of the last variant built (coalesced copies): the fused MoE GPU tests (prefill sizes included)
PYTHONPATH=$PWD/build/device/pkg timeout 200 python3 -m pytest -q -m gpu tests/python/test_gpu_fused_moe.py -x 2>&1 | tail -2
