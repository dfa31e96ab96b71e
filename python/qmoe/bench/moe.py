"""`qmoe bench moe`: the whole MoE layer (qmoe.fused_moe) at model shapes (DESIGN.md 8), for each
--quant-mode (w4a8_int4 by default; w4a16_int4, w4a16, w4a8, w4a4 or all).

For each quant mode, model (E, top-k, H, I) and token count T: uniform random routing (top-k
distinct experts per token, softmax weights) and random data of the mode made on the GPU
(common.make_mode_weights / make_mode_activations): w4a8_int4 bf16 x [T, H] with static
a1 = amax(x)/448 and a2 = 8/448 (or dynamic scales with --dynamic-scales); w4a16_int4 and w4a16
bf16 x; w4a8 e4m3 x + ue8m0 scales [T, H/32]; w4a4 fp4x2 x [T, H/2] + e4m3 scales [T, H/16] and
fc2_input_scale. FP4 weights are random codes with e4m3 (NVFP4, 2^-3..2^3) or ue8m0 (MXFP4,
2^-8..2^0) scale bytes in the 128x4 swizzle, with per-expert alphas that keep the output O(1);
gate/up [gate; up] for the int4 modes, FlashInfer's 64-row interleave for the FP4 modes. Per row:
  - qmoe.fused_moe with the deterministic and the fused (default) finalize, each timed eagerly
    (CUDA events around the Python call, started from an idle GPU, median) and as a CUDA-graph
    replay (calls captured with preallocated out= and fixed inputs, median of replays);
  - the floor: sum over GEMM1 (N = 2I, K = H) and GEMM2 (N = H, K = I) of
    max(bytes / copy bandwidth, FLOPs / dense rate), bytes = 4-bit weights + block scales of the
    experts hit (int4: bf16 per 128; NVFP4: a byte per 16; MXFP4: a byte per 32) + the mode's
    activation operand [M, K] (e4m3; bf16; MXFP8 = e4m3 + a byte per 32; NVFP4 = half a byte + a
    byte per 16) + bf16 output [M, N], FLOPs = 2 M N K, M = T * top-k; the rate is the dense fp8
    one for w4a8_int4, w4a8 and w4a4, the dense bf16 one for w4a16 and w4a16_int4
    (common.QUANT_MODES, common.gemm_floor; ceilings measured once at the start: copy and
    torch._scaled_mm fp8 as `qmoe bench gemm` does, torch.mm bf16 8192^3 when a bf16 mode runs);
  - a plain PyTorch MoE on the same routing (sort by expert, gather, GEMM1, SiLU(gate) * up,
    GEMM2, weighted top-k sum) with torch._grouped_mm (bf16 weights) and torch._scaled_grouped_mm
    (e4m3 weights, per-channel weight scales, per-row dynamic activation scales,
    use_fast_accum=True), timed as graph replays, once per (model, T), shown in every mode's table;
  - vLLM's Triton fused MoE graph times (bf16, fp8, int4 w4a16) for the same (model, T) from the
    peer file bench/peers/2026-11-30_h200_vllm_triton_moe.json (another run, same GPU model).
What is rotated out of L2: every implementation cycles over several weight sets, each with its
own x (and out); the routing is the same for all sets, so the experts hit and the floor are exact.
Sets are added until the bytes one call touches times (sets - 1) exceed --rotate-mb, within
--max-weight-gb (DeepSeek-V3 at T = 1: 3 int4 sets of 5.6 GB; at large T every call touches
the whole set, which is far beyond L2 by itself). A graph holds one call per set; its replay
time is divided by the number of sets. Eager sample i uses set i mod sets.
int4-g128 needs H and I to be multiples of 128: gpt-oss-120b (H = I = 2880) gets "n/a" for qmoe in
the int4 modes; the FP4 modes need multiples of 32 (the GPU GEMM's K step) and run it.
Modes run one after another in the order of common.QUANT_MODES (w4a8_int4 first): a mode whose
GPU path raises shows "n/a" with the reason in its rows; after an error that leaves the CUDA
context unusable, everything later shows that error (run new modes in their own process).
--dry-run needs no GPU: nominal ceilings, shapes shrunk by --shrink, qmoe and the torch peers run
once on the CPU when torch is installed (graph times n/a), floors, table and files as on the GPU.
Output: markdown on stdout; one table per mode in <out-dir>/<date>_<gpu>_moe[_<mode>].{md,json}
(w4a8_int4: no suffix).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

from . import common
from .common import fmt, norm
# The plain PyTorch MoE peer lives in common (re-exported: tests and callers use these names).
from .common import loop_grouped_mm, make_bf16_weights, make_fp8_weights, torch_moe_bf16, torch_moe_fp8  # noqa: F401
from .common import sort_by_expert as _sort_by_expert  # noqa: F401

DEFAULT_MODELS = ("deepseek_v3", "qwen3_30b_a3b", "mixtral_8x7b", "qwen3_235b_a22b", "gpt_oss_120b")
DEFAULT_TOKENS = (1, 8, 64, 512, 4096)
DRY_RUN_TOKENS = (1, 8, 64)
FINALIZES = {"det": True, "fused": False}  # name -> qmoe.fused_moe(deterministic=...)


def _packed(args, mode) -> bool:
    """--fp4-packed applies to the FP4 weight modes (w4a4, w4a8, w4a16)."""
    return bool(getattr(args, "fp4_packed", False)) and common.QUANT_MODES[mode][0] != "int4_g128"


def _pdl_kwargs(args) -> dict:
    """--pdl: qmoe.fused_moe's enable_pdl, or nothing (the library's default); --tactic: a forced tactic."""
    kw = {} if args.pdl == "default" else {"enable_pdl": args.pdl == "on"}
    if args.tactic:
        kw["tactic"] = args.tactic
    return kw
PEER_FILE = "2026-11-30_h200_vllm_triton_moe.json"
PEER_FORMATS = ("bf16", "fp8", "int4")
MODES = tuple(common.QUANT_MODES)  # run order
DEFAULT_MODE = "w4a8_int4"
# Used only by --dry-run (no GPU to measure): the H200 ceilings of the 2026-11-30 GEMM run (bf16:
# about half the fp8 rate, not measured there).
NOMINAL_CEILINGS = dict(copy_tbps=4.20, fp8_tflops=1550.0, bf16_tflops=770.0)
A2_STATIC = common.W4A8_INT4_A2  # static a2 for an |act| bound of 8 (qmoe.testing's choice)
QMOE_KEYS = tuple(f"qmoe_{f}_{how}_us" for f in FINALIZES for how in ("eager", "graph"))
TORCH_KEYS = ("torch_bf16_graph_us", "torch_fp8_graph_us")


def _parse_args(argv):
    from .. import testing

    p = argparse.ArgumentParser(prog="qmoe bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma list of " + ", ".join(testing.MODEL_SHAPES) + " (default: %(default)s)")
    p.add_argument("--quant-mode", default=DEFAULT_MODE,
                   help="comma list of " + ", ".join(MODES) + ", or all (default: %(default)s); they run in this order")
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
    p.add_argument("--dynamic-scales", action="store_true",
                   help="qmoe w4a8_int4: dynamic a1 and a2 instead of static (the other modes take no such choice)")
    p.add_argument("--pdl", choices=["default", "on", "off"], default="default",
                   help="qmoe's enable_pdl (default: the library's default)")
    p.add_argument("--tactic", default="",
                   help="force this tactic on qmoe's calls (default: the heuristic); where it is not valid the "
                        "row records the error")
    p.add_argument("--fp4-packed", action="store_true",
                   help="FP4 weight modes: weights prepared by qmoe.quant.pack_fp4_weights, fused_moe(fp4_weights_packed=True)"
                   " (results files get a _packed suffix)")
    p.add_argument("--aux-stream", action="store_true",
                   help="pass an aux_stream (one side stream) to qmoe.fused_moe: the fused finalize's output memset "
                        "then overlaps the layer, as in CuteDslMoEWrapper")
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
    asked = [m.strip() for m in args.quant_mode.split(",") if m.strip()]
    if asked == ["all"]:
        asked = list(MODES)
    bad = [m for m in asked if m not in MODES]
    if not asked or bad:
        p.error(f"--quant-mode: unknown {bad or asked}; expected a comma list of {', '.join(MODES)} or all")
    args.quant_mode = [m for m in MODES if m in asked]  # run order, duplicates dropped
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
    (an odd multiple of 64), so the dry run keeps gpt-oss's n/a path in the int4 modes while its
    FP4 modes (multiples of 32, and of 64 for the gate/up interleave) still run."""
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


