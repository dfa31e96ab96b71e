#!/usr/bin/env bash
# The split-K decode tactics (src/cuda/gemm/split_k.cuh) and the GEMM PDL switch on the device, in one
# call (about 5 minutes on an H200): build; their GPU tests; every W4A8 tactic vs the CPU reference with
# the split tactics offered (each mma.sync tactic must give the same bits); the tactic sweep at decode
# token counts (split vs unsplit per model GEMM); the layer at T = 1 and 8 with each split tactic forced,
# with the heuristic, and with QMOE_PDL_GEMMS=0 (GEMMs launched without the PDL attribute) alternated
# with the default. Logs and results go to $OUT (the device tool's output folder, at most 8 files come
# back) or ./device_out as logs.tgz and results.tar, packed also when the script is stopped early; the
# short tables are printed last. Usage on the device: timeout 590 bash scripts/device_split_k.sh
# (carry .dev/cutlass). QMOE_SPLIT_K_LAYER=0 skips the layer benchmarks (about 4 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
RES=$(mktemp -d) LOGS=$(mktemp -d)
pack() { tar -C "$LOGS" -czf "$OUT/logs.tgz" . 2>/dev/null; tar -C "$RES" -cf "$OUT/results.tar" . 2>/dev/null; }
trap pack EXIT
trap 'exit 143' TERM INT
export PYTHONUNBUFFERED=1
S=$(date +%s); step() { echo "[$(( $(date +%s) - S ))s] $*"; }
step build; bash scripts/device_build.sh > "$LOGS/build.log" 2>&1 || { tail -40 "$LOGS/build.log"; exit 1; }
export PYTHONPATH=$PWD/build/device/pkg
step "pytest: split-K and PDL"
QMOE_SKIP_BUILD=1 QMOE_SKIP_CPP=1 timeout 300 bash scripts/gpu_tests.sh -k "split or pdl_gives" > "$LOGS/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$LOGS/gpu_tests.log" | tail -8
step "w4a8 check, split tactics offered"
{ bash tests/gpu/build_w4a8_check.sh build/w4a8_check && QMOE_SPLIT_K_TACTICS=1 timeout 240 build/w4a8_check
  echo "w4a8 gemm check rc=$?"; } > "$LOGS/check.log" 2>&1
grep -c "^ok" "$LOGS/check.log" | sed 's/^/ok lines: /'; grep -E "^FAIL|check rc" "$LOGS/check.log" | head -12
step "tactic sweep"
QMOE_SKIP_BUILD=1 QMOE_SPLIT_K_TACTICS=1 QMOE_SWEEP_T=${QMOE_SWEEP_T:-1,4,8,16,32} OUT="$RES" \
  timeout 300 bash scripts/device_tactic_sweep.sh > "$LOGS/sweep.log" 2>&1; echo "sweep rc=$?"
step "layer: tactics and PDL"
bench() {  # label, extra environment and bench arguments
  local label=$1; shift
  env "$@" timeout 75 python3 -m qmoe.cli bench moe --models deepseek_v3,qwen3_30b_a3b,qwen3_235b_a22b,mixtral_8x7b \
    --tokens ${BENCH_T:-1,8,64} --finalize det --no-torch-peers --peers '' --budget-ms 40 --out-dir "$RES/$label" \
    ${BENCH_ARGS:-} > "$LOGS/bench_$label.log" 2>&1
  echo "bench $label rc=$?"
}
if [[ "${QMOE_SPLIT_K_LAYER:-1}" != 0 ]]; then
  BENCH_T=1,8 BENCH_ARGS="--tactic decode_m64_n8_k512_s4" bench split_s4 QMOE_SPLIT_K_TACTICS=1
  BENCH_T=1,8 BENCH_ARGS="--tactic decode_m64_n8_k512_s8" bench split_s8 QMOE_SPLIT_K_TACTICS=1
  BENCH_T=1,8 BENCH_ARGS="--tactic decode_m64_n8_k512" bench unsplit_m64 QMOE_SPLIT_K_TACTICS=0
  for run in 1 2; do
    bench "default_$run" QMOE_SPLIT_K_TACTICS=0
    bench "pdl_gemms_off_$run" QMOE_PDL_GEMMS=0
  done
fi
step "tables"
cat "$RES/tactic_sweep.md" 2>/dev/null | head -60
python3 - "$RES" <<'PY'
import glob, json, os, sys
rows = {}
for path in glob.glob(os.path.join(sys.argv[1], "*", "*.json")):
    label = os.path.basename(os.path.dirname(path))
    try:
        data = json.load(open(path))
    except Exception:
        continue
    for r in data.get("rows", data if isinstance(data, list) else []):
        if isinstance(r, dict) and "T" in r:
            rows.setdefault((r.get("model"), r["T"]), {})[label] = (
                r.get("qmoe_det_graph_us") or r.get("errors", {}).get("qmoe_det_graph_us", "-"))
labels = sorted({l for v in rows.values() for l in v})
print("| model | T | " + " | ".join(labels) + " |")
print("|---|--:|" + "--:|" * len(labels))
for (m, t), v in sorted(rows.items(), key=lambda x: (str(x[0][0]), x[0][1])):
    print(f"| {m} | {t} | " + " | ".join(f"{v[l]:.1f}" if isinstance(v.get(l), float) else str(v.get(l, "-"))[:12]
                                         for l in labels) + " |")
PY
step done
