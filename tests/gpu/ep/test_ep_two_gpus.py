#!/usr/bin/env python3
"""Expert parallelism over NCCL on 2 GPUs (docs/expert-parallel.md): qmoe.ep.ExpertParallelMoE with
the NCCL transport (from a torch.distributed group) must equal the single-GPU layer,
qmoe.fused_moe(all experts, deterministic=True), BIT FOR BIT on each rank's tokens.

Checks (each prints one 'PASS name: ...' or 'FAIL name: ...' line per rank; exit status non-zero when
any check failed on any rank):
  transport        grouped send/recv with unequal and zero sizes, self included, into `out=`
  <mode>/uniform   uniform routing, GEMM tactic pinned (a decode and a prefill tactic) and heuristic
  <mode>/batch     static a1: the ranks' outputs together == fused_moe of the whole global batch
  <mode>/skewed    80% of the slots on rank 1's experts
  <mode>/no_recv   rank 1 receives no token (every id in rank 0's experts)
  <mode>/empty     rank 1 holds no token (T = 0)
  <mode>/dyn_a1    dynamic a1 (amax over each home rank's x)
  low_latency/graph  the whole layer captured in a CUDA graph, inputs changed in place, replayed:
                   == eager == single GPU
  low_latency/capacity  T > max_tokens_per_rank: ValueError naming it, before any exchange
  low_latency/chunks<n>  forward(chunks=n), n in {2, 3} (exchanges on a side stream, overlapped with
                   the GEMMs): == chunks=1 and == single GPU, bitwise, pinned tactic and heuristic
                   (the heuristic's tactic of the unchunked call is pinned for every chunk);
                   T = 300 / 223 per rank (GPU): each chunk's 2400 slots take the multi-CTA
                   (cooperative) routing kernel while NCCL runs beside it
  low_latency/chunks_empty  chunks=2 with rank 1 holding no token (its chunks are empty)
  low_latency/chunks_graph  chunks=2 captured in a CUDA graph (side stream forked and joined in the
                   capture), replayed with new inputs: == eager chunks=1 == single GPU
  bf16/<quant>     w4a16_int4, w4a4, w4a8, w4a16 (the bf16 x 4-bit pipeline), both modes
with <mode> in throughput, low_latency.

Run (one process per GPU; NCCL_NVLS_ENABLE=0 is set unless given):
  python3 tests/gpu/ep/test_ep_two_gpus.py              spawns 2 processes (FileStore, no network)
  torchrun --nproc-per-node 2 tests/gpu/ep/test_ep_two_gpus.py
  python3 tests/gpu/ep/test_ep_two_gpus.py --cpu        the same checks on CPU tensors (reference
                   engine, gloo point-to-point transport, no tactics, no graph): tests this script
Needs PYTHONPATH with the qmoe package built with the sm_90a kernels (scripts/device_build.sh).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before NCCL loads: NVLink multicast stays off

import numpy as np  # noqa: E402

H, I, E, K = 1024, 512, 16, 8  # hidden, intermediate, experts, top-k: int4-g128 layouts with K % 512 == 0
PINNED = ("decode_m128_n16_k256", "prefill_m128_n128_k128")  # int4 x e4m3 tactics checked bit for bit
PINNED_BF16 = "decode_m128_n16_k256"  # a tactic of the bf16 x 4-bit GEMM as well


# ---- data ------------------------------------------------------------------------------------------

def routing(total, top_k, num_experts, seed, lo=None, hi=None, share=0.0, only_below=None):
    """Distinct experts per token; `share` of the slots drawn from [lo, hi); only_below: ids < it."""
    rng = np.random.default_rng(seed)
    pool = num_experts if only_below is None else only_below
    ids = np.empty((total, top_k), np.int32)
    for t in range(total):
        row = []
        while len(row) < top_k:
            e = int(rng.integers(lo, hi)) if lo is not None and rng.random() < share else int(rng.integers(0, pool))
            if e not in row:
                row.append(e)
        ids[t] = row
    return ids, rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)


class Env:
    """Per-rank context: torch, device, transport, results."""

    def __init__(self, rank, world, cpu):
        import torch

        from qmoe import testing

        self.torch, self.testing, self.rank, self.world, self.cpu = torch, testing, rank, world, cpu
        self.device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
        self.failures, self.passes = [], 0

    def to_dev(self, a):
        import ml_dtypes

        torch = self.torch
        if a is None or not isinstance(a, np.ndarray):
            return a
        a = np.ascontiguousarray(a)
        if a.dtype == np.dtype(ml_dtypes.bfloat16):
            t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        elif a.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            t = torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
        else:
            t = torch.from_numpy(a)
        return t.to(self.device)

    def tactic(self, name):
        return None if self.cpu else name

    def report(self, name, ok, detail):
        line = f"[rank {self.rank}] {'PASS' if ok else 'FAIL'} {name}: {detail}"
        print(line, flush=True)
        if ok:
            self.passes += 1
        else:
            self.failures.append(name)


def compare(env, got, want, what):
    """(ok, detail): bitwise equality of two outputs, with diagnostics when they differ."""
    torch = env.torch
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return False, f"{what}: shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if got.numel() == 0:
        return True, f"{what}: empty [0, {got.shape[1]}] as expected"
    g, w = got.float(), want.float()
    bits = (lambda t: t.view(torch.int16)) if got.element_size() == 2 else (lambda t: t.view(torch.int32))
    same = bits(got) == bits(want)
    nz = float(w.abs().sum())
    if bool(same.all()):
        return nz > 0, f"{what}: bitwise equal ({got.shape[0]} x {got.shape[1]})" + ("" if nz > 0 else
                                                                                        " BUT ALL ZERO")
    bad = (~same).nonzero()
    t, n = (int(v) for v in bad[0])
    diff = (g - w).abs()
    rel = float(((g - w) ** 2).mean().sqrt() / ((w ** 2).mean().sqrt() + 1e-30))
    return False, (f"{what}: {bad.shape[0]} of {same.numel()} elements differ; first at token {t} feature {n}: "
                   f"{float(g[t, n])!r} vs {float(w[t, n])!r}; max |diff| {float(diff.nan_to_num(1e30).max()):.4g}, "
                   f"rel RMS {rel:.3g}, NaN got/want {int(g.isnan().sum())}/{int(w.isnan().sum())}")


def make_case(env, quant_mode, ids, wts, seed=0):
    case = env.testing.make_fused_moe_case(quant_mode, ids.shape[0], H, I, E, ids.shape[1], seed, routing=(ids, wts))
    return {k: env.to_dev(v) for k, v in case.items()}


def rank_slice(case, bounds, rank):
    total = case["topk_ids"].shape[0]
    mine = dict(case)
    lo, hi = bounds[rank], bounds[rank + 1]
    for key in ("x", "x_scale", "per_token_scale", "topk_ids", "topk_weights"):
        v = case.get(key)
        if v is not None and v.shape[0] == total and not (key == "x_scale" and v.numel() == 1 and total != 1):
            mine[key] = v[lo:hi].contiguous()
    return mine


def single_gpu(env, mine, tactic, **kw):
    from qmoe import ops

    args = {k: v for k, v in mine.items() if k not in ("num_local_experts", "local_expert_offset")}
    return ops.fused_moe(**args, deterministic=True, tactic=tactic, **kw)


def local_weights(env, case):
    """This rank's E / world experts of every weight tensor (None where the case has none)."""
    per = E // env.world
    sl = slice(env.rank * per, (env.rank + 1) * per)
    return {k: (None if case.get(k) is None else case[k][sl]) for k in ("w1", "w1_scale", "w2", "w2_scale", "w1_alpha",
                                                                         "w2_alpha")}