def qmoe_unsupported(hidden: int, inter: int, mode: str = DEFAULT_MODE):
    """Why qmoe cannot run these dims in `mode` (None when it can): the int4 group is 128 along K;
    the FP4 modes' GPU GEMM steps K by 32 (src/api/fused_moe.cpp, check_gpu_limits)."""
    if common.QUANT_MODES[mode][0] == "int4_g128":
        return "K % 128 != 0" if hidden % 128 or inter % 128 else None
    return "K % 32 != 0" if hidden % 32 or inter % 32 else None


def moe_floor(counts, topk: int, hidden: int, inter: int, copy_tbps: float, fp8_tflops: float,
              mode: str = DEFAULT_MODE, bf16_tflops: float = None) -> dict:
    """Per-GEMM floors (common.gemm_floor in `mode`'s formats, against the dense rate
    common.QUANT_MODES names for it) and their sum for one routing; counts = rows per expert."""
    rate = common.QUANT_MODES[mode][2]
    tflops = fp8_tflops if rate == "fp8" else bf16_tflops
    if tflops is None:
        raise ValueError(f"moe_floor: quant mode {mode} needs the dense {rate} rate (bf16_tflops)")
    rows = int(sum(counts))
    hit = int(sum(1 for c in counts if c))
    g1 = common.gemm_floor(hit, rows, 2 * inter, hidden, copy_tbps, tflops, mode)
    g2 = common.gemm_floor(hit, rows, hidden, inter, copy_tbps, tflops, mode)
    return dict(M=rows, experts_hit=hit, gemm1=g1, gemm2=g2, floor_us=g1["floor_us"] + g2["floor_us"],
                bytes=g1["bytes"] + g2["bytes"], flops=g1["flops"] + g2["flops"], rate=rate, rate_tflops=tflops)


