#!/usr/bin/env bash
# Session 32: bench/ab/routing_whole_tiles.patch (moe_mm_data's warp parts are whole tiles of 256 slots, so at
# most 8 warps own slots and the per-expert loops over their histograms run 8 deep, not 32) against the tree as it
# is. Routing kernel time (graph replay of 10 calls, median of 7) at decode and prefill slot counts, both builds,
# then the routing GPU tests on the patched build (it stays applied). Device, carry .dev/cutlass. Output:
# $OUT/routing_ab.md
set -uo pipefail
cd "$(dirname "$0")/../.."
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
bash bench/ab/build_pair.sh bench/ab/routing_whole_tiles.patch tiles || exit 1
{ echo "| E | slots | us |"; echo "|--:|--:|--:|"
  for run in base tiles base tiles; do echo "| $run |"; time_routing /tmp/pkg_$run; done; } | tee "$OUT/routing_ab.md"
PYTHONPATH=/tmp/pkg_tiles python3 -m pytest -q -m gpu tests/python/test_gpu_w4a8.py -k "mm_data or routing" 2>&1 | tail -3
