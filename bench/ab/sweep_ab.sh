#!/usr/bin/env bash
# Tactic-sweep A/B of a patch that the working tree already carries: the tree with PATCH reversed (base), then
# as it is. Device. Usage: bash bench/ab/sweep_ab.sh PATCH NAME [bf16]. Output: $OUT/base_KERNEL.md, $OUT/NAME_KERNEL.md
# (KERNEL w4a8 or bf16: scripts/device_tactic_sweep.sh). Headers are touched first: a copied tree may carry
# sources older than the objects of an earlier patched build.
set -uo pipefail
cd "$(dirname "$0")/../.."
patch_file=$1 name=$2 kernel=${3:-w4a8}
export QMOE_SWEEP_T=${QMOE_SWEEP_T:-16,32,64,128,192,256,384}
[[ $kernel == bf16 ]] && export QMOE_SWEEP_KERNEL=bf16
sweep() {
  bash scripts/device_build.sh > "$OUT/build_$1.log" 2>&1 || { tail -30 "$OUT/build_$1.log"; exit 1; }
  QMOE_SKIP_BUILD=1 bash scripts/device_tactic_sweep.sh > "$OUT/$1_$kernel.md" 2>&1
}
touch src/cuda/gemm/*.cuh src/cuda/gemm/*.h
patch -R -p1 < "$patch_file" > /dev/null || exit 1
sweep base
patch -p1 < "$patch_file" > /dev/null || exit 1
sweep "$name"
