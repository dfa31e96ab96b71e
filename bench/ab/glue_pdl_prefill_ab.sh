#!/usr/bin/env bash
# Does PDL between the glue kernels cost time at prefill? (s31c saw the enable_pdl=True replay 2-3.5% slower at
# DeepSeek-V3 T = 4096, but measured after the False one, on a hotter, power-capped GPU.) w4a8_int4 layer, det
# finalize, T = 512 and 4096, enable_pdl on / off alternated twice (on, off, off, on) so that clock drift cancels.
# Device, machine with build/device. Output: $OUT/pdl_{on,off}_{1,2}/*.md
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/build/device/pkg
[[ -f build/device/libqmoe.a ]] || bash scripts/device_build.sh > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
for run in on_1 off_1 off_2 on_2; do
  python3 -m qmoe.cli bench moe --tokens 512,4096 --finalize det --no-torch-peers --budget-ms 80 --pdl "${run%_*}" \
    --out-dir "$OUT/pdl_$run" > "$OUT/pdl_$run.log" 2>&1 || { tail -20 "$OUT/pdl_$run.log"; exit 1; }
done
python3 - "$OUT" <<'PY'
import json, glob, sys, os
out = sys.argv[1]
res = {}
for run in ["on_1", "off_1", "off_2", "on_2"]:
    for f in glob.glob(f"{out}/pdl_{run}/*.json"):
        for r in json.load(open(f)).get("rows", []):
            key = (r.get("model"), r.get("T"))
            res.setdefault(key, {})[run] = r.get("qmoe_det_graph_us")
print("| model | T | on 1 | off 1 | off 2 | on 2 | on / off |")
print("|---|--:|--:|--:|--:|--:|--:|")
for (m, t), v in sorted(res.items(), key=lambda kv: (str(kv[0][0]), kv[0][1] or 0)):
    try:
        ratio = (v["on_1"] + v["on_2"]) / (v["off_1"] + v["off_2"])
    except Exception:
        ratio = float("nan")
    print(f"| {m} | {t} | " + " | ".join(str(v.get(k)) for k in ["on_1", "off_1", "off_2", "on_2"]) + f" | {ratio:.3f} |")
PY
