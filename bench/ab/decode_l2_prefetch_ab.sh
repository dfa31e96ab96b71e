#!/usr/bin/env bash
# Ran in session 30 (bench/results/2026-12-03_s30a_*): up to 4x slower, not kept.
# Prepared in session 29 (compile-checked, not run). At decode the own-rows gather's first CTA asks L2 for the weight
# blocks of the experts its slots hit (GEMM1's weights and scales, then GEMM2's; cp.async.bulk.prefetch.L2, up to a
# budget), so that they stream in while the gather and the routing kernel run, before GEMM1's main loop
# (bench/ab/decode_l2_prefetch.patch; QMOE_DECODE_L2_PREFETCH_MB sets the budget, 0 = off; results cannot change:
# a prefetch is a hint). Session 27's GEMM2-side prefetch (s27b) competed with GEMM1's stream; this one fills the
# latency-bound glue window instead. Qwen3-30B T = 1 needs 19 MB for both GEMMs' weights (fits the 50 MB L2).
# On the device (carry .dev/cutlass):  bash bench/ab/decode_l2_prefetch_ab.sh
set -e
bash bench/ab/build_pair.sh bench/ab/decode_l2_prefetch.patch pf
d=${OUT:-/tmp}/ab  # results land under $OUT as they come, so a cut-off run keeps what it measured
mkdir -p $d
run() {  # $1 label, $2 package, $3 budget MB, $4... extra bench args
  local label=$1 pkg=$2 mb=$3; shift 3
  rm -rf $d/$label
  QMOE_DECODE_L2_PREFETCH_MB=$mb PYTHONPATH=$pkg python3 -m qmoe.cli bench moe --tokens 1,2,4,8 --no-torch-peers \
    --finalize det --budget-ms 80 --out-dir $d/$label "$@" > $d/$label.log 2>&1 || tail -5 $d/$label.log
  echo "== $label: model T det-graph-us"
  grep -h "^| [a-z]" $d/$label/*.md | grep -v "^| model" | awk -F'|' '{print $2, $3, $7}' | tr -s ' ' | tr '\n' ';'; echo
}
run base1 /tmp/pkg_base 0
run pf40_1 /tmp/pkg_pf 40
run pf24_1 /tmp/pkg_pf 24
run off1 /tmp/pkg_pf 0
run fp4_base /tmp/pkg_base 0 --quant-mode w4a4 --fp4-packed
run fp4_pf40 /tmp/pkg_pf 40 --quant-mode w4a4 --fp4-packed
run base2 /tmp/pkg_base 0
run pf40_2 /tmp/pkg_pf 40
QMOE_DECODE_L2_PREFETCH_MB=40 PYTHONPATH=/tmp/pkg_pf timeout 150 python3 -m pytest -q -m gpu \
  tests/python/test_gpu_fused_moe.py tests/python/test_gpu_gather_own_rows.py -x 2>&1 | tail -2
