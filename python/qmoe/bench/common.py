"""Helpers shared by the GPU benchmarks (`qmoe bench gemm`, `qmoe bench moe`), DESIGN.md 8.

- ceilings: device copy bandwidth (bytes read + written per second) and the dense fp8 GEMM rate,
  measured once per run (measure_ceilings);
- floors: one W4A8 int4-g128 GEMM's floor = max(bytes / copy bandwidth, FLOPs / fp8 rate) with
  bytes = int4 weights + bf16 group scales of the experts hit + e4m3 activations [M, K] + bf16
  output [M, N] and FLOPs = 2 M N K (gemm_floor; pure arithmetic, no torch);
- timing: one CUDA-graph replay of one call per weight set (time_graph), eager calls between
  CUDA events from an idle GPU (time_eager), and time_calls (graph, else events: the GEMM
  benchmark's method);
- data: uniform top-k routing on the device, the int4 scale layout, weight-set rotation counts,
  numpy -> torch conversion of qmoe.testing cases (bf16 / e4m3 through same-size integer views);
- report: model-name normalisation, number formatting, peer-file locations.
Everything that needs torch takes the module as an argument, so importing this file needs
neither torch nor CUDA.
"""
from __future__ import annotations

import math
import os
import re
import statistics

# Stop sampling once this much time went into one measurement (>= 5 samples taken).
SAMPLE_BUDGET_S = 3.0


