"""`qmoe bench gemm`: the W4A8 grouped GEMM at DESIGN.md 7 model shapes (DESIGN.md 8 method).

For each model (E, top-k, H, I) and token count T: uniform random routing (top-k distinct
experts per token), routing metadata from qmoe's get_cutlass_w4a8_moe_mm_data, then
  GEMM1  N = 2I, K = H      GEMM2  N = H, K = I        (M = T * top-k rows, all valid)
timed as qmoe's cutlass_w4a8_moe_mm, torch._grouped_mm (bf16) and torch._scaled_grouped_mm
(fp8 rowwise scales, use_fast_accum=True) on the same routing, plus SGLang's times from a peer
measurement file for the same (model, T) when it is readable (another run, same GPU model).
Where that run's routing sample hit a different number of experts than ours (a different number of
weight bytes: Mixtral T = 8 hit 5 of 8 experts there, 8 here), qmoe is timed again on a routing over
exactly that many experts (routing_with_hit) and the SGLang comparison uses that time.

Method: weights are cycled over several weight sets so that the experts one call touches are
not in L2 from the previous call (sets are added until the bytes touched between two uses of
a set exceed --rotate-mb); each sample is one CUDA-graph replay of one call per set (eager
calls between CUDA events if capture fails), divided by the number of sets; median of --iters.
Bytes touched = int4 weights of the experts hit + their bf16 group scales + fp8 activations +
bf16 output; FLOPs = 2 M N K. Floor = max(bytes / copy bandwidth, FLOPs / dense fp8 rate), both
measured at the start of the run (1 GiB device copy; torch._scaled_mm 8192^3, fast accum).
Output: a markdown table on stdout (with, below it, which points meet issue #3's targets); JSON + markdown under bench/results/ named
<date>_<gpu>_gemm.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from .common import fmt as _fmt
from .common import gemm_floor, measure_ceilings  # noqa: F401  (measure_ceilings: used by main, re-exported)
from .common import norm as _norm
from .common import peer_path
from .common import routing as _routing
from .common import routing_with_hit as _routing_with_hit
from .common import scale_shape as _scale_shape
from .common import targets_summary as _targets_summary
from .common import time_calls as _time_calls
from .common import weight_sets as _weight_sets

DEFAULT_TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
PEER_FILE = "2026-11-30_h200_sglang_w4a8.json"
# The shared folder beside the checkout, or a copy inside it (the device machine gets the repo only).
PEER_CANDIDATES = ("/work/shared/peers/" + PEER_FILE, "shared/peers/" + PEER_FILE, "bench/peers/" + PEER_FILE)


def _default_peers() -> str:
    return peer_path(PEER_FILE, "QMOE_SGLANG_PEERS")


def _parse_args(argv):
    from .. import testing

    p = argparse.ArgumentParser(prog="qmoe bench gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(testing.MODEL_SHAPES),
                   help="comma list of " + ", ".join(testing.MODEL_SHAPES) + " (default: all)")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma list of T")
    p.add_argument("--gemms", default="gemm1,gemm2", help="gemm1, gemm2 or both")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel shard of I (default 1)")
    p.add_argument("--iters", type=int, default=30, help="timed samples (median)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rotate-mb", type=float, default=256.0,
                   help="bytes touched between two uses of a weight set, at least (L2 is 50-60 MB)")
    p.add_argument("--max-weight-gb", type=float, default=40.0, help="cap on the memory of all weight sets")
    p.add_argument("--no-torch-peers", action="store_true", help="skip torch._grouped_mm / _scaled_grouped_mm")
    p.add_argument("--peers", default=_default_peers(),
                   help="SGLang peer measurement JSON ('' to skip; default $QMOE_SGLANG_PEERS or the first of "
                   + ", ".join(PEER_CANDIDATES) + " that exists)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    by_norm = {_norm(m): m for m in testing.MODEL_SHAPES}
    unknown = [m for m in args.models if _norm(m) not in by_norm]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {list(testing.MODEL_SHAPES)}")
    args.models = [by_norm[_norm(m)] for m in args.models]
    args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    args.gemms = [g.strip() for g in args.gemms.split(",") if g.strip()]
    if any(g not in ("gemm1", "gemm2") for g in args.gemms):
        p.error("--gemms: gemm1 and/or gemm2")
    return args


# ------------------------------------------------------------------------------------------------
# peers
# ------------------------------------------------------------------------------------------------
def _sglang_rows(path):
    if not path:
        return {}, None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        return {}, f"peer file {path} not readable ({e})"
    rows = {}
    for r in data.get("rows", []):
        rows[(_norm(r["model"]), int(r["tokens"]))] = r
    return rows, f"SGLang: {path} ({data.get('device', '?')}, sglang {str(data.get('sglang_commit', '?'))[:7]})"


# ------------------------------------------------------------------------------------------------
# one (model, T, gemm) row
# ------------------------------------------------------------------------------------------------
def bench_row(torch, sgl, ops, model, shape, tokens, gemm, meta, args, ceilings, sglang_rows):
    experts, topk, hidden, inter = shape
    inter //= args.tp
    n, k = (2 * inter, hidden) if gemm == "gemm1" else (hidden, inter)
    counts = meta["counts"]
    rows = int(sum(counts))
    hit = int(sum(1 for c in counts if c))
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed + tokens)
    row = dict(model=model, E=experts, topk=topk, H=hidden, I=inter, T=tokens, gemm=gemm, N=n, K=k, M=rows,
               experts_hit=hit)
    floor = gemm_floor(hit, rows, n, k, ceilings["copy_tbps"], ceilings["fp8_tflops"])
    flops, bytes_touched, floor_us = floor["flops"], floor["bytes"], floor["floor_us"]
    weight_bytes = bytes_touched - rows * k - rows * n * 2
    row.update(bytes=bytes_touched, flops=flops)
    row["floor_us"] = floor_us
    offsets = meta["offsets"]
    a = torch.randn((rows, k), device="cuda", generator=gen, dtype=torch.bfloat16).to(torch.float8_e4m3fn)

    # ---- qmoe -----------------------------------------------------------------------------------
    if k % 128:
        row["qmoe_error"] = f"K = {k} is not a multiple of 128 (unsupported by the int4-g128 format)"
    else:
        try:
            # (the SGLang wrapper below passes an a_slots scratch where it pays: the choice with it)
            row["tactic"] = ops.select_tactic(n, k, rows, experts, topk, activation_slots=True)
            if ops.w4a8_activation_slots(n, k, rows, experts, topk):
                row["tactic"] += " + a_slots"
        except Exception as e:  # informative only
            row["tactic"] = f"? ({e})"
        sizes = (meta["ps1"] if gemm == "gemm1" else meta["ps2"])
        a_scales = torch.full((1,), 1.0 / 448, device="cuda")
        d = torch.empty((rows, n), device="cuda", dtype=torch.bfloat16)
        ks = torch.full((experts, 3), k, dtype=torch.int64, device="cuda")
        ns = torch.full((experts, 3), n, dtype=torch.int64, device="cuda")
        set_bytes = experts * n * k // 2 + experts * n * (k // 128) * 2

        def make():
            q = torch.randint(-128, 128, (experts, n, k // 2), dtype=torch.int8, device="cuda", generator=gen)
            s = (torch.rand(_scale_shape(experts, n, k), device="cuda", generator=gen) * 0.01).to(torch.bfloat16)
            return q, s

        try:
            sets = _weight_sets(weight_bytes, set_bytes, args, make)
            calls = [lambda q=q, s=s: sgl.cutlass_w4a8_moe_mm(d, a, q, a_scales, s, offsets[:-1], sizes, ks, ks, ns,
                                                               ns, 128, topk) for q, s in sets]
            calls[0]()
            torch.cuda.synchronize()
            row["qmoe_finite"] = bool(torch.isfinite(d).all()) if rows else True
            us, how = _time_calls(torch, calls, args.iters, args.warmup)
            row.update(qmoe_us=us, timing=how, weight_sets=len(sets), tbps=bytes_touched / (us * 1e-6) / 1e12,
                       tflops=flops / (us * 1e-6) / 1e12, floor_fraction=floor_us / us)
            del sets, calls
        except Exception as e:
            row["qmoe_error"] = f"{type(e).__name__}: {e}"
        del d
        torch.cuda.empty_cache()

    # ---- torch peers on the same routing --------------------------------------------------------
    if not args.no_torch_peers and rows:
        ends = torch.cumsum(torch.tensor(counts, device="cuda", dtype=torch.int64), 0).to(torch.int32)
        bf16_set_bytes = experts * n * k * 2
        try:
            a16 = torch.randn((rows, k), device="cuda", generator=gen, dtype=torch.bfloat16)

            def make16():
                return torch.randn((experts, n, k), device="cuda", generator=gen, dtype=torch.bfloat16)

            sets = _weight_sets(hit * n * k * 2, bf16_set_bytes, args, make16)
            calls = [lambda w=w: torch._grouped_mm(a16, w.transpose(-2, -1), offs=ends) for w in sets]
            row["torch_bf16_us"], _ = _time_calls(torch, calls, args.iters, args.warmup)
            del sets, calls, a16
        except Exception as e:
            row["torch_bf16_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        torch.cuda.empty_cache()
        try:
            scale_a = torch.rand((rows,), device="cuda", generator=gen) + 0.5

            def make8():
                w = torch.randn((experts, n, k), device="cuda", generator=gen, dtype=torch.bfloat16)
                return w.to(torch.float8_e4m3fn), torch.rand((experts, n), device="cuda", generator=gen) + 0.5

            sets = _weight_sets(hit * n * k, experts * n * k, args, make8)
            calls = [lambda w=w, sb=sb: torch._scaled_grouped_mm(a, w.transpose(-2, -1), scale_a, sb, offs=ends,
                                                                 out_dtype=torch.bfloat16, use_fast_accum=True)
                     for w, sb in sets]
            row["torch_fp8_us"], _ = _time_calls(torch, calls, args.iters, args.warmup)
            del sets, calls
        except Exception as e:
            row["torch_fp8_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        torch.cuda.empty_cache()

    # ---- SGLang's measured time (peer file) --------------------------------------------------------
    peer = sglang_rows.get((_norm(model), tokens))
    if peer is not None and args.tp == 1 and int(peer.get("I", inter)) == inter:
        row["sglang_us"] = peer.get(f"{gemm}_cold_us")
        row["sglang_cfg"] = peer.get(f"{gemm}_cfg")
    return row


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
# Issue #3's targets (DESIGN.md 8): decode (T <= 256) within max(1.25 x floor, floor + 3 us); prefill
# (>= 1024 rows per expert hit) at >= 75% of the dense fp8 rate; faster than torch fp8 and than SGLang.
DECODE_MAX_T = 256
PREFILL_MIN_ROWS_PER_EXPERT = 1024


def target_checks(row, fp8_tflops):
    """[(target, met, detail)] for one measured row (none without a qmoe time)."""
    us = row.get("qmoe_us")
    if us is None:
        return []
    checks = []
    floor = row.get("floor_us")
    if row["T"] <= DECODE_MAX_T and floor:
        limit = max(1.25 * floor, floor + 3.0)
        checks.append(("decode <= max(1.25 x floor, floor + 3 us)", us <= limit, f"{us / floor:.2f}x floor"))
    hit = row.get("experts_hit") or 0
    if hit and row["M"] / hit >= PREFILL_MIN_ROWS_PER_EXPERT and fp8_tflops and row.get("tflops"):
        frac = row["tflops"] / fp8_tflops
        checks.append(("prefill >= 0.75 x dense fp8 rate", frac >= 0.75, f"{frac:.2f} of the fp8 rate"))
    peer = row.get("torch_fp8_us")
    if peer:
        checks.append(("faster than torch fp8", us < peer, f"{us / peer:.2f}x its time"))
    peer = row.get("sglang_us")
    if peer:
        # At SGLang's own expert-hit count when its routing sample differed from ours (same bytes).
        mine, at = (row["qmoe_us_sglang_hit"], f" at its {row['sglang_hit']} experts hit") \
            if row.get("qmoe_us_sglang_hit") else (us, "")
        checks.append(("faster than SGLang", mine < peer, f"{mine / peer:.2f}x its time{at}"))
    return checks


def targets_summary(rows, fp8_tflops):
    """Markdown lines: per target, the points that meet it and the ones that miss it (with by how much)."""
    checks = [(f"{r['model']} {r['gemm']} T={r['T']}", target_checks(r, fp8_tflops)) for r in rows]
    return _targets_summary(checks, "Targets (issue #3), met at / of the points measured:")


def markdown(rows, header_lines, fp8_tflops=None):
    cols = ["model", "gemm", "T", "M", "hit", "N", "K", "qmoe us", "TB/s", "TFLOP/s", "floor us", "floor/time",
            "torch bf16 us", "torch fp8 us", "SGLang us", "tactic"]
    out = list(header_lines) + ["", "| " + " | ".join(cols) + " |", "|" + "|".join(["---"] * 7 + ["--:"] * 8 + ["---"]) + "|"]
    for r in rows:
        q = _fmt(r.get("qmoe_us")) if "qmoe_us" in r else ("error" if "qmoe_error" in r else "-")
        out.append("| " + " | ".join([
            r["model"], r["gemm"], str(r["T"]), str(r["M"]), str(r["experts_hit"]), str(r["N"]), str(r["K"]), q,
            _fmt(r.get("tbps"), 2), _fmt(r.get("tflops")), _fmt(r.get("floor_us")), _fmt(r.get("floor_fraction"), 2),
            _fmt(r.get("torch_bf16_us")) if "torch_bf16_error" not in r else "n/a",
            _fmt(r.get("torch_fp8_us")) if "torch_fp8_error" not in r else "n/a",
            _sglang_cell(r), str(r.get("tactic", "-"))]) + " |")
    if any(r.get("qmoe_us_sglang_hit") for r in rows):
        out += ["", "SGLang us 'x (hit h: qmoe y)': SGLang's run hit h experts, this run's routing a different number; "
                "y = qmoe timed on a routing over exactly h experts, the time its comparison uses."]
    labels = {"qmoe_error": "qmoe", "torch_bf16_error": "torch bf16", "torch_fp8_error": "torch fp8"}
    notes = sorted({f"{r['model']} {r['gemm']} T={r['T']}, {label}: {r[key]}" for r in rows
                    for key, label in labels.items() if key in r})
    if notes:
        out += ["", "Errors / unavailable:"] + [f"- {n}" for n in notes]
    out += targets_summary(rows, fp8_tflops)
    return "\n".join(out)


def _sglang_cell(r):
    if not r.get("qmoe_us_sglang_hit"):
        return _fmt(r.get("sglang_us"))
    return f"{_fmt(r.get('sglang_us'))} (hit {r['sglang_hit']}: qmoe {_fmt(r['qmoe_us_sglang_hit'])})"


def _routing_meta(torch, sgl, ids, experts, inter, hidden):
    """SGLang's routing data for topk_ids `ids`, and the per-expert row counts."""
    slots = ids.numel()
    offsets = torch.empty(experts + 1, dtype=torch.int32, device="cuda")
    ps1 = torch.empty((experts, 3), dtype=torch.int32, device="cuda")
    ps2 = torch.empty_like(ps1)
    perm_in = torch.empty(slots, dtype=torch.int32, device="cuda")
    perm_out = torch.empty(slots, dtype=torch.int32, device="cuda")
    sgl.get_cutlass_w4a8_moe_mm_data(ids, offsets, ps1, ps2, perm_in, perm_out, experts, inter, hidden)
    return dict(offsets=offsets, ps1=ps1, ps2=ps2, counts=ps1[:, 1].tolist())


