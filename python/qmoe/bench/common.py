"""Helpers shared by the GPU benchmarks (`qmoe bench gemm`, `qmoe bench moe`), DESIGN.md 8.

- ceilings: device copy bandwidth (bytes read + written per second) and the dense fp8 GEMM rate,
  measured once per run (measure_ceilings), and the dense bf16 rate (measure_bf16_tflops);
- floors: one grouped GEMM's floor = max(bytes / copy bandwidth, FLOPs / dense rate) with
  bytes = 4-bit weights + their block scales of the experts hit + the activation operand [M, K]
  in the mode's format + bf16 output [M, N] and FLOPs = 2 M N K (gemm_floor; pure arithmetic, no
  torch). The formats and the rate of each fused-MoE quant mode are in QUANT_MODES; the default
  (w4a8_int4: int4 + bf16 scale per 128, e4m3 activations, fp8 rate) is the W4A8 GEMM's floor;
- timing: one CUDA-graph replay of one call per weight set (time_graph), eager calls between
  CUDA events from an idle GPU (time_eager), and time_calls (graph, else events: the GEMM
  benchmark's method);
- data: uniform top-k routing on the device (and on the host over a subset of a given size:
  routing_with_hit), the int4 and swizzled FP4 scale layouts, random
  weights / activations of every quant mode made on the device (make_mode_weights,
  make_mode_activations), weight-set rotation counts, numpy -> torch conversion of qmoe.testing
  cases (bf16 / e4m3 through same-size integer views);
- the plain PyTorch MoE peer of `qmoe bench moe` (sort by expert, gather, torch._grouped_mm bf16
  or torch._scaled_grouped_mm fp8 rowwise, SiLU * up, weighted top-k sum), its weights and a
  per-group loop with the grouped GEMMs' meaning that the peer check compares against;
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
# Fused-MoE quant mode -> (weight format, activation format of both GEMM operands, dense rate the
# FLOPs are held against). Hopper has no FP4 MMA: an NVFP4 x NVFP4 product can at best run at the
# fp8 rate (e2m1 is exact in e4m3), so w4a4 is held against fp8 too; the bf16-activation modes
# against the dense bf16 rate. Run order of `qmoe bench moe` (the known-good w4a8_int4 first).
QUANT_MODES = {
    "w4a8_int4": ("int4_g128", "e4m3", "fp8"),
    "w4a16_int4": ("int4_g128", "bf16", "bf16"),
    "w4a16": ("nvfp4", "bf16", "bf16"),
    "w4a8": ("mxfp4", "mxfp8", "fp8"),
    "w4a4": ("nvfp4", "nvfp4", "fp8"),
}
# 4-bit weight format -> K elements per one-byte block scale (int4-g128: a bf16 scale per 128).
FP4_BLOCK = {"nvfp4": 16, "mxfp4": 32}
# Activation format -> (bytes per element, K elements per one-byte scale or None).
ACT_FORMATS = {"e4m3": (1.0, None), "bf16": (2.0, None), "mxfp8": (1.0, 32), "nvfp4": (0.5, 16)}


def int4_weight_bytes(experts_hit: int, n: int, k: int) -> int:
    """int4 codes (N*K/2 bytes) + bf16 scales per full 128 of K of each expert hit."""
    return experts_hit * n * k // 2 + experts_hit * n * (k // 128) * 2


def weight_bytes(fmt: str, experts_hit: int, n: int, k: int) -> int:
    """4-bit codes + block scales of the experts hit: int4-g128 (bf16 per 128 of K), NVFP4 (one
    e4m3 byte per 16), MXFP4 (one ue8m0 byte per 32); the swizzle's padding is not counted."""
    if fmt == "int4_g128":
        return int4_weight_bytes(experts_hit, n, k)
    return experts_hit * n * k // 2 + experts_hit * n * (k // FP4_BLOCK[fmt])


