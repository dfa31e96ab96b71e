#!/usr/bin/env bash
# Runs the A/B binaries of scripts/build_gemm_variants.sh on the device: for each list directory in
# .dev/ab (one per bench/ab/<list>.txt), one line per variant with us per (shape, T) for the heuristic's
# tactic (32 back-to-back launches over 8 rotated routings; tests/gpu/w4a8_gemm_check.cu --bench-only, or
# bf16_w4_gemm_check.cu for bf16_* binaries). The first variant of a list runs again last: the spread of
# the two is the noise. Usage (device, carry [".dev/ab"]): bash scripts/device_ab.sh [list ...]
# Options (environment, or a list's "# ab-env:" line): QMOE_AB_SHAPES="E:topk:N:K,..." (default:
# DeepSeek-V3 GEMM1/GEMM2, Qwen3-235B GEMM1, Mixtral GEMM1/GEMM2, Qwen3-30B GEMM1/GEMM2),
# QMOE_AB_T="1,8,64,256", QMOE_AB_TACTIC=heuristic (or a tactic name), QMOE_AB_CHECK=1 (each binary's
# correctness checks first: every tactic vs the CPU reference), QMOE_AB_MAX_T=512 (bf16 binaries),
# QMOE_AB_TIMEOUT=<s> (per binary and run; default 150 for the checks, 120 for the timing: lower it for a
# new kernel that might hang; a binary that times out once is not run again in its list).
# Output: stdout and $OUT/ab.log (appended). Binaries of whole commits (a branch against main): scripts/build_ab_revs.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
# carried as one packed file (build_gemm_variants.sh all): unpack it first
if [[ -f .dev/ab.tgz && ! -d .dev/ab ]]; then tar -C .dev -xzf .dev/ab.tgz; fi
lists=("$@")
if [[ ${#lists[@]} -eq 0 ]]; then
  for d in .dev/ab/*/; do lists+=("$(basename "$d")"); done
fi
[[ ${#lists[@]} -gt 0 ]] || { echo "no .dev/ab/<list> directories: run scripts/build_gemm_variants.sh here and carry .dev/ab"; exit 2; }
run_list() {
  local list=$1 dir=.dev/ab/$1
  # shellcheck disable=SC2046
  [[ -f bench/ab/$list.txt ]] && eval "$(grep -E '^# ab-env:' "bench/ab/$list.txt" | sed 's/^# ab-env://' | sed 's/\([A-Z_]*=\)/export \1/g')"
  export QMOE_BENCH_BATCH=1 QMOE_BENCH_TACTIC=${QMOE_AB_TACTIC:-heuristic} QMOE_BENCH_T=${QMOE_AB_T:-1,8,64,256}
  export QMOE_BENCH_SHAPES=${QMOE_AB_SHAPES:-256:8:4096:7168,256:8:7168:2048,128:8:3072:4096,8:2:28672:4096,8:2:4096:14336,128:8:1536:2048,128:8:2048:768}
  local bins=()
  for b in "$dir"/chk_* "$dir"/bf16_*; do [[ -x "$b" && "$b" != *.log ]] && bins+=("$b"); done
  [[ ${#bins[@]} -gt 0 ]] || { echo "== $list: no binaries"; return; }
  if [[ "${bins[0]}" == */bf16_* ]]; then
    echo "== $list (bf16 x 4-bit GEMM, DeepSeek-V3 GEMM1/GEMM2, T <= ${QMOE_AB_MAX_T:-512}): us per format/gemm/T"
  else
    echo "== $list (shapes gemm<i> = i-th of $QMOE_BENCH_SHAPES; T $QMOE_BENCH_T; tactic $QMOE_BENCH_TACTIC)"
  fi
  local hung=" " out rc
  for b in "${bins[@]}" "${bins[0]}"; do
    local name=${b##*/}
    # A binary that ran into the timeout once (a hang: a new kernel's barrier protocol) is not run again.
    if [[ "$hung" == *" $name "* ]]; then echo "$name: skipped (timed out before)"; continue; fi
    if [[ "${QMOE_AB_CHECK:-0}" == 1 ]]; then
      out=$(timeout "${QMOE_AB_TIMEOUT:-150}" "$b" 2>&1); rc=$?
      echo "$name check: $(grep -E '^correctness' <<< "$out")"
      if [[ $rc == 124 ]]; then echo "$name: TIMED OUT (${QMOE_AB_TIMEOUT:-150} s)"; hung+="$name "; continue; fi
    fi
    local args=(--bench-only)
    if [[ "$name" == bf16_* ]]; then
      args+=("${QMOE_AB_MAX_T:-512}")
      filter() { grep -E '^\| [a-z0-9]+ +\| gemm' | grep '\*' | awk -F'|' '$4 ~ /[0-9]/ {gsub(/ /, "", $2); gsub(/ /, "", $3); gsub(/ /, "", $4); gsub(/ /, "", $6); printf "%s/%s/T%s %s; ", $2, $3, $4, $6}'; }
    else
      filter() { grep '^| gemm' | awk -F'|' '{gsub(/ /, "", $2); gsub(/ /, "", $3); gsub(/ /, "", $5); printf "%s/T%s %s; ", $2, $3, $5}'; }
    fi
    out=$(timeout "${QMOE_AB_TIMEOUT:-120}" "$b" "${args[@]}" 2>&1); rc=$?
    echo "$name: $(filter <<< "$out")"
    if [[ $rc == 124 ]]; then echo "$name: TIMED OUT (${QMOE_AB_TIMEOUT:-120} s)"; hung+="$name "; fi
  done
}
# Everything also goes to $OUT/ab.log (the device tool returns it): a long run's stdout tail is cut.
LOG=${OUT:-$PWD/device_out}/ab.log
mkdir -p "$(dirname "$LOG")"
for l in "${lists[@]}"; do (run_list "$l"); done 2>&1 | tee -a "$LOG"
