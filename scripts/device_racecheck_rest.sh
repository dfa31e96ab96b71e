#!/usr/bin/env bash
# Session 10's racecheck call (issue #6): the split-K and GEMM-PDL tests (collected here) first, then
# the 16 ids the s9a call left, one shard each. Usage on the 2-GPU device: timeout 590 bash scripts/device_racecheck_rest.sh
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/device_build.sh > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
IDS=$PWD/build/racecheck_rest.ids
QMOE_SKIP_BUILD=1 QMOE_SKIP_CPP=1 bash scripts/gpu_tests.sh -k "split_k or gemms_off or gemms_on" --collect-only > /tmp/collect.log 2>&1
grep -E '^tests/python/[^:]*::' /tmp/collect.log | awk '!seen[$0]++' > "$IDS"
echo "new ids: $(wc -l < "$IDS")"
grep -E '^tests/python/[^:]*::' bench/results/2026-11-30_s9a_nvidia_h200_racecheck.md >> "$IDS"
QMOE_SKIP_BUILD=1 QMOE_SANITIZE_JOBS=${JOBS:-24} QMOE_SANITIZE_TOOLS=racecheck QMOE_SANITIZE_IDS="$IDS" \
  QMOE_SANITIZE_LIMIT_RACECHECK=${LIMIT:-530} bash scripts/gpu_sanitize.sh
