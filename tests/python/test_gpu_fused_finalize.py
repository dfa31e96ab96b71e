"""GPU tests of the fused finalize (qmoe.fused_moe deterministic=False; FlashInfer's
use_fused_finalize=True; DESIGN.md 5.2, docs/design.md "The fused finalize"): the output [T, H] is
zeroed (cudaMemsetAsync, on aux_stream when given, forked from and joined back into the current
stream by events) and GEMM2's epilogue adds bf16(rsf * w[t, j] * v) into out[t] atomically
(src/cuda/gemm/grouped_gemm_epilogue.cuh): no y buffer, no finalize kernel.

Each GPU result is compared with the C++ CPU engine's fused rounding (the same per-add bf16
rounding, in slot order) within qmoe.testing's tolerance for the mode; outputs are poisoned with
NaN before every call, so an element neither zeroed nor added shows. Coverage: w4a8_int4 and
w4a16 (the bf16 x 4-bit GEMM) x T in {1, 7, 128, 515} x output bf16 / f16 / f32 x aux_stream given
(torch.cuda.Stream, or a raw int handle) or not; routed_scaling_factor; an EP slice with tokens
that have no local expert (exact zero rows); every GEMM tactic forced (both GEMMs: the W4A8 GEMM's
for w4a8_int4, the bf16 x 4-bit GEMM's for w4a16); the memset covers exactly out (neighbours of a
view stay poisoned); a 2-byte aligned output view (the finalize-kernel fallback); PDL; T = 0; CUDA
graph capture with aux_stream (two layers in one graph) replayed with new routing; the run-to-run
spread over 20 runs (printed; bounded by the tolerance); the deterministic mode still bitwise
stable, unaffected by aux_stream; the aux_stream argument errors.

The w4a8_int4 pipeline does not scatter by default (its y + finalize kernel in the fused rounding order
measured faster, fused_finalize_scatter in src/cuda/fused/moe_pipeline_steps.cu): every test here forces the
scatter with QMOE_DECODE_SCATTER=1 (autouse fixture), and test_w4a8_default_keeps_rows_in_y checks the default.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_common import env_var, local_slots, on_device, require_hopper, run_cpu, to_np  # noqa: E402

torch = require_hopper()

import qmoe  # noqa: E402
from qmoe import ops  # noqa: E402
from qmoe import testing  # noqa: E402

DEV = torch.device("cuda")
MODES = ("w4a8_int4", "w4a16")
OUTPUT_DTYPES = ("bfloat16", "float16", "float32")
HIDDEN, INTER = 256, 128
SCATTER_ENV = "QMOE_DECODE_SCATTER"


@pytest.fixture(autouse=True)
def decode_tiles_scatter():
    """The scatter path under test in both pipelines (QMOE_DECODE_SCATTER=1; read by the pipelines per call)."""
    with env_var(SCATTER_ENV, "1"):
        yield


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def make_case(mode, tokens, top_k, experts, seed, **kw):
    return testing.make_fused_moe_case(mode, tokens, HIDDEN, INTER, experts, top_k, seed, **kw)


def poisoned(tokens, output_dtype="bfloat16"):
    return torch.full((tokens, HIDDEN), float("nan"), dtype=getattr(torch, output_dtype), device=DEV)


def run_fused(dev, out, **options):
    """qmoe.fused_moe with the fused finalize into `out` (poisoned by the caller), synchronized."""
    got = qmoe.fused_moe(**dev, out=out, deterministic=False, **options)
    assert got is out
    torch.cuda.synchronize()
    return out


def cpu_fused(case, output_dtype="bfloat16", **options):
    return run_cpu(case, output_dtype, deterministic=False, **options)


def check(mode, gpu, cpu, what):
    gpu = to_np(gpu) if isinstance(gpu, torch.Tensor) else gpu
    assert gpu.dtype == cpu.dtype, (gpu.dtype, cpu.dtype)
    return testing.assert_close(gpu, cpu, mode, what=what)


def fused_tactics(mode, tokens, top_k, experts):
    """The tactics a forced fused_moe call accepts: valid for both GEMMs (src/api/fused_moe.cpp)."""
    rows, bf16 = tokens * top_k, mode != "w4a8_int4"
    gemm1 = qmoe.valid_tactics(2 * INTER, HIDDEN, rows, experts, top_k, bf16_activations=bf16)
    gemm2 = qmoe.valid_tactics(HIDDEN, INTER, rows, experts, top_k, bf16_activations=bf16)
    return [t for t in gemm1 if t in gemm2]


def bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


# ------------------------------------------------------------------------------------------------
# against the CPU engine: modes x T x output dtype x aux stream
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("aux", ["none", "stream", "handle"])
@pytest.mark.parametrize("output_dtype", OUTPUT_DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 128, 515])
@pytest.mark.parametrize("mode", MODES)
def test_matches_cpu_engine(mode, tokens, output_dtype, aux):
    case = make_case(mode, tokens, 4, 16, seed=tokens + 3)
    dev = on_device(case)
    side = torch.cuda.Stream()
    aux_stream = {"none": None, "stream": side, "handle": side.cuda_stream}[aux]
    out = run_fused(dev, poisoned(tokens, output_dtype), aux_stream=aux_stream, routed_scaling_factor=1.5)
    want = cpu_fused(case, output_dtype, routed_scaling_factor=1.5)
    check(mode, out, want, f"{mode} T={tokens} {output_dtype} aux={aux}")
    assert torch.isfinite(out.float()).all(), "an element was neither zeroed nor added"


@pytest.mark.parametrize("output_dtype", OUTPUT_DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_ep_slice_tokens_without_local_expert_are_zero(mode, output_dtype):
    """EP rank holding experts [8, 12) of 16: slots of other experts add nothing; tokens with no
    local slot are exact zeros (from the memset alone)."""
    tokens, top_k = 33, 2
    case = make_case(mode, tokens, top_k, 16, seed=5, num_local_experts=4, local_expert_offset=8,
                     expert_range=(6, 14))
    ids = case["topk_ids"].copy()
    ids[2] = [0, 15]    # both non-local
    ids[5] = [-1, 99]   # dropped
    ids[7] = [3, -5]    # non-local and dropped
    ids[9] = [9, 9]     # one local expert twice (counts twice)
    case["topk_ids"] = ids
    keep = local_slots(case)
    empty = np.flatnonzero(~keep.any(axis=1))
    assert {2, 5, 7} <= set(empty.tolist()) and keep.any(axis=1).sum() > tokens // 2
    side = torch.cuda.Stream()
    out = run_fused(on_device(case), poisoned(tokens, output_dtype), aux_stream=side)
    want = cpu_fused(case, output_dtype)
    check(mode, out, want, f"{mode} EP {output_dtype}")
    got = to_np(out).astype(np.float32)
    assert np.all(got[empty] == 0), f"tokens {empty.tolist()} must be exact zero rows"
    assert np.all(want.astype(np.float32)[empty] == 0)
    assert np.all(np.any(got[keep.any(axis=1)] != 0, axis=1)), "a token with a local slot got nothing"


def test_no_local_slot_at_all_gives_zeros():
    case = make_case("w4a8_int4", 9, 2, 16, seed=6, num_local_experts=4, local_expert_offset=0,
                     expert_range=(8, 16))
    out = run_fused(on_device(case), poisoned(9), aux_stream=torch.cuda.Stream())
    assert torch.equal(out.float(), torch.zeros_like(out.float()))


# ------------------------------------------------------------------------------------------------
# every GEMM tactic
# ------------------------------------------------------------------------------------------------
def _tactic_params():
    params = []
    for mode in MODES:
        for tokens in (7, 300):
            for tactic in fused_tactics(mode, tokens, 4, 8):
                params.append(pytest.param(mode, tokens, tactic, id=f"{mode}-T{tokens}-{tactic}"))
    return params


@pytest.mark.parametrize("mode,tokens,tactic", _tactic_params())
def test_every_tactic_scatters(mode, tokens, tactic):
    """Each compiled tactic honours the scatter in GEMM2 (GEMM1 writes its fp32 rows as before)."""
    case = make_case(mode, tokens, 4, 8, seed=tokens + 7)
    dev = on_device(case)
    for output_dtype, aux in (("bfloat16", None), ("float32", torch.cuda.Stream())):
        out = run_fused(dev, poisoned(tokens, output_dtype), tactic=tactic, aux_stream=aux,
                        routed_scaling_factor=0.75)
        check(mode, out, cpu_fused(case, output_dtype, routed_scaling_factor=0.75),
              f"{mode} T={tokens} {tactic} {output_dtype}")


@pytest.mark.parametrize("mode", MODES)
def test_tactic_list_covers_both_families(mode):
    """The parametrization above is not vacuous: mma.sync decode tiles and prefill tiles (the W4A8
    GEMM's WGMMA ones among them) are all forced."""
    names = fused_tactics(mode, 300, 4, 8)
    assert any(t.startswith("decode") for t in names) and any(t.startswith("prefill") for t in names), names


# ------------------------------------------------------------------------------------------------
# the memset: exactly out, nothing around it; the unaligned fallback; T = 0; PDL
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("aux", [False, True], ids=["inline", "aux"])
@pytest.mark.parametrize("output_dtype", OUTPUT_DTYPES)
def test_memset_covers_exactly_the_output(output_dtype, aux):
    """out is rows [1, T + 1) of a larger poisoned buffer: every element of out is written, the rows
    before and after stay NaN (the memset is [T, H] at out's address, not more)."""
    tokens, mode = 20, "w4a8_int4"
    case = make_case(mode, tokens, 4, 8, seed=8)
    big = torch.full((tokens + 2, HIDDEN), float("nan"), dtype=getattr(torch, output_dtype), device=DEV)
    out = big[1:tokens + 1]
    assert out.is_contiguous()
    run_fused(on_device(case), out, aux_stream=torch.cuda.Stream() if aux else None)
    check(mode, out, cpu_fused(case, output_dtype), f"view {output_dtype}")
    assert torch.isnan(big[0].float()).all() and torch.isnan(big[-1].float()).all(), "memset overran out"


@pytest.mark.parametrize("output_dtype", ["bfloat16", "float16"])
def test_two_byte_aligned_output_falls_back(output_dtype):
    """A 16-bit output at an odd element offset cannot take the paired 32-bit atomics: the GEMM
    writes its rows and the finalize kernel combines them (same rounding); the element before the
    view stays NaN."""
    tokens, mode = 11, "w4a16"
    case = make_case(mode, tokens, 4, 8, seed=9)
    flat = torch.full((tokens * HIDDEN + 1,), float("nan"), dtype=getattr(torch, output_dtype), device=DEV)
    out = flat[1:].view(tokens, HIDDEN)
    assert out.data_ptr() % 4 == 2
    run_fused(on_device(case), out, aux_stream=torch.cuda.Stream())
    check(mode, out, cpu_fused(case, output_dtype), f"2-byte aligned {output_dtype}")
    assert torch.isnan(flat[0].float())


@pytest.mark.parametrize("mode", MODES)
def test_zero_tokens(mode):
    case = make_case(mode, 4, 2, 8, seed=10)
    for key in ("x", "topk_ids", "topk_weights"):
        case[key] = case[key][:0]
    out = qmoe.fused_moe(**on_device(case), deterministic=False, aux_stream=torch.cuda.Stream())
    torch.cuda.synchronize()
    assert tuple(out.shape) == (0, HIDDEN)


@pytest.mark.parametrize("mode", MODES)
def test_pdl_with_aux_stream(mode):
    tokens = 37
    case = make_case(mode, tokens, 4, 16, seed=11)
    dev = on_device(case)
    want = cpu_fused(case)
    for aux in (None, torch.cuda.Stream()):
        out = run_fused(dev, poisoned(tokens), enable_pdl=True, aux_stream=aux)
        check(mode, out, want, f"{mode} pdl aux={aux is not None}")


# ------------------------------------------------------------------------------------------------
# CUDA graphs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("mode", MODES)
def test_graph_capture_with_aux_stream_replays_new_routing(mode, pdl):
    """Two layers (one per mode's case, different seeds) captured in one graph, each forking its
    memset onto the same aux stream (the thread's events re-recorded inside the capture); replays
    after new routing is written in place give the CPU engine's result of that routing."""
    tokens, top_k, experts = 48, 4, 16
    bases = [make_case(mode, tokens, top_k, experts, seed=s) for s in (12, 13)]
    devs = [on_device(b) for b in bases]
    outs = [poisoned(tokens) for _ in devs]
    side = torch.cuda.Stream()

    def body():
        for dev, out in zip(devs, outs):
            qmoe.fused_moe(**dev, out=out, deterministic=False, aux_stream=side, enable_pdl=pdl)

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        body()  # warm-up outside the capture (lazy loading, the thread's events)
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()

    for seed, kw in [(1, {}), (2, dict(hot_expert=3)), (3, dict(out_of_range=20, minus_one=10))]:
        for i, (base, dev, out) in enumerate(zip(bases, devs, outs)):
            ids, w = testing.make_routing(tokens, top_k, experts, seed * 10 + i, **kw)
            dev["topk_ids"].copy_(torch.from_numpy(ids))
            dev["topk_weights"].copy_(torch.from_numpy(w))
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (base, out) in enumerate(zip(bases, outs)):
            ids, w = testing.make_routing(tokens, top_k, experts, seed * 10 + i, **kw)
            want = cpu_fused(dict(base, topk_ids=ids, topk_weights=w))
            check(mode, out, want, f"{mode} replay {seed} layer {i}")


# ------------------------------------------------------------------------------------------------
# run-to-run spread; the deterministic mode
# ------------------------------------------------------------------------------------------------
RUNS = 20


@pytest.mark.parametrize("mode", MODES)
def test_run_to_run_spread(mode, capsys):
    """20 runs (aux stream on even runs): each within tolerance of the CPU engine; the largest
    element difference between runs is printed and bounded by the tolerance times max |out|."""
    tokens = 130
    case = make_case(mode, tokens, 8, 16, seed=14, hot_expert=2)
    dev = on_device(case)
    side = torch.cuda.Stream()
    want = cpu_fused(case)
    outs = []
    for i in range(RUNS):
        outs.append(run_fused(dev, poisoned(tokens), aux_stream=side if i % 2 == 0 else None).clone())
        check(mode, outs[-1], want, f"{mode} run {i}")
    stack = torch.stack([o.float() for o in outs])
    spread = stack.max(dim=0).values - stack.min(dim=0).values
    worst, scale = float(spread.max()), float(stack[0].abs().max())
    differing = int((spread != 0).sum())
    line = (f"FUSED_FINALIZE_SPREAD {mode}: runs={RUNS} elements_differing={differing}/{spread.numel()} "
            f"max_abs_diff={worst:.3e} max_rel_diff={worst / scale:.3e} (tol {testing.TOLERANCES[mode]:.0e})")
    with capsys.disabled():
        print("\n" + line)
    assert worst <= testing.TOLERANCES[mode] * scale, line


@pytest.mark.parametrize("mode", MODES)
def test_deterministic_mode_bitwise_stable_and_ignores_aux_stream(mode):
    """deterministic=True keeps the fixed-order finalize: 5 runs, with and without aux_stream (which
    it does not use), and a graph replay are bit-identical; close to the CPU engine's deterministic
    sum; and the fused finalize stays within tolerance of it."""
    tokens = 130
    case = make_case(mode, tokens, 8, 16, seed=15, out_of_range=5)
    dev = on_device(case)
    side = torch.cuda.Stream()
    first = poisoned(tokens)
    qmoe.fused_moe(**dev, out=first, deterministic=True)
    torch.cuda.synchronize()
    for i in range(5):
        again = poisoned(tokens)
        qmoe.fused_moe(**dev, out=again, deterministic=True, aux_stream=side if i % 2 else None)
        torch.cuda.synchronize()
        assert torch.equal(bits(first), bits(again)), f"deterministic run {i} differs"
    out = poisoned(tokens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qmoe.fused_moe(**dev, out=out, deterministic=True, aux_stream=side)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(first), bits(out)), "deterministic graph replay differs"
    check(mode, first, run_cpu(case, deterministic=True), f"{mode} deterministic vs CPU")
    fused = run_fused(dev, poisoned(tokens), aux_stream=side)
    testing.assert_close(to_np(fused), to_np(first), mode, what=f"{mode} fused vs deterministic")


def test_moe_expert_rows_still_matches_deterministic():
    """moe_expert_rows never scatters: rows + moe_finalize equal fused_moe(deterministic) bit for bit."""
    mode, tokens, top_k = "w4a8_int4", 21, 4
    case = make_case(mode, tokens, top_k, 8, seed=16)
    dev = on_device(case)
    det = qmoe.fused_moe(**dev, deterministic=True)
    hidden = case["w2"].shape[1]
    rows = torch.full((tokens * top_k, hidden), float("nan"), dtype=torch.bfloat16, device=det.device)
    ops.moe_expert_rows(**{k: v for k, v in dev.items() if k != "topk_weights"}, rows=rows)
    fin = ops.moe_finalize(rows, dev["topk_ids"], dev["topk_weights"], num_experts=case["num_experts"])
    torch.cuda.synchronize()
    assert torch.equal(bits(det), bits(fin))


# ------------------------------------------------------------------------------------------------
# aux_stream argument errors (checked before any work)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["stream", 1.5, -1, True])
def test_bad_aux_stream_is_refused_by_name(bad):
    case = on_device(make_case("w4a8_int4", 3, 2, 8, seed=17))
    out = poisoned(3)
    with pytest.raises(ValueError, match="aux_stream"):
        qmoe.fused_moe(**case, out=out, deterministic=False, aux_stream=bad)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all(), "a refused call wrote the output"


def test_flashinfer_compat_forwards_aux_stream():
    from qmoe.compat import flashinfer

    mode, tokens = "w4a16", 9
    case = make_case(mode, tokens, 2, 8, seed=18)
    dev = on_device(case)
    out = poisoned(tokens)
    got = flashinfer.cute_dsl_fused_moe(
        dev["x"], None, dev["topk_ids"], dev["topk_weights"], dev["w1"], dev["w1_scale"], dev["w1_alpha"], None,
        dev["w2"], dev["w2_scale"], dev["w2_alpha"], 8, 2, use_fused_finalize=True, moe_output=out,
        aux_stream=torch.cuda.Stream(), quant_mode=mode)
    torch.cuda.synchronize()
    assert got is out
    check(mode, out, cpu_fused(case), "compat aux_stream")


@pytest.mark.parametrize("tokens", [1, 7, 128])
def test_w4a8_default_keeps_rows_in_y(tokens):
    """w4a8_int4 without QMOE_DECODE_SCATTER: deterministic=False runs y + the finalize kernel's fused mode, so
    it equals the forced-off path bit for bit, repeats bitwise, and writes every element of a poisoned output
    (no memset); within tolerance of the CPU engine's fused rounding."""
    case = make_case("w4a8_int4", tokens, 4, 16, seed=71 + tokens)
    dev = on_device(case)

    def run():
        out = torch.full((tokens, HIDDEN), float("nan"), dtype=torch.bfloat16, device=DEV)
        qmoe.fused_moe(**dev, out=out, deterministic=False)
        torch.cuda.synchronize()
        return out.view(torch.int16).clone()

    with env_var(SCATTER_ENV, None):
        default = [run() for _ in range(3)]
    with env_var(SCATTER_ENV, "0"):
        off = run()
    for again in default[1:]:
        assert torch.equal(default[0], again), "the default fused finalize of w4a8_int4 is not bitwise stable"
    assert torch.equal(default[0], off), "the default differs from QMOE_DECODE_SCATTER=0"
    got = to_np(default[0].view(torch.bfloat16))
    assert np.isfinite(got.astype(np.float32)).all(), "an output element was left unwritten"
    check("w4a8_int4", got, cpu_fused(case), f"T={tokens} default fused finalize")