def ep_forward(env, layer, case, mine, mode, tactic, capacity=None, drop=(), out=None, chunks=None, **kw):
    w = local_weights(env, case)
    extra = {k: mine.get(k) for k in ("x_scale", "fc2_input_scale", "per_token_scale") if k not in drop}
    return layer.forward(mine["x"], mine["topk_ids"], mine["topk_weights"], w["w1"], w["w1_scale"], w["w2"],
                         w["w2_scale"], w1_alpha=w["w1_alpha"], w2_alpha=w["w2_alpha"], mode=mode,
                         max_tokens_per_rank=capacity if mode == "low_latency" else None, tactic=tactic, out=out,
                         chunks=chunks, **extra, **kw)


def make_layer(env, transport, case, engine="cpp"):
    from qmoe.ep import ExpertParallelMoE

    return ExpertParallelMoE(env.world, env.rank, E, transport=transport, quant_mode=case["quant_mode"],
                             activation=case["activation"], gate_up_layout=case["gate_up_layout"],
                             low_latency_engine=engine)


def sync(env):
    if not env.cpu:
        env.torch.cuda.synchronize()


def capture_graph(fn):
    """A CUDA graph of fn() after two eager warm-ups on a side stream (qmoe.testing.capture_graph)."""
    from qmoe import testing

    return testing.capture_graph(fn, 2)