def norm(name: str) -> str:
    """'DeepSeek-V3' -> 'deepseek_v3': how model names from different files are matched."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def fmt(v, digits=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def peer_path(file_name: str, env_var: str) -> str:
    """$env_var, else the first existing of the shared folder beside the checkout, shared/peers/
    and bench/peers/ (the copy inside the repository, which travels to the device machine)."""
    if env_var in os.environ:
        return os.environ[env_var]
    candidates = ("/work/shared/peers/" + file_name, "shared/peers/" + file_name, "bench/peers/" + file_name)
    return next((p for p in candidates if os.path.exists(p)), candidates[0])


# ------------------------------------------------------------------------------------------------
# floors (DESIGN.md 8)
# ------------------------------------------------------------------------------------------------
def int4_weight_bytes(experts_hit: int, n: int, k: int) -> int:
    """int4 codes (N*K/2 bytes) + bf16 scales per full 128 of K of each expert hit."""
    return experts_hit * n * k // 2 + experts_hit * n * (k // 128) * 2


def gemm_floor(experts_hit: int, m: int, n: int, k: int, copy_tbps: float, fp8_tflops: float) -> dict:
    """One W4A8 grouped GEMM of M valid rows: bytes, FLOPs and floor_us (see the module doc)."""
    nbytes = int4_weight_bytes(experts_hit, n, k) + m * k + m * n * 2
    flops = 2.0 * m * n * k
    floor_us = max(nbytes / (copy_tbps * 1e12), flops / (fp8_tflops * 1e12)) * 1e6
    return dict(bytes=nbytes, flops=flops, floor_us=floor_us)


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
def _capture(torch, calls):
    """One CUDA graph holding one call per set (warmed up on a side stream first); raises when the
    calls cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _samples(torch, run, per, iters, budget_s, wall):
    """Median over up to `iters` samples of run() between CUDA events, in us / per. Stops after
    >= 5 samples once budget_s is spent: replay time when wall, else the per-call times summed."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(max(1, iters)):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / per)
        if len(samples) >= 5 and sum(samples) * (per if wall else 1) * 1e-6 > budget_s:  # enough
            break
    return statistics.median(samples)


def _warm(torch, calls, warmup):
    for _ in range(warmup):
        for call in calls:
            call()
    torch.cuda.synchronize()


def time_calls(torch, calls, iters, warmup, budget_s=SAMPLE_BUDGET_S):
    """Median time in us of one call, calls = one zero-argument callable per weight set.
    Returns (us, how) with how 'graph' or 'events' (eager fallback when capture fails)."""
    _warm(torch, calls, warmup)
    try:
        graph = _capture(torch, calls)
    except Exception:  # not capturable: time eager calls between events
        graph = None
        torch.cuda.synchronize()

    def run():
        if graph is not None:
            graph.replay()
        else:
            for call in calls:
                call()

    us = _samples(torch, run, len(calls), iters, budget_s, wall=False)
    how = "graph" if graph is not None else "events"
    del graph
    return us, how


def time_graph(torch, calls, iters, warmup, budget_s=SAMPLE_BUDGET_S):
    """Median us of one call as a CUDA-graph replay of one call per set (divided by the number
    of sets). Raises when capture fails (the caller reports it)."""
    _warm(torch, calls, warmup)
    graph = _capture(torch, calls)
    try:
        return _samples(torch, graph.replay, len(calls), iters, budget_s, wall=True)
    finally:
        del graph


def time_eager(torch, calls, iters, warmup, budget_s=SAMPLE_BUDGET_S):
    """Median us of one Python call between CUDA events, started from an idle GPU (host launch
    overhead included); sample i uses set i % len(calls)."""
    _warm(torch, calls, warmup)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for i in range(max(1, iters)):
        call = calls[i % len(calls)]
        torch.cuda.synchronize()
        start.record()
        call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
        if len(samples) >= 5 and sum(samples) * 1e-6 > budget_s:
            break
    return statistics.median(samples)


def measure_ceilings(torch):
    """Device copy bandwidth (bytes read + written per second; the best of a memcpy and an
    elementwise copy kernel, since a captured memcpy node can be slower) and dense fp8 GEMM rate."""
    n = 1 << 28  # 1 GiB of fp32
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    best_us = min(time_calls(torch, [fn], iters=20, warmup=3)[0]
                  for fn in (lambda: dst.copy_(src), lambda: torch.mul(src, 1.0, out=dst)))
    copy_tbps = 2 * src.numel() * 4 / (best_us * 1e-6) / 1e12
    del src, dst
    size = 8192
    a = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn).t()  # column-major operand
    one = torch.ones((), device="cuda")
    us, _ = time_calls(torch, [lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                       use_fast_accum=True)], iters=20, warmup=3)
    fp8_tflops = 2 * size ** 3 / (us * 1e-6) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return copy_tbps, fp8_tflops


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def routing(torch, tokens, topk, experts, gen, device="cuda"):
    """top-k distinct experts per token, uniform: the top-k of uniform random keys."""
    keys = torch.rand((tokens, experts), device=device, generator=gen)
    return torch.topk(keys, topk, dim=1).indices.to(torch.int32).contiguous()


def scale_shape(experts, n, k):
    """SGLang's stored layout of int4-g128 scales (DESIGN.md 3): [E, K/512, 4N] or [E, K/128, N]."""
    return (experts, k // 512, 4 * n) if k % 512 == 0 else (experts, k // 128, n)


def weight_set_count(touched_bytes, set_bytes, rotate_mb, max_weight_gb) -> int:
    """Sets needed so that > rotate_mb are touched between two uses of one set, within the cap."""
    want = max(1, math.ceil(rotate_mb * 2 ** 20 / max(touched_bytes, 1)) + 1) if touched_bytes else 1
    cap = max(1, int(max_weight_gb * 2 ** 30 // max(set_bytes, 1)))
    return min(want, cap)


def weight_sets(touched_bytes, set_bytes, args, make):
    """make() called weight_set_count(...) times (args.rotate_mb, args.max_weight_gb)."""
    return [make() for _ in range(weight_set_count(touched_bytes, set_bytes, args.rotate_mb, args.max_weight_gb))]


def numpy_to_torch(torch, a, device):
    """A numpy array (bf16 / e4m3 from ml_dtypes through same-size integer views) as a torch
    tensor on `device`; anything else is returned as it is (the tests' conversion)."""
    import numpy as np

    if not isinstance(a, np.ndarray):
        return a
    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16)
    if a.dtype.name == "float8_e4m3fn":
        return torch.from_numpy(a.view(np.uint8)).to(device).view(torch.float8_e4m3fn)
    return torch.from_numpy(a).to(device)


def torch_to_numpy(torch, t):
    """The inverse of numpy_to_torch (bf16 / e4m3 back through ml_dtypes)."""
    import ml_dtypes

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()
