#!/usr/bin/env bash
# Builds the GEMM check binaries of whole commits (not sed variants) for an A/B run on the device: for each
# git revision, its library (CUDA kernels on, the library's own flags) in a worktree, then
# tests/gpu/w4a8_gemm_check.cu and tests/gpu/bf16_w4_gemm_check.cu of that revision linked against it.
# Use it for a branch against main when the change spans headers, launchers or signatures, where
# scripts/build_gemm_variants.sh (sed edits of one unit) cannot reach.
#
# Usage: bash scripts/build_ab_revs.sh <name> <base rev> <rev> [<rev> ...]
#   -> .dev/ab/<name>/chk_<i>_<short sha> and bf16_<i>_<short sha> (i = 0 for the base: device_ab.sh runs
#      the first binary first and again last, for the noise), plus revs.txt (which binary is which commit).
# Then on the device: QMOE_AB_CHECK=1 QMOE_AB_T=... bash scripts/device_ab.sh <name>   (carry [".dev/ab/<name>"])
# One worktree and library build in build/ab_rev/shared, checked out at each revision in turn (incremental
# rebuilds: only what the revisions change). CUTLASS_DIR defaults to .dev/cutlass.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:?usage: build_ab_revs.sh <name> <base rev> <rev> [<rev> ...]}
shift
[[ $# -ge 2 ]] || { echo "give a base revision and at least one other" >&2; exit 2; }
ROOT=$PWD
CUTLASS_DIR=${CUTLASS_DIR:-$ROOT/.dev/cutlass}
HOST_CXX=$([[ -x /usr/bin/g++ ]] && echo /usr/bin/g++ || command -v g++)
OUT=$ROOT/.dev/ab/$NAME
rm -rf "$OUT" && mkdir -p "$OUT"
i=0
for rev in "$@"; do
  sha=$(git rev-parse --verify "$rev^{commit}")
  short=${sha:0:8}
  # One worktree and build directory for every revision: checking a revision out touches only the files
  # that differ, so the library rebuilds only what depends on them (a full library is ~10 min on 2 cores).
  tree=$ROOT/build/ab_rev/shared/src
  lib=$ROOT/build/ab_rev/shared/lib
  if [[ ! -d "$tree" ]]; then
    mkdir -p "$(dirname "$tree")"
    git worktree add --detach -f "$tree" "$sha" > /dev/null
  fi
  git -C "$tree" checkout -q --detach "$sha"
  if [[ ! -f "$lib/build.ninja" ]]; then
    cmake -S "$tree" -B "$lib" -G Ninja -DQMOE_BUILD_TESTS=OFF -DQMOE_BUILD_PYTHON=OFF -DQMOE_WITH_CUDA_KERNELS=ON \
      -DCUTLASS_DIR="$CUTLASS_DIR" -DCMAKE_BUILD_TYPE=Release > /dev/null
  fi
  echo "[$rev = $short] library"
  cmake --build "$lib" --target qmoe -j"$(nproc)" > "$OUT/build_$short.log" 2>&1 || { tail -20 "$OUT/build_$short.log"; exit 1; }
  nvcc="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I$tree/include -I$tree/src -I$CUTLASS_DIR/include -ccbin $HOST_CXX"
  $nvcc -o "$OUT/chk_${i}_$short" "$tree/tests/gpu/w4a8_gemm_check.cu" "$lib/libqmoe.a" -lpthread -ldl &
  $nvcc -o "$OUT/bf16_${i}_$short" "$tree/tests/gpu/bf16_w4_gemm_check.cu" "$lib/libqmoe.a" -lpthread -ldl &
  wait
  echo "chk_${i}_$short bf16_${i}_$short = $rev ($sha) $(git log -1 --format=%s "$sha" | cut -c1-100)" >> "$OUT/revs.txt"
  i=$((i + 1))
done
cat "$OUT/revs.txt"
