"""`qmoe bench moe`: the whole w4a8_int4 MoE layer (qmoe.fused_moe) at model shapes (DESIGN.md 8).

For each model (E, top-k, H, I) and token count T: uniform random routing (top-k distinct experts
per token, softmax weights), bf16 x [T, H], static a1 = amax(x)/448 and a2 = 8/448 (or dynamic
scales with --dynamic-scales). Per row:
  - qmoe.fused_moe with the deterministic and the fused (default) finalize, each timed eagerly
    (CUDA events around the Python call, started from an idle GPU, median) and as a CUDA-graph
    replay (calls captured with preallocated out= and fixed inputs, median of replays);
  - the floor: sum over GEMM1 (N = 2I, K = H) and GEMM2 (N = H, K = I) of
    max(bytes / copy bandwidth, FLOPs / dense fp8 rate), bytes = int4 weights + bf16 scales of the
    experts hit + e4m3 activations [M, K] + bf16 output [M, N], FLOPs = 2 M N K, M = T * top-k
    (common.gemm_floor; ceilings measured once at the start, as `qmoe bench gemm` does);
  - a plain PyTorch MoE on the same routing (sort by expert, gather, GEMM1, SiLU(gate) * up,
    GEMM2, weighted top-k sum) with torch._grouped_mm (bf16 weights) and torch._scaled_grouped_mm
    (e4m3 weights, per-channel weight scales, per-row dynamic activation scales,
    use_fast_accum=True), timed as graph replays;
  - vLLM's Triton fused MoE graph times (bf16, fp8, int4 w4a16) for the same (model, T) from the
    peer file bench/peers/2026-11-30_h200_vllm_triton_moe.json (another run, same GPU model).
What is rotated out of L2: every implementation cycles over several weight sets, each with its
own x (and out); the routing is the same for all sets, so the experts hit and the floor are exact.
Sets are added until the bytes one call touches times (sets - 1) exceed --rotate-mb, within
--max-weight-gb (DeepSeek-V3 at T = 1: 3 int4 sets of 5.6 GB; at large T every call touches
the whole set, which is far beyond L2 by itself). A graph holds one call per set; its replay
time is divided by the number of sets. Eager sample i uses set i mod sets.
int4-g128 needs H and I to be multiples of 128: gpt-oss-120b (H = I = 2880) gets "n/a" for qmoe.
--dry-run needs no GPU: nominal ceilings, shapes shrunk by --shrink, qmoe and the torch peers run
once on the CPU when torch is installed (graph times n/a), floors, table and files as on the GPU.
Output: markdown on stdout; <out-dir>/<date>_<gpu>_moe.{md,json}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

from . import common
from .common import fmt, norm

DEFAULT_MODELS = ("deepseek_v3", "qwen3_30b_a3b", "mixtral_8x7b", "qwen3_235b_a22b", "gpt_oss_120b")
DEFAULT_TOKENS = (1, 8, 64, 512, 4096)
DRY_RUN_TOKENS = (1, 8, 64)
FINALIZES = {"det": True, "fused": False}  # name -> qmoe.fused_moe(deterministic=...)
PEER_FILE = "2026-11-30_h200_vllm_triton_moe.json"
PEER_FORMATS = ("bf16", "fp8", "int4")
# Used only by --dry-run (no GPU to measure): the H200 ceilings of the 2026-11-30 GEMM run.
NOMINAL_CEILINGS = dict(copy_tbps=4.20, fp8_tflops=1550.0)
A2_STATIC = 8.0 / 448  # static a2 for an |act| bound of 8 (qmoe.testing's choice)
QMOE_KEYS = tuple(f"qmoe_{f}_{how}_us" for f in FINALIZES for how in ("eager", "graph"))
TORCH_KEYS = ("torch_bf16_graph_us", "torch_fp8_graph_us")


def _parse_args(argv):
    from .. import testing

    p = argparse.ArgumentParser(prog="qmoe bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma list of " + ", ".join(testing.MODEL_SHAPES) + " (default: %(default)s)")
    p.add_argument("--tokens", default=None, help="comma list of T (default " + ",".join(map(str, DEFAULT_TOKENS))
                   + "; dry run " + ",".join(map(str, DRY_RUN_TOKENS)) + ")")
    p.add_argument("--finalize", default="det,fused", help="det (deterministic) and/or fused (default: both)")
    p.add_argument("--iters", type=int, default=30, help="timed samples at most (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-ms", type=float, default=150.0,
                   help="stop sampling one measurement after this much time (>= 5 samples): fewer for big T")
    p.add_argument("--rotate-mb", type=float, default=256.0,
                   help="bytes touched between two uses of a weight set, at least (L2 is 50-60 MB)")
    p.add_argument("--max-weight-gb", type=float, default=40.0, help="cap on the memory of one implementation's sets")
    p.add_argument("--dynamic-scales", action="store_true", help="qmoe: dynamic a1 and a2 instead of static")
    p.add_argument("--no-torch-peers", action="store_true", help="skip the torch._grouped_mm MoE peers")
    p.add_argument("--peers", default=common.peer_path(PEER_FILE, "QMOE_VLLM_PEERS"),
                   help="vLLM peer measurement JSON ('' to skip; default $QMOE_VLLM_PEERS or the shared/bench copy)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: nominal ceilings, shrunk shapes run once on the CPU (needs torch for the runs)")
    p.add_argument("--shrink", type=int, default=16, help="dry run: divide H and I by this (kept multiples of 128)")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    by_norm = {norm(m): m for m in testing.MODEL_SHAPES}
    unknown = [m for m in args.models if norm(m) not in by_norm]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {list(testing.MODEL_SHAPES)}")
    args.models = [by_norm[norm(m)] for m in args.models]
    if args.tokens is None:
        args.tokens = list(DRY_RUN_TOKENS if args.dry_run else DEFAULT_TOKENS)
    else:
        try:
            args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            p.error(f"--tokens: expected a comma list of integers, got {args.tokens!r}")
    if not args.tokens or any(t < 1 for t in args.tokens):
        p.error("--tokens: positive integers")
    args.finalize = [f.strip() for f in args.finalize.split(",") if f.strip()]
    if not args.finalize or any(f not in FINALIZES for f in args.finalize):
        p.error("--finalize: det and/or fused")
    if args.iters < 1 or args.warmup < 0 or args.shrink < 1:
        p.error("--iters >= 1, --warmup >= 0, --shrink >= 1")
    return args


# ------------------------------------------------------------------------------------------------
# shapes, floors, peers (no torch)
# ------------------------------------------------------------------------------------------------
def _shrink_dim(d: int, s: int) -> int:
    """d / s rounded up to a multiple of 128; a dim that is not a multiple of 128 stays one
    (an odd multiple of 64), so the dry run keeps gpt-oss's n/a path."""
    if s == 1:
        return d
    base = max(128, -(-d // s // 128) * 128 if d // s >= 128 else 128)
    return base if d % 128 == 0 else base + 64


def model_dims(model: str, args) -> tuple:
    """(E, top-k, H, I) of the model; H and I shrunk in the dry run."""
    from .. import testing

    experts, topk, hidden, inter = testing.MODEL_SHAPES[model]
    if args.dry_run:
        hidden, inter = _shrink_dim(hidden, args.shrink), _shrink_dim(inter, args.shrink)
    return experts, topk, hidden, inter


def qmoe_unsupported(hidden: int, inter: int):
    """Why qmoe's int4-g128 format cannot run these dims (None when it can)."""
    return "K % 128 != 0" if hidden % 128 or inter % 128 else None


def moe_floor(counts, topk: int, hidden: int, inter: int, copy_tbps: float, fp8_tflops: float) -> dict:
    """Per-GEMM floors (common.gemm_floor) and their sum for one routing; counts = rows per expert."""
    rows = int(sum(counts))
    hit = int(sum(1 for c in counts if c))
    g1 = common.gemm_floor(hit, rows, 2 * inter, hidden, copy_tbps, fp8_tflops)
    g2 = common.gemm_floor(hit, rows, hidden, inter, copy_tbps, fp8_tflops)
    return dict(M=rows, experts_hit=hit, gemm1=g1, gemm2=g2, floor_us=g1["floor_us"] + g2["floor_us"],
                bytes=g1["bytes"] + g2["bytes"], flops=g1["flops"] + g2["flops"])


def qmoe_weight_shapes(experts: int, hidden: int, inter: int) -> dict:
    """Shapes and dtypes of the w4a8_int4 weights (as qmoe.testing.make_fused_moe_case makes them)."""
    return {"w1": ((experts, 2 * inter, hidden // 2), "int8"),
            "w1_scale": (common.scale_shape(experts, 2 * inter, hidden), "bfloat16"),
            "w2": ((experts, hidden, inter // 2), "int8"),
            "w2_scale": (common.scale_shape(experts, hidden, inter), "bfloat16")}


def load_vllm_peers(path):
    """{(normalised model, T, format): peer row} and a note naming the file (or why it is unread)."""
    if not path:
        return {}, None
    try:
        with open(path) as f:
            data = json.load(f)
        rows = {}
        for r in data.get("rows", []):
            rows[(norm(str(r["model"])), int(r["T"]), str(r["format"]))] = r
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {}, f"vLLM peer file {path} not readable ({type(e).__name__}: {e})"
    return rows, (f"vLLM: {path} ({data.get('device', '?')}, vllm {str(data.get('vllm_commit', '?'))[:7]}, "
                  f"torch {data.get('torch', '?')}, triton {data.get('triton', '?')})")


def add_peer_columns(row: dict, peers: dict, hidden: int, inter: int) -> None:
    """vllm_<format>_{graph,eager}_us for the row's (model, T) when the peer ran the same shape
    (hidden, inter: the model's, unshrunk)."""
    for f in PEER_FORMATS:
        r = peers.get((norm(row["model"]), int(row["T"]), f))
        if r is not None and int(r.get("H", hidden)) == hidden and int(r.get("I", inter)) == inter:
            row[f"vllm_{f}_graph_us"] = r.get("graph_us")
            row[f"vllm_{f}_eager_us"] = r.get("eager_us")


def set_error(row: dict, key: str, reason: str) -> None:
    row.setdefault("errors", {})[key] = reason


def _cell(row: dict, key: str, digits=1) -> str:
    """The value, or 'n/a: <reason>' (the message when short, else the exception's name; the
    full reason is listed under the table)."""
    err = row.get("errors", {}).get(key)
    if err is None:
        return fmt(row.get(key), digits)
    name, _, message = err.partition(": ")
    if not message:
        return "n/a: " + err[:32]
    return "n/a: " + (message if len(message) <= 32 else name[:32])


TABLE_COLUMNS = (
    # (header, row key, digits)
    ("hit", "experts_hit", 0), ("floor us", "floor_us", 1),
    ("qmoe det eager", "qmoe_det_eager_us", 1), ("qmoe det graph", "qmoe_det_graph_us", 1),
    ("det graph/floor", "qmoe_det_graph_over_floor", 2),
    ("qmoe fused eager", "qmoe_fused_eager_us", 1), ("qmoe fused graph", "qmoe_fused_graph_us", 1),
    ("fused graph/floor", "qmoe_fused_graph_over_floor", 2),
    ("torch bf16 graph", "torch_bf16_graph_us", 1), ("torch fp8 graph", "torch_fp8_graph_us", 1),
    ("vLLM bf16 graph", "vllm_bf16_graph_us", 1), ("vLLM fp8 graph", "vllm_fp8_graph_us", 1),
    ("vLLM int4 graph", "vllm_int4_graph_us", 1),
)


def markdown(rows, header_lines, finalizes=tuple(FINALIZES)) -> str:
    cols = [c for c in TABLE_COLUMNS if not c[1].startswith("qmoe_") or c[1].split("_")[1] in finalizes]
    out = list(header_lines) + ["", "| model | T | " + " | ".join(c[0] for c in cols) + " |",
                                "|---|--:|" + "|".join(["--:"] * len(cols)) + "|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['T']} | " + " | ".join(_cell(r, key, d) for _, key, d in cols) + " |")
    where = {}  # (column key, reason) -> rows
    for r in rows:
        for key, why in r.get("errors", {}).items():
            where.setdefault((key, why), []).append(f"{r['model']} T={r['T']}")
    if where:
        out += ["", "Unavailable (n/a), with the rows:"]
        out += [f"- {key}: {why} ({', '.join(at)})" for (key, why), at in sorted(where.items())]
    return "\n".join(out)


def write_outputs(out_dir: str, stem_name: str, table: str, payload: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, stem_name)
    with open(stem + ".json", "w") as f:
        json.dump(payload, f, indent=1, default=str)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    return stem


# ------------------------------------------------------------------------------------------------
# the plain PyTorch MoE peer (any device; the grouped GEMMs can be swapped for tests)
# ------------------------------------------------------------------------------------------------
def _sort_by_expert(torch, ids, experts):
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
    tok, order, ends = _sort_by_expert(torch, ids, w13.shape[0])
    h = mm(x.index_select(0, tok), w13.transpose(-2, -1), offs=ends)
    a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    return _combine(torch, mm(a, w2.transpose(-2, -1), offs=ends), order, wts)


def torch_moe_fp8(torch, x, ids, wts, w13, s13, w2, s2, scaled_grouped_mm=None):
    """Plain MoE in fp8: e4m3 w13 [E, 2I, H] and w2 [E, H, I] with fp32 per-channel scales s13
    [E, 2I], s2 [E, H]; activations quantized per row (x before the gather, the SiLU*up output
    before GEMM2)."""
    mm = scaled_grouped_mm or torch._scaled_grouped_mm
    inter = w2.shape[2]
    tok, order, ends = _sort_by_expert(torch, ids, w13.shape[0])
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


# ------------------------------------------------------------------------------------------------
# data on the device
# ------------------------------------------------------------------------------------------------
def _routing_weights(torch, tokens, topk, gen, device):
    logits = torch.randn((tokens, topk), device=device, generator=gen)
    return torch.softmax(logits, dim=1).float().contiguous()


def make_qmoe_weights(torch, experts, hidden, inter, gen, device):
    """Random int4 codes and bf16 group scales around 1/(4.6 sqrt(K)) (qmoe.testing's recipe)."""
    out = {}
    for name, (shape, dtype) in qmoe_weight_shapes(experts, hidden, inter).items():
        if dtype == "int8":
            out[name] = torch.randint(-128, 128, shape, dtype=torch.int8, device=device, generator=gen)
        else:
            k = hidden if name == "w1_scale" else inter
            s = torch.rand(shape, device=device, generator=gen).add_(0.5).mul_(1.0 / (4.6 * math.sqrt(k)))
            out[name] = s.to(torch.bfloat16)
    return out


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


# ------------------------------------------------------------------------------------------------
# timing (CUDA, or the host clock in the dry run)
# ------------------------------------------------------------------------------------------------
class CudaTimer:
    def __init__(self, torch, args):
        self.torch, self.args = torch, args

    def sync(self):
        self.torch.cuda.synchronize()

    def eager(self, calls):
        a = self.args
        return common.time_eager(self.torch, calls, a.iters, a.warmup, a.budget_ms / 1e3)

    def graph(self, calls):
        a = self.args
        return common.time_graph(self.torch, calls, a.iters, a.warmup, a.budget_ms / 1e3)

    def free(self):
        try:  # after a sticky CUDA error this raises too: the rows already carry the reason
            self.torch.cuda.empty_cache()
        except Exception:
            pass


class HostTimer:
    """Dry run: each call runs once (it is not a measurement); graphs are unavailable."""

    def sync(self):
        pass

    def eager(self, calls):
        samples = []
        for call in calls[:1]:
            start = time.perf_counter()
            call()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)

    def graph(self, calls):
        raise RuntimeError("dry run: no CUDA graphs")

    def free(self):
        pass


def _measure(row, key, fn):
    """row[key] = fn(); on any error row[key] stays unset and the reason is recorded."""
    try:
        row[key] = fn()
    except Exception as e:  # fail soft: report and go on
        set_error(row, key, _reason(e))


# ------------------------------------------------------------------------------------------------
# one model: all T, one implementation at a time (its weight sets made once, reused across T)
# ------------------------------------------------------------------------------------------------
class _Pool:
    """Weight sets made on demand and kept for the model; dropped by clear()."""

    def __init__(self, make):
        self.make, self.sets = make, []

    def take(self, n):
        while len(self.sets) < n:
            self.sets.append(self.make())
        return self.sets[:n]

    def clear(self):
        self.sets = []


def _set_count(touched_bytes, set_bytes, args) -> int:
    """Weight sets for one row (common.weight_set_count); at most 2 in the dry run, whose shrunk
    shapes would otherwise ask for dozens of CPU-made sets."""
    n = common.weight_set_count(touched_bytes, set_bytes, args.rotate_mb, args.max_weight_gb)
    return min(n, 2) if args.dry_run else n


def _bench_qmoe(torch, ctx, rows, routes, args, timer):
    import qmoe

    experts, topk, hidden, inter, device, gen = ctx
    set_bytes = experts * (common.int4_weight_bytes(1, 2 * inter, hidden) + common.int4_weight_bytes(1, hidden, inter))
    pool = _Pool(lambda: make_qmoe_weights(torch, experts, hidden, inter, gen, device))
    for row in rows:
        ids, wts = routes[row["T"]]
        try:
            n_sets = _set_count(row["bytes"], set_bytes, args)
            row["qmoe_weight_sets"] = n_sets
            kwargs = []
            for w in pool.take(n_sets):
                x = torch.randn((row["T"], hidden), device=device, generator=gen, dtype=torch.bfloat16)
                kw = dict(w, x=x, topk_ids=ids, topk_weights=wts, quant_mode="w4a8_int4", num_experts=experts)
                if not args.dynamic_scales:
                    kw.update(x_scale=(x.abs().amax().float() / 448).reshape(1),
                              fc2_input_scale=torch.full((1,), A2_STATIC, device=device))
                kwargs.append(kw)
            outs = {f: [torch.empty((row["T"], hidden), device=device, dtype=torch.bfloat16) for _ in kwargs]
                    for f in args.finalize}
            # one checked call of each finalize on set 0 before timing
            first = {f: qmoe.fused_moe(**kwargs[0], deterministic=FINALIZES[f], out=outs[f][0]).float()
                     for f in args.finalize}
            timer.sync()
            row["qmoe_finite"] = all(bool(torch.isfinite(v).all()) for v in first.values())
            if len(first) == 2:
                d, u = first["det"], first["fused"]
                row["qmoe_det_vs_fused_rel_rms"] = float((d - u).norm() / d.norm().clamp(min=1e-30))
            del first
        except Exception as e:  # nothing to time for this row
            for f in args.finalize:
                for how in ("eager", "graph"):
                    set_error(row, f"qmoe_{f}_{how}_us", _reason(e))
            continue
        for f in args.finalize:
            calls = [lambda kw=kw, o=o, det=FINALIZES[f]: qmoe.fused_moe(**kw, deterministic=det, out=o)
                     for kw, o in zip(kwargs, outs[f])]
            _measure(row, f"qmoe_{f}_eager_us", lambda: timer.eager(calls))
            _measure(row, f"qmoe_{f}_graph_us", lambda: timer.graph(calls))
            if row.get(f"qmoe_{f}_graph_us"):
                row[f"qmoe_{f}_graph_over_floor"] = row[f"qmoe_{f}_graph_us"] / row["floor_us"]
        del kwargs, outs
        timer.free()
    pool.clear()
    timer.free()


def _bench_torch(torch, ctx, rows, routes, args, timer, kind):
    experts, topk, hidden, inter, device, gen = ctx
    elem = 2 if kind == "bf16" else 1
    set_bytes = experts * 3 * inter * hidden * elem
    make = make_bf16_weights if kind == "bf16" else make_fp8_weights
    pool = _Pool(lambda: make(torch, experts, hidden, inter, gen, device))
    for row in rows:
        ids, wts = routes[row["T"]]

        def run():
            touched = row["experts_hit"] * 3 * inter * hidden * elem + row["T"] * hidden * 4
            n_sets = _set_count(touched, set_bytes, args)
            row[f"torch_{kind}_weight_sets"] = n_sets
            moe = torch_moe_bf16 if kind == "bf16" else torch_moe_fp8
            calls = []
            for w in pool.take(n_sets):
                x = torch.randn((row["T"], hidden), device=device, generator=gen, dtype=torch.bfloat16)
                calls.append(lambda x=x, w=w: moe(torch, x, ids, wts, *w))
            out = calls[0]()
            timer.sync()
            row[f"torch_{kind}_finite"] = bool(torch.isfinite(out.float()).all())
            del out
            try:
                return timer.graph(calls)
            except Exception as e:  # keep an eager time beside the reason
                set_error(row, f"torch_{kind}_graph_us", _reason(e))
                _measure(row, f"torch_{kind}_eager_us", lambda: timer.eager(calls))
                return None

        _measure(row, f"torch_{kind}_graph_us", run)
        if row.get(f"torch_{kind}_graph_us") is None:
            row.pop(f"torch_{kind}_graph_us", None)
        timer.free()
    pool.clear()
    timer.free()


def _reason(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160]}" if text else type(e).__name__


def bench_model(torch, model, args, ceilings, peers, timer, device):
    """All rows of one model (one per T): routing once per T, then qmoe, torch bf16, torch fp8,
    each with its weight sets made once for the model."""
    experts, topk, hidden, inter = model_dims(model, args)
    gen = torch.Generator(device=device)
    rows, routes = [], {}
    for tokens in args.tokens:
        gen.manual_seed(args.seed * 1000003 + tokens)
        ids = common.routing(torch, tokens, topk, experts, gen, device=device)
        routes[tokens] = (ids, _routing_weights(torch, tokens, topk, gen, device))
        counts = torch.bincount(ids.reshape(-1).long(), minlength=experts).tolist()
        rows.append(floor_row(model, (experts, topk, hidden, inter), tokens, counts, ceilings, peers))
    ctx = (experts, topk, hidden, inter, device, gen)
    why = qmoe_unsupported(hidden, inter)
    if why:
        for row in rows:
            for f in args.finalize:
                for how in ("eager", "graph"):
                    set_error(row, f"qmoe_{f}_{how}_us", why)
    else:
        _bench_qmoe(torch, ctx, rows, routes, args, timer)
    if not args.no_torch_peers:
        for kind in ("bf16", "fp8"):
            _bench_torch(torch, ctx, rows, routes, args, timer, kind)
    return rows


def floor_row(model, dims, tokens, counts, ceilings, peers) -> dict:
    """A row with the shape, the routing's floor and the vLLM peer columns (no timings yet)."""
    from .. import testing

    experts, topk, hidden, inter = dims
    row = dict(model=model, E=experts, topk=topk, H=hidden, I=inter, T=tokens,
               **moe_floor(counts, topk, hidden, inter, ceilings["copy_tbps"], ceilings["fp8_tflops"]))
    add_peer_columns(row, peers, *testing.MODEL_SHAPES[model][2:])
    return row


def numpy_counts(tokens, topk, experts, seed):
    """Rows per expert of uniform top-k routing drawn with numpy (dry run without torch)."""
    import numpy as np

    keys = np.random.default_rng(seed).random((tokens, experts))
    ids = np.argpartition(-keys, topk - 1, axis=1)[:, :topk]
    return np.bincount(ids.reshape(-1), minlength=experts).tolist()


# ------------------------------------------------------------------------------------------------
# checks run once before the table (reported in its header)
# ------------------------------------------------------------------------------------------------
def check_qmoe(torch, device) -> str:
    """qmoe.fused_moe on `device` vs the C++ CPU engine on numpy, a small qmoe.testing case moved
    to torch with the tests' conversion."""
    import qmoe
    from .. import testing

    case = testing.make_fused_moe_case("w4a8_int4", 37, 256, 128, 16, 4, seed=3)
    dev = {k: common.numpy_to_torch(torch, v, device) for k, v in case.items()}
    parts = []
    for f, det in FINALIZES.items():
        got = common.torch_to_numpy(torch, qmoe.fused_moe(**dev, deterministic=det))
        want = qmoe.fused_moe(**case, deterministic=det)
        parts.append(f"{f} rel_rms {testing.rel_rms(got, want):.1e}")
    return "qmoe on " + str(device) + " vs the CPU engine (T=37, E=16, k=4, H=256, I=128): " + ", ".join(parts)


def check_torch_peers(torch, device) -> str:
    """The torch peers with torch's grouped GEMMs vs the same pipeline with a per-group loop."""
    gen = torch.Generator(device=device)
    gen.manual_seed(5)
    experts, topk, hidden, inter, tokens = 6, 2, 256, 128, 29
    ids = common.routing(torch, tokens, topk, experts, gen, device=device)
    wts = _routing_weights(torch, tokens, topk, gen, device)
    x = torch.randn((tokens, hidden), device=device, generator=gen, dtype=torch.bfloat16)
    loop, loop_scaled = loop_grouped_mm(torch)
    parts = []
    for kind in ("bf16", "fp8"):
        try:
            if kind == "bf16":
                w = make_bf16_weights(torch, experts, hidden, inter, gen, device)
                got, want = torch_moe_bf16(torch, x, ids, wts, *w), torch_moe_bf16(torch, x, ids, wts, *w, grouped_mm=loop)
            else:
                w = make_fp8_weights(torch, experts, hidden, inter, gen, device)
                got = torch_moe_fp8(torch, x, ids, wts, *w)
                want = torch_moe_fp8(torch, x, ids, wts, *w, scaled_grouped_mm=loop_scaled)
            rel = float((got.float() - want.float()).norm() / want.float().norm())
            parts.append(f"{kind} rel_rms {rel:.1e}")
        except Exception as e:
            parts.append(f"{kind} n/a ({_reason(e)[:80]})")
    return "torch peers vs a per-group loop: " + ", ".join(parts)


def summary_line(rows) -> str:
    """Output checks over the rows: qmoe finite, det vs fused agreement, torch peers finite."""
    ran = [r for r in rows if "qmoe_finite" in r]
    parts = [f"qmoe outputs finite in {sum(bool(r['qmoe_finite']) for r in ran)} of {len(ran)} rows run"]
    rel = [r["qmoe_det_vs_fused_rel_rms"] for r in ran if "qmoe_det_vs_fused_rel_rms" in r]
    if rel:
        parts.append(f"deterministic vs fused finalize rel_rms <= {max(rel):.1e}")
    for kind in ("bf16", "fp8"):
        seen = [r[f"torch_{kind}_finite"] for r in rows if f"torch_{kind}_finite" in r]
        if seen:
            parts.append(f"torch {kind} finite in {sum(map(bool, seen))} of {len(seen)}")
    return "Output checks: " + "; ".join(parts) + "."


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def _import_torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def main(argv=None) -> int:
    args = _parse_args(argv)
    started = time.perf_counter()
    torch = _import_torch()
    if not args.dry_run and (torch is None or not torch.cuda.is_available()):
        print("qmoe bench moe: needs torch with CUDA (or --dry-run)", file=sys.stderr)
        return 2
    peers, peer_note = load_vllm_peers(args.peers)
    today = datetime.date.today().isoformat()
    if args.dry_run:
        device, gpu, ceilings = "cpu", "cpu dry run", dict(NOMINAL_CEILINGS)
        timer = HostTimer()
        ceiling_line = (f"DRY RUN (no GPU; not a measurement): nominal ceilings {ceilings['copy_tbps']:.2f} TB/s copy, "
                        f"{ceilings['fp8_tflops']:.0f} TFLOP/s fp8; H and I shrunk by {args.shrink} (multiples of 128 "
                        "kept); each implementation ran once on the CPU.")
    else:
        device, gpu = "cuda", torch.cuda.get_device_name()
        timer = CudaTimer(torch, args)
        try:
            copy_tbps, fp8_tflops = common.measure_ceilings(torch)
            ceilings = dict(copy_tbps=copy_tbps, fp8_tflops=fp8_tflops)
            ceiling_line = (f"Ceilings measured in this run: device copy {copy_tbps:.2f} TB/s (read + write), dense "
                            f"fp8 torch._scaled_mm 8192^3 {fp8_tflops:.0f} TFLOP/s.")
        except Exception as e:  # floors from the nominal H200 ceilings, said so
            ceilings = dict(NOMINAL_CEILINGS)
            ceiling_line = (f"Ceilings NOT measured ({_reason(e)}): floors use nominal {ceilings['copy_tbps']:.2f} "
                            f"TB/s and {ceilings['fp8_tflops']:.0f} TFLOP/s.")
            timer.free()
    checks = []
    if torch is not None:
        for check in (check_qmoe, check_torch_peers):
            try:
                checks.append(check(torch, device))
            except Exception as e:
                checks.append(f"{check.__name__}: n/a ({_reason(e)})")
    scales = "dynamic a1, a2" if args.dynamic_scales else "static a1 = amax(x)/448, a2 = 8/448"
    header = [f"# qmoe fused MoE layer (w4a8_int4), {gpu}, {today}",
              "",
              ceiling_line,
              "floor us = sum over GEMM1 and GEMM2 of max(bytes / copy, FLOPs / fp8 rate); bytes = int4 weights + "
              "bf16 scales of the experts hit + e4m3 activations + bf16 output. graph/floor = time / floor (>= 1).",
              f"Uniform top-k routing (distinct experts), {scales}, bf16 out. eager = CUDA events around the Python "
              "call from an idle GPU; graph = replay of captured calls (out= preallocated); medians of up to "
              f"{args.iters} samples ({args.budget_ms:.0f} ms budget each). Weight sets, each with its own x, cycled "
              f"so that >= {args.rotate_mb:.0f} MB are touched between uses of a set (cap {args.max_weight_gb:.0f} GB).",
              "torch peers (same run, same routing): sort + gather + torch._grouped_mm bf16 / torch._scaled_grouped_mm "
              "fp8 rowwise (use_fast_accum=True) + SiLU*up + weighted top-k sum, graph replay."]
    if peers:
        header.append(peer_note + "; vLLM columns are its Triton fused_experts graph times (another run; int4 = "
                      "w4a16 g128; its table has no T=512).")
    elif peer_note:
        header.append(peer_note)
    header += [f"Check: {c}" for c in checks]
    print("\n".join(header), flush=True)

    rows = []
    for model in args.models:
        t0 = time.perf_counter()
        if torch is None:  # dry run without torch: floors and peers only
            dims = model_dims(model, args)
            model_rows = []
            for tokens in args.tokens:
                row = floor_row(model, dims, tokens, numpy_counts(tokens, dims[1], dims[0], args.seed + tokens),
                                ceilings, peers)
                why = qmoe_unsupported(dims[2], dims[3])
                for key in QMOE_KEYS + TORCH_KEYS:
                    set_error(row, key, why if why and key in QMOE_KEYS else "no torch")
                model_rows.append(row)
        else:
            try:
                model_rows = bench_model(torch, model, args, ceilings, peers, timer, device)
            except Exception as e:  # e.g. out of memory while making weights: report, go on
                print(f"  {model}: failed ({_reason(e)})", flush=True)
                dims = model_dims(model, args)
                model_rows = []
                for tokens in args.tokens:
                    row = floor_row(model, dims, tokens, numpy_counts(tokens, dims[1], dims[0], args.seed + tokens),
                                    ceilings, peers)
                    for key in QMOE_KEYS + TORCH_KEYS:
                        set_error(row, key, _reason(e))
                    model_rows.append(row)
                timer.free()
        for r in model_rows:
            print(f"  {model} T={r['T']}: floor {fmt(r['floor_us'])} us, qmoe det {fmt(r.get('qmoe_det_eager_us'))} / "
                  f"{fmt(r.get('qmoe_det_graph_us'))}, fused {fmt(r.get('qmoe_fused_eager_us'))} / "
                  f"{fmt(r.get('qmoe_fused_graph_us'))} us (eager / graph), torch bf16 "
                  f"{fmt(r.get('torch_bf16_graph_us'))}, fp8 {fmt(r.get('torch_fp8_graph_us'))}", flush=True)
        print(f"  {model}: {time.perf_counter() - t0:.1f} s", flush=True)
        rows += model_rows

    elapsed = time.perf_counter() - started
    table = markdown(rows, header + [summary_line(rows), f"Run time {elapsed:.0f} s."], args.finalize)
    print()
    print(table)
    payload = dict(device=gpu, torch=getattr(torch, "__version__", None), dry_run=args.dry_run,
                   date=datetime.datetime.now().isoformat(timespec="seconds"), ceilings=ceilings,
                   args=vars(args), peers=peer_note, checks=checks, seconds=elapsed, rows=rows)
    stem = write_outputs(args.out_dir, f"{today}_{norm(gpu)}_moe", table, payload)
    print(f"\nwrote {stem}.json and {stem}.md")
    supported = [r for r in rows if not qmoe_unsupported(r["H"], r["I"])]
    failed = [r for r in supported if any(k in r.get("errors", {}) for k in QMOE_KEYS)]
    return 1 if failed and not args.dry_run else 0


if __name__ == "__main__":
    sys.exit(main())