def activation_bytes(fmt: str, m: int, k: int) -> int:
    """One [M, K] activation operand: elements + one-byte block scales (a per-tensor or per-row
    fp32 scale is not counted)."""
    per, block = ACT_FORMATS[fmt]
    return int(m * k * per) + (m * (k // block) if block else 0)


def targets_summary(checks, title):
    """Markdown lines under a results table: per target, how many points meet it and where the others miss
    (by how much). checks: (point label, [(target, met, detail)]) per measured point."""
    order, met, missed = [], {}, {}
    for point, point_checks in checks:
        for name, ok, detail in point_checks:
            if name not in met:
                order.append(name)
                met[name], missed[name] = 0, []
            if ok:
                met[name] += 1
            else:
                missed[name].append(f"{point} ({detail})")
    if not order:
        return []
    out = ["", title]
    for name in order:
        line = f"- {name}: {met[name]} / {met[name] + len(missed[name])}"
        out.append(line + (("; missed at " + ", ".join(missed[name])) if missed[name] else ""))
    return out


def gemm_floor(experts_hit: int, m: int, n: int, k: int, copy_tbps: float, tflops: float,
               mode: str = "w4a8_int4") -> dict:
    """One grouped GEMM of M valid rows in `mode`'s formats, `tflops` the dense rate QUANT_MODES
    names for it: bytes, FLOPs and floor_us (see the module doc)."""
    wfmt, afmt, _ = QUANT_MODES[mode]
    nbytes = weight_bytes(wfmt, experts_hit, n, k) + activation_bytes(afmt, m, k) + m * n * 2
    flops = 2.0 * m * n * k
    floor_us = max(nbytes / (copy_tbps * 1e12), flops / (tflops * 1e12)) * 1e6
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


def measure_bf16_tflops(torch):
    """Dense bf16 GEMM rate: torch.mm 8192^3 (row-major x column-major, as the fp8 ceiling)."""
    size = 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16).t()
    us, _ = time_calls(torch, [lambda: torch.mm(a, b)], iters=20, warmup=3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * size ** 3 / (us * 1e-6) / 1e12


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def routing(torch, tokens, topk, experts, gen, device="cuda"):
    """top-k distinct experts per token, uniform: the top-k of uniform random keys."""
    keys = torch.rand((tokens, experts), device=device, generator=gen)
    return torch.topk(keys, topk, dim=1).indices.to(torch.int32).contiguous()


def routing_with_hit(tokens, topk, experts, hit, seed):
    """top-k distinct experts per token, uniform over a random subset of exactly `hit` experts, each of
    which takes at least one slot: int32 numpy [tokens, topk], or None when no such routing exists
    (topk > hit or tokens * topk < hit). For comparing with a peer whose own routing sample hit a
    different number of experts (a different number of weight bytes at decode)."""
    import numpy as np

    if hit > experts or topk > hit or tokens * topk < hit or hit <= 0:
        return None
    rng = np.random.default_rng(seed)
    subset = rng.permutation(experts)[:hit]
    for _ in range(100):
        ids = np.argsort(rng.random((tokens, hit)), axis=1)[:, :topk]
        if len(np.unique(ids)) == hit:
            return subset[ids].astype(np.int32)
    # Rare fallback (slots barely cover the subset): slot j takes subset member j mod hit; distinct per
    # token since topk <= hit.
    ids = (np.arange(tokens * topk).reshape(tokens, topk)) % hit
    return subset[ids].astype(np.int32)


def scale_shape(experts, n, k):
    """SGLang's stored layout of int4-g128 scales (DESIGN.md 3): [E, K/512, 4N] or [E, K/128, N]."""
    return (experts, k // 512, 4 * n) if k % 512 == 0 else (experts, k // 128, n)


def swizzled_scale_shape(experts, n, k, block):
    """FP4 weight scales in the 128x4 swizzle (DESIGN.md 3.3): [E, round_up(N, 128), round_up(K/block, 4)]."""
    return (experts, -(-n // 128) * 128, -(-(k // block) // 4) * 4)


# Random block-scale codes of the benchmark data, inclusive ranges that hold no NaN code: e4m3
# bytes of 2^-3 .. 2^3 (exponent field 4..10, sign 0), ue8m0 bytes of 2^-8 .. 2^0.
SCALE_CODES = {"e4m3": (0x20, 0x50), "ue8m0": (119, 127)}


def e4m3_value(code: int) -> float:
    """The value of an e4m3fn byte (finite codes only)."""
    exp, man = (code >> 3) & 15, code & 7
    v = man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return -v if code & 0x80 else v


def _rms(values) -> float:
    values = list(values)
    return math.sqrt(sum(v * v for v in values) / len(values))


# rms of a uniformly random e2m1 nibble (all 16 codes) and of the random scale codes above.
E2M1_RMS = _rms([0, .5, 1, 1.5, 2, 3, 4, 6] * 2)
SCALE_RMS = {"e4m3": _rms(e4m3_value(c) for c in range(SCALE_CODES["e4m3"][0], SCALE_CODES["e4m3"][1] + 1)),
             "ue8m0": _rms(2.0 ** (c - 127) for c in range(SCALE_CODES["ue8m0"][0], SCALE_CODES["ue8m0"][1] + 1))}
W4A4_FC2_INPUT_SCALE = 448 * 6 / 8.0  # NVFP4 encode scale of the intermediate for |act| up to about 8
W4A8_INT4_A2 = 8.0 / 448              # static a2 of w4a8_int4 for an |act| bound of 8 (qmoe.testing's)


def mode_weight_shapes(mode, experts, hidden, inter) -> dict:
    """Shapes and storage dtypes of a quant mode's weights (gated: W13 has 2I rows). int4 modes as
    qmoe.testing makes them (int8 codes, bf16 scales in SGLang's layout); FP4 modes as uint8 codes
    and uint8 scale bytes in the 128x4 swizzle (qmoe takes uint8 storage for both)."""
    wfmt = QUANT_MODES[mode][0]
    out = {}
    for name, n, k in (("w1", 2 * inter, hidden), ("w2", hidden, inter)):
        if wfmt == "int4_g128":
            out[name] = ((experts, n, k // 2), "int8")
            out[name + "_scale"] = (scale_shape(experts, n, k), "bfloat16")
        else:
            out[name] = ((experts, n, k // 2), "uint8")
            out[name + "_scale"] = (swizzled_scale_shape(experts, n, k, FP4_BLOCK[wfmt]), "uint8")
    return out


def mode_alphas(mode, hidden, inter):
    """Base per-expert (w1_alpha, w2_alpha) of the random FP4-mode data, chosen so that GEMM1's
    output and the layer's output are O(1) (1 / (rms of the dequantized operands * sqrt(K)));
    None for the int4 modes (their bf16 scales already carry 1/(4.6 sqrt(K)))."""
    wfmt, afmt, _ = QUANT_MODES[mode]
    if wfmt == "int4_g128":
        return None
    w_rms = E2M1_RMS * SCALE_RMS["e4m3" if wfmt == "nvfp4" else "ue8m0"]
    x_rms = {"bf16": 1.0, "nvfp4": E2M1_RMS * SCALE_RMS["e4m3"], "mxfp8": SCALE_RMS["ue8m0"]}[afmt]
    fc2 = W4A4_FC2_INPUT_SCALE if mode == "w4a4" else 1.0  # w4a4's GEMM2 sees the encoded intermediate
    return 1.0 / (w_rms * x_rms * math.sqrt(hidden)), 1.0 / (fc2 * w_rms * math.sqrt(inter))


def mode_gate_up_layout(mode, inter) -> str:
    """SGLang's [gate; up] for the int4 modes; FlashInfer's 64-row interleave for the FP4 modes
    (as qmoe.testing and FlashInfer callers pass them) when I allows it."""
    return "up_gate_interleaved64" if QUANT_MODES[mode][0] != "int4_g128" and inter % 64 == 0 else "gate_up"


def _codes(torch, fmt, shape, gen, device):
    lo, hi = SCALE_CODES[fmt]
    return torch.randint(lo, hi + 1, shape, dtype=torch.uint8, device=device, generator=gen)


def make_mode_weights(torch, mode, experts, hidden, inter, gen, device) -> dict:
    """Random weights of one quant mode made on `device` (no host data, no big temporaries):
    int4: random int8 codes and bf16 group scales around 1/(4.6 sqrt(K)) (qmoe.testing's recipe);
    FP4: random uint8 codes and scale bytes from SCALE_CODES, plus f32 [E] alphas (mode_alphas
    times U(0.75, 1.25))."""
    wfmt = QUANT_MODES[mode][0]
    out = {}
    for name, (shape, dtype) in mode_weight_shapes(mode, experts, hidden, inter).items():
        k = hidden if name.startswith("w1") else inter
        if dtype == "int8":
            out[name] = torch.randint(-128, 128, shape, dtype=torch.int8, device=device, generator=gen)
        elif dtype == "bfloat16":
            s = torch.rand(shape, device=device, generator=gen).add_(0.5).mul_(1.0 / (4.6 * math.sqrt(k)))
            out[name] = s.to(torch.bfloat16)
        elif name.endswith("_scale"):
            out[name] = _codes(torch, "e4m3" if wfmt == "nvfp4" else "ue8m0", shape, gen, device)
        else:
            out[name] = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
    alphas = mode_alphas(mode, hidden, inter)
    if alphas is not None:
        for name, base in zip(("w1_alpha", "w2_alpha"), alphas):
            out[name] = torch.rand((experts,), device=device, generator=gen).mul_(0.5).add_(0.75).mul_(base)
    return out


def make_mode_activations(torch, mode, tokens, hidden, gen, device, dynamic=False) -> dict:
    """x (and x_scale, fc2_input_scale) of one quant mode on `device`: bf16 N(0, 1) for w4a16*;
    w4a8_int4: bf16 x with static a1 = amax(x)/448 and a2 = 8/448 (none when dynamic); w4a8: e4m3
    N(0, 1) [T, H] + ue8m0 bytes [T, H/32]; w4a4: random fp4x2 bytes [T, H/2] + e4m3 bytes
    [T, H/16] and fc2_input_scale = 448*6/8."""
    afmt = QUANT_MODES[mode][1]
    if afmt == "nvfp4":
        x = torch.randint(0, 256, (tokens, hidden // 2), dtype=torch.uint8, device=device, generator=gen)
        return dict(x=x, x_scale=_codes(torch, "e4m3", (tokens, hidden // 16), gen, device),
                    fc2_input_scale=torch.full((1,), W4A4_FC2_INPUT_SCALE, device=device))
    x = torch.randn((tokens, hidden), device=device, generator=gen, dtype=torch.bfloat16)
    if afmt == "mxfp8":
        return dict(x=x.to(torch.float8_e4m3fn), x_scale=_codes(torch, "ue8m0", (tokens, hidden // 32), gen, device))
    if mode == "w4a8_int4" and not dynamic:
        return dict(x=x, x_scale=(x.abs().amax().float() / 448).reshape(1),
                    fc2_input_scale=torch.full((1,), W4A8_INT4_A2, device=device))
    return dict(x=x)


def weight_set_count(touched_bytes, set_bytes, rotate_mb, max_weight_gb) -> int:
    """Sets needed so that > rotate_mb are touched between two uses of one set, within the cap."""
    want = max(1, math.ceil(rotate_mb * 2 ** 20 / max(touched_bytes, 1)) + 1) if touched_bytes else 1
    cap = max(1, int(max_weight_gb * 2 ** 30 // max(set_bytes, 1)))
    return min(want, cap)


def weight_sets(touched_bytes, set_bytes, args, make):
    """make() called weight_set_count(...) times (args.rotate_mb, args.max_weight_gb)."""
    return [make() for _ in range(weight_set_count(touched_bytes, set_bytes, args.rotate_mb, args.max_weight_gb))]


def numpy_to_torch(torch, a, device):
    """A numpy array as a torch tensor on `device` (qmoe.testing.to_torch); anything else as it is."""
    from .. import testing

    return testing.to_torch(a, device)


def torch_to_numpy(torch, t):
    """The inverse of numpy_to_torch (bf16 / e4m3 back through ml_dtypes)."""
    import ml_dtypes

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


# ------------------------------------------------------------------------------------------------
# the plain PyTorch MoE peer (any device; the grouped GEMMs can be swapped for tests)
# ------------------------------------------------------------------------------------------------
def sort_by_expert(torch, ids, experts):
    """(token of each expert-sorted row, order = flat slot of each row, group ends int32 [E])."""
    k = ids.shape[1]
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(experts, device=ids.device, dtype=sorted_ids.dtype), right=True)
    return order // k, order, ends.to(torch.int32)


def _combine(torch, y, order, wts):
    """out[t] = sum_j wts[t, j] * y[row of slot (t, j)] (rows back to slot order, then a top-k sum)."""
    tokens, k = wts.shape
    by_slot = torch.empty_like(y).index_copy_(0, order, y)
    return (by_slot.view(tokens, k, -1) * wts.to(y.dtype).unsqueeze(-1)).sum(dim=1)


def _quantize_rows(torch, v):
    """Dynamic per-row e4m3: (q [R, K], scale fp32 [R]) with v ~ q * scale."""
    scale = v.abs().amax(dim=1).float().clamp(min=1e-12) / 448.0
    return (v.float() / scale.unsqueeze(1)).to(torch.float8_e4m3fn), scale


def torch_moe_bf16(torch, x, ids, wts, w13, w2, grouped_mm=None):
    """Plain MoE in bf16: w13 [E, 2I, H] (gate rows first), w2 [E, H, I]."""
    mm = grouped_mm or torch._grouped_mm
    inter = w2.shape[2]
    tok, order, ends = sort_by_expert(torch, ids, w13.shape[0])
    h = mm(x.index_select(0, tok), w13.transpose(-2, -1), offs=ends)
    a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    return _combine(torch, mm(a, w2.transpose(-2, -1), offs=ends), order, wts)


def torch_moe_fp8(torch, x, ids, wts, w13, s13, w2, s2, scaled_grouped_mm=None):
    """Plain MoE in fp8: e4m3 w13 [E, 2I, H] and w2 [E, H, I] with fp32 per-channel scales s13
    [E, 2I], s2 [E, H]; activations quantized per row (x before the gather, the SiLU*up output
    before GEMM2)."""
    mm = scaled_grouped_mm or torch._scaled_grouped_mm
    inter = w2.shape[2]
    tok, order, ends = sort_by_expert(torch, ids, w13.shape[0])
    xq, xs = _quantize_rows(torch, x)
    aq = xq.view(torch.uint8).index_select(0, tok).view(torch.float8_e4m3fn)  # gather as bytes
    h = mm(aq, w13.transpose(-2, -1), xs.index_select(0, tok), s13, offs=ends, out_dtype=torch.bfloat16,
           use_fast_accum=True)
    a8, sa = _quantize_rows(torch, torch.nn.functional.silu(h[:, :inter]) * h[:, inter:])
    y = mm(a8, w2.transpose(-2, -1), sa, s2, offs=ends, out_dtype=torch.bfloat16, use_fast_accum=True)
    return _combine(torch, y, order, wts)


def loop_grouped_mm(torch):
    """A per-group matmul loop with torch._grouped_mm's and _scaled_grouped_mm's meaning
    (a [M, K] rows grouped by ends, b [E, K, N]); the reference the peer check compares with."""
    def grouped(a, b, offs):
        out = torch.empty((a.shape[0], b.shape[2]), dtype=torch.bfloat16, device=a.device)
        start = 0
        for e, end in enumerate(offs.tolist()):
            out[start:end] = (a[start:end].float() @ b[e].float()).to(torch.bfloat16)
            start = end
        return out

    def scaled(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum=True):
        out = torch.empty((a.shape[0], b.shape[2]), dtype=out_dtype, device=a.device)
        start = 0
        for e, end in enumerate(offs.tolist()):
            acc = a[start:end].float() @ b[e].float()
            out[start:end] = (acc * scale_a[start:end].unsqueeze(1) * scale_b[e].unsqueeze(0)).to(out_dtype)
            start = end
        return out

    return grouped, scaled


def make_bf16_weights(torch, experts, hidden, inter, gen, device):
    w13 = torch.randn((experts, 2 * inter, hidden), device=device, generator=gen, dtype=torch.bfloat16)
    w2 = torch.randn((experts, hidden, inter), device=device, generator=gen, dtype=torch.bfloat16)
    return w13.mul_(1.0 / math.sqrt(hidden)), w2.mul_(1.0 / math.sqrt(inter))


def make_fp8_weights(torch, experts, hidden, inter, gen, device):
    """e4m3 weights (cast one expert at a time: no full-size bf16 temporary) and scales ~ 1/sqrt(K)."""
    out = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        w = torch.empty((experts, n, k), device=device, dtype=torch.float8_e4m3fn)
        for e in range(experts):
            w[e] = torch.randn((n, k), device=device, generator=gen, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        out += [w, torch.rand((experts, n), device=device, generator=gen).add_(0.75).mul_(1.0 / math.sqrt(k))]
    return tuple(out)
