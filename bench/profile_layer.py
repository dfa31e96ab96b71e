"""Per-kernel time of one fused MoE layer (qmoe.fused_moe, any quant mode) with torch.profiler.

Shows where a layer's time goes beyond the two GEMMs (the glue kernels), then the same layer as a graph replay:
its own kernel records (per-kernel time inside the replay, idle time between kernels). Usage on the GPU machine:
    PYTHONPATH=build/device/pkg python3 bench/profile_layer.py [model:T[:quant_mode[:packed]] ...]
Default: deepseek_v3:1 deepseek_v3:64 qwen3_30b_a3b:1 qwen3_30b_a3b:64 (w4a8_int4), then qwen3_30b_a3b:1,
deepseek_v3:64 and qwen3_30b_a3b:4096 in w4a4. Weights of one set only
(L2-warm for small models: this is a breakdown, not the benchmark; bench/ has the real numbers).
"""
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import qmoe
from qmoe import quant
from qmoe.bench import common
from qmoe.bench.moe import _routing_weights, make_qmoe_weights
from qmoe.testing import MODEL_SHAPES


def run(model: str, tokens: int, mode: str = "w4a8_int4", packed: str = "", iters: int = 20) -> None:
    experts, topk, hidden, inter = MODEL_SHAPES[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = make_qmoe_weights(torch, experts, hidden, inter, gen, "cuda", mode)
    if packed not in ("", "packed"):
        raise SystemExit(f"profile_layer: the fourth part of a spec is 'packed' or nothing, got {packed!r}")
    extra = {}
    if packed:  # FP4 weights in qmoe's packed word order (as `qmoe bench moe --fp4-packed`)
        w = dict(w, w1=quant.pack_fp4_weights(w["w1"]), w2=quant.pack_fp4_weights(w["w2"]))
        extra = {"fp4_weights_packed": True}
    ids = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:topk] for _ in range(tokens)]).int()
    wts = _routing_weights(torch, tokens, topk, gen, "cuda")
    act = common.make_mode_activations(torch, mode, tokens, hidden, gen, "cuda")
    kw = dict(w, **act, topk_ids=ids, topk_weights=wts, quant_mode=mode, num_experts=experts,
              gate_up_layout=common.mode_gate_up_layout(mode, inter), **extra)
    out = torch.empty((tokens, hidden), device="cuda", dtype=torch.bfloat16)
    # Profiled without PDL: with it a kernel starts early and its time includes the wait for the one before.
    for _ in range(3):
        qmoe.fused_moe(**kw, deterministic=True, out=out, enable_pdl=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            qmoe.fused_moe(**kw, deterministic=True, out=out, enable_pdl=False)
        torch.cuda.synchronize()
    label = f"{mode} packed" if packed else mode
    print(f"\n## {model} T={tokens} {label} (E={experts}, k={topk}, H={hidden}, I={inter}); us per layer call")
    total = 0.0
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t <= 0:
            continue
        rows.append((t / iters, e.count // iters, e.key[:90]))
        total += t / iters
    for t, n, k in sorted(rows, reverse=True):
        print(f"| {t:8.1f} | {n:2d} | {k} |")
    print(f"| {total:8.1f} |    | total kernel time |")
    # Eager wall time per call (no profiler), to set beside the kernel sum above and the replays below.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        qmoe.fused_moe(**kw, deterministic=True, out=out, enable_pdl=False)
    end.record()
    end.synchronize()
    print(f"eager, enable_pdl=False: {start.elapsed_time(end) * 1000 / iters:.1f} us per layer call (wall)")
    # The layer as a CUDA-graph replay (10 calls per graph), without and with PDL between its kernels.
    for pdl in (False, True):
        graph = torch.cuda.CUDAGraph()
        qmoe.fused_moe(**kw, deterministic=True, out=out, enable_pdl=pdl)
        with torch.cuda.graph(graph):
            for _ in range(10):
                qmoe.fused_moe(**kw, deterministic=True, out=out, enable_pdl=pdl)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / 10)
        times.sort()
        print(f"graph replay, enable_pdl={pdl}: {times[len(times) // 2]:.1f} us per layer (L2-warm weights)")
        if not pdl:
            graph_timeline(graph)


def graph_timeline(graph, calls: int = 10) -> None:
    """Where a graph replay's time goes: per-kernel time inside the replay and the idle time between kernels.

    The eager breakdown above times each kernel launched on its own; a replay can differ (L2 contents, kernels
    that wait on each other, gaps between kernels), which this shows from the replay's own kernel records."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    kernels = sorted((e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    if not kernels:
        print("graph replay timeline: no kernel records (CUPTI did not trace the graph)")
        return
    by_name, idle, end = {}, 0.0, kernels[0]["ts"]
    gaps = []
    for e in kernels:
        by_name.setdefault(e["name"][:90], []).append(e["dur"])
        if e["ts"] > end:
            idle += e["ts"] - end
            gaps.append((e["ts"] - end, e["name"][:60]))
        end = max(end, e["ts"] + e["dur"])
    span = end - kernels[0]["ts"]
    busy = sum(sum(v) for v in by_name.values())
    print(f"graph replay timeline ({len(kernels)} kernels, {calls} layer calls): span {span / calls:.1f} us, "
          f"kernel time {busy / calls:.1f} us, idle between kernels {idle / calls:.1f} us per layer")
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"|  {sum(durs) / calls:8.1f} | {len(durs) // calls:2d} | {name} |")
    for gap, name in sorted(gaps, reverse=True)[:5]:
        print(f"   largest gaps: {gap:.1f} us before {name}")


if __name__ == "__main__":
    specs = sys.argv[1:] or ["deepseek_v3:1", "deepseek_v3:64", "qwen3_30b_a3b:1", "qwen3_30b_a3b:64",
                             "qwen3_30b_a3b:1:w4a4", "deepseek_v3:64:w4a4", "qwen3_30b_a3b:4096:w4a4"]
    for spec in specs:
        m, t, *mode = spec.split(":")
        run(m, int(t), *mode)
