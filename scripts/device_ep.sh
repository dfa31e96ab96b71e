#!/usr/bin/env bash
# Expert parallelism on the 2-GPU device kind (nvidia-h200-x2), in one device call (~5-8 minutes):
#   1. build (scripts/device_build.sh)                                   -> $OUT/build.log
#   2. one-GPU tests of moe_expert_rows / moe_finalize on CUDA tensors     -> $OUT/ep_test.log
#   3. the two-rank EP test, NCCL transport (tests/gpu/ep/test_ep_two_gpus.py) -> $OUT/ep_test.log
#   4. the weak-scaling benchmark (python3 -m qmoe.bench.ep)              -> $OUT/ep_bench.log,
#      $OUT/<date>_h200x2_ep.md and .json
# Five files in $OUT. The exit status is non-zero when the build or a test failed (the benchmark's
# own status is printed). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends, KINDS.md).
# Usage on the device (carry .dev/cutlass):  bash scripts/device_ep.sh
# Switches: QMOE_EP_SKIP_BENCH=1 (tests only), QMOE_EP_BENCH_ARGS="--tokens 64,512 ..." (benchmark options).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$(date +%s); step() { echo "[$(( $(date +%s) - S ))s] $*"; }

step environment
nvidia-smi -L 2>&1 | head -4
nvidia-smi topo -m 2>&1 | head -4
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'

step build
if ! bash scripts/device_build.sh > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "device_ep: BUILD FAILED"; exit 1
fi
export PYTHONPATH=$PWD/build/device/pkg

step "one-GPU tests: moe_expert_rows / moe_finalize on CUDA"
python3 -m pytest -q -p no:cacheprovider -ra tests/gpu/ep/test_expert_rows_gpu.py > "$OUT/ep_test.log" 2>&1
rc_ops=$?
grep -E "passed|failed|error|^FAILED|^ERROR" "$OUT/ep_test.log" | tail -12

step "two-rank EP test (NCCL)"
timeout 560 python3 tests/gpu/ep/test_ep_two_gpus.py --timeout 480 >> "$OUT/ep_test.log" 2>&1
rc_ep=$?
grep -E "^== |FAIL|rank 0\] [0-9]+ passed|rank 1\] [0-9]+ passed|Error|TIMEOUT" "$OUT/ep_test.log" | grep -v "^\[rank [01]\] PASS" | tail -40

rc_bench=skipped
if [[ "${QMOE_EP_SKIP_BENCH:-0}" != 1 ]]; then
  step "benchmark: weak scaling"
  # shellcheck disable=SC2086 # the options are meant to split
  timeout 560 python3 -m qmoe.bench.ep --out-dir "$OUT" ${QMOE_EP_BENCH_ARGS:-} > "$OUT/ep_bench.log" 2>&1
  rc_bench=$?
  sed -n '/^## Expert parallelism/,$p' "$OUT/ep_bench.log"
  [[ $rc_bench -ne 0 ]] && tail -30 "$OUT/ep_bench.log"
fi

step done
echo "device_ep: one-GPU tests rc=$rc_ops, two-rank test rc=$rc_ep, benchmark rc=$rc_bench"
[[ $rc_ops -eq 0 && $rc_ep -eq 0 ]]
