#!/usr/bin/env bash
# Prepared in session 29 (compile-checked, not run). At decode the own-rows gather's first CTA asks L2 for the weight
# blocks of the experts its slots hit (GEMM1's weights and scales, then GEMM2's; cp.async.bulk.prefetch.L2, up to a
# budget), so that they stream in while the gather and the routing kernel run, before GEMM1's main loop
# (bench/ab/decode_l2_prefetch.patch; QMOE_DECODE_L2_PREFETCH_MB sets the budget, 0 = off; results cannot change:
# a prefetch is a hint). Session 27's GEMM2-side prefetch (s27b) competed with GEMM1's stream; this one fills the
# latency-bound glue window instead. Qwen3-30B T = 1 needs 19 MB for both GEMMs' weights (fits the 50 MB L2).
# On the device (carry .dev/cutlass):  bash bench/ab/decode_l2_prefetch_ab.sh
set -e
bash bench/ab/build_pair.sh bench/ab/decode_l2_prefetch.patch pf
run() {  # $1 label, $2 package, $3 budget MB
  rm -rf /tmp/ab_$1
  QMOE_DECODE_L2_PREFETCH_MB=$3 PYTHONPATH=$2 python3 -m qmoe.cli bench moe --tokens 1,2,4,8 --no-torch-peers \
    --finalize det --budget-ms 80 --out-dir /tmp/ab_$1 > /tmp/ab_$1.log 2>&1 || tail -5 /tmp/ab_$1.log
  echo "== $1: model T det-graph-us"
  grep -h "^| [a-z]" /tmp/ab_$1/*.md | grep -v "^| model" | awk -F'|' '{print $2, $3, $7}' | tr -s ' ' | tr '\n' ';'; echo
}
for rep in 1 2; do
  run base$rep /tmp/pkg_base 0
  run off$rep /tmp/pkg_pf 0
  run pf24_$rep /tmp/pkg_pf 24
  run pf40_$rep /tmp/pkg_pf 40
done
QMOE_DECODE_L2_PREFETCH_MB=40 PYTHONPATH=/tmp/pkg_pf timeout 200 python3 -m pytest -q -m gpu \
  tests/python/test_gpu_fused_moe.py tests/python/test_gpu_gather_own_rows.py -x 2>&1 | tail -2
