#!/usr/bin/env bash
# A/B of a source edit through the whole library, on the device: for the base tree and each sed expression
# (each applied to the base file alone), a device build (scripts/device_build.sh, incremental: ~30 s on an
# H200 machine) and the per-kernel times of bench/profile_layer.py for the given layers, filtered to the
# kernels named. For constants of the glue kernels (rows per pass, threads) and other edits that scripts/
# build_gemm_variants.sh (GEMM launchers only) cannot reach. Session 18 found the requant's rows per pass
# this way (bench/results/2026-12-01_s18g_*).
#
# Usage (device, carry .dev/cutlass):
#   QMOE_AB_PROFILE="mixtral_8x7b:4096:w4a4 deepseek_v3:4096:w4a4" QMOE_AB_KERNELS="gather|requant" \
#     bash scripts/device_build_ab.sh <file> '<sed expression>' ['<sed expression>' ...]
# Output: per variant, the layer headers, the matching kernel rows and the graph time. The file is restored
# at the end. A variant that fails to build stops the run (its build log tail is printed).
set -uo pipefail
cd "$(dirname "$0")/.."
FILE=${1:?usage: device_build_ab.sh <file> <sed expression>...}
shift
[[ $# -ge 1 ]] || { echo "give at least one sed expression" >&2; exit 2; }
[[ -f "$FILE" ]] || { echo "no such file: $FILE" >&2; exit 2; }
PROFILE=${QMOE_AB_PROFILE:-mixtral_8x7b:4096:w4a4 qwen3_30b_a3b:4096:w4a4 deepseek_v3:4096:w4a4}
KERNELS=${QMOE_AB_KERNELS:-gather|requant|finalize}
export PYTHONPATH=$PWD/build/device/pkg
ORIG=$(mktemp)
cp "$FILE" "$ORIG"
trap 'cp "$ORIG" "$FILE"' EXIT
run_variant() {
  local name=$1
  echo "== $name"
  bash scripts/device_build.sh > /tmp/qmoe_ab_build.log 2>&1 || { tail -20 /tmp/qmoe_ab_build.log; exit 1; }
  # shellcheck disable=SC2086 # PROFILE is a list of specs
  python3 bench/profile_layer.py $PROFILE 2>&1 | grep -E "^## |$KERNELS|enable_pdl=True" |
    sed 's/void qmoe::cuda::fused::(anonymous namespace):://' | cut -c1-110
}
run_variant "base"
for expr in "$@"; do
  cp "$ORIG" "$FILE"
  sed -i "$expr" "$FILE"
  if cmp -s "$ORIG" "$FILE"; then echo "== $expr: changes nothing in $FILE" >&2; exit 2; fi
  run_variant "$expr"
done
