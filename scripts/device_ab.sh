#!/usr/bin/env bash
# Runs the A/B binaries of scripts/build_gemm_variants.sh on the device and prints one line per variant:
# us per (shape, T), the heuristic's tactic, 32 back-to-back launches over 8 rotated routings
# (tests/gpu/w4a8_gemm_check.cu --bench-only). The first variant runs again last: the spread of the two
# is the noise. Usage (device, carry [".dev/ab"]): bash scripts/device_ab.sh
# Options (environment): QMOE_AB_SHAPES="E:topk:N:K,..." (default: DeepSeek-V3 GEMM1/GEMM2, Qwen3-235B
# GEMM1, Mixtral GEMM1/GEMM2, Qwen3-30B GEMM1/GEMM2), QMOE_AB_T="1,8,64,256", QMOE_AB_TACTIC=heuristic
# (or a tactic name), QMOE_AB_CHECK=1 also runs each binary's correctness checks (every tactic vs the
# CPU reference) first.
set -uo pipefail
cd "$(dirname "$0")/.."
export QMOE_BENCH_BATCH=1 QMOE_BENCH_TACTIC=${QMOE_AB_TACTIC:-heuristic} QMOE_BENCH_T=${QMOE_AB_T:-1,8,64,256}
export QMOE_BENCH_SHAPES=${QMOE_AB_SHAPES:-256:8:4096:7168,256:8:7168:2048,128:8:3072:4096,8:2:28672:4096,8:2:4096:14336,128:8:1536:2048,128:8:2048:768}
bins=()
for b in .dev/ab/chk_*; do [[ -x "$b" && "$b" != *.log ]] && bins+=("$b"); done
bf16=()
for b in .dev/ab/bf16_*; do [[ -x "$b" && "$b" != *.log ]] && bf16+=("$b"); done
if [[ ${#bf16[@]} -gt 0 ]]; then  # bf16 x 4-bit variants: DeepSeek-V3 GEMM1/GEMM2, int4 and NVFP4, heuristic rows
  echo "bf16 x 4-bit GEMM (tests/gpu/bf16_w4_gemm_check.cu --bench-only ${QMOE_AB_MAX_T:-512}): us per format/gemm/T"
  for b in "${bf16[@]}" "${bf16[0]}"; do
    if [[ "${QMOE_AB_CHECK:-0}" == 1 ]]; then
      echo "${b##*/bf16_} check: $(timeout 120 "$b" 2>&1 | grep -E '^correctness')"
    fi
    echo "${b##*/bf16_}: $(timeout 120 "$b" --bench-only "${QMOE_AB_MAX_T:-512}" 2>&1 | grep -E '^\| [a-z0-9]+ +\| gemm' | grep '\*' | awk -F'|' '$4 ~ /[0-9]/ {gsub(/ /, "", $2); gsub(/ /, "", $3); gsub(/ /, "", $4); gsub(/ /, "", $6); printf "%s/%s/T%s %s; ", $2, $3, $4, $6}')"
  done
fi
[[ ${#bins[@]} -gt 0 ]] || { [[ ${#bf16[@]} -gt 0 ]] && exit 0; echo "no .dev/ab binaries: run scripts/build_gemm_variants.sh here and carry .dev/ab"; exit 2; }
echo "shapes (gemm<i> = i-th): $QMOE_BENCH_SHAPES; T: $QMOE_BENCH_T; tactic: $QMOE_BENCH_TACTIC"
for b in "${bins[@]}" "${bins[0]}"; do
  name=${b##*/chk_}
  if [[ "${QMOE_AB_CHECK:-0}" == 1 ]]; then
    echo "$name check: $(timeout 120 "$b" 2>&1 | grep -E '^correctness')"
  fi
  echo "$name: $(timeout 120 "$b" --bench-only 2>&1 | grep '^| gemm' | awk -F'|' '{gsub(/ /, "", $2); gsub(/ /, "", $3); gsub(/ /, "", $5); printf "%s/T%s %s; ", $2, $3, $5}')"
done
