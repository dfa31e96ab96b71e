"""GPU reliability tests, issue #6 items 1 and 2 (docs/reliability.md, section "GPU"); items 4-6 are
in test_gpu_reliability_runtime.py, the shared helpers in gpu_reliability_common.py.

Ops: get_cutlass_w4a8_moe_mm_data, cutlass_w4a8_moe_mm (qmoe.compat.sgl_kernel) and qmoe.fused_moe for
every mode in FUSED_MODES (a mode whose GPU pipeline is not built yet skips).
  test_odd_*      item 2: N, K and row counts that are not multiples of any tile, every tactic, against
                  the C++ CPU engine, outputs poisoned, rows outside every expert block unread (e4m3
                  NaN) and unwritten. scripts/gpu_sanitize.sh runs these under compute-sanitizer,
                  selected by the size word in their ids (tiny / small / big). Under initcheck the
                  unread rows and the outputs of get_cutlass_w4a8_moe_mm_data are left uninitialized
                  and the fused op's workspace comes from fresh memory, so a read before a write shows.
  test_hostile_*  item 1: CUDA tensors moved to the CPU (or cuda:1), one element misaligned, with
                  doubled strides, outputs overlapping any other tensor of the call, bad workspaces,
                  T = 0. A refused call raises the documented error naming the argument, launches no
                  qmoe kernel (torch.profiler) and changes no byte of any tensor (snapshots). A legal
                  mutation (a misaligned tensor that the kernels read element-wise, a strided tensor
                  of one element) gives the unmutated call's result bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_common import require_hopper, to_np  # noqa: E402

torch = require_hopper()

import qmoe  # noqa: E402
from qmoe import _C, testing  # noqa: E402
from qmoe._tensors import arg, current_stream  # noqa: E402
from qmoe.compat import sgl_kernel as sgl  # noqa: E402

from gpu_reliability_common import (  # noqa: E402
    DEV, FUSED_MODES, GEMM_ODD, OPS, SANITIZER, TACTICS, assert_unchanged, build, check_fused_vs_cpu,
    check_refused, fused_case_np, fused_kw, gemm_cpu, gemm_kw, gpu_mode, layer_call, mm_data_kw, mutate,
    mutation_labels, on_device, overlapping, poisoned, raw, same_bits, snapshot, stable_seed)

_GEMM_EXPECTED: dict = {}


# ------------------------------------------------------------------------------------------------
# item 2: odd shapes (N, K, rows not multiples of any tile), every tactic, vs the CPU engine
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tactic", TACTICS + [None], ids=TACTICS + ["heuristic"])
@pytest.mark.parametrize("name", list(GEMM_ODD))
def test_odd_gemm(name, tactic):
    experts, n, k, counts, per_row = GEMM_ODD[name]
    kw, mask, full = gemm_kw(stable_seed(name), experts, n, k, counts, gap=3, tail=5, per_row=per_row,
                             fill_gaps=SANITIZER != "initcheck")
    if name not in _GEMM_EXPECTED:  # the same seed gives the same data for every tactic
        _GEMM_EXPECTED[name] = gemm_cpu(kw, full)
    expected = _GEMM_EXPECTED[name]
    poison_bits = raw(kw["d"])[0, 0].item()
    sgl.cutlass_w4a8_moe_mm(**kw, tactic=tactic)
    torch.cuda.synchronize()
    d, m = kw["d"], to_np(mask)
    assert bool((raw(d)[~mask] == poison_bits).all()), "rows outside every expert block were written"
    testing.assert_close(to_np(d)[m], expected[m], "grouped_gemm", what=f"{name} tactic {tactic}")


MM_DATA_ODD = [(1, 3), (3, 1000), (2047, 7), (2049, 1023), (4099, 5), (65537, 1000)]


@pytest.mark.parametrize("slots,experts", MM_DATA_ODD,
                         ids=[("tiny" if s < 4096 else "small") + f"_{s}_e{e}" for s, e in MM_DATA_ODD])
def test_odd_mm_data(slots, experts):
    ids = np.random.default_rng(slots).integers(-3, experts + 3, size=slots).astype(np.int32)
    outs = {}
    for where, make in (("cpu", lambda s: testing.poison(s, np.int32)), ("gpu", None)):
        shapes = [(experts + 1,), (experts, 3), (experts, 3), (slots,), (slots,)]
        if make is not None:
            bufs, src = [make(s) for s in shapes], ids
        else:
            if SANITIZER == "initcheck":  # fresh, never-written memory: any read before a write is reported
                torch.cuda.empty_cache()
                bufs = [torch.empty(s, dtype=torch.int32, device=DEV) for s in shapes]
            else:
                bufs = [poisoned(s, torch.int32) for s in shapes]
            src = torch.from_numpy(ids).to(DEV)
        sgl.get_cutlass_w4a8_moe_mm_data(src, *bufs, experts, 72, 384)
        outs[where] = [b if isinstance(b, np.ndarray) else to_np(b) for b in bufs]
    for got, want in zip(outs["gpu"], outs["cpu"]):
        np.testing.assert_array_equal(got, want)


FUSED_ODD = {  # name: (tokens, top_k, experts, H, I, extra case options)
    "tiny_t3_k3_h384_i384": (3, 3, 5, 384, 384, dict(num_local_experts=4, local_expert_offset=1)),
    "small_t17_k6_h640_i384": (17, 6, 7, 640, 384, dict(out_of_range=4, minus_one=3)),
    "small_t129_k1_h384_i640": (129, 1, 5, 384, 640, {}),
}


def run_fused_odd(mode, name, det, tactic=None):
    tokens, top_k, experts, hidden, inter, extra = FUSED_ODD[name]
    case = fused_case_np(mode, tokens, top_k, experts, hidden, inter, seed=stable_seed(name, mode), **extra)
    dev = on_device(case)
    out = poisoned((tokens, hidden), torch.bfloat16)
    if SANITIZER == "initcheck":
        torch.cuda.empty_cache()  # the workspace then comes from fresh memory
    qmoe.fused_moe(**dev, out=out, deterministic=det, tactic=tactic)
    torch.cuda.synchronize()
    check_fused_vs_cpu(mode, case, out, f"{name} det={det} tactic={tactic}", deterministic=det)


@pytest.mark.parametrize("det", [True, False], ids=["det", "fusedfin"])
@pytest.mark.parametrize("name", list(FUSED_ODD))
@pytest.mark.parametrize("mode", FUSED_MODES)
def test_odd_fused(mode, name, det):
    gpu_mode(mode)
    run_fused_odd(mode, name, det)


@pytest.mark.parametrize("tactic", TACTICS)
@pytest.mark.parametrize("name,det", [("tiny_t3_k3_h384_i384", True), ("small_t17_k6_h640_i384", False)],
                         ids=["tiny_det", "small_fusedfin"])
def test_odd_fused_tactics(name, det, tactic):
    """Every compiled GEMM tactic forced in both GEMMs of the fused op (w4a8_int4)."""
    run_fused_odd("w4a8_int4", name, det, tactic)


# ------------------------------------------------------------------------------------------------
# item 1: hostile calls with CUDA tensors
# ------------------------------------------------------------------------------------------------
def hostile_params():
    params = [pytest.param(op, None, lab, id=f"{op}-{lab}") for op in ("mm_data", "gemm")
              for lab in mutation_labels(op, None)]
    params += [pytest.param("fused", m, lab, id=f"fused-{m}-{lab}") for m in FUSED_MODES
               for lab in mutation_labels("fused", m)]
    return params


@pytest.mark.parametrize("op,mode,label", hostile_params())
def test_hostile_tensor(op, mode, label):
    if label.startswith("cuda1") and torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU")
    if mode:
        gpu_mode(mode)
    seed = stable_seed(op, mode, label)
    kw, (expect, names) = mutate(op, build(op, mode, seed), label)
    if expect == "error":
        check_refused(op, kw, names, label)
        return
    snap = snapshot(kw)
    try:
        OPS[op].run(kw)
    except (ValueError, TypeError) as e:
        assert expect == "either", f"{label}: a legal mutation was refused: {e}"
        assert any(f"argument '{n}'" in str(e) for n in names), f"{label}: {e}"
        assert_unchanged(snap, label)
        return
    baseline = build(op, mode, seed)
    OPS[op].run(baseline)
    torch.cuda.synchronize()
    for out in OPS[op].outputs:
        assert same_bits(kw[out], baseline[out]), f"{label}: '{out}' differs from the unmutated call"


def kernels_launched(fn):
    """Names of the qmoe kernels that ran during fn() (torch.profiler / CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    names += [k.name for e in prof.events() for k in (getattr(e, "kernels", None) or [])]
    return [n for n in names if "qmoe" in n], len(names)


@pytest.mark.skipif(bool(SANITIZER), reason="CUPTI (torch.profiler) does not run under compute-sanitizer")
@pytest.mark.parametrize("op,mode", [("mm_data", None), ("gemm", None)] + [("fused", m) for m in FUSED_MODES])
def test_hostile_errors_launch_no_kernel(op, mode):
    """Every refused mutation of the op, inside one profiler session: no qmoe kernel runs. The
    positive control (the valid call) shows the profiler does see qmoe kernels."""
    if mode:
        gpu_mode(mode)
    cases = []
    for label in mutation_labels(op, mode):
        if label.startswith("cuda1") and torch.cuda.device_count() < 2:
            continue
        kw, (expect, names) = mutate(op, build(op, mode, stable_seed(label)), label)
        if expect == "error":
            cases.append((label, kw, names))

    def refuse_all():
        for label, kw, names in cases:
            check_refused(op, kw, names, label)

    launched, _ = kernels_launched(refuse_all)
    assert launched == [], f"{len(cases)} refused calls launched qmoe kernels: {sorted(set(launched))[:5]}"
    control, events = kernels_launched(lambda: OPS[op].run(build(op, mode, 7)))
    if events == 0:
        pytest.skip("torch.profiler recorded no CUDA activity on this machine (CUPTI unavailable)")
    assert control, "the profiler saw no qmoe kernel in a valid call: the check above proves nothing"


def test_hostile_t0_mm_data():
    kw = mm_data_kw(3, tokens=0)
    OPS["mm_data"].run(kw)
    torch.cuda.synchronize()
    assert to_np(kw["expert_offsets"]).tolist() == [0] * 41
    np.testing.assert_array_equal(to_np(kw["problem_sizes1"]), np.tile([144, 0, 384], (40, 1)))
    np.testing.assert_array_equal(to_np(kw["problem_sizes2"]), np.tile([384, 0, 72], (40, 1)))


def test_hostile_t0_gemm():
    kw, _, _ = gemm_kw(4, counts=(0, 0, 0, 0), gap=0, tail=0)
    assert kw["a"].shape[0] == 0
    for tactic in TACTICS + [None]:
        sgl.cutlass_w4a8_moe_mm(**kw, tactic=tactic)
    torch.cuda.synchronize()
    valid, mask, full = gemm_kw(5)
    sgl.cutlass_w4a8_moe_mm(**valid)  # and the next call works
    torch.cuda.synchronize()
    m = to_np(mask)
    testing.assert_close(to_np(valid["d"])[m], gemm_cpu(valid, full)[m], "grouped_gemm")


@pytest.mark.parametrize("det", [True, False], ids=["det", "fusedfin"])
@pytest.mark.parametrize("mode", FUSED_MODES)
def test_hostile_t0_fused(mode, det):
    gpu_mode(mode)
    case = fused_case_np(mode, 4, 2, 8, seed=8)
    for key in ("x", "topk_ids", "topk_weights", "per_token_scale"):
        if key in case:
            case[key] = case[key][:0]
    if "x_scale" in case and case["x_scale"].ndim == 2:  # block scales per token
        case["x_scale"] = case["x_scale"][:0]
    dev = on_device(case)
    out = qmoe.fused_moe(**dev, deterministic=det)
    torch.cuda.synchronize()
    assert tuple(out.shape) == (0, case["w2"].shape[1])
    kw = fused_kw(mode, 9)  # and the next call works
    qmoe.fused_moe(**kw)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(kw["out"].float()).all())


