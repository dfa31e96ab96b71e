#!/usr/bin/env bash
# Every W4A8 GEMM tactic at the model shapes, token counts between the bench's defaults (where the
# heuristic switches tiles: 4 (7 from 64 experts on), 14, 20, 24, 48 rows per expert; src/tune/tactics.cpp). One table: us per tactic (back-to-back launches,
# tests/gpu/w4a8_gemm_check.cu --bench-only with QMOE_BENCH_BATCH=1), the heuristic's pick (*) and
# the fastest (<). Input for src/tune/tactics.cpp's thresholds. About a minute on an H200 after the build.
# Usage (device, carry .dev/cutlass): bash scripts/device_tactic_sweep.sh   (QMOE_SKIP_BUILD=1 reuses build/device)
# Options: QMOE_SWEEP_SHAPES="name=E:topk:N:K,..." QMOE_SWEEP_T="1,2,4,..." Output: stdout and $OUT/tactic_sweep.md.
# QMOE_SWEEP_KERNEL=bf16: the bf16 x 4-bit GEMM of the FP4 / w4a16 modes instead (tests/gpu/bf16_w4_gemm_check.cu
# --bench-only: NVFP4 and int4-g128 weights, one launch per timing), output $OUT/tactic_sweep_bf16.md.
# W4A8 only: QMOE_SWEEP_ROWS="12,16,20" sweeps rows per expert instead (T = rows * E / topk for each shape),
# QMOE_SWEEP_TACTICS="a,b" times only those tactics, QMOE_SWEEP_BIN=<check binary built here> skips every build
# (QMOE_LIB=build/py/libqmoe.a bash tests/gpu/build_w4a8_check.sh .dev/sweep/w4a8_check; carry .dev/sweep).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
if [[ "${QMOE_SKIP_BUILD:-0}" != 1 && -z "${QMOE_SWEEP_BIN:-}" ]]; then bash scripts/device_build.sh > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }; fi
SHAPES=${QMOE_SWEEP_SHAPES:-dsv3_g1=256:8:4096:7168,dsv3_g2=256:8:7168:2048,q235_g1=128:8:3072:4096,q235_g2=128:8:4096:1536,mixtral_g1=8:2:28672:4096,mixtral_g2=8:2:4096:14336,q30_g1=128:8:1536:2048,q30_g2=128:8:2048:768}
TS=${QMOE_SWEEP_T:-1,8,16,32,64,128,256,512,1024}
LOG=$(mktemp)
if [[ "${QMOE_SWEEP_KERNEL:-w4a8}" == bf16 ]]; then
  bash tests/gpu/build_w4a8_check.sh build/bf16_w4_check tests/gpu/bf16_w4_gemm_check.cu || exit 1
  MAX_T=$(echo "$TS" | tr ',' '\n' | sort -n | tail -n1)
  QMOE_BENCH_SHAPES=$(echo "$SHAPES" | sed 's/[a-z0-9_]*=//g') QMOE_BENCH_T=$TS \
    build/bf16_w4_check --bench-only "$MAX_T" > "$LOG" 2>&1 || { tail -20 "$LOG"; exit 1; }
  python3 - "$LOG" "$SHAPES" <<'PY' | tee "$OUT/tactic_sweep_bf16.md"
import re, sys
log, shapes = open(sys.argv[1]).read().splitlines(), sys.argv[2].split(",")
names = [s.split("=")[0] for s in shapes]
times, chosen = {}, {}
for line in log:  # | format | gemmG | T | tactic[*] | us | TB/s | TFLOP/s |
    m = re.match(r"\| (\w+)\s*\| gemm(\d+)\s*\|\s*(\d+) \| (\w+)\s*(\*?)\s*\|\s*([\d.]+) \|", line)
    if m:
        key = (m[1], int(m[2]), int(m[3]))
        times.setdefault(key, {})[m[4]] = float(m[6])
        if m[5]:
            chosen[key] = m[4]
