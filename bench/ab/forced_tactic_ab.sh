#!/usr/bin/env bash
# Shared part of the device scripts of two-variant W4A8 A/B lists (bench/ab/<list>_run.sh, built by
# scripts/build_gemm_variants.sh into .dev/ab/<list>/chk_<variant>): `source bench/ab/forced_tactic_ab.sh <list> <variant>`
# checks chk_<variant> (every tactic vs the CPU reference), then `run <tactic> <E:topk:N:K,...> <T,...>` prints the
# tactic forced at those points, base / <variant> alternated twice (us, 32 back-to-back launches over 8 routings).
AB_VARIANT=$2
cd ".dev/ab/$1" || exit 2
echo "== check $AB_VARIANT: $(timeout 200 "./chk_$AB_VARIANT" 2>&1 | grep -iE '^correctness' | head -1)"
export QMOE_BENCH_BATCH=1
run() {  # tactic, shapes, T list
  for rep in 1 2; do
    for b in base "$AB_VARIANT"; do
      echo "$1 $b: $(QMOE_BENCH_SHAPES=$2 QMOE_BENCH_T=$3 QMOE_BENCH_TACTIC=$1 timeout 120 "./chk_$b" --bench-only 2>&1 |
        grep -E '^  gemm[0-9] N' | awk '{printf "%s/%s %s; ", $1, $4, $6}')"
    done
  done
}
