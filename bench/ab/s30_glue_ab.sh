#!/usr/bin/env bash
# Ran in session 30 (bench/results/2026-12-03_s30c_*); gather_vec16.patch has since landed (211f46d), so this
# script no longer applies to the tree as it is. Session 30, on the device (carry .dev/cutlass): two A/Bs of prefill glue kernels and the GPU suite, one call.
#   base    = the tree (the bf16 requant of the FP4 modes on the flat (row, chunk) kernel where the row kernel
#             idles lanes, as the fp8 one since s30b)
#   g16     = base + bench/ab/gather_vec16.patch (prefill gather: 16 columns per thread, 16-byte stores)
#   rowbf16 = base - bench/ab/act_bf16_flat.patch (the bf16 requant on the row kernel only, as before)
# Prints the gather kernel (w4a8_int4) and the bf16 requant kernel (w4a4) us per layer call at T = 4096, alternated
# twice, then runs scripts/gpu_tests.sh on base. Logs under $OUT/s30.
set -e
d=${OUT:-/tmp}/s30; mkdir -p $d
bash bench/ab/build_pair.sh bench/ab/gather_vec16.patch g16
patch -R -p1 < bench/ab/gather_vec16.patch > /dev/null
patch -R -p1 < bench/ab/act_bf16_flat.patch > /dev/null
bash scripts/device_build.sh > /tmp/build_rowbf16.log 2>&1 || { tail -30 /tmp/build_rowbf16.log; exit 1; }
rm -rf /tmp/pkg_rowbf16 && cp -r build/device/pkg /tmp/pkg_rowbf16
patch -p1 < bench/ab/act_bf16_flat.patch > /dev/null
bash scripts/device_build.sh > /tmp/build_base2.log 2>&1 || { tail -30 /tmp/build_base2.log; exit 1; }
prof() {  # $1 package, $2 kernel pattern, $3... specs: prints "model T=.. us" per spec
  local pkg=$1 pat=$2 log=$d/prof_$1_$RANDOM.log; shift 2
  PYTHONPATH=/tmp/pkg_$pkg python3 bench/profile_layer.py "$@" > $log 2>&1 || tail -3 $log
  grep -E "^## |$pat" $log | awk '/^## /{printf "%s %s %s ", $2, $3, $4; next} {printf "%s; ", $2}'; echo
}
for rep in 1 2; do
  for pkg in base g16; do
    echo "=== gather $pkg rep $rep"
    prof $pkg gather_quantize qwen3_30b_a3b:4096 qwen3_235b_a22b:4096 deepseek_v3:4096 mixtral_8x7b:4096
  done
  for pkg in base rowbf16; do
    echo "=== bf16 requant $pkg rep $rep"
    prof $pkg activation_requant_bf16 qwen3_30b_a3b:4096:w4a4 qwen3_235b_a22b:4096:w4a4 qwen3_30b_a3b:4096:w4a16
  done
done
QMOE_SKIP_BUILD=1 QMOE_SKIP_CPP=1 timeout 250 bash scripts/gpu_tests.sh > $d/gpu_tests.log 2>&1 || true
tail -12 $d/gpu_tests.log
