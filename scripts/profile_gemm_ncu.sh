#!/usr/bin/env bash
# Nsight Compute profile of the W4A8 grouped GEMM at the points where it is furthest from its floor
# (docs/status.md): one kernel launch per case, DeepSeek-V3 shapes, through tests/gpu/w4a8_gemm_check.cu
# --bench-only with its filters. Prints, per case, the few metrics that say what bounds the kernel
# (DRAM and SM throughput, issue activity, the top warp stall reasons); the full reports go to $OUT.
# Usage (device machine, after scripts/device_build.sh): bash scripts/profile_gemm_ncu.sh
# Cases: QMOE_PROFILE_CASES="gemm:T:tactic ..." (default below). Needs ncu with hardware counters
# (the Firecracker machines; docs of the device tool); --clock-control none leaves the clocks alone.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n1)
[[ -n "$NCU" ]] || { echo "ncu not found"; exit 2; }
bash tests/gpu/build_w4a8_check.sh build/w4a8_check > /dev/null || exit 1
CASES=${QMOE_PROFILE_CASES:-"1:1:decode_m128_n8_k256 1:256:decode_m128_n16_k256 1:1024:prefill_m128_n64_k128 1:4096:prefill_m128_n128_k128"}
METRICS=dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__inst_issued.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
smsp__warps_active.avg.per_cycle_active,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,\
smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,\
smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,\
smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_not_selected.ratio,\
smsp__average_warp_latency_issue_stalled_selected.ratio,smsp__average_warp_latency_issue_stalled_dispatch_stall.ratio,\
smsp__average_warp_latency_issue_stalled_lg_throttle.ratio,smsp__average_warp_latency_issue_stalled_sleeping.ratio,\
smsp__average_warp_latency_issue_stalled_membar.ratio,smsp__average_warp_latency_issue_stalled_misc.ratio,\
sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__cycles_elapsed.avg,\
sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,\
lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex.sum,smsp__cycles_active.avg,\
gpu__time_duration.sum
for c in $CASES; do
  IFS=: read -r gemm t tactic <<<"$c"
  name="gemm${gemm}_T${t}_${tactic}"
  echo "== $name"
  QMOE_BENCH_GEMM=$gemm QMOE_BENCH_T=$t QMOE_BENCH_TACTIC=$tactic QMOE_BENCH_BATCH=1 \
    timeout 300 "$NCU" --clock-control none --kernel-name-base demangled -k regex:"sm90_grouped_gemm|wgmma" --launch-skip 3 --launch-count 1 \
    --metrics "$METRICS" --csv build/w4a8_check --bench-only > "$OUT/ncu_$name.csv" 2> "$OUT/ncu_$name.err"
  echo "ncu rc=$?"
  # Metric name, unit, value: the last three columns of ncu's --csv rows.
  grep -E '"(dram__|sm__|smsp__|gpu__|l1tex__|lts__)' "$OUT/ncu_$name.csv" | awk -F'","' '{print "  " $(NF-2) " = " $NF " " $(NF-1)}' | tr -d '"'
done