def qmoe_weight_shapes(experts: int, hidden: int, inter: int, mode: str = DEFAULT_MODE) -> dict:
    """Shapes and storage dtypes of a mode's weights (common.mode_weight_shapes; int4 modes as
    qmoe.testing.make_fused_moe_case makes them, FP4 modes as uint8 storage of its arrays)."""
    return common.mode_weight_shapes(mode, experts, hidden, inter)


def output_stem(date: str, gpu: str, mode: str) -> str:
    """<date>_<gpu>_moe for w4a8_int4 (the name before modes existed), <date>_<gpu>_moe_<mode> else."""
    return f"{date}_{norm(gpu)}_moe" + ("" if mode == DEFAULT_MODE else f"_{mode}")


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


# Issues #4 / #5's layer targets: decode (T <= 64) within 1.3x the two GEMMs' floors; faster than every peer
# at every point. qmoe's time is the faster of the finalizes measured (graph replay).
DECODE_MAX_T = 64
DECODE_FLOOR_RATIO = 1.3
TARGET_PEERS = (("torch_fp8_graph_us", "torch fp8"), ("vllm_bf16_graph_us", "vLLM bf16"),
                ("vllm_fp8_graph_us", "vLLM fp8"), ("vllm_int4_graph_us", "vLLM int4"))


def target_checks(row, finalizes=tuple(FINALIZES)):
    """[(target, met, detail)] for one row (none without a qmoe graph time)."""
    times = [row[k] for k in (f"qmoe_{f}_graph_us" for f in finalizes) if isinstance(row.get(k), (int, float))]
    if not times:
        return []
    us, floor = min(times), row.get("floor_us")
    checks = []
    if row["T"] <= DECODE_MAX_T and floor:
        checks.append((f"decode (T <= {DECODE_MAX_T}) <= {DECODE_FLOOR_RATIO} x floor", us <= DECODE_FLOOR_RATIO * floor,
                       f"{us / floor:.2f}x floor"))
    for key, name in TARGET_PEERS:
        peer = row.get(key)
        if isinstance(peer, (int, float)) and peer > 0:
            checks.append((f"faster than {name}", us < peer, f"{us / peer:.2f}x its time"))
    return checks


