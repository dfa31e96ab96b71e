"""Shared by the GPU reliability tests (test_gpu_reliability.py, test_gpu_reliability_runtime.py) and
by the fault-injection child process they start: raw-bit views, poison, byte snapshots, relocated
copies (misaligned, strided, overlapping), valid calls of the three ops from fresh random data, the
one-argument mutations of a call and what each must give (docs/reliability.md, section "GPU").
Import after gpu_common.require_hopper(): needs torch with a CUDA device and the qmoe extension.
"""
from __future__ import annotations

import gc
import math
import os
import zlib

import numpy as np
import pytest
import torch

import qmoe
from gpu_common import to_dev, to_np
from qmoe import ops, testing
from qmoe import reference as ref
from qmoe.compat import sgl_kernel as sgl

DEV = torch.device("cuda")
SANITIZER = os.environ.get("QMOE_SANITIZER", "")
RUNS = 3 if SANITIZER else 20
# Fused quant modes under test. A mode whose GPU pipeline is not built yet skips (gpu_mode), so a
# new GPU mode is covered as soon as it lands; a new mode name is one line here.
FUSED_MODES = ["w4a8_int4", "w4a16_int4", "w4a16", "w4a4", "w4a8"]
TACTICS = qmoe.valid_tactics(256, 256, 64, 8)
POISON_I32 = int(np.array([0xAAAAAAAA], np.uint32).view(np.int32)[0])
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ERROR_NAMES = {"out": "output", "experts_offsets": "expert_offsets"}  # Python name -> name in errors


# ------------------------------------------------------------------------------------------------
# tensor helpers: raw bits, poison, snapshots, relocated copies
# ------------------------------------------------------------------------------------------------
def raw(t):
    """Same-size integer view: bit comparisons and copies for any dtype (fp8 included)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def same_bits(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and torch.equal(raw(a).cpu(), raw(b).cpu())


def poisoned(shape, dtype, device=DEV):
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, POISON_I32 if dtype == torch.int32 else 0xAA, dtype=dtype, device=device)


def tensors_of(kw):
    return {k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}


def snapshot(kw):
    return [(name, t, raw(t).clone()) for name, t in tensors_of(kw).items()]


def assert_unchanged(snap, what):
    torch.cuda.synchronize()
    for name, t, before in snap:
        assert torch.equal(raw(t), before), f"{what}: '{name}' was written by a call that raised"


def misaligned(t, elems=1):
    """A copy of t starting `elems` elements into a fresh allocation (never 16-byte aligned)."""
    r = raw(t.contiguous())
    flat = torch.empty(r.numel() + elems + 16, dtype=r.dtype, device=t.device)
    view = flat[elems:elems + r.numel()]
    view.copy_(r.reshape(-1))
    return view.view(t.shape).view(t.dtype)


def strided(t):
    """A copy of t with every stride doubled: non-contiguous unless it has at most one element."""
    r = raw(t)
    big = torch.zeros(tuple(t.shape) + (2,), dtype=r.dtype, device=t.device)
    view = big[..., 0]
    view.copy_(r)
    return view.view(t.dtype)


def overlapping(victim, shape, dtype, offset_bytes):
    """(copy of victim, new tensor of shape/dtype) in one allocation; the new tensor starts
    offset_bytes into the victim's bytes (a multiple of 16, so alignment checks pass)."""
    vbytes = victim.numel() * victim.element_size()
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    buf = torch.zeros(max(vbytes, offset_bytes + nbytes) + 16, dtype=torch.uint8, device=victim.device)
    v = buf[:vbytes].view(raw(victim).dtype).view(victim.shape)
    v.copy_(raw(victim))
    o = buf[offset_bytes:offset_bytes + nbytes].view(_INT_OF_SIZE[itemsize]).view(shape).view(dtype)
    return v.view(victim.dtype), o


def stable_seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


