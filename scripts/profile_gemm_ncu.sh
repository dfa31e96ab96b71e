#!/usr/bin/env bash
# Nsight Compute profile of the W4A8 grouped GEMM at the points where it is furthest from its floor
# (docs/status.md): one kernel launch per case, DeepSeek-V3 shapes, through tests/gpu/w4a8_gemm_check.cu
# --bench-only with its filters. Prints, per case, the few metrics that say what bounds the kernel
# (DRAM and SM throughput, issue activity, the top warp stall reasons); the full reports go to $OUT.
# Usage (device machine, after scripts/device_build.sh): bash scripts/profile_gemm_ncu.sh
# Cases: QMOE_PROFILE_CASES="gemm:T:tactic ..." (default below). Needs ncu with hardware counters
# (the Firecracker machines; docs of the device tool); --clock-control none leaves the clocks alone.
# QMOE_PROFILE_SOURCE=1: instead, where the warps wait per SASS instruction (SourceCounters warp-stall
# sampling): the QMOE_PROFILE_TOP (40) instructions with the most samples and their top stall reasons,
# and the samples by opcode, in $OUT/src_<case>.txt.
# QMOE_PROFILE_KERNEL: the regex of the kernel names profiled (default: every grouped-GEMM kernel), e.g.
# "wgmma_bf16" for the bf16 x 4-bit WGMMA tile of tests/gpu/bf16_w4_gemm_check.cu (which has no tactic filter).
# QMOE_PROFILE_SKIP: matching launches skipped before the profiled one (default 3). The bf16 check program times
# every valid tactic (24 launches each) for plain, then packed FP4 words: e.g. 123 = packed decode n8 at T = 8
# with QMOE_PROFILE_KERNEL=bf16_w4_kernel (5 mma.sync tactics there).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n1)
[[ -n "$NCU" ]] || { echo "ncu not found"; exit 2; }
# QMOE_PROFILE_BIN: a prebuilt check binary (e.g. one of scripts/build_ab_revs.sh's); else built here.
BIN=${QMOE_PROFILE_BIN:-build/w4a8_check}
[[ -n "${QMOE_PROFILE_BIN:-}" ]] || bash tests/gpu/build_w4a8_check.sh build/w4a8_check > /dev/null || exit 1
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
sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,\
lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex.sum,smsp__cycles_active.avg,\
gpu__time_duration.sum
for c in $CASES; do
  IFS=: read -r gemm t tactic <<<"$c"
  name="gemm${gemm}_T${t}_${tactic}"
  echo "== $name"
  export QMOE_BENCH_GEMM=$gemm QMOE_BENCH_T=$t QMOE_BENCH_TACTIC=$tactic QMOE_BENCH_BATCH=1
  NCU_RUN=("$NCU" --clock-control none --kernel-name-base demangled -k regex:"${QMOE_PROFILE_KERNEL:-sm90_grouped_gemm|wgmma}" --launch-skip "${QMOE_PROFILE_SKIP:-3}" --launch-count 1)
  if [[ "${QMOE_PROFILE_SOURCE:-0}" == 1 ]]; then
    REP=$(mktemp -d)
    timeout 300 "${NCU_RUN[@]}" --section SourceCounters --section WarpStateStats --import-source no \
      -f -o "$REP/$name" "$BIN" --bench-only > "$REP/$name.log" 2>&1
    echo "ncu rc=$?"
    "$NCU" -i "$REP/$name.ncu-rep" --page source --csv --print-source sass > "$REP/$name.csv" 2> "$REP/$name.err"
    python3 - "$REP/$name.csv" "${QMOE_PROFILE_TOP:-40}" <<'PY' | tee "$OUT/src_$name.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr_i = next((i for i, r in enumerate(rows) if any("Warp Stall Sampling" in c for c in r)), None)
if hdr_i is None:
    print("no stall-sampling columns; first lines:"); [print(",".join(r)[:300]) for r in rows[:5]]; sys.exit(0)
hdr, body = rows[hdr_i], rows[hdr_i + 1:]
col = lambda name: next((i for i, c in enumerate(hdr) if c == name), None)
i_all = col("Warp Stall Sampling (All Samples)") or next(i for i, c in enumerate(hdr) if "Warp Stall Sampling" in c)
i_src = col("Source") if col("Source") is not None else 1
i_adr = col("Address") if col("Address") is not None else 0
# per-reason sample columns, if this ncu version prints them ("stall_*" style names)
reasons = [i for i, c in enumerate(hdr) if c.lower().startswith("stall") or "(stall" in c.lower()]
num = lambda s: float(s.replace(",", "") or 0) if s.replace(",", "").replace(".", "", 1).isdigit() else 0.0
total = sum(num(r[i_all]) for r in body if len(r) > i_all)
print(f"instructions {len(body)}, stall samples {total:.0f}; columns: {len(hdr)}")
top = sorted((r for r in body if len(r) > i_all), key=lambda r: -num(r[i_all]))[: int(sys.argv[2])]
for r in top:
    why = sorted(((num(r[i]), hdr[i]) for i in reasons if num(r[i]) > 0), reverse=True)[:3]
    print(f"{100 * num(r[i_all]) / max(total, 1):5.1f}% {r[i_adr]:>6} {r[i_src][:70]:70} " +
          " ".join(f"{n}:{v:.0f}" for v, n in why))
# opcode histogram of samples
by_op = {}
for r in body:
    if len(r) > i_all:
        op = r[i_src].split()[0] if r[i_src].split() else "?"
        if op.startswith("@"):
            op = r[i_src].split()[1] if len(r[i_src].split()) > 1 else op
        by_op[op.split(".")[0]] = by_op.get(op.split(".")[0], 0) + num(r[i_all])
print("samples by opcode:", ", ".join(f"{k} {100 * v / max(total, 1):.1f}%" for k, v in sorted(by_op.items(), key=lambda x: -x[1])[:14]))
PY
    continue
  fi
  timeout 300 "${NCU_RUN[@]}" --metrics "$METRICS" --csv "$BIN" --bench-only > "$OUT/ncu_$name.csv" 2> "$OUT/ncu_$name.err"
  echo "ncu rc=$?"
  # Metric name, unit, value: the last three columns of ncu's --csv rows.
  grep -E '"(dram__|sm__|smsp__|gpu__|l1tex__|lts__)' "$OUT/ncu_$name.csv" | awk -F'","' '{print "  " $(NF-2) " = " $NF " " $(NF-1)}' | tr -d '"'
done