def targets_summary(rows, finalizes=tuple(FINALIZES)):
    """Markdown lines: per target, the points that meet it and the ones that miss it (with by how much)."""
    checks = [(f"{r['model']} T={r['T']}", target_checks(r, finalizes)) for r in rows]
    return common.targets_summary(
        checks, "Targets (issues #4 / #5; qmoe = the faster finalize, graph replay), met at / of the points measured:")


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
    out += targets_summary(rows, finalizes)
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
# data on the device
# ------------------------------------------------------------------------------------------------
def _routing_weights(torch, tokens, topk, gen, device):
    logits = torch.randn((tokens, topk), device=device, generator=gen)
    return torch.softmax(logits, dim=1).float().contiguous()


def make_qmoe_weights(torch, experts, hidden, inter, gen, device, mode=DEFAULT_MODE):
    """Random weights of `mode` on `device` (common.make_mode_weights; int4: random codes and bf16
    group scales around 1/(4.6 sqrt(K)), qmoe.testing's recipe)."""
    return common.make_mode_weights(torch, mode, experts, hidden, inter, gen, device)


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

    def broken(self):
        """None while CUDA works, else the reason: a sticky error (an illegal address in a kernel)
        makes every later CUDA call fail, so nothing more is tried once it is seen."""
        try:
            self.torch.cuda.synchronize()
            return None
        except Exception as e:
            return _reason(e)


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

    def broken(self):
        return None


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


def _bench_qmoe(torch, ctx, rows, routes, args, timer, mode=DEFAULT_MODE):
    import qmoe
    from .. import quant

    experts, topk, hidden, inter, device, gen = ctx
    wfmt = common.QUANT_MODES[mode][0]
    set_bytes = experts * (common.weight_bytes(wfmt, 1, 2 * inter, hidden)
                           + common.weight_bytes(wfmt, 1, hidden, inter))
    packed = _packed(args, mode)

    def make():
        w = make_qmoe_weights(torch, experts, hidden, inter, gen, device, mode)
        if packed:
            w = dict(w, w1=quant.pack_fp4_weights(w["w1"]), w2=quant.pack_fp4_weights(w["w2"]))
        return w

    pool = _Pool(make)
    layout = common.mode_gate_up_layout(mode, inter)
    aux_stream = torch.cuda.Stream() if getattr(args, "aux_stream", False) and not args.dry_run else None
    for row in rows:
        ids, wts = routes[row["T"]]
        try:
            n_sets = _set_count(row["bytes"], set_bytes, args)
            row["qmoe_weight_sets"] = n_sets
            row["gate_up_layout"] = layout
            kwargs = []
            aux = {"aux_stream": aux_stream} if aux_stream is not None else {}
            for w in pool.take(n_sets):
                act = common.make_mode_activations(torch, mode, row["T"], hidden, gen, device, args.dynamic_scales)
                kwargs.append(dict(w, **act, topk_ids=ids, topk_weights=wts, quant_mode=mode, num_experts=experts,
                                   gate_up_layout=layout, **_pdl_kwargs(args), **aux,
                                   **({"fp4_weights_packed": True} if packed else {})))
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
        except Exception as e:  # nothing to time for this row (a mode whose GPU path raises lands here)
            set_qmoe_errors(row, args.finalize, _reason(e))
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


def bench_model(torch, model, args, ceilings, peers, timer, device, mode=DEFAULT_MODE, torch_cache=None):
    """All rows of one model in one quant mode (one per T): routing once per T (seeded by T, so
    the same in every mode), then the torch peers bf16 and fp8 unless torch_cache {(model, T):
    their columns} has them already (they are measured once per model and T, whatever the mode),
    then qmoe in `mode`; each implementation's weight sets are made once for the model."""
    experts, topk, hidden, inter = model_dims(model, args)
    gen = torch.Generator(device=device)
    rows, routes = [], {}
    for tokens in args.tokens:
        gen.manual_seed(args.seed * 1000003 + tokens)
        ids = common.routing(torch, tokens, topk, experts, gen, device=device)
        routes[tokens] = (ids, _routing_weights(torch, tokens, topk, gen, device))
        counts = torch.bincount(ids.reshape(-1).long(), minlength=experts).tolist()
        rows.append(floor_row(model, (experts, topk, hidden, inter), tokens, counts, ceilings, peers, mode))
    ctx = (experts, topk, hidden, inter, device, gen)
    if not args.no_torch_peers:  # first: an error that breaks the CUDA context in a new mode keeps them
        cache = {} if torch_cache is None else torch_cache
        if any((model, r["T"]) not in cache for r in rows):
            gen.manual_seed((1 << 40) + args.seed)  # apart from every routing seed
            peer_rows = [dict(model=model, T=r["T"], experts_hit=r["experts_hit"]) for r in rows]
            for kind in ("bf16", "fp8"):
                _bench_torch(torch, ctx, peer_rows, routes, args, timer, kind)
            cache.update({(model, r["T"]): torch_columns(r) for r in peer_rows})
        for row in rows:
            merge_torch_columns(row, cache[(model, row["T"])])
    why = qmoe_unsupported(hidden, inter, mode)
    if why:
        for row in rows:
            set_qmoe_errors(row, args.finalize, why)
    else:
        gen.manual_seed((2 << 40) + args.seed * len(MODES) + MODES.index(mode))
        _bench_qmoe(torch, ctx, rows, routes, args, timer, mode)
    return rows


