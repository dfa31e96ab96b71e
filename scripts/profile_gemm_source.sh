#!/usr/bin/env bash
# Where one W4A8 GEMM kernel's warps wait, per SASS instruction: Nsight Compute's warp-stall sampling
# (SourceCounters) of one launch, then the instructions with the most samples, with their stall reasons.
# Companion to profile_gemm_ncu.sh (whole-kernel metrics). DeepSeek-V3 shapes through
# tests/gpu/w4a8_gemm_check.cu --bench-only, one launch per case.
# Usage (device, after scripts/device_build.sh): bash scripts/profile_gemm_source.sh
# Cases: QMOE_PROFILE_CASES="gemm:T:tactic ..." (default: the two WGMMA prefill tiles). Top rows:
# QMOE_PROFILE_TOP (default 40). Reports go to $OUT/src_<case>.ncu-rep (not returned: large) and
# $OUT/src_<case>.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n1)
[[ -n "$NCU" ]] || { echo "ncu not found"; exit 2; }
bash tests/gpu/build_w4a8_check.sh build/w4a8_check > /dev/null || exit 1
CASES=${QMOE_PROFILE_CASES:-"1:1024:prefill_m128_n64_k128 1:4096:prefill_m128_n128_k128"}
REP=$(mktemp -d)
for c in $CASES; do
  IFS=: read -r gemm t tactic <<<"$c"
  name="gemm${gemm}_T${t}_${tactic}"
  echo "== $name"
  QMOE_BENCH_GEMM=$gemm QMOE_BENCH_T=$t QMOE_BENCH_TACTIC=$tactic QMOE_BENCH_BATCH=1 \
    timeout 300 "$NCU" --clock-control none --kernel-name-base demangled -k regex:"sm90_grouped_gemm|wgmma" --launch-skip 3 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source no \
    -f -o "$REP/$name" build/w4a8_check --bench-only > "$REP/$name.log" 2>&1
  echo "ncu rc=$? $(tail -n 2 "$REP/$name.log" | tr '\n' ' ' | cut -c1-200)"
  "$NCU" -i "$REP/$name.ncu-rep" --page source --csv --print-source sass > "$REP/$name.csv" 2> "$REP/$name.err"
  "$NCU" -i "$REP/$name.ncu-rep" --page details --csv > "$REP/$name.details.csv" 2>> "$REP/$name.err"
  python3 - "$REP/$name.csv" "$REP/$name.details.csv" "${QMOE_PROFILE_TOP:-40}" <<'PY' | tee "$OUT/src_$name.txt"
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
top = sorted((r for r in body if len(r) > i_all), key=lambda r: -num(r[i_all]))[: int(sys.argv[3])]
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
det = list(csv.reader(open(sys.argv[2])))
keep = ("Duration", "DRAM Throughput", "Compute (SM) Throughput", "Issue Slots Busy", "Warp Cycles Per Issued",
        "Stall", "Achieved Active Warps", "L2 Cache Throughput", "Memory Throughput")
for r in det[1:]:
    if len(r) >= 3 and any(k in r[-3] for k in keep):
        print(f"  {r[-3]} = {r[-1]} {r[-2]}")
PY
done
