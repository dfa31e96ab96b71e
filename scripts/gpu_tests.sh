#!/usr/bin/env bash
# The whole GPU test suite, on the device machine (an sm_90a GPU with torch, numpy, pytest and
# ml-dtypes installed):
#   1. scripts/device_build.sh: library, C++ tests, extension for this python3 (CUTLASS headers
#      carried in .dev/cutlass) into build/device/pkg;
#   2. the C++ tests (build/device/qmoe_tests) when GoogleTest was found;
#   3. python3 -m pytest -m gpu tests/python with PYTHONPATH=build/device/pkg;
#   4. a summary of the three steps; the exit status is non-zero when any of them failed.
#
# Usage:   bash scripts/gpu_tests.sh [extra pytest arguments, e.g. -k mm_data -x]
# Switches (environment):
#   QMOE_SANITIZER=memcheck|racecheck|synccheck|initcheck
#                       run the pytest step under `compute-sanitizer --tool $QMOE_SANITIZER`
#                       (errors fail the run; racecheck/synccheck are slow: restrict with -k)
#   QMOE_SKIP_BUILD=1   reuse an existing build/device (no rebuild)
#   QMOE_SKIP_CPP=1     skip the C++ tests
#   QMOE_PYTEST_LOG=<file>  where pytest's output is also written (default /tmp/qmoe_pytest.log;
#                       scripts/gpu_sanitize.sh gives each of its concurrent runs its own)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
declare -A RESULT

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
python3 - <<'EOF'
import importlib
for name in ("torch", "numpy", "ml_dtypes", "pytest"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # report, do not stop: pytest skips what it cannot run
        print(f"{name}: NOT importable ({e})")
EOF
python3 -m pip show ml-dtypes 2>/dev/null | sed -n 's/^Version: /ml-dtypes (pip show): /p'

echo "== build"
if [[ "${QMOE_SKIP_BUILD:-0}" == 1 && -d build/device/pkg/qmoe ]]; then
  RESULT[build]="skipped (QMOE_SKIP_BUILD=1)"
elif bash scripts/device_build.sh; then
  RESULT[build]=ok
else
  RESULT[build]=FAILED
  echo "device build failed; configure log: /tmp/qmoe_configure.log"
fi

echo "== C++ tests"
if [[ "${QMOE_SKIP_CPP:-0}" == 1 ]]; then
  RESULT[cpp]="skipped (QMOE_SKIP_CPP=1)"
elif [[ -x build/device/qmoe_tests ]]; then
  # pipefail: the pipeline fails when qmoe_tests does
  if build/device/qmoe_tests 2>&1 | tee /tmp/qmoe_cpp_tests.log | tail -n 40; then
    RESULT[cpp]="ok ($(grep -Eo '[0-9]+ tests? from [0-9]+ test suites? ran' /tmp/qmoe_cpp_tests.log | tail -n1))"
  else
    RESULT[cpp]=FAILED
  fi
else
  RESULT[cpp]="not built (no GoogleTest on this machine)"
fi

echo "== pytest -m gpu"
export PYTHONPATH=$ROOT/build/device/pkg${PYTHONPATH:+:$PYTHONPATH}
PYTEST=(python3 -m pytest -m gpu tests/python -ra -q -p no:cacheprovider "$@")
if [[ -n "${QMOE_SANITIZER:-}" ]]; then
  case "$QMOE_SANITIZER" in
    memcheck|racecheck|synccheck|initcheck) ;;
    *) echo "QMOE_SANITIZER must be memcheck, racecheck, synccheck or initcheck (got '$QMOE_SANITIZER')"; exit 2 ;;
  esac
  SANITIZER=$(command -v compute-sanitizer || find /usr/local/cuda*/bin -name compute-sanitizer 2>/dev/null | head -n1)
  if [[ -z "$SANITIZER" ]]; then
    echo "compute-sanitizer not found"; exit 2
  fi
  echo "running under $SANITIZER --tool $QMOE_SANITIZER"
  PYTEST=("$SANITIZER" --tool "$QMOE_SANITIZER" --error-exitcode 86 --print-limit 20 --target-processes all "${PYTEST[@]}")
fi
PYLOG=${QMOE_PYTEST_LOG:-/tmp/qmoe_pytest.log}
"${PYTEST[@]}" 2>&1 | tee "$PYLOG"
rc=${PIPESTATUS[0]}
line=$(grep -E '^=*.*(passed|failed|error|skipped|no tests ran).*' "$PYLOG" | tail -n1)
if [[ $rc -eq 0 ]]; then
  RESULT[pytest]="ok ${line}"
elif [[ $rc -eq 86 ]]; then
  RESULT[pytest]="FAILED: compute-sanitizer ($QMOE_SANITIZER) reported errors ${line}"
else
  RESULT[pytest]="FAILED (exit $rc) ${line}"
fi

echo
echo "== summary"
status=0
for step in build cpp pytest; do
  printf '  %-7s %s\n' "$step" "${RESULT[$step]}"
  [[ "${RESULT[$step]}" == FAILED* ]] && status=1
done
exit $status
