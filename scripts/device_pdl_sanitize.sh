#!/usr/bin/env bash
# Session 10's second 2-GPU call: the GEMM-PDL rule timed (QMOE_PDL_GEMMS default / 1 / 0, alternated
# twice, T 1-64, four models), then memcheck, synccheck and initcheck over the split-K and GEMM-PDL
# tests (issue #6). Usage: timeout 590 bash scripts/device_pdl_sanitize.sh; results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
bash scripts/device_build.sh > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
export PYTHONPATH=$PWD/build/device/pkg PYTHONUNBUFFERED=1
RES=$(mktemp -d)
for run in 1 2; do
  for cfg in default on off; do
    case $cfg in default) v=;; on) v=1;; off) v=0;; esac
    CUDA_VISIBLE_DEVICES=1 QMOE_PDL_GEMMS=$v timeout 80 python3 -m qmoe.cli bench moe \
      --models deepseek_v3,qwen3_30b_a3b,qwen3_235b_a22b,mixtral_8x7b --tokens 1,2,4,8,16,64 --finalize det \
      --no-torch-peers --peers '' --budget-ms 40 --out-dir "$RES/${cfg}_$run" > "$RES/${cfg}_$run.log" 2>&1
    echo "bench $cfg $run rc=$?"
  done
done
tar -C "$RES" -cf "$OUT/pdl_bench.tar" .
python3 - "$RES" <<'PY'
import glob, json, os, sys
rows = {}
for path in glob.glob(os.path.join(sys.argv[1], "*", "*.json")):
    label = os.path.basename(os.path.dirname(path))
    for r in json.load(open(path)).get("rows", []):
        if isinstance(r, dict) and "T" in r:
            rows.setdefault((r.get("model"), r["T"]), {})[label] = r.get("qmoe_det_graph_us")
labels = sorted({l for v in rows.values() for l in v})
print("| model | T | " + " | ".join(labels) + " |")
for (m, t), v in sorted(rows.items(), key=lambda x: (str(x[0][0]), x[0][1])):
    print(f"| {m} | {t} | " + " | ".join(f"{v[l]:.1f}" if isinstance(v.get(l), float) else "-" for l in labels) + " |")
PY
K="split_k or gemms_off or gemms_on"
QMOE_SKIP_BUILD=1 QMOE_SANITIZE_JOBS=16 QMOE_SANITIZE_TOOLS="memcheck synccheck initcheck" \
  QMOE_SANITIZE_K_MEMCHECK="$K" QMOE_SANITIZE_K_SYNCCHECK="$K" QMOE_SANITIZE_K_INITCHECK="$K" \
  QMOE_SANITIZE_LIMIT_MEMCHECK=${LM:-140} QMOE_SANITIZE_LIMIT_SYNCCHECK=${LS:-120} QMOE_SANITIZE_LIMIT_INITCHECK=${LI:-150} \
  bash scripts/gpu_sanitize.sh 2>&1 | grep -v "^  shard"