def set_qmoe_errors(row: dict, finalizes, reason: str) -> None:
    for f in finalizes:
        for how in ("eager", "graph"):
            set_error(row, f"qmoe_{f}_{how}_us", reason)


def torch_columns(row: dict) -> dict:
    """The torch peers' keys of a row and their errors: what every mode's row of (model, T) shares."""
    cols = {k: v for k, v in row.items() if k.startswith("torch_")}
    errors = {k: v for k, v in row.get("errors", {}).items() if k.startswith("torch_")}
    if errors:
        cols["errors"] = errors
    return cols


def merge_torch_columns(row: dict, cols: dict) -> None:
    for k, v in cols.items():
        if k == "errors":
            for key, why in v.items():
                set_error(row, key, why)
        else:
            row[k] = v


def floor_row(model, dims, tokens, counts, ceilings, peers, mode=DEFAULT_MODE) -> dict:
    """A row with the shape, the routing's floor in `mode` and the vLLM peer columns (no timings yet)."""
    from .. import testing

    experts, topk, hidden, inter = dims
    row = dict(model=model, quant_mode=mode, E=experts, topk=topk, H=hidden, I=inter, T=tokens,
               **moe_floor(counts, topk, hidden, inter, ceilings["copy_tbps"], ceilings["fp8_tflops"], mode,
                           ceilings.get("bf16_tflops")))
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
def check_qmoe(torch, device, mode=DEFAULT_MODE, packed=False) -> str:
    """qmoe.fused_moe in `mode` on `device` vs the C++ CPU engine on numpy, a small qmoe.testing
    case moved to torch with the tests' conversion."""
    import qmoe
    from .. import quant, testing

    case = testing.make_fused_moe_case(mode, 37, 256, 128, 16, 4, seed=3)
    dev = {k: common.numpy_to_torch(torch, v, device) for k, v in case.items()}
    extra = {}
    if packed:  # packed on the device, the CPU engine on the plain weights
        dev.update(w1=quant.pack_fp4_weights(dev["w1"]), w2=quant.pack_fp4_weights(dev["w2"]))
        extra = dict(fp4_weights_packed=True)
    parts = []
    for f, det in FINALIZES.items():
        got = common.torch_to_numpy(torch, qmoe.fused_moe(**dev, deterministic=det, **extra))
        want = qmoe.fused_moe(**case, deterministic=det)
        parts.append(f"{f} rel_rms {testing.rel_rms(got, want):.1e}")
    return (f"qmoe {mode}{' (packed FP4 weights)' if packed else ''} on {device} vs the CPU engine "
            "(T=37, E=16, k=4, H=256, I=128): " + ", ".join(parts))


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


def measure_ceilings(torch, need_bf16: bool):
    """(ceilings dict, header line): copy and fp8 (and bf16 when a bf16 mode runs) measured now;
    a failed measurement falls back to NOMINAL_CEILINGS and says so."""
    try:
        copy_tbps, fp8_tflops = common.measure_ceilings(torch)
        ceilings = dict(copy_tbps=copy_tbps, fp8_tflops=fp8_tflops)
        line = (f"Ceilings measured in this run: device copy {copy_tbps:.2f} TB/s (read + write), dense "
                f"fp8 torch._scaled_mm 8192^3 {fp8_tflops:.0f} TFLOP/s")
    except Exception as e:  # floors from the nominal H200 ceilings, said so
        ceilings = dict(NOMINAL_CEILINGS)
        line = (f"Ceilings NOT measured ({_reason(e)}): floors use nominal {ceilings['copy_tbps']:.2f} "
                f"TB/s and {ceilings['fp8_tflops']:.0f} TFLOP/s fp8")
    if need_bf16:
        try:
            ceilings["bf16_tflops"] = common.measure_bf16_tflops(torch)
            line += f", dense bf16 torch.mm 8192^3 {ceilings['bf16_tflops']:.0f} TFLOP/s"
        except Exception as e:
            ceilings["bf16_tflops"] = NOMINAL_CEILINGS["bf16_tflops"]
            line += f"; bf16 rate NOT measured ({_reason(e)}): nominal {ceilings['bf16_tflops']:.0f} TFLOP/s"
    return ceilings, line + "."


