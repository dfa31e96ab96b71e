#!/usr/bin/env bash
# Decode layer A/B of a GEMM patch against the tree as it is: both builds (bench/ab/build_pair.sh; the patch
# stays applied), then `qmoe bench moe` (det finalize, graph replay) with the builds alternated (base, NAME,
# base, NAME) per quant mode, and the side-by-side table of scripts/compare_moe_runs.py. Device, carry
# .dev/cutlass. Usage: bash bench/ab/decode_layer_ab.sh PATCH NAME [MODES] [TOKENS]; MODES: comma list of
# w4a8_int4, w4a4p (w4a4 with packed weights), w4a16p, w4a8p, w4a4, w4a16, w4a8 (default w4a4p,w4a8_int4),
# TOKENS default 8,64; MODELS (environment): --models of the benchmark (default: its own). Output: $OUT/decode_ab.md, $OUT/decode_ab_runs.tgz (every run's files).
set -uo pipefail
cd "$(dirname "$0")/../.."
patch_file=$1 name=$2 modes=${3:-w4a4p,w4a8_int4} tokens=${4:-8,64}
touch src/cuda/gemm/*.cuh src/cuda/gemm/*.h
bash bench/ab/build_pair.sh "$patch_file" "$name" || exit 1
runs=/tmp/decode_ab_runs
rm -rf $runs && mkdir -p $runs
for mode in ${modes//,/ }; do
  args=(--quant-mode "${mode%p}")
  [[ $mode == *p ]] && args+=(--fp4-packed)  # w4a4p, w4a16p, w4a8p
  [[ -n ${MODELS:-} ]] && args+=(--models "$MODELS")
  for round in 1 2; do
    for arm in base "$name"; do
      PYTHONPATH=/tmp/pkg_$arm python3 -m qmoe.cli bench moe "${args[@]}" --tokens "$tokens" --finalize det \
        --no-torch-peers --peers '' --budget-ms 40 --out-dir "$runs/${mode}_${round}_$arm" > "$runs/${mode}_${round}_$arm.log" 2>&1 ||
        tail -5 "$runs/${mode}_${round}_$arm.log"
    done
  done
  { echo "## $mode: base 1, $name 1, base 2, $name 2"
    python3 scripts/compare_moe_runs.py "$runs/${mode}_1_base" "$runs/${mode}_1_$name" "$runs/${mode}_2_base" "$runs/${mode}_2_$name"
    echo; } >> "$OUT/decode_ab.md"
done
tar -C /tmp -czf "$OUT/decode_ab_runs.tgz" decode_ab_runs
cat "$OUT/decode_ab.md"