def _time_at_sglang_hit(torch, sgl, ops, model, shape, tokens, gemm, args, ceilings, row, peer):
    """qmoe's time on a routing over exactly the number of experts SGLang's run hit, when it differs."""
    experts, topk, hidden, inter = shape
    peer_hit = int(peer.get("experts_hit") or 0)
    if not peer_hit or peer_hit == row["experts_hit"] or "qmoe_us" not in row:
        return
    ids = _routing_with_hit(tokens, topk, experts, peer_hit, args.seed * 1000003 + tokens)
    if ids is None:
        return
    meta = _routing_meta(torch, sgl, torch.from_numpy(ids).cuda(), experts, inter // args.tp, hidden)
    quiet = argparse.Namespace(**{**vars(args), "no_torch_peers": True})
    again = bench_row(torch, sgl, ops, model, shape, tokens, gemm, meta, quiet, ceilings, {})
    if again.get("qmoe_us"):
        row["sglang_hit"] = peer_hit
        row["qmoe_us_sglang_hit"] = again["qmoe_us"]


def main(argv=None) -> int:
    args = _parse_args(argv)
    try:
        import torch
    except ImportError:
        print("qmoe bench gemm: needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("qmoe bench gemm: no CUDA device", file=sys.stderr)
        return 2
    from .. import ops, testing
    from ..compat import sgl_kernel as sgl

    gpu = torch.cuda.get_device_name()
    copy_tbps, fp8_tflops = measure_ceilings(torch)
    ceilings = dict(copy_tbps=copy_tbps, fp8_tflops=fp8_tflops)
    sglang_rows, peer_note = _sglang_rows(args.peers)
    header = [f"# qmoe W4A8 grouped GEMM, {gpu}, {datetime.date.today().isoformat()}",
              "",
              f"Ceilings measured in this run: device copy {copy_tbps:.2f} TB/s (read + write), dense fp8 "
              f"torch._scaled_mm 8192^3 {fp8_tflops:.0f} TFLOP/s. floor/time = fraction of the floor reached.",
              f"Uniform random top-k routing; weights cycled out of L2 (>= {args.rotate_mb:.0f} MB between uses "
              f"of a set); median of {args.iters} (graph replay, or events). torch peers: bf16 _grouped_mm and "
              "fp8 rowwise _scaled_grouped_mm (use_fast_accum=True), same routing, same run."]
    if sglang_rows:
        header.append(peer_note + "; 'SGLang us' is that file's L2-flushed GPU time (another run).")
    elif peer_note:
        header.append(peer_note)
    print("\n".join(header), flush=True)

    rows = []
    gen = torch.Generator(device="cuda")
    for model in args.models:
        shape = testing.MODEL_SHAPES[model]
        experts, topk, hidden, inter = shape
        for tokens in args.tokens:
            gen.manual_seed(args.seed * 1000003 + tokens)
            ids = _routing(torch, tokens, topk, experts, gen)
            meta = _routing_meta(torch, sgl, ids, experts, inter // args.tp, hidden)
            for gemm in args.gemms:
                row = bench_row(torch, sgl, ops, model, shape, tokens, gemm, meta, args, ceilings, sglang_rows)
                if "sglang_us" in row:
                    _time_at_sglang_hit(torch, sgl, ops, model, shape, tokens, gemm, args, ceilings, row,
                                        sglang_rows[(_norm(model), tokens)])
                rows.append(row)
                print(f"  {model} {gemm} T={tokens}: qmoe {_fmt(row.get('qmoe_us'))} us "
                      f"(floor {_fmt(row.get('floor_us'))}), torch bf16 {_fmt(row.get('torch_bf16_us'))}, "
                      f"fp8 {_fmt(row.get('torch_fp8_us'))}, SGLang {_sglang_cell(row)}"
                      + (f" [{row['qmoe_error']}]" if "qmoe_error" in row else ""), flush=True)

    table = markdown(rows, header, fp8_tflops)
    print()
    print(table)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"{datetime.date.today().isoformat()}_{_norm(gpu)}_gemm")
    with open(stem + ".json", "w") as f:
        json.dump(dict(device=gpu, torch=torch.__version__, date=datetime.datetime.now().isoformat(timespec="seconds"),
                       ceilings=ceilings, args={k: v for k, v in vars(args).items()}, peers=peer_note, rows=rows),
                  f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    print(f"\nwrote {stem}.json and {stem}.md")
    failed = [r for r in rows if "qmoe_error" in r and r["K"] % 128 == 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