# What the header says of each mode's floor bytes and data.
WEIGHT_TEXT = {"int4_g128": "int4 weights + bf16 scales", "nvfp4": "NVFP4 weights + e4m3 scales per 16",
               "mxfp4": "MXFP4 weights + ue8m0 scales per 32"}
ACT_TEXT = {"e4m3": "e4m3 activations", "bf16": "bf16 activations",
            "mxfp8": "MXFP8 activations (e4m3 + ue8m0 per 32)", "nvfp4": "NVFP4 activations (e2m1 + e4m3 per 16)"}
DATA_TEXT = {
    "w4a16_int4": "bf16 x ~ N(0, 1), int4 weights with bf16 group scales ~ 1/(4.6 sqrt(K)), no alphas, "
                  "[gate; up]",
    "w4a16": "bf16 x ~ N(0, 1), random NVFP4 weights (e4m3 scales 2^-3..2^3), per-expert alphas",
    "w4a8": "e4m3 x ~ N(0, 1) with ue8m0 scales 2^-8..2^0, random MXFP4 weights (ue8m0 scales 2^-8..2^0), "
            "per-expert alphas",
    "w4a4": f"random NVFP4 x (e4m3 scales 2^-3..2^3), fc2_input_scale {common.W4A4_FC2_INPUT_SCALE:g}, random "
            "NVFP4 weights (e4m3 scales 2^-3..2^3), per-expert alphas",
}
FP4_LAYOUT_TEXT = ", [up; gate] interleaved by 64 rows (FlashInfer's; [gate; up] when I % 64 != 0)"


