#!/usr/bin/env bash
# Routing kernel A/B of a patch to src/cuda/routing/sm90_moe_mm_data.cu against the tree as it is: both builds
# (bench/ab/build_pair.sh; the patch stays applied), the kernel's time (graph replay of 10 calls, median of 7) at
# decode and prefill slot counts with the builds alternated (base, NAME, base, NAME), then the routing GPU tests on
# the patched build. Device, carry .dev/cutlass. Usage: bash bench/ab/routing_ab.sh PATCH NAME. Output:
# $OUT/routing_ab.md. Used for bench/ab/routing_kept_keys.patch (s32a) and routing_whole_tiles.patch (s32c).
set -uo pipefail
cd "$(dirname "$0")/../.."
patch_file=$1 name=$2
time_routing() {  # $1: package dir
  PYTHONPATH=$1 python3 - <<'PY'
import torch
from qmoe.compat import sgl_kernel as sgl
for experts, slots in [(256, 8), (256, 2048), (128, 4096), (128, 32768), (256, 32768), (256, 65536), (1024, 262144)]:
    ids = torch.randint(0, experts, (slots,), dtype=torch.int32, device="cuda")
    outs = [torch.empty(s, dtype=torch.int32, device="cuda")
            for s in [(experts + 1,), (experts, 3), (experts, 3), (slots,), (slots,)]]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sgl.get_cutlass_w4a8_moe_mm_data(ids, *outs, experts, 128, 128)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            sgl.get_cutlass_w4a8_moe_mm_data(ids, *outs, experts, 128, 128)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record(); graph.replay(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end) * 100)
    print(f"| {experts} | {slots} | {sorted(times)[3]:.2f} |")
PY
}
bash bench/ab/build_pair.sh "$patch_file" "$name" || exit 1
{ echo "| E | slots | us |"; echo "|--:|--:|--:|"
  for run in base "$name" base "$name"; do echo "| $run |"; time_routing /tmp/pkg_$run; done; } | tee "$OUT/routing_ab.md"
PYTHONPATH=/tmp/pkg_$name python3 -m pytest -q -m gpu tests/python/test_gpu_w4a8.py -k "mm_data or routing" 2>&1 | tail -3
