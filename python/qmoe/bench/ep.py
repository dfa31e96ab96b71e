"""`python3 -m qmoe.bench.ep`: expert parallelism on 2 GPUs of one host (docs/expert-parallel.md).

Weak scaling, one w4a8_int4 MoE layer at model shapes (E, top-k, H, I of qmoe.testing.MODEL_SHAPES),
T tokens per rank, uniform top-k routing, static a1 / a2, deterministic finalize:
  single   one GPU (rank 0's) with ALL experts and T tokens: qmoe.fused_moe(deterministic=True), as a
           CUDA-graph replay and as an eager call (events, from an idle GPU);
  EP       2 GPUs, each with half the experts and its own T tokens (2T in all): throughput mode timed
           eagerly (it syncs the host once for the counts), low-latency mode as a CUDA-graph replay;
           each sample starts on both ranks together (gloo barrier); the time is the slower rank's
           median. ratios: throughput / single eager, low latency / single graph (target <= 1.25: the
           same work per GPU plus the exchange). The LL columns run forward(chunks=1) (one exchange
           each way); --chunks N adds, per N, the low-latency graph replay with forward(chunks=N)
           (exchanges on a side stream, overlapped with the other chunk's GEMMs, which leave
           --comm-sms SMs free for NCCL's kernels), its ratio, and whether its output is bitwise the
           chunks=1 output (rank 0).
  split    prep (plan + count exchange + quantize + pack; "prep host": the host's time for the same
           phase) / dispatch / compute (moe_expert_rows) / combine / finalize (through row_index)
           of an eager throughput forward, CUDA events at the phase marks (ExpertParallelMoE.forward's
           timeline), medians, slower rank;
  link     bytes each rank sends to the other rank in dispatch and combine (packed rows: e4m3 x, a1,
           ids; bf16 rows back), the achieved GB/s over the phase time, and a plain grouped NCCL
           send/recv of exactly those byte counts (same transport, uint8 buffers, nothing else) for
           the link's rate at that size; peer numbers of torch all_to_all_single in
           shared/peers/h200x2-nccl-all-to-all.md.
  check    rank 0's EP output vs the single-GPU output of the same tokens (heuristic tactics on both
           sides, which may differ with the problem size): bitwise, else rel RMS.
  C++      with --cpp, the C++ layers (include/qmoe/expert_parallel_layer.h) on the same communicator:
           low latency as a graph replay, throughput eagerly (it waits on the host three times).
Markdown table on stdout (rank 0); --out-dir writes <date>_h200x2_ep.md and .json too.
--cpu: the same code on CPU tensors (reference engine, gloo point-to-point transport, shapes shrunk by
--shrink, no graphs, wall-clock timing): a test of this script, not a benchmark.
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

DEFAULT_MODELS = ("deepseek_v3", "qwen3_235b_a22b")
DEFAULT_TOKENS = (64, 512, 4096)
A2 = 8.0 / 448


def _parse(argv):
    p = argparse.ArgumentParser(prog="python3 -m qmoe.bench.ep", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="tokens per rank")
    p.add_argument("--modes", default="throughput,low_latency")
    p.add_argument("--chunks", default="2", help="extra low-latency chunk counts (> 1), comma list; '' for none")
    p.add_argument("--cpp", action="store_true",
                   help="also time the C++ layers (include/qmoe/expert_parallel_layer.h) on the same NCCL communicator")
    p.add_argument("--comm-sms", type=int, default=16,
                   help="SMs a chunked forward leaves to NCCL while its GEMMs run (ExpertParallelMoE comm_sms)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out-dir", default="")
    p.add_argument("--timeout", type=float, default=540.0)
    p.add_argument("--cpu", action="store_true", help="CPU tensors, shrunk shapes: tests the script")
    p.add_argument("--shrink", type=int, default=16, help="--cpu: divide E, H and I by this (H, I kept >= 128)")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.modes = [m for m in args.modes.split(",") if m]
    args.chunks = [int(c) for c in args.chunks.split(",") if c and int(c) > 1]
    return args


class _Clock:
    """CUDA events on the GPU, wall clock on the CPU."""

    def __init__(self, torch, cpu):
        self.torch, self.cpu = torch, cpu

    def mark(self):
        if self.cpu:
            return time.perf_counter()
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def us(self, a, b):
        if self.cpu:
            return (b - a) * 1e6
        b.synchronize()
        return a.elapsed_time(b) * 1000.0

    def sync(self):
        if not self.cpu:
            self.torch.cuda.synchronize()


def _dims(model, args):
    from .. import testing

    experts, topk, hidden, inter = testing.MODEL_SHAPES[model]
    if args.cpu:
        experts = max(4, experts // args.shrink)
        hidden = max(128, hidden // args.shrink // 128 * 128)
        inter = max(128, inter // args.shrink // 128 * 128)
    return experts, topk, hidden, inter


def _weights(torch, device, experts, hidden, inter, seed):
    """Random int4 codes and bf16 group scales around 1/(4.6 sqrt(K)) (W . x stays O(|x|)); the same on
    every rank (same seed), so rank r's half is a slice."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def scales(n, k):
        base = 1.0 / (4.6 * k ** 0.5)
        return (torch.rand(common.scale_shape(experts, n, k), generator=gen, device=device) + 0.5).mul_(base).to(
            torch.bfloat16)

    w1 = torch.randint(-128, 128, (experts, 2 * inter, hidden // 2), generator=gen, device=device, dtype=torch.int8)
    w2 = torch.randint(-128, 128, (experts, hidden, inter // 2), generator=gen, device=device, dtype=torch.int8)
    return dict(w1=w1, w1_scale=scales(2 * inter, hidden), w2=w2, w2_scale=scales(hidden, inter))


def _median_max(torch, samples):
    """Median of this rank's samples, then the max over ranks (gloo)."""
    import torch.distributed as dist

    t = torch.tensor([statistics.median(samples) if samples else float("nan")], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _barrier(clock):
    import torch.distributed as dist

    clock.sync()
    dist.barrier()


def _time_ep(torch, clock, fn, iters, warmup):
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        _barrier(clock)
        a = clock.mark()
        fn()
        b = clock.mark()
        samples.append(clock.us(a, b))
    return _median_max(torch, samples)


def _graph(torch, fn, warmup):
    from ..testing import capture_graph

    return capture_graph(fn, warmup)


def _plain_exchange_us(torch, clock, transport, send_bytes, recv_bytes, device, iters):
    """A grouped send/recv of exactly these per-peer byte counts (uint8 buffers), median, slower rank."""
    sends = [torch.empty(int(b), dtype=torch.uint8, device=device) for b in send_bytes]
    out = torch.empty(int(sum(recv_bytes)), dtype=torch.uint8, device=device)
    return _time_ep(torch, clock, lambda: transport.all_to_all(sends, list(recv_bytes), out=out), iters, 2)


def _peer_bytes(torch, ids, num_experts, world, rank, hidden, packed_width, capacity):
    """Bytes this rank sends to each peer: dispatch (packed rows) and combine (throughput: bf16 rows of
    the peer's slots this rank owns; low latency: C*k rows per peer). Host-side, outside any timing."""
    import numpy as np
    import torch.distributed as dist

    per = num_experts // world
    ids_h = ids.cpu().numpy().astype(np.int64)
    valid = (ids_h >= 0) & (ids_h < num_experts)
    owner = np.where(valid, ids_h // per, -1)
    tokens_to = [int(np.any(owner == d, axis=1).sum()) for d in range(world)]
    slots_of_mine_owned_by = [int((owner == d).sum()) for d in range(world)]
    # What peers send back to me = my slots they own; what I send back to peer s = s's slots I own.
    mine = torch.tensor(slots_of_mine_owned_by, dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    combine_to = [int(gathered[s][rank]) for s in range(world)]
    top_k = ids.shape[1]
    return dict(dispatch=[t * packed_width for t in tokens_to],
                combine_thr=[c * hidden * 2 for c in combine_to],
                combine_ll=[capacity * top_k * hidden * 2] * world,
                dispatch_ll=[capacity * packed_width] * world)


def _time_cpp_layers(torch, clock, args, transport, world, rank, experts, x, ids, wts, a1, a2, local, tokens,
                     hidden, deterministic=True, single_out=None) -> dict:
    """us of the C++ low-latency layer (graph replay, capacity = tokens) and throughput layer (eager).
    deterministic=False: the reduced combine (keys cpp_ll_fused_us, cpp_thr_fused_us), and with
    single_out (fused_moe over all experts on this rank's tokens, fused finalize) the relative RMS of
    both layers' outputs against it (cpp_fused_rel_rms, the larger of the two)."""
    from .. import _C, ops
    from .._tensors import current_stream

    per = experts // world
    tag = "" if deterministic else "_fused"
    out = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=x.device)
    call = ops._layer_call("w4a8_int4", x, a1, ids, wts, local["w1"], local["w1_scale"], None, a2, local["w2"],
                           local["w2_scale"], None, None, (out, "output"), experts, per, rank * per, "swiglu", 1.0,
                           0.0, float("inf"), 1.0, None, "gate_up", deterministic, 1.0, None)
    nbytes = _C.ep_low_latency_layer_workspace_size(call, world, rank, tokens)
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=x.device)

    def ll():
        _C.ep_low_latency_layer(call, world, rank, tokens, transport.comm, ops.arg(workspace, "workspace"),
                                current_stream(out))

    def rel_rms():
        ref = single_out.float()
        return float((out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))

    errors = []
    graph = _graph(torch, ll, args.warmup)
    result = {f"cpp_ll{tag}_us": _time_ep(torch, clock, graph.replay, args.iters, 1)}
    del graph
    if single_out is not None:
        out.fill_(float("nan"))
        ll()
        torch.cuda.synchronize()
        errors.append(rel_rms())
    thr = lambda: _C.ep_throughput_layer(call, world, rank, transport.comm, current_stream(out))  # noqa: E731
    result[f"cpp_thr{tag}_us"] = _time_ep(torch, clock, thr, args.iters, args.warmup)
    if single_out is not None:
        out.fill_(float("nan"))
        thr()
        torch.cuda.synchronize()
        errors.append(rel_rms())
        result["cpp_fused_rel_rms"] = max(errors)
    return result


def _split(torch, clock, layer, run, iters):
    """Median per phase of an eager forward (timeline marks), slower rank. prep_host: the host's own
    time from the start to the dispatch mark (perf_counter); next to prep (GPU events) it tells a
    host-bound prep (Python work, the count sync) from GPU work."""
    import time

    names = ("prep", "dispatch", "compute", "combine", "finalize")
    samples = {n: [] for n in names + ("prep_host",)}
    for _ in range(iters):
        marks, host = {}, {}

        def mark(name):
            host[name] = time.perf_counter()
            marks[name] = clock.mark()

        _barrier(clock)
        mark("start")
        run(mark)
        order = ["start", "dispatch", "compute", "combine", "finalize", "end"]
        for n, (a, b) in zip(names, zip(order, order[1:])):
            samples[n].append(clock.us(marks[a], marks[b]))
        samples["prep_host"].append((host["dispatch"] - host["start"]) * 1e6)
    return {n: _median_max(torch, samples[n]) for n in names + ("prep_host",)}


def rank_main(rank, world, args) -> int:
    import torch
    import torch.distributed as dist

    from .. import ops
    from ..ep import ExpertParallelMoE
    from ..ep_transport import NcclTransport, ProcessGroupTransport

    clock = _Clock(torch, args.cpu)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    transport = ProcessGroupTransport() if args.cpu else NcclTransport.from_process_group()
    rows = []
    for model in args.models:
        experts, top_k, hidden, inter = _dims(model, args)
        weights = _weights(torch, device, experts, hidden, inter, seed=1)
        per = experts // world
        local = {k: v[rank * per:(rank + 1) * per] for k, v in weights.items()}
        layer = ExpertParallelMoE(world, rank, experts, transport=transport, quant_mode="w4a8_int4",
                                  comm_sms=args.comm_sms)
        for tokens in args.tokens:
            gen = torch.Generator(device=device).manual_seed(1000 + 17 * rank + tokens)
            x = torch.randn((tokens, hidden), generator=gen, device=device).to(torch.bfloat16)
            ids = common.routing(torch, tokens, top_k, experts, gen, device=device)
            wts = torch.rand((tokens, top_k), generator=gen, device=device).add_(0.1)
            a1 = (x.float().abs().amax() / 448).reshape(1)
            a2 = torch.full((1,), A2, dtype=torch.float32, device=device)
            row = dict(model=model, E=experts, topk=top_k, H=hidden, I=inter, T=tokens)

            def single(out=None, fused=False):
                return ops.fused_moe(x, ids, wts, weights["w1"], weights["w1_scale"], weights["w2"],
                                     weights["w2_scale"], quant_mode="w4a8_int4", num_experts=experts, x_scale=a1,
                                     fc2_input_scale=a2, deterministic=not fused, out=out)

            def ep(mode, out=None, timeline=None, chunks=1, deterministic=True):
                return layer.forward(x, ids, wts, local["w1"], local["w1_scale"], local["w2"], local["w2_scale"],
                                     x_scale=a1, fc2_input_scale=a2, mode=mode, out=out, timeline=timeline,
                                     max_tokens_per_rank=tokens if mode == "low_latency" else None, chunks=chunks,
                                     deterministic=deterministic)

            # Single GPU on rank 0 (rank 1 waits), graph replay.
            if rank == 0:
                try:
                    if args.cpu:
                        samples = []
                        for _ in range(max(1, args.iters // 4)):
                            a = clock.mark()
                            single()
                            samples.append(clock.us(a, clock.mark()))
                        row["single_us"] = statistics.median(samples)
                    else:
                        out_single = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=device)
                        row["single_us"] = common.time_graph(torch, [lambda: single(out_single)], args.iters,
                                                             args.warmup)
                        row["single_eager_us"] = common.time_eager(torch, [lambda: single(out_single)], args.iters,
                                                                   args.warmup)
                        # The fused finalize: the base of the reduced combine (deterministic=False).
                        fused = [lambda: single(out_single, fused=True)]
                        row["single_fused_us"] = common.time_graph(torch, fused, args.iters, args.warmup)
                        row["single_fused_eager_us"] = common.time_eager(torch, fused, args.iters, args.warmup)
                except Exception as e:  # noqa: BLE001 - reported in the row
                    row["single_error"] = f"{type(e).__name__}: {e}"
            dist.barrier()
            # EP, both modes.
            for mode in args.modes:
                key = "thr" if mode == "throughput" else "ll"
                try:
                    if mode == "low_latency" and not args.cpu:
                        out_ll = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=device)
                        graph = _graph(torch, lambda: ep(mode, out_ll), args.warmup)
                        row[f"ep_{key}_us"] = _time_ep(torch, clock, graph.replay, args.iters, 1)
                        del graph
                        # The reduced combine (deterministic=False) against one GPU's fused finalize.
                        graph = _graph(torch, lambda: ep(mode, out_ll, deterministic=False), args.warmup)
                        row["ep_ll_fused_us"] = _time_ep(torch, clock, graph.replay, args.iters, 1)
                        del graph
                        if row.get("single_fused_us"):
                            row["ratio_ll_fused"] = row["ep_ll_fused_us"] / row["single_fused_us"]
                    else:
                        row[f"ep_{key}_us"] = _time_ep(torch, clock, lambda: ep(mode), args.iters if not args.cpu
                                                       else max(1, args.iters // 4), 1 if args.cpu else args.warmup)
                    # Like for like: the eager throughput mode against the eager single call, the
                    # graph-replayed low-latency mode against the graph-replayed single call.
                    base = row.get("single_us") if key == "ll" and not args.cpu else row.get("single_eager_us",
                                                                                              row.get("single_us"))
                    if base:
                        row[f"ratio_{key}"] = row[f"ep_{key}_us"] / base
                except Exception as e:  # noqa: BLE001
                    row[f"ep_{key}_error"] = f"{type(e).__name__}: {e}"
                    print(f"[rank {rank}] {model} T={tokens} {mode}: {row[f'ep_{key}_error']}", flush=True)
                    raise  # the peer may be inside an exchange: stop rather than desynchronise
            # The C++ layers on the transport's communicator: low latency as a graph replay, throughput
            # eager (it waits on the host), against the single GPU like the Python modes.
            if args.cpp and not args.cpu:
                try:
                    row.update(_time_cpp_layers(torch, clock, args, transport, world, rank, experts, x, ids, wts, a1,
                                                a2, local, tokens, hidden))
                    # The reduced combine (deterministic=False) against one GPU's fused finalize.
                    out_fused = single(fused=True)
                    row.update(_time_cpp_layers(torch, clock, args, transport, world, rank, experts, x, ids, wts, a1,
                                                a2, local, tokens, hidden, deterministic=False, single_out=out_fused))
                    for key, base in (("cpp_ll", row.get("single_us")), ("cpp_thr", row.get("single_eager_us")),
                                      ("cpp_ll_fused", row.get("single_fused_us")),
                                      ("cpp_thr_fused", row.get("single_fused_eager_us"))):
                        if base:
                            row[f"ratio_{key}"] = row[f"{key}_us"] / base
                except Exception as e:  # noqa: BLE001
                    row["cpp_error"] = f"{type(e).__name__}: {e}"
                    print(f"[rank {rank}] {model} T={tokens} C++ layers: {row['cpp_error']}", flush=True)
                    raise  # the peer may be inside an exchange: stop rather than desynchronise
            # Low latency in chunks (forward(chunks=n)): graph replay, ratio, bitwise vs chunks=1.
            for n in (args.chunks if "low_latency" in args.modes else []):
                key = f"ll_c{n}"
                try:
                    if not args.cpu:
                        out_c = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=device)
                        graph = _graph(torch, lambda: ep("low_latency", out_c, chunks=n), args.warmup)
                        row[f"ep_{key}_us"] = _time_ep(torch, clock, graph.replay, args.iters, 1)
                        del graph
                    else:
                        row[f"ep_{key}_us"] = _time_ep(torch, clock, lambda: ep("low_latency", chunks=n),
                                                       max(1, args.iters // 4), 1)
                    base = row.get("single_us") if not args.cpu else row.get("single_eager_us", row.get("single_us"))
                    if base:
                        row[f"ratio_{key}"] = row[f"ep_{key}_us"] / base
                    one, many = ep("low_latency", chunks=1), ep("low_latency", chunks=n)
                    clock.sync()
                    if rank == 0:
                        same = bool(torch.equal(one.view(torch.int16), many.view(torch.int16)))
                        rel = float(((many.float() - one.float()) ** 2).mean().sqrt()
                                    / (one.float() ** 2).mean().sqrt())
                        row[f"{key}_check"] = "bitwise" if same else f"rel RMS {rel:.2e}"
                except Exception as e:  # noqa: BLE001
                    row[f"ep_{key}_error"] = f"{type(e).__name__}: {e}"
                    print(f"[rank {rank}] {model} T={tokens} low_latency chunks={n}: {row[f'ep_{key}_error']}",
                          flush=True)
                    raise  # the peer may be inside an exchange: stop rather than desynchronise
            # Phase split (throughput) and link numbers.
            row["split"] = _split(torch, clock, layer, lambda tl: ep("throughput", timeline=tl),
                                  3 if args.cpu else max(3, args.iters // 2))
            packed_width = -(-(hidden + 4 + 4 * top_k) // 16) * 16
            nbytes = _peer_bytes(torch, ids, experts, world, rank, hidden, packed_width, tokens)
            other = 1 - rank
            row["dispatch_mb"] = nbytes["dispatch"][other] / 1e6
            row["combine_mb"] = nbytes["combine_thr"][other] / 1e6
            recv_dispatch = _exchange_ints(torch, nbytes["dispatch"])
            recv_combine = _exchange_ints(torch, nbytes["combine_thr"])
            if not args.cpu:
                row["plain_dispatch_us"] = _plain_exchange_us(torch, clock, transport, nbytes["dispatch"],
                                                              recv_dispatch, device, args.iters)
                row["plain_combine_us"] = _plain_exchange_us(torch, clock, transport, nbytes["combine_thr"],
                                                             recv_combine, device, args.iters)
            for phase, mb_key in (("dispatch", "dispatch_mb"), ("combine", "combine_mb")):
                us = row["split"][phase]
                row[f"{phase}_gbps"] = row[mb_key] * 1e3 / us if us > 0 else None
                plain = row.get(f"plain_{phase}_us")
                row[f"plain_{phase}_gbps"] = row[mb_key] * 1e3 / plain if plain else None
            # Check: rank 0's EP tokens are the single run's tokens.
            got = ep("throughput")
            if rank == 0:
                want = single()
                clock.sync()
                same = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
                rel = float(((got.float() - want.float()) ** 2).mean().sqrt() / (want.float() ** 2).mean().sqrt())
                row["check"] = "bitwise" if same else f"rel RMS {rel:.2e}"
            rows.append(row)
            if rank == 0:
                print(f"   {model} T={tokens}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()
                                                          if k not in ("split",)), flush=True)
        weights = local = None  # free the model's weights before the next one
        if not args.cpu:
            torch.cuda.empty_cache()
    if not args.cpu:
        clock.sync()
        transport.close()
    if rank == 0:
        _report(rows, args)
    return 0


def _exchange_ints(torch, values):
    """values[d] sent to rank d; returns what each rank sent here (gloo)."""
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    rank = dist.get_rank()
    return [int(g[rank]) for g in gathered]


def _fmt(v, digits=1):
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) >= 0.01 or v == 0 else f"{v:.3g}"
    return common.fmt(v, digits)


COLUMNS = (("model", "model"), ("T/rank", "T"), ("single eager", "single_eager_us"), ("EP thr eager", "ep_thr_us"),
           ("thr ratio", "ratio_thr"), ("single graph", "single_us"), ("EP LL graph", "ep_ll_us"),
           ("LL ratio", "ratio_ll"), ("single fused graph", "single_fused_us"), ("EP LL fused graph", "ep_ll_fused_us"),
           ("LL fused ratio", "ratio_ll_fused"),
           ("prep", "split.prep"), ("prep host", "split.prep_host"), ("dispatch", "split.dispatch"),
           ("compute", "split.compute"), ("combine", "split.combine"), ("finalize", "split.finalize"),
           ("disp MB", "dispatch_mb"), ("disp GB/s", "dispatch_gbps"), ("plain GB/s", "plain_dispatch_gbps"),
           ("comb MB", "combine_mb"), ("comb GB/s", "combine_gbps"), ("plain GB/s ", "plain_combine_gbps"),
           ("EP vs single", "check"))


def _columns(args):
    """COLUMNS with, per --chunks N, the chunked low-latency time and ratio after the LL ratio and
    its bitwise check at the end; with --cpp the C++ layers' times and ratios after those."""
    cpp = [("C++ LL graph", "cpp_ll_us"), ("C++ LL ratio", "ratio_cpp_ll"), ("C++ thr eager", "cpp_thr_us"),
           ("C++ thr ratio", "ratio_cpp_thr"),
           ("C++ LL fused graph", "cpp_ll_fused_us"), ("C++ LL fused ratio", "ratio_cpp_ll_fused"),
           ("C++ thr fused eager", "cpp_thr_fused_us"), ("C++ thr fused ratio", "ratio_cpp_thr_fused"),
           ("C++ fused vs single", "cpp_fused_rel_rms")] if getattr(args, "cpp", False) else []
    extra = [c for n in args.chunks for c in ((f"EP LL c{n} graph", f"ep_ll_c{n}_us"),
                                                (f"LL c{n} ratio", f"ratio_ll_c{n}"))]
    at = [k for _, k in COLUMNS].index("ratio_ll") + 1
    return (COLUMNS[:at] + tuple(extra) + tuple(cpp) + COLUMNS[at:]
            + tuple((f"LL c{n} vs c1", f"ll_c{n}_check") for n in args.chunks))


def _get(row, key):
    if key.startswith("split."):
        return row.get("split", {}).get(key[6:])
    return row.get(key)


def _report(rows, args):
    columns = _columns(args)
    lines = ["", "## Expert parallelism, 2 ranks: weak scaling (w4a8_int4, deterministic finalize)", "",
             "EP: 2 GPUs, half the experts each, T tokens per rank; single: 1 GPU, all experts, T tokens. "
             "Times in us (median, slower rank); thr ratio = EP throughput (eager: it syncs the host once) / "
             "single eager; LL ratio = EP low-latency graph replay / single graph replay (target <= 1.25); "
             f"LL cN = the same with forward(chunks=N) (exchanges overlapped with the other chunk's GEMMs, which "
             f"leave comm_sms = {args.comm_sms} SMs to NCCL), "
             "'LL cN vs c1' = its output against chunks=1; split = phases of an eager throughput forward; MB = bytes "
             "each rank sends to the other; plain = a grouped NCCL send/recv of the same bytes alone."
             + " 'fused' = forward(deterministic=False), the reduced combine (owners finalize their slots, one "
               "partial row per token and owner comes back), against one GPU's fused finalize (single fused "
               "graph / eager)."
             + (" C++ = the C++ layers (expert_parallel_layer.h) on the same communicator; 'C++ fused vs "
                "single' = relative RMS of their reduced-combine output against that one-GPU output (not bitwise "
                "by design)." if getattr(args, "cpp", False) else "")
             + (" CPU run (--cpu): not a benchmark." if args.cpu else ""), "",
             "| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(_get(row, k), 2 if k.startswith("ratio") or k.endswith("_mb") else 1)
                                       for _, k in columns)
                     + " |")
    errors = [(r["model"], r["T"], k, v) for r in rows for k, v in r.items() if k.endswith("_error")]
    for model, tokens, key, err in errors:
        lines.append(f"- {model} T={tokens} {key}: {err}")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        stem = os.path.join(args.out_dir, f"{datetime.date.today().isoformat()}_h200x2_ep")
        with open(stem + ".md", "w") as f:
            f.write(text + "\n")
        with open(stem + ".json", "w") as f:
            json.dump(dict(rows=rows, modes=args.modes, chunks=args.chunks, comm_sms=args.comm_sms, cpu=args.cpu), f,
                      indent=1, default=str)


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from ..ep_transport import spawn_local

    if not args.cpu:
        import torch

        if torch.cuda.device_count() < 2:
            print(f"qmoe bench ep: 2 GPUs needed, {torch.cuda.device_count()} visible", flush=True)
            return 1
    return spawn_local(rank_main, 2, (args,), timeout_s=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