# ------------------------------------------------------------------------------------------------
# the three ops: valid calls built from fresh random data
# ------------------------------------------------------------------------------------------------
def mm_data_kw(seed, tokens=37, top_k=6, experts=40, n=72, k=384):
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(-2, experts + 3, size=(tokens, top_k)).astype(np.int32)).to(DEV)
    slots = tokens * top_k
    i32 = torch.int32
    return dict(topk_ids=ids, expert_offsets=poisoned((experts + 1,), i32), problem_sizes1=poisoned((experts, 3), i32),
                problem_sizes2=poisoned((experts, 3), i32), input_permutation=poisoned((slots,), i32),
                output_permutation=poisoned((slots,), i32), num_experts=experts, n=n, k=k)


def interleave_scales(s):
    """Logical S [E, N, G] -> SGLang's stored layout ([E, G/4, 4N] when G % 4 == 0, else [E, G, N])."""
    e, n, g = s.shape
    if g % 4 == 0:
        return s.reshape(e, n, g // 4, 4).permute(0, 2, 1, 3).reshape(e, g // 4, 4 * n).contiguous()
    return s.transpose(1, 2).contiguous()


def gemm_kw(seed, experts=4, n=64, k=256, counts=(5, 0, 9, 3), *, gap=1, tail=2, per_row=False, fill_gaps=True):
    """A cutlass_w4a8_moe_mm call with a gap row before every expert block and `tail` rows after the
    last; rows outside every block hold e4m3 NaN (fill_gaps) or are never written (initcheck).
    Returns (kw, mask of in-block rows, a with every row quantized, for the CPU reference)."""
    gen = torch.Generator(device=DEV)
    gen.manual_seed(seed)
    starts, pos = [], 0
    for c in counts:
        pos += gap
        starts.append(pos)
        pos += c
    rows = pos + tail
    mask = torch.zeros(rows, dtype=torch.bool, device=DEV)
    for s, c in zip(starts, counts):
        mask[s:s + c] = True
    q = torch.randint(-128, 128, (experts, n, k // 2), dtype=torch.int8, device=DEV, generator=gen)
    scale = (0.5 + torch.rand((experts, n, k // 128), device=DEV, generator=gen)) / (4.6 * math.sqrt(k))
    x = torch.randn((rows, k), device=DEV, generator=gen)
    amax = float(x.abs().max()) if rows else 1.0
    full = (x * (448.0 / amax)).clamp(-448, 448).to(torch.float8_e4m3fn)
    a = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=DEV)
    if fill_gaps:
        a.view(torch.uint8).fill_(0x7F)
    a.view(torch.uint8)[mask] = full.view(torch.uint8)[mask]
    if per_row:
        a_scales = (amax / 448.0) * (0.25 + 1.5 * torch.rand((rows,), device=DEV, generator=gen))
    else:
        a_scales = torch.tensor([amax / 448.0], device=DEV)
    ks = torch.full((experts, 3), k, dtype=torch.int64, device=DEV)
    ns = torch.full((experts, 3), n, dtype=torch.int64, device=DEV)
    kw = dict(d=poisoned((rows, n), torch.bfloat16), a=a, b=q, a_scales=a_scales.float().contiguous(),
              b_scales=interleave_scales(scale.to(torch.bfloat16)),
              experts_offsets=torch.tensor(starts, dtype=torch.int32, device=DEV),
              problem_sizes=torch.tensor([[n, c, k] for c in counts], dtype=torch.int32, device=DEV),
              a_strides=ks, b_strides=ks.clone(), d_strides=ns, s_strides=ns.clone(), chunk_size=128, topk=8)
    return kw, mask, full


def gemm_cpu(kw, a_full):
    """The same call on numpy arrays: the C++ CPU reference (rows outside blocks stay poisoned)."""
    rows, n = kw["d"].shape
    d = testing.poison((rows, n), ref.BF16)
    # kw["a"] is not copied: under initcheck its gap rows are never written, and reading them here
    # would be the test's own uninitialized read.
    np_kw = {k: (to_np(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items() if k != "a"}
    np_kw.update(d=d, a=to_np(a_full))
    sgl.cutlass_w4a8_moe_mm(**np_kw)
    return d


def fused_case_np(mode, tokens, top_k, experts, hidden=256, inter=128, seed=0, **kw):
    case = testing.make_fused_moe_case(mode, tokens, hidden, inter, experts, top_k, seed=seed, **kw)
    return {k: v for k, v in case.items() if v is not None}


def on_device(case):
    return {k: to_dev(v) for k, v in case.items()}


def fused_kw(mode, seed, tokens=5, top_k=2, experts=8, **kw):
    dev = on_device(fused_case_np(mode, tokens, top_k, experts, seed=seed, out_of_range=1, **kw))
    dev.update(out=poisoned((tokens, dev["w2"].shape[1]), torch.bfloat16), deterministic=True)
    return dev


class Op:
    def __init__(self, name, run, outputs, reference, needs_alignment):
        self.name, self.run, self.outputs = name, run, outputs
        self.reference = reference              # the tensor the others' device is checked against
        self.needs_alignment = needs_alignment  # tensors whose misalignment must be refused


OPS = {
    "mm_data": Op("mm_data", lambda kw: sgl.get_cutlass_w4a8_moe_mm_data(**kw),
                  ("expert_offsets", "problem_sizes1", "problem_sizes2", "input_permutation", "output_permutation"),
                  "topk_ids", ()),
    "gemm": Op("gemm", lambda kw: sgl.cutlass_w4a8_moe_mm(**kw), ("d",), "a", ("d", "a", "b", "b_scales")),
    "fused": Op("fused", lambda kw: qmoe.fused_moe(**kw), ("out",), "x", ("w1", "w1_scale", "w2", "w2_scale")),
}


def build(op, mode, seed):
    if op == "mm_data":
        return mm_data_kw(seed)
    if op == "gemm":
        return gemm_kw(seed)[0]
    return fused_kw(mode, seed)


_MODE_STATUS: dict = {}


def gpu_mode(mode):
    """Skip the calling test unless fused quant_mode `mode` runs on the GPU in this build (its GPU
    pipeline raises a kRuntime error 'not available on the GPU' until it exists)."""
    if mode not in _MODE_STATUS:
        try:
            qmoe.fused_moe(**fused_kw(mode, seed=1))
            torch.cuda.synchronize()
            _MODE_STATUS[mode] = ""
        except RuntimeError as e:
            if "not available on the GPU" not in str(e):
                raise
            _MODE_STATUS[mode] = str(e)
    if _MODE_STATUS[mode]:
        pytest.skip(f"quant_mode {mode}: {_MODE_STATUS[mode]}")


def check_fused_vs_cpu(mode, case, out, what, **opts):
    cpu = qmoe.fused_moe(**case, output_dtype="bfloat16", **opts)
    testing.assert_close(to_np(out), cpu, mode, what=what)


def live_bytes():
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def report(capsys, line):
    """Results the docs quote: printed past pytest's capture, prefixed for grep."""
    with capsys.disabled():
        print("\nRELIABILITY " + line)


def layer_call(c, out, tactic=None):
    return ops._layer_call(
        quant_mode=c["quant_mode"], x=c["x"], x_scale=c.get("x_scale"), topk_ids=c["topk_ids"],
        topk_weights=c["topk_weights"], w1=c["w1"], w1_scale=c["w1_scale"], w1_alpha=c.get("w1_alpha"),
        fc2_input_scale=c.get("fc2_input_scale"), w2=c["w2"], w2_scale=c["w2_scale"], w2_alpha=c.get("w2_alpha"),
        per_token_scale=c.get("per_token_scale"), output=(out, "out"), num_experts=c["num_experts"],
        num_local_experts=c.get("num_local_experts"), local_expert_offset=c.get("local_expert_offset", 0),
        activation=c.get("activation", "swiglu"), swiglu_alpha=1.0, swiglu_beta=0.0, swiglu_limit=math.inf,
        situ_beta=1.0, situ_linear_beta=None, gate_up_layout=c.get("gate_up_layout", "gate_up"),
        deterministic=True, routed_scaling_factor=1.0, tactic=tactic)


# ------------------------------------------------------------------------------------------------
# one-argument mutations of a valid call
# ------------------------------------------------------------------------------------------------
def tensor_names(op, mode):
    if op == "fused":
        return sorted(k for k, v in fused_case_np(mode, 3, 2, 4).items() if isinstance(v, np.ndarray)) + ["out"]
    return sorted(tensors_of(build(op, None, 0)))


def mutation_labels(op, mode):
    names = tensor_names(op, mode)
    labels = [f"{kind}:{n}" for n in names for kind in ("cpu", "cuda1", "misaligned", "strided")]
    for out in OPS[op].outputs:
        labels += [f"alias:{out}:{n}" for n in names if n != out]
    return labels


def mutate(op, kw, label):
    """(mutated kw, expectation): ('error', names the message may give), ('legal', None) or
    ('either', names): refused naming one of names, or computed like the valid call."""
    spec, parts = OPS[op], label.split(":")
    kw = dict(kw)
    if parts[0] == "alias":
        out, victim = parts[1], parts[2]
        vbytes = kw[victim].numel() * kw[victim].element_size()
        kw[victim], kw[out] = overlapping(kw[victim], tuple(kw[out].shape), kw[out].dtype, 16 if vbytes > 16 else 0)
        kw[out].copy_(poisoned(tuple(kw[out].shape), kw[out].dtype))
        return kw, ("error", {ERROR_NAMES.get(out, out), ERROR_NAMES.get(victim, victim)})
    kind, name = parts
    t, shown = kw[name], ERROR_NAMES.get(name, name)
    anyone = None if name == spec.reference else {shown}  # moving the reference: any argument may be named
    if kind == "cpu":
        kw[name] = t.cpu()
        return kw, ("error", anyone)
    if kind == "cuda1":
        kw[name] = t.to("cuda:1")
        return kw, ("error", anyone)
    if kind == "misaligned":
        kw[name] = misaligned(t)
        must = name in spec.needs_alignment and (op != "fused" or kw["quant_mode"] == "w4a8_int4")
        return kw, ("error", {shown}) if must else ("either", {shown})
    kw[name] = strided(t)
    return kw, ("error", {shown}) if t.numel() > 1 else ("legal", None)


def check_refused(op, kw, names, what):
    snap = snapshot(kw)
    with pytest.raises((ValueError, TypeError)) as info:
        OPS[op].run(kw)
    msg = str(info.value)
    assert msg.startswith("qmoe: argument '"), f"{what}: not a qmoe argument error: {msg}"
    if names is not None:
        assert any(f"argument '{n}'" in msg for n in names), f"{what}: expected one of {sorted(names)} named: {msg}"
    assert_unchanged(snap, what)


# Odd-shaped GEMM problems (N, K and row counts not multiples of any tile), shared with the child.
GEMM_ODD = {  # name: (experts, N, K, rows per expert, per-row a_scales)
    "tiny_e3_n72_k384": (3, 72, 384, (17, 0, 5), False),
    "small_e5_n200_k640": (5, 200, 640, (1, 33, 0, 65, 3), True),
    "small_e4_n8_k128": (4, 8, 128, (2, 0, 0, 1), False),
    "small_e6_n136_k1536": (6, 136, 1536, (1, 2, 3, 0, 31, 9), True),  # K % 512 == 0: packed scales
    # packed scales with N below the WGMMA tiles' 64-row TMA boxes; 70 rows: several token tiles
    "small_e3_n24_k1024": (3, 24, 1024, (70, 0, 5), False),
    "big_e2_n1032_k1152": (2, 1032, 1152, (129, 7), False),
}
