#!/usr/bin/env bash
# Everything a GPU session checks and measures, in one device call (about 2-3 minutes on an H200):
# build, GPU pytest suite, every GEMM tactic on ragged cases, quantizer and tuner tests, then the GEMM
# and MoE-layer benchmarks, a per-kernel profile of the layer. Logs and result files go to $OUT (the device tool's output folder) or
# ./device_out. Usage on the device: bash scripts/device_all.sh   (carry .dev/cutlass)
# QMOE_PROFILE="model:T ...": the layers bench/profile_layer.py breaks down (default: its own list).
# Switch: QMOE_SANITIZER=memcheck|racecheck|synccheck|initcheck runs the pytest step under
# compute-sanitizer (slow: restrict with QMOE_PYTEST_ARGS="-k ...").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
RES=$(mktemp -d)  # result files (.md/.json), packed into $OUT/results.tar at the end (the device tool returns <= 8 files)
export PYTHONUNBUFFERED=1
S=$(date +%s); step() { echo "[$(( $(date +%s) - S ))s] $*"; }
step build; bash scripts/device_build.sh > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
export PYTHONPATH=$PWD/build/device/pkg
step "pytest (gpu)"
QMOE_SKIP_BUILD=1 bash scripts/gpu_tests.sh ${QMOE_PYTEST_ARGS:-} \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; grep -E "^FAILED|passed|failed|summary" -A3 "$OUT/gpu_tests.log" | tail -12
step "gemm checks"; {
  bash tests/gpu/build_w4a8_check.sh build/w4a8_check && build/w4a8_check --bench
  echo "w4a8 gemm check rc=$?"
  bash tests/gpu/build_w4a8_check.sh build/bf16_w4_check tests/gpu/bf16_w4_gemm_check.cu && build/bf16_w4_check --bench
  echo "bf16 x 4-bit gemm check rc=$?"
  bash tests/gpu/build_w4a8_check.sh build/fused_glue_check tests/gpu/fused_glue_check.cu && build/fused_glue_check
  echo "fused glue kernels check rc=$?"
  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iinclude -Isrc -o build/e4m3_cvt_check \
    tests/gpu/e4m3_cvt_check.cu && build/e4m3_cvt_check
  echo "hardware e4m3 conversion check rc=$?"
} > "$OUT/checks.log" 2>&1; grep -E "FAIL|correctness|check rc|PASS" "$OUT/checks.log" | tail -12
step "bench gemm"; python3 -m qmoe.cli bench gemm --models deepseek_v3,qwen3_235b_a22b,qwen3_30b_a3b,mixtral_8x7b \
  --tokens 1,8,64,256,1024,4096,16384 --iters 10 --out-dir "$RES" > "$OUT/bench.log" 2>&1; echo "bench gemm rc=$?"
step "bench moe"; python3 -m qmoe.cli bench moe --quant-mode ${QMOE_BENCH_MODES:-all} --budget-ms 80 --out-dir "$RES" >> "$OUT/bench.log" 2>&1
echo "bench moe rc=$?"
step "profile layer"; python3 bench/profile_layer.py ${QMOE_PROFILE:-} >> "$OUT/bench.log" 2>&1; echo "profile rc=$?"
tar -C "$RES" -cf "$OUT/results.tar" . && echo "results: $(ls "$RES" | tr '\n' ' ')"
step done