# ---- checks ----------------------------------------------------------------------------------------

def check_transport(env, transport):
    torch = env.torch
    world, rank = env.world, env.rank
    size = lambda src, dst: (3 * src + 5 * dst + 1) if (src + dst) % 3 else 0  # noqa: E731 - zero sizes too
    sends = [torch.arange(size(rank, d) * 4, device=env.device, dtype=torch.int32).reshape(-1, 4) + 1000 * rank
             for d in range(world)]
    recv_counts = [size(s, rank) for s in range(world)]
    out = torch.full((sum(recv_counts) + 1, 4), -7, dtype=torch.int32, device=env.device)
    recvs = transport.all_to_all(sends, recv_counts, out=out)
    sync(env)
    for s in range(world):
        want = torch.arange(size(s, rank) * 4, device=env.device, dtype=torch.int32).reshape(-1, 4) + 1000 * s
        if not torch.equal(recvs[s], want):
            return False, f"rows from rank {s} differ: got {recvs[s][:2].tolist()} want {want[:2].tolist()}"
    if int(out[-1, 0]) != -7:
        return False, "a receive wrote past its slice of out"
    return True, f"sizes per peer {recv_counts} (zero-size peers skipped, self copy included)"


def check_equal(env, name, transport, quant_mode, mode, ids, wts, bounds, tactics, capacity, drop=(), whole=False,
                engine="cpp"):
    """EP == single GPU on each rank's tokens, for each tactic (None = heuristic: reported, must agree
    bitwise when both sides pick the same tactic, else within 1e-2 rel RMS). engine: the layer's
    low_latency_engine; the engine that ran must be the one expected (cpp on GPUs, else python)."""
    case = make_case(env, quant_mode, ids, wts)
    mine = rank_slice(case, bounds, env.rank)
    for key in drop:
        mine[key] = None
    layer = make_layer(env, transport, case, engine)
    for tactic in tactics:
        label = f"{name} [tactic {tactic or 'heuristic'}]"
        got = ep_forward(env, layer, case, mine, mode, tactic, capacity, drop)
        ran = "cpp" if mode == "low_latency" and engine == "cpp" and not env.cpu else "python"
        if layer.last_engine != ran:
            env.report(label, False, f"engine {layer.last_engine!r} ran, expected {ran!r}")
            continue
        want = single_gpu(env, mine, tactic)
        sync(env)
        ok, detail = compare(env, got, want, "EP vs single GPU")
        if not ok and tactic is None and "differ" in detail:
            rel = float(((got.float() - want.float()) ** 2).mean().sqrt() / ((want.float() ** 2).mean().sqrt()))
            ok = rel <= 1e-2
            detail += f" (heuristic tactics may differ between the two problem sizes: rel RMS {rel:.3g} <= 1e-2: {ok})"
        env.report(label, ok, detail)
        if whole and (tactic is not None or env.cpu):
            check_whole_batch(env, label, case, got, bounds, tactic)