@pytest.mark.parametrize("kind", ["none", "short", "byte_offset", "offset16", "over_out", "over_x", "over_w1"])
@pytest.mark.parametrize("mode", FUSED_MODES)
def test_hostile_workspace(mode, kind):
    gpu_mode(mode)
    kw = fused_kw(mode, stable_seed(kind))
    need = _C.fused_moe_workspace_size(layer_call(kw, kw["out"]))
    if need == 0:
        pytest.skip(f"{mode} needs no workspace")
    big = torch.zeros(need + 512, dtype=torch.uint8, device=DEV)
    ws = {"none": None, "short": big[:need - 1], "byte_offset": big[1:need + 1],
          "offset16": big[16:need + 16]}.get(kind)
    if kind == "over_out":
        ws, kw["out"] = overlapping(big[:need], tuple(kw["out"].shape), kw["out"].dtype, 0)
        kw["out"].fill_(float("nan"))
    elif kind in ("over_x", "over_w1"):
        victim = kind[5:]
        kw[victim], ws = overlapping(kw[victim], (need,), torch.uint8, 0)
    kw["ws"] = ws
    snap = snapshot(kw)
    with pytest.raises(ValueError, match="argument 'workspace'"):
        _C.fused_moe(layer_call(kw, kw["out"]), arg(ws, "workspace"), current_stream(kw["out"]))
    assert_unchanged(snap, kind)
    assert bool(torch.isnan(kw["out"].float()).all())