def mode_header(mode, gpu, today, ceiling_line, args, peers, peer_note, checks) -> list:
    wfmt, afmt, rate = common.QUANT_MODES[mode]
    if mode == DEFAULT_MODE:
        data = "dynamic a1, a2" if args.dynamic_scales else "static a1 = amax(x)/448, a2 = 8/448"
    else:
        data = DATA_TEXT[mode] + (FP4_LAYOUT_TEXT if wfmt != "int4_g128" else "")
        if _packed(args, mode):
            data += ", weights in qmoe's packed word order (pack_fp4_weights, fp4_weights_packed=True)"
    header = [f"# qmoe fused MoE layer ({mode}), {gpu}, {today}",
              "",
              ceiling_line,
              f"floor us = sum over GEMM1 and GEMM2 of max(bytes / copy, FLOPs / {rate} rate); bytes = "
              f"{WEIGHT_TEXT[wfmt]} of the experts hit + {ACT_TEXT[afmt]} + bf16 output. graph/floor = time / "
              "floor (>= 1).",
              f"Uniform top-k routing (distinct experts), {data}, bf16 out. eager = CUDA events around the Python "
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
    return header + [f"Check: {c}" for c in checks]


def fallback_rows(model, args, ceilings, peers, mode, reason, torch_cache=None) -> list:
    """Rows of a model that did not run (no torch, a failure, an unusable CUDA context): floors
    from numpy routing, cached torch columns when there are some, `reason` for every other time."""
    dims = model_dims(model, args)
    why = qmoe_unsupported(dims[2], dims[3], mode)
    rows = []
    for tokens in args.tokens:
        row = floor_row(model, dims, tokens, numpy_counts(tokens, dims[1], dims[0], args.seed + tokens),
                        ceilings, peers, mode)
        cached = (torch_cache or {}).get((model, tokens))
        if cached:
            merge_torch_columns(row, cached)
        for key in QMOE_KEYS:
            set_error(row, key, why or reason)
        for key in TORCH_KEYS if not cached else ():
            set_error(row, key, reason)
        rows.append(row)
    return rows


def run_mode(torch, mode, args, ceilings, peers, timer, device, torch_cache, state) -> list:
    """Every model's rows in one mode; state["broken"] holds the reason once CUDA is unusable."""
    rows = []
    for model in args.models:
        t0 = time.perf_counter()
        if torch is None:  # dry run without torch: floors and peers only
            model_rows = fallback_rows(model, args, ceilings, peers, mode, "no torch")
        else:
            state["broken"] = state["broken"] or timer.broken()
            if state["broken"]:
                model_rows = fallback_rows(model, args, ceilings, peers, mode,
                                           "CUDA unusable after an earlier error: " + state["broken"], torch_cache)
            else:
                try:
                    model_rows = bench_model(torch, model, args, ceilings, peers, timer, device, mode, torch_cache)
                except Exception as e:  # e.g. out of memory while making weights: report, go on
                    print(f"  {mode} {model}: failed ({_reason(e)})", flush=True)
                    model_rows = fallback_rows(model, args, ceilings, peers, mode, _reason(e), torch_cache)
                    timer.free()
        for r in model_rows:
            print(f"  {mode} {model} T={r['T']}: floor {fmt(r['floor_us'])} us, qmoe det "
                  f"{fmt(r.get('qmoe_det_eager_us'))} / {fmt(r.get('qmoe_det_graph_us'))}, fused "
                  f"{fmt(r.get('qmoe_fused_eager_us'))} / {fmt(r.get('qmoe_fused_graph_us'))} us (eager / graph), "
                  f"torch bf16 {fmt(r.get('torch_bf16_graph_us'))}, fp8 {fmt(r.get('torch_fp8_graph_us'))}", flush=True)
        print(f"  {mode} {model}: {time.perf_counter() - t0:.1f} s", flush=True)
        rows += model_rows
    return rows


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
                        f"{ceilings['fp8_tflops']:.0f} TFLOP/s fp8, {ceilings['bf16_tflops']:.0f} TFLOP/s bf16; H and "
                        f"I shrunk by {args.shrink} (multiples of 128 kept); each implementation ran once on the CPU.")
    else:
        device, gpu = "cuda", torch.cuda.get_device_name()
        timer = CudaTimer(torch, args)
        ceilings, ceiling_line = measure_ceilings(
            torch, any(common.QUANT_MODES[m][2] == "bf16" for m in args.quant_mode))
        timer.free()
    checks = []
    if torch is not None:
        try:
            checks.append(check_torch_peers(torch, device))
        except Exception as e:
            checks.append(f"check_torch_peers: n/a ({_reason(e)})")
    torch_cache, state, failed = {}, dict(broken=None), []
    for mode in args.quant_mode:
        mode_started = time.perf_counter()
        mode_checks = list(checks)
        if torch is not None:
            try:
                mode_checks.append(check_qmoe(torch, device, mode, _packed(args, mode)))
            except Exception as e:
                mode_checks.append(f"check_qmoe {mode}: n/a ({_reason(e)})")
        header = mode_header(mode, gpu, today, ceiling_line, args, peers, peer_note, mode_checks)
        print("\n".join(header), flush=True)
        rows = run_mode(torch, mode, args, ceilings, peers, timer, device, torch_cache, state)
        elapsed = time.perf_counter() - mode_started
        table = markdown(rows, header + [summary_line(rows), f"Run time {elapsed:.0f} s."], args.finalize)
        print()
        print(table)
        payload = dict(device=gpu, torch=getattr(torch, "__version__", None), dry_run=args.dry_run, quant_mode=mode,
                       date=datetime.datetime.now().isoformat(timespec="seconds"), ceilings=ceilings,
                       args=vars(args), peers=peer_note, checks=mode_checks, seconds=elapsed, rows=rows)
        stem = write_outputs(args.out_dir, output_stem(today, gpu, mode) + ("_packed" if _packed(args, mode) else ""),
                             table, payload)
        print(f"\nwrote {stem}.json and {stem}.md\n", flush=True)
        supported = [r for r in rows if not qmoe_unsupported(r["H"], r["I"], mode)]
        failed += [r for r in supported if any(k in r.get("errors", {}) for k in QMOE_KEYS)]
    print(f"Total run time {time.perf_counter() - started:.0f} s.")
    return 1 if failed and not args.dry_run else 0


if __name__ == "__main__":
    sys.exit(main())