def check_cpp_layer(env, transport, quant_mode, ids, wts, bounds, tactic, capacity, deterministic=True):
    """A C++ layer (include/qmoe/expert_parallel_layer.h): low latency with capacity C, or throughput with
    capacity None, on the transport's NCCL communicator == single GPU on each rank's tokens, bitwise
    (pinned tactic). deterministic=False (the reduced combine: owners finalize, partial rows come back):
    every element written (NaN-poisoned output) and within 1e-2 relative RMS of the single GPU's fused
    finalize (two-level sums: not bitwise by design)."""
    from qmoe import _C, ops
    from qmoe._tensors import current_stream

    torch = env.torch
    case = make_case(env, quant_mode, ids, wts)
    mine = rank_slice(case, bounds, env.rank)
    per = E // env.world
    w = local_weights(env, case)
    tokens = mine["topk_ids"].shape[0]
    out = torch.full((tokens, H), float("nan"), dtype=torch.bfloat16, device=env.device)
    call = ops._layer_call(quant_mode, mine["x"], mine.get("x_scale"), mine["topk_ids"], mine["topk_weights"], w["w1"],
                           w["w1_scale"], w["w1_alpha"], mine.get("fc2_input_scale"), w["w2"], w["w2_scale"],
                           w["w2_alpha"], mine.get("per_token_scale"), (out, "output"), E, per, env.rank * per,
                           case["activation"], 1.0, 0.0, float("inf"), 1.0, None, case["gate_up_layout"], deterministic,
                           1.0, tactic)
    if capacity is None:  # the throughput layer
        _C.ep_throughput_layer(call, env.world, env.rank, transport.comm, current_stream(out))
        what = f"C++ throughput layer ({quant_mode})"
    else:
        nbytes = _C.ep_low_latency_layer_workspace_size(call, env.world, env.rank, capacity)
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=env.device)
        _C.ep_low_latency_layer(call, env.world, env.rank, capacity, transport.comm, ops.arg(workspace, "workspace"),
                                current_stream(out))
        what = f"C++ low-latency layer ({quant_mode}, {nbytes} B workspace)"
    if not deterministic:
        args = {k: v for k, v in mine.items() if k not in ("num_local_experts", "local_expert_offset")}
        want = ops.fused_moe(**args, deterministic=False, tactic=tactic)
        sync(env)
        g, w_ = out.float(), want.float()
        rel = float(((g - w_) ** 2).mean().sqrt() / ((w_ ** 2).mean().sqrt() + 1e-30)) if g.numel() else 0.0
        nan = int(g.isnan().sum())
        ok = nan == 0 and rel <= 1e-2 and (g.numel() == 0 or float(w_.abs().sum()) > 0)
        return ok, f"{what}, reduced combine vs single GPU fused finalize: rel RMS {rel:.3g}, NaN {nan} ({tokens} x {H})"
    want = single_gpu(env, mine, tactic)
    sync(env)
    return compare(env, out, want, f"{what} vs single GPU")


def check_equal_chunks_empty(env, transport, ids, wts):
    """chunks=2 while rank 1 holds no token: its two chunks are empty, it still computes and returns
    rank 0's rows."""
    case = make_case(env, "w4a8_int4", ids, wts)
    mine = rank_slice(case, [0, 24, 24], env.rank)
    layer = make_layer(env, transport, case)
    tactic = env.tactic(PINNED[0])
    got = ep_forward(env, layer, case, mine, "low_latency", tactic, 24, chunks=2)
    want = single_gpu(env, mine, tactic)
    sync(env)
    ok, detail = compare(env, got, want, "chunks=2 vs single GPU")
    env.report("low_latency/chunks_empty", ok and layer.last_chunks == 2, detail)


def check_whole_batch(env, label, case, got, bounds, tactic):
    """Static a1: the ranks' outputs concatenated == fused_moe of the whole global batch."""
    import torch.distributed as dist

    torch = env.torch
    parts = [None] * env.world
    dist.all_gather_object(parts, got.view(torch.int16).cpu().numpy())
    whole = single_gpu(env, case, tactic).view(torch.int16).cpu().numpy()
    joined = np.concatenate(parts)
    ok = joined.shape == whole.shape and np.array_equal(joined, whole)
    env.report(label.replace("uniform", "batch"), ok,
               "ranks' outputs together == fused_moe(whole batch)" if ok else
               f"{int(np.sum(joined != whole)) if joined.shape == whole.shape else 'shape'} elements differ")