tactics = sorted({t for v in times.values() for t in v})
print("| format | shape | T | " + " | ".join(tactics) + " | pick / best |")
print("|---|---|--:|" + "--:|" * len(tactics) + "---|")
for (f, g, t), v in sorted(times.items()):
    best = min(v, key=v.get)
    pick = chosen.get((f, g, t), "?")
    cells = [("%.1f" % v[x] if x in v else "-") + (" *" if x == pick else "") + (" <" if x == best else "") for x in tactics]
    loss = v[pick] / v[best] if pick in v else float("nan")
    print(f"| {f} | {names[g - 1]} | {t} | " + " | ".join(cells) + f" | {loss:.2f}x |")
PY
  exit 0
fi
BIN=${QMOE_SWEEP_BIN:-build/w4a8_check}
[[ -n "${QMOE_SWEEP_BIN:-}" ]] || bash tests/gpu/build_w4a8_check.sh "$BIN" || exit 1
[[ -n "${QMOE_SWEEP_TACTICS:-}" ]] && export QMOE_BENCH_TACTIC=$QMOE_SWEEP_TACTICS
if [[ -n "${QMOE_SWEEP_ROWS:-}" ]]; then
  # One run per shape, with that shape's token counts; "## shape i" tells the parser which shape follows.
  i=0
  for spec in ${SHAPES//,/ }; do
    i=$((i + 1))
    IFS=: read -r e topk _ _ <<< "${spec#*=}"
    ts=$(for r in ${QMOE_SWEEP_ROWS//,/ }; do echo $(((r * e + topk - 1) / topk)); done | paste -sd,)
    echo "## shape $i" >> "$LOG"
    QMOE_BENCH_SHAPES=${spec#*=} QMOE_BENCH_T=$ts QMOE_BENCH_BATCH=1 "$BIN" --bench-only >> "$LOG" 2>&1 ||
      { tail -20 "$LOG"; exit 1; }
  done
else
  QMOE_BENCH_SHAPES=$(echo "$SHAPES" | sed 's/[a-z0-9_]*=//g') QMOE_BENCH_T=$TS QMOE_BENCH_BATCH=1 \
    "$BIN" --bench-only > "$LOG" 2>&1 || { tail -20 "$LOG"; exit 1; }
fi
python3 - "$LOG" "$SHAPES" <<'PY' | tee "$OUT/tactic_sweep.md"
import re, sys
log, shapes = open(sys.argv[1]).read().splitlines(), sys.argv[2].split(",")
names = [s.split("=")[0] for s in shapes]
times, chosen = {}, {}
shape = None  # set by "## shape i" (one run per shape): the log's gemm index is then always 1
for line in log:
    m = re.match(r"## shape (\d+)", line)
    if m:
        shape = int(m[1])
    m = re.match(r"\s+gemm(\d+) N=\d+ K=\d+ T=(\d+) (\S+)\s+([\d.]+) us", line)
    if m:
        times.setdefault((shape or int(m[1]), int(m[2])), {})[m[3]] = float(m[4])
    m = re.match(r"\| gemm(\d+) \| (\d+) \| (\S+) \|", line)
    if m:
        chosen[(shape or int(m[1]), int(m[2]))] = m[3]
tactics = sorted({t for v in times.values() for t in v})
print("| shape | T | " + " | ".join(tactics) + " | pick / best |")
print("|---|--:|" + "--:|" * len(tactics) + "---|")
for (g, t), v in sorted(times.items()):
    best = min(v, key=v.get)
    pick = chosen.get((g, t), "?")
    cells = [("%.1f" % v[x] if x in v else "-") + (" *" if x == pick else "") + (" <" if x == best else "") for x in tactics]
    loss = v[pick] / v[best] if pick in v else float("nan")
    print(f"| {names[g - 1]} | {t} | " + " | ".join(cells) + f" | {loss:.2f}x |")
PY
