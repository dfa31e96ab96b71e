#!/usr/bin/env bash
# Builds one W4A8 GEMM check binary per launcher variant, here (no GPU needed), for a cheap A/B run on
# the device (scripts/device_ab.sh): a variant is the launcher src/cuda/gemm/sm90_grouped_gemm_w4a8_int4.cu
# with sed edits (usually other template arguments of an instantiation), compiled and linked before a
# local libqmoe.a, so it replaces the library's launcher. Session 4 ran 5-variant A/B rounds for ~35 s
# of device time each this way (a full device build + suite + benchmarks costs ~250 s).
#
# Usage: bash scripts/build_gemm_variants.sh bench/ab/<list>.txt  -> .dev/ab/<list>/chk_<name> (+ .log)
# The list itself may say what it edits and how the device runs it, in comment lines:
#   # ab-build: QMOE_AB_GEMM=bf16     the bf16 x 4-bit GEMM (its launcher header, rebuilt into its three
#                                     format units, checked by tests/gpu/bf16_w4_gemm_check.cu: bf16_<name>)
#   # ab-build: QMOE_AB_SRC=<unit>    another W4A8 unit (e.g. src/cuda/gemm/sm90_grouped_gemm_w4a8_int4_wgmma.cu)
#   # ab-env: QMOE_AB_T=256,1024      options for scripts/device_ab.sh when it runs this list
# `bash scripts/build_gemm_variants.sh all` builds every list in bench/ab and packs them into .dev/ab.tgz.
# List format, one variant per line (# comments and blank lines skipped):
#   <name> | <sed expression> [| <sed expression> ...]       e.g.
#   base   | s/xx/xx/
#   m64s3  | s/launch<2, 1, 2, 1, 4, 4, 2, 2>/launch<2, 1, 2, 1, 4, 3, 2, 3>/
# ('|' separates the expressions, so it cannot appear inside one.) A sed expression that changes nothing
# or that sed rejects is an error (a stale list would silently measure the base).
# The library comes from build/ab_lib (configured with the CUDA kernels on first use, then rebuilt
# incrementally, ~30 s on 2 cores); CUTLASS_DIR defaults to .dev/cutlass. With cuobjdump (CUOBJDUMP=<path>; the pip
# wheel nvidia-cuda-cuobjdump ships one) each variant also reports its tensor-core instruction count: a drop against
# base means ptxas deleted MMAs whose results the variant never reads.
# Then on the device: run `bash scripts/device_ab.sh` with carry [".dev/ab"].
set -euo pipefail
cd "$(dirname "$0")/.."
LIST=${1:?usage: build_gemm_variants.sh <variant list> | all}
if [[ "$LIST" == all ]]; then
  for l in bench/ab/*.txt; do bash "$0" "$l" || exit 1; done
  # One compressed file (binaries gzip to ~30%): carried with .dev/cutlass it stays under the 64 MiB
  # carry limit, so one device call can build, test and run every A/B list (device_ab.sh unpacks it).
  tar -C .dev -czf .dev/ab.tgz ab && echo "packed .dev/ab.tgz ($(du -h .dev/ab.tgz | cut -f1))"
  exit 0
fi
# shellcheck disable=SC2046 # the list's ab-build words are NAME=value assignments
eval "$(grep -E '^# ab-build:' "$LIST" | sed 's/^# ab-build://' | sed 's/\([A-Z_]*=\)/export \1/g')"
GEMM=${QMOE_AB_GEMM:-w4a8}
OUTDIR=.dev/ab/$(basename "$LIST" .txt)
if [[ "$GEMM" == bf16 ]]; then
  SRC=${QMOE_AB_SRC:-src/cuda/gemm/sm90_grouped_gemm_bf16_w4_launch.cuh}  # or the kernel header (..._bf16_w4.cuh)
  UNITS=(src/cuda/gemm/sm90_grouped_gemm_bf16_w4_int4.cu src/cuda/gemm/sm90_grouped_gemm_bf16_w4_nvfp4.cu
         src/cuda/gemm/sm90_grouped_gemm_bf16_w4_mxfp4.cu)
  CHECK=tests/gpu/bf16_w4_gemm_check.cu
  PREFIX=bf16_
else
  SRC=${QMOE_AB_SRC:-src/cuda/gemm/sm90_grouped_gemm_w4a8_int4.cu}  # or the WGMMA unit (..._wgmma.cu)
  CHECK=tests/gpu/w4a8_gemm_check.cu
  PREFIX=chk_
fi
CUTLASS_DIR=${CUTLASS_DIR:-$PWD/.dev/cutlass}
NVCC_FLAGS="-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr"
NVCC="nvcc $NVCC_FLAGS -Iinclude -Isrc -I$CUTLASS_DIR/include"
HOST_CXX=$([[ -x /usr/bin/g++ ]] && echo /usr/bin/g++ || command -v g++)
CUOBJDUMP=${CUOBJDUMP:-cuobjdump}  # optional (the pip wheel nvidia-cuda-cuobjdump has one)

# QMOE_AB_LIB: an already built libqmoe.a of this tree (e.g. build/py/libqmoe.a from scripts/setup.sh), which
# saves configuring and building build/ab_lib.
LIB=${QMOE_AB_LIB:-build/ab_lib/libqmoe.a}
if [[ -z "${QMOE_AB_LIB:-}" ]]; then
  if [[ ! -f build/ab_lib/build.ninja ]]; then
    cmake -S . -B build/ab_lib -G Ninja -DQMOE_BUILD_TESTS=OFF -DQMOE_BUILD_PYTHON=OFF -DQMOE_WITH_CUDA_KERNELS=ON \
      -DCUTLASS_DIR="$CUTLASS_DIR" -DCMAKE_BUILD_TYPE=Release > /dev/null
  fi
  cmake --build build/ab_lib --target qmoe -j"$(nproc)" > /dev/null
fi
rm -rf "$OUTDIR" && mkdir -p "$OUTDIR"
tmp=$(mktemp -d)
while IFS= read -r line; do
  line=${line%%#*}
  [[ -z "${line// }" ]] && continue
  IFS='|' read -r -a parts <<<"$line"
  name=$(echo "${parts[0]}" | tr -d ' ')
  args=()
  for ((i = 1; i < ${#parts[@]}; ++i)); do
    expr=$(echo "${parts[$i]}" | sed 's/^ *//; s/ *$//')
    args+=(-e "$expr")
    if ! sed -e "$expr" "$SRC" > /dev/null; then
      echo "variant $name: sed rejects '$expr'" >&2; exit 1
    fi
    if [[ "$expr" != "s/xx/xx/" ]] && [[ "$(sed -e "$expr" "$SRC")" == "$(cat "$SRC")" ]]; then
      echo "variant $name: '$expr' changes nothing in $SRC" >&2; exit 1
    fi
  done
  log="$OUTDIR/$PREFIX$name.log"
  # (no `set -e` inside: bash ignores it in a tested subshell, hence the explicit exits)
  if ! (
    if [[ "$GEMM" == bf16 ]]; then  # the edited header first on the include path, then the three units
      mkdir -p "$tmp/$name/cuda/gemm"
      sed "${args[@]}" "$SRC" > "$tmp/$name/cuda/gemm/${SRC##*/}" || exit 1
      objs=()
      for u in "${UNITS[@]}"; do
        nvcc $NVCC_FLAGS -I"$tmp/$name" -Iinclude -Isrc -I"$CUTLASS_DIR/include" -Xptxas -v -c \
          -o "$tmp/$name/${u##*/}.o" "$u" 2>> "$log" || exit 1
        objs+=("$tmp/$name/${u##*/}.o")
      done
    else
      sed "${args[@]}" "$SRC" > "$tmp/$name.cu" || exit 1
      $NVCC -I"$(dirname "$SRC")" -Xptxas -v -c -o "$tmp/$name.o" "$tmp/$name.cu" 2> "$log" || exit 1
      objs=("$tmp/$name.o")
    fi
    $NVCC -ccbin "$HOST_CXX" -o "$OUTDIR/$PREFIX$name" "$CHECK" "${objs[@]}" "$LIB" -lpthread -ldl \
      || exit 1
    spills=$(grep -cE "[1-9][0-9]* bytes spill stores" "$log" || true)
    # Tensor-core instructions in the variant's SASS (when cuobjdump is around): a variant whose MMA results
    # are never read loses its wgmmas to dead-code elimination, and then times an empty pipeline (session 25).
    mma=""
    if command -v "$CUOBJDUMP" > /dev/null 2>&1; then
      mma=", tensor-core instructions: $(for o in "${objs[@]}"; do "$CUOBJDUMP" -sass "$o"; done | grep -cE "[QH]GMMA|HMMA|IMMA")"
    fi
    echo "built $OUTDIR/$PREFIX$name (kernels with spills: $spills$mma)"
  ); then echo "variant $name FAILED to build: see $log (grep error)"; fi &
  while (( $(jobs -rp | wc -l) >= $(nproc) )); do wait -n || true; done
done < "$LIST"
wait || true
rm -rf "$tmp"