def check_chunks(env, transport, chunks, bounds, capacity, seed):
    """Low-latency forward(chunks=n) == forward(chunks=1) == single GPU, bitwise (pinned tactic;
    heuristic: == chunks=1 bitwise, since the unchunked call's tactic is pinned)."""
    ids, wts = routing(bounds[-1], K, E, seed=seed)
    case = make_case(env, "w4a8_int4", ids, wts, seed=seed % 97)
    mine = rank_slice(case, bounds, env.rank)
    layer = make_layer(env, transport, case)
    tactics = [env.tactic(PINNED[0]), None] if not env.cpu else [None]
    results = []
    for tactic in tactics:
        one = ep_forward(env, layer, case, mine, "low_latency", tactic, capacity, chunks=1)
        got = ep_forward(env, layer, case, mine, "low_latency", tactic, capacity, chunks=chunks)
        used = (layer.last_chunks, layer.last_tactic)
        sync(env)
        ok1, d1 = compare(env, got, one, f"chunks={chunks} vs chunks=1")
        ok, detail = ok1 and used[0] == chunks, f"{d1}; used chunks/tactic {used}"
        if tactic is not None or env.cpu:
            want = single_gpu(env, mine, tactic)
            sync(env)
            ok2, d2 = compare(env, got, want, "vs single GPU")
            ok, detail = ok and ok2, f"{detail}; {d2}"
        results.append((tactic, ok, detail))
    for tactic, ok, detail in results:
        env.report(f"low_latency/chunks{chunks} [tactic {tactic or 'heuristic'}]", ok, detail)


def check_chunks_graph(env, transport):
    """chunks=2 captured once (side stream forked from and joined into the capture stream), replayed
    with new inputs written in place: == eager chunks=1 == single GPU."""
    torch = env.torch
    capacity, bounds = 24, [0, 21, 37]
    ids, wts = routing(37, K, E, seed=510)
    case = make_case(env, "w4a8_int4", ids, wts, seed=7)
    mine = rank_slice(case, bounds, env.rank)
    layer = make_layer(env, transport, case)
    tactic = PINNED[0]
    static = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in mine.items()}
    out = torch.empty((static["x"].shape[0], H), dtype=torch.bfloat16, device=env.device)

    def call():
        return ep_forward(env, layer, case, static, "low_latency", tactic, capacity, out=out, chunks=2)

    graph = capture_graph(call)  # two warm-ups: NCCL peer connections, the layer's exchange stream, pools
    ids2, wts2 = routing(37, K, E, seed=511, lo=E // 2, hi=E, share=0.5)
    case2 = make_case(env, "w4a8_int4", ids2, wts2, seed=8)
    mine2 = rank_slice(case2, bounds, env.rank)
    for key in ("x", "topk_ids", "topk_weights"):
        static[key].copy_(mine2[key])
    graph.replay()
    graph.replay()  # twice: a replay must not depend on the previous one's leftovers
    torch.cuda.synchronize()
    replayed = out.clone()
    eager_in = dict(mine2)
    eager_in["x_scale"], eager_in["fc2_input_scale"] = mine["x_scale"], mine["fc2_input_scale"]
    eager = ep_forward(env, layer, case, eager_in, "low_latency", tactic, capacity, chunks=1)
    ref_in = dict(case)
    ref_in.update({k: eager_in[k] for k in ("x", "topk_ids", "topk_weights", "x_scale", "fc2_input_scale")})
    want = single_gpu(env, ref_in, tactic)
    torch.cuda.synchronize()
    ok1, d1 = compare(env, replayed, eager, "chunks=2 graph replay vs eager chunks=1")
    ok2, d2 = compare(env, replayed, want, "vs single GPU")
    env.report("low_latency/chunks_graph", ok1 and ok2, f"{d1}; {d2}")


def check_graph(env, transport, engine="cpp"):
    """Low-latency layer captured once, replayed with new inputs written in place (engine: the layer's
    low_latency_engine)."""
    torch = env.torch
    capacity, bounds = 24, [0, 20, 37]
    ids, wts = routing(37, K, E, seed=500)
    case = make_case(env, "w4a8_int4", ids, wts, seed=5)
    mine = rank_slice(case, bounds, env.rank)
    layer = make_layer(env, transport, case, engine)
    tactic = PINNED[0]
    static = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in mine.items()}
    out = torch.empty((static["x"].shape[0], H), dtype=torch.bfloat16, device=env.device)

    def call():
        return ep_forward(env, layer, case, static, "low_latency", tactic, capacity, out=out)

    graph = capture_graph(call)  # two warm-ups: NCCL peer connections, allocator pools
    # New tokens and routing, same shapes: written into the captured inputs.
    ids2, wts2 = routing(37, K, E, seed=501, lo=0, hi=E // 2, share=0.5)
    case2 = make_case(env, "w4a8_int4", ids2, wts2, seed=6)
    mine2 = rank_slice(case2, bounds, env.rank)
    for key in ("x", "topk_ids", "topk_weights"):
        static[key].copy_(mine2[key])
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    graph.replay()  # twice: a replay must not depend on the previous one's leftovers
    torch.cuda.synchronize()
    again = out.clone()
    eager_in = dict(mine2)
    eager_in["x_scale"], eager_in["fc2_input_scale"] = mine["x_scale"], mine["fc2_input_scale"]
    eager = ep_forward(env, layer, case, eager_in, "low_latency", tactic, capacity)
    # case2's weights are case's (same seed offsets would differ): the single-GPU reference uses case's.
    ref_in = dict(case)
    ref_in.update({k: eager_in[k] for k in ("x", "topk_ids", "topk_weights", "x_scale", "fc2_input_scale")})
    want = single_gpu(env, ref_in, tactic)
    torch.cuda.synchronize()
    ok1, d1 = compare(env, replayed, eager, "graph replay vs eager")
    ok2, d2 = compare(env, again, replayed, "second replay vs first")
    ok3, d3 = compare(env, replayed, want, "graph replay vs single GPU")
    env.report(f"low_latency/graph/{engine}_engine", ok1 and ok2 and ok3, f"{d1}; {d2}; {d3}")


def check_reduced(env, transport, mode, graph):
    """forward(deterministic=False), the reduced combine: every element written (NaN-poisoned out) and
    within 1e-2 relative RMS of one GPU's fused finalize (not bitwise by design). graph=True (low
    latency): captured once, replayed with new tokens and routing written into the captured inputs."""
    from qmoe import ops

    torch = env.torch
    capacity, bounds = 24, [0, 21, 41]
    ids, wts = routing(41, K, E, seed=950)
    case = make_case(env, "w4a8_int4", ids, wts, seed=9)
    mine = rank_slice(case, bounds, env.rank)
    layer = make_layer(env, transport, case)
    tactic = env.tactic(PINNED[0])
    static = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in mine.items()}
    out = torch.full((static["x"].shape[0], H), float("nan"), dtype=torch.bfloat16, device=env.device)

    def call():
        return ep_forward(env, layer, case, static, mode, tactic, capacity, out=out, deterministic=False)

    if graph:
        g = capture_graph(call)
        ids2, wts2 = routing(41, K, E, seed=951, lo=0, hi=E // 2, share=0.5)
        mine2 = rank_slice(make_case(env, "w4a8_int4", ids2, wts2, seed=10), bounds, env.rank)
        for key in ("x", "topk_ids", "topk_weights"):
            static[key].copy_(mine2[key])
        out.fill_(float("nan"))
        g.replay()
    else:
        call()
    args = {k: v for k, v in static.items() if k not in ("num_local_experts", "local_expert_offset")}
    want = ops.fused_moe(**args, deterministic=False, tactic=tactic)
    sync(env)
    gf, wf = out.float(), want.float()
    rel = float(((gf - wf) ** 2).mean().sqrt() / ((wf ** 2).mean().sqrt() + 1e-30))
    nan = int(gf.isnan().sum())
    ok = nan == 0 and rel <= 1e-2 and float(wf.abs().sum()) > 0
    return ok, (f"reduced combine ({mode}{', graph replay with new inputs' if graph else ''}) vs single GPU fused "
                f"finalize: rel RMS {rel:.3g}, NaN {nan} ({out.shape[0]} x {H})")


def check_capacity(env, transport):
    ids, wts = routing(10, K, E, seed=600)
    case = make_case(env, "w4a8_int4", ids, wts)
    mine = rank_slice(case, [0, 5, 10], env.rank)  # 5 tokens on each rank: both refuse, nobody waits
    layer = make_layer(env, transport, case)
    try:
        ep_forward(env, layer, case, mine, "low_latency", None, capacity=4)
    except ValueError as e:
        ok = "max_tokens_per_rank" in str(e) and "T = 5" in str(e)
        env.report("low_latency/capacity", ok, f"ValueError: {e}")
        return
    env.report("low_latency/capacity", False, "no error for T = 5 > max_tokens_per_rank = 4")


# ---- driver ----------------------------------------------------------------------------------------

def run_checks(env, transport, only):
    def guarded(name, fn, *args, **kw):
        if only and not any(o in name for o in only):
            return
        try:
            fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - reported as a FAIL line with the traceback
            env.report(name, False, f"{type(e).__name__}: {e}")
            traceback.print_exc()
            sys.stdout.flush()
            agree(env)  # may time out when the peer is stuck in NCCL: then the process ends here
            return
        agree(env)

    def transport_check():
        ok, detail = check_transport(env, transport)
        env.report("transport", ok, detail)

    guarded("transport", transport_check)
    tactics = [env.tactic(t) for t in PINNED] + [None] if not env.cpu else [None]
    per = E // env.world
    for mode in ("throughput", "low_latency"):
        ids, wts = routing(73, K, E, seed=100)
        guarded(f"{mode}/uniform", check_equal, env, f"{mode}/uniform", transport, "w4a8_int4", mode, ids, wts,
                [0, 40, 73], tactics, 40, whole=True)
        if mode == "low_latency":
            guarded(f"{mode}/uniform/python_engine", check_equal, env, f"{mode}/uniform/python_engine", transport,
                    "w4a8_int4", mode, ids, wts, [0, 40, 73], tactics, 40, whole=True, engine="python")
        ids, wts = routing(64, K, E, seed=200, lo=per, hi=2 * per, share=0.8)
        guarded(f"{mode}/skewed", check_equal, env, f"{mode}/skewed", transport, "w4a8_int4", mode, ids, wts,
                [0, 32, 64], tactics[:1], 32)
        ids, wts = routing(30, K, E, seed=300, only_below=per)
        guarded(f"{mode}/no_recv", check_equal, env, f"{mode}/no_recv", transport, "w4a8_int4", mode, ids, wts,
                [0, 14, 30], tactics[:1], 16)
        ids, wts = routing(24, K, E, seed=400)
        guarded(f"{mode}/empty", check_equal, env, f"{mode}/empty", transport, "w4a8_int4", mode, ids, wts,
                [0, 24, 24], tactics[:1], 24)
        ids, wts = routing(50, K, E, seed=450)
        guarded(f"{mode}/dyn_a1", check_equal, env, f"{mode}/dyn_a1", transport, "w4a8_int4", mode, ids, wts,
                [0, 26, 50], tactics[:1], 26, drop=("x_scale",))
    if not env.cpu:
        guarded("low_latency/graph", check_graph, env, transport)
        guarded("low_latency/graph/python_engine", check_graph, env, transport, "python")
    for mode, graph in (("throughput", False), ("low_latency", False), ("low_latency", True)):
        label = f"{mode}/reduced{'/graph' if graph else ''}"
        if graph and env.cpu:
            continue

        def reduced_check(mode=mode, graph=graph, label=label):
            ok, detail = check_reduced(env, transport, mode, graph)
            env.report(label, ok, detail)

        guarded(label, reduced_check)
    guarded("low_latency/capacity", check_capacity, env, transport)
    big = [0, 300, 523] if not env.cpu else [0, 40, 73]  # GPU: 2400 slots per chunk (multi-CTA routing)
    for n in (2, 3):
        guarded(f"low_latency/chunks{n}", check_chunks, env, transport, n, big, big[1], 800 + n)
    ids, wts = routing(24, K, E, seed=820)
    guarded("low_latency/chunks_empty", check_equal_chunks_empty, env, transport, ids, wts)
    if not env.cpu:
        guarded("low_latency/chunks_graph", check_chunks_graph, env, transport)
    if not env.cpu:  # the C++ layer's exchange is NCCL
        for quant_mode, tactic in (("w4a8_int4", env.tactic(PINNED[0])), ("w4a16", env.tactic(PINNED_BF16))):
            ids, wts = routing(61, K, E, seed=900)
            name = f"cpp_layer/{quant_mode}"

            for capacity in (33, None):  # low latency, throughput
                for det in (True, False):
                    label = f"{name}/{'low_latency' if capacity else 'throughput'}{'' if det else '/reduced'}"

                    def cpp_check(quant_mode=quant_mode, tactic=tactic, ids=ids, wts=wts, label=label,
                                  capacity=capacity, det=det):
                        ok, detail = check_cpp_layer(env, transport, quant_mode, ids, wts, [0, 33, 61], tactic,
                                                     capacity, det)
                        env.report(label, ok, detail)

                    guarded(label, cpp_check)
    for quant_mode in ("w4a16_int4", "w4a4", "w4a8", "w4a16"):
        for mode in ("throughput", "low_latency"):
            ids, wts = routing(41, K, E, seed=700)
            name = f"bf16/{quant_mode}/{mode}"
            guarded(name, check_equal, env, name, transport, quant_mode, mode, ids, wts, [0, 21, 41],
                    [env.tactic(PINNED_BF16)], 21)


def agree(env):
    """Both ranks finish a check before the next one starts (gloo; times out if a peer hangs)."""
    import torch.distributed as dist

    dist.barrier()


def rank_main(rank, world, cpu, only) -> int:
    import torch
    import torch.distributed as dist

    from qmoe import _C
    from qmoe.ep_transport import NcclTransport, ProcessGroupTransport, nccl_available

    env = Env(rank, world, cpu)
    start = time.time()
    if rank == 0:
        print(f"== EP on {world} ranks: torch {torch.__version__}, NCCL_NVLS_ENABLE="
              f"{os.environ.get('NCCL_NVLS_ENABLE')}, kernels built: {_C.kernels_built()}, "
              f"{'CPU (reference engine, gloo transport)' if cpu else torch.cuda.get_device_name()}", flush=True)
    if cpu:
        transport = ProcessGroupTransport()
    else:
        if not _C.kernels_built() or not nccl_available():
            env.report("setup", False, f"kernels built {_C.kernels_built()}, NCCL loadable {nccl_available()}")
            return 1
        transport = NcclTransport.from_process_group()
        if rank == 0:
            print(f"   NCCL {_C.nccl_version()} from {_C.nccl_library()}", flush=True)
    try:
        run_checks(env, transport, only)
    finally:
        if not cpu:
            sync(env)
            transport.close()
    failed = torch.tensor([len(env.failures)], dtype=torch.int64)
    dist.all_reduce(failed)
    print(f"[rank {rank}] {env.passes} passed, {len(env.failures)} failed in {time.time() - start:.1f} s"
          + (f": {', '.join(env.failures)}" if env.failures else ""), flush=True)
    if rank == 0:
        print(f"== EP two-rank test: {'ALL PASSED' if int(failed[0]) == 0 else f'{int(failed[0])} FAILED (all ranks)'}",
              flush=True)
    return 1 if int(failed[0]) else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU tensors, reference engine, gloo transport")
    parser.add_argument("--only", default="", help="comma list of substrings of check names to run")
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds before hung ranks are terminated")
    args = parser.parse_args()
    only = [o for o in args.only.split(",") if o]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        import datetime

        import torch
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if not args.cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
        rc = rank_main(rank, world, args.cpu, only)
        dist.destroy_process_group()
        return rc
    from qmoe.ep_transport import spawn_local

    if not args.cpu:
        import torch

        if torch.cuda.device_count() < 2:
            print(f"FAIL setup: 2 GPUs needed, {torch.cuda.device_count()} visible")
            return 1
    rc = spawn_local(rank_main, 2, (args.cpu, only), timeout_s=args.timeout)
    if rc:
        print("== EP two-rank test: FAILED (see the FAIL lines above)", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
