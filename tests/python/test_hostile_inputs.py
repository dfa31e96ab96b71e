"""Hostile inputs at every public Python entry point (reliability issue, parts 1 and 6), CPU backend.

Method: build one VALID call per entry point (qmoe.testing generators), check it against the numpy
twin (qmoe.reference), then let Hypothesis mutate exactly ONE thing and call again with every output
buffer poisoned. Each mutated call must end in one of two ways:

  * rejected: ValueError / TypeError whose message names the mutated argument (for shape and device
    mutations of tensors whose sizes are tied together, any argument of the call: which tensor of a
    coupled pair is blamed is the validator's choice), every output byte-identical to its poison and
    every input byte-identical to what was passed;
  * accepted, where the mutation is legal by design (see LEGAL below): inputs untouched and the result
    bit-identical to the unmutated call (layout-only mutations) or equal to the numpy twin (value
    mutations such as dropped expert ids or NaN scales).

Never a crash, never a silent write. After every rejected call the next valid call must still match
(fault recovery, issue part 6): `_recover` checks it every few examples.

Designed behaviour, as read from DESIGN.md, include/qmoe/*.h and src/api/*.cpp (LEGAL):
  * expert ids < 0, >= num_experts or outside the local range are dropped (DESIGN 3b "Routing");
  * top-k > E is legal for routing (an expert twice in one token counts twice), top-k > 16 is an
    error for the fused op (kMaxTopK);
  * T = 0 is legal everywhere (empty outputs); E = 0 is an error (num_experts / expert_offsets);
  * NaN / Inf in activation scales are not checked: they propagate (DESIGN 3b "NaN");
  * a misaligned (byte-offset) CPU tensor is legal: alignment is only required of CUDA tensors
    (TMA), x86 reads unaligned data;
  * a tensor whose only odd strides are on size-1 axes, or that is empty, counts as contiguous;
  * `topk` of cutlass_w4a8_moe_mm is a tactic hint: any value >= 1 is legal;
  * the stride tensors of cutlass_w4a8_moe_mm may be None.
qmoe.quant.* has its own file (test_hostile_quant.py). The number of calls of each kind is counted
and printed at the end (run with -s to see it; docs/reliability.md quotes the counts).
"""
from __future__ import annotations

import collections
import functools
import math
import re
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qmoe
from qmoe import reference as ref
from qmoe import testing
from qmoe.compat import flashinfer, sgl_kernel

CALLS = collections.Counter()  # (entry point, outcome) -> count

HYPO = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
# Candidate dtypes for the "wrong dtype" mutation (numpy names; float64, int16 and bool are not
# qmoe dtypes at all and must be refused by the Python layer itself).
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "float64": np.dtype(np.float64),
          "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8), "int16": np.dtype(np.int16),
          "int32": np.dtype(np.int32), "int64": np.dtype(np.int64), "bfloat16": BF16,
          "float8_e4m3fn": E4M3, "float8_e8m0fnu": E8M0, "bool": np.dtype(np.bool_)}


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    total = sum(CALLS.values())
    lines = [f"  {entry:28s} {outcome:9s} {n}" for (entry, outcome), n in sorted(CALLS.items())]
    print(f"\n[test_hostile_inputs] {total} mutated calls\n" + "\n".join(lines))


# ------------------------------------------------------------------------------------------------
# Generic machinery
# ------------------------------------------------------------------------------------------------
class Entry:
    """One valid call. kw: the keyword arguments (arrays and scalars); outputs: names of the
    caller-owned output buffers; call(kw) -> dict of the results to compare; twin(kw) -> the same
    dict from the numpy twin; names[arg]: other argument names an error about `arg` may use;
    accepted[arg]: dtypes that are legal for arg (never drawn as a "wrong dtype")."""

    def __init__(self, label, call, kw, outputs, twin, accepted, names=None, tol=0.0):
        self.label, self.call, self.kw, self.outputs, self.twin = label, call, kw, outputs, twin
        self.accepted, self.names, self.tol = accepted, names or {}, tol
        self.baseline = None
        self.shape_free = set()  # args whose shape is free as long as numel holds (topk_ids of routing)

    def arrays(self):
        return [k for k, v in self.kw.items() if isinstance(v, np.ndarray)]

    def inputs(self):
        return [k for k in self.arrays() if k not in self.outputs]

    def allowed_names(self, arg):
        return set(self.names.get(arg, ())) | {arg}


def _poison_like(a):
    """a poisoned IN PLACE (its strides, offset and alignment are part of the mutation)."""
    if a.size:
        a[...] = True if a.dtype.kind == "b" else testing.poison(a.shape, a.dtype)
    return a


def _bytes(a):
    return np.ascontiguousarray(a).view(np.uint8).tobytes() if a.size else b""


def _named(err):
    return re.findall(r"argument '([^']+)'", str(err))


def _same_bits(got, want, what):
    g, w = np.ascontiguousarray(got), np.ascontiguousarray(want)
    assert g.shape == w.shape and g.dtype == w.dtype, what
    assert _bytes(g) == _bytes(w), f"{what}: result differs from the unmutated call"


def _match_twin(got, want, tol, what):
    """Exact for integers; for floats the NaN / inf pattern must agree and the rest be within tol."""
    g = np.asarray(got)
    w = np.asarray(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    if g.dtype.kind in "iu":
        np.testing.assert_array_equal(g, w, err_msg=what)
        return
    g64, w64 = g.astype(np.float32).astype(np.float64), w.astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g64), np.isnan(w64), err_msg=f"{what}: NaN pattern")
    np.testing.assert_array_equal(np.isinf(g64), np.isinf(w64), err_msg=f"{what}: inf pattern")
    fin = np.isfinite(w64)
    np.testing.assert_array_equal(g64[np.isinf(w64)], w64[np.isinf(w64)], err_msg=f"{what}: inf sign")
    if fin.any():
        testing.assert_close(g64[fin], w64[fin], tol=max(tol, 1e-6), what=what)


def attempt(entry, kw, arg, *, legal, strict_name=True, compare="same", poison=True):
    """Run entry.call on kw (one thing changed: `arg`) and check the outcome as the module docstring
    says. legal: True (must succeed), False (must be rejected). compare: "same" (bit-identical to the
    unmutated call) or "twin" (numpy twin on the mutated kw)."""
    kw = dict(kw)
    for o in entry.outputs:
        if poison and isinstance(kw.get(o), np.ndarray):
            kw[o] = _poison_like(kw[o])
    before = {k: _bytes(v) for k, v in kw.items() if isinstance(v, np.ndarray)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = entry.call(kw)
    except (ValueError, TypeError) as err:
        CALLS[(entry.label, "rejected")] += 1
        assert not legal, f"{entry.label}: legal mutation of '{arg}' was rejected: {err}"
        names = _named(err)
        if strict_name:
            assert set(names) & entry.allowed_names(arg), (
                f"{entry.label}: error about '{arg}' names {names}: {err}")
        else:
            assert names and set(names) & (set(entry.kw) | {n for a in entry.kw for n in entry.allowed_names(a)}), (
                f"{entry.label}: error after mutating '{arg}' names no argument of the call: {err}")
        for k, b in before.items():
            assert _bytes(kw[k]) == b, f"{entry.label}: '{k}' was written although the call was rejected ({err})"
        return "rejected"
    CALLS[(entry.label, "accepted")] += 1
    assert legal, f"{entry.label}: illegal mutation of '{arg}' was accepted"
    for k in entry.inputs():
        if k in kw and isinstance(kw[k], np.ndarray) and k not in entry.outputs:
            assert _bytes(kw[k]) == before[k], f"{entry.label}: input '{k}' was written"
    if compare == "same":
        for name, value in result.items():
            _same_bits(value, entry.baseline[name], f"{entry.label}: {name} after mutating {arg}")
    else:
        with np.errstate(all="ignore"):
            want = entry.twin(kw)
        for name, value in result.items():
            _match_twin(value, want[name], entry.tol, f"{entry.label}: {name} after mutating {arg}")
    return "accepted"


def establish(entry):
    """The unmutated call: succeeds, writes every output, matches the twin; kept as the baseline."""
    kw = dict(entry.kw)
    for o in entry.outputs:
        kw[o] = _poison_like(kw[o])
    result = entry.call(kw)
    with np.errstate(all="ignore"):
        want = entry.twin(kw)
    for name, value in result.items():
        _match_twin(value, want[name], entry.tol, f"{entry.label}: valid call {name}")
    entry.baseline = {k: np.array(v, copy=True) for k, v in result.items()}
    return entry


def _recover(entry):
    """Fault recovery: the valid call after any number of rejected ones still gives the baseline."""
    kw = dict(entry.kw)
    for o in entry.outputs:
        kw[o] = _poison_like(kw[o])
    for name, value in entry.call(kw).items():
        _same_bits(value, entry.baseline[name], f"{entry.label}: valid call after errors")
    CALLS[(entry.label, "recovery")] += 1


# ---- layout mutations ---------------------------------------------------------------------------
def qmoe_contiguous(a):
    """TensorRef::is_contiguous: empty, or row-major strides on every axis of size != 1."""
    if a.size == 0:
        return True
    expected = 1
    for size, stride in zip(reversed(a.shape), reversed(a.strides)):
        if size != 1 and stride != expected * a.itemsize:
            return False
        expected *= size
    return True


def strided(a, axis):
    """Same shape and values, stride doubled along `axis` (a view into a bigger buffer)."""
    big_shape = list(a.shape)
    big_shape[axis] *= 2
    big = np.zeros(big_shape, a.dtype)
    index = [slice(None)] * a.ndim
    index[axis] = slice(None, None, 2)
    view = big[tuple(index)]
    view[...] = a
    return view


def fortran(a):
    return np.asfortranarray(a)


def misaligned(a, offset=1):
    """Same shape and values at an address `offset` bytes past an aligned one."""
    buf = np.zeros(a.nbytes + 64, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    view = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    view[...] = a
    return view


def random_array(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = rng.integers(0, 256, size=n, dtype=np.uint8)
    if dtype == np.bool_:
        raw = raw & 1
    return raw.view(dtype).reshape(shape).copy()


def aliased_output(entry, kw, out_name, in_name, shift):
    """kw with `out_name` replaced by a buffer that overlaps input `in_name` (same dtype/shape as the
    original output): both are views of one byte buffer, the output starting `shift` bytes in."""
    out, inp = kw[out_name], kw[in_name]
    size = max(out.nbytes + shift, inp.nbytes) + 16
    buf = np.zeros(size, np.uint8)
    in_view = buf[:inp.nbytes].view(inp.dtype).reshape(inp.shape)
    in_view[...] = inp
    out_view = buf[shift:shift + out.nbytes].view(out.dtype).reshape(out.shape)
    kw = dict(kw)
    kw[in_name] = in_view
    kw[out_name] = out_view
    return kw


# ------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------
ROUTING_OUTPUTS = ("expert_offsets", "problem_sizes1", "problem_sizes2", "input_permutation", "output_permutation")


@functools.lru_cache(maxsize=None)
def routing_entry(case):
    tokens, top_k, experts = [(7, 2, 4), (5, 8, 16), (9, 6, 3)][case]  # the last: top-k > E
    ids, _ = testing.make_routing(tokens, top_k, experts, seed=case, distinct=top_k <= experts, out_of_range=2,
                                  minus_one=1)
    slots = ids.size
    kw = dict(topk_ids=ids, expert_offsets=np.zeros(experts + 1, np.int32),
              problem_sizes1=np.zeros((experts, 3), np.int32), problem_sizes2=np.zeros((experts, 3), np.int32),
              input_permutation=np.zeros(slots, np.int32), output_permutation=np.zeros(slots, np.int32),
              num_experts=experts, n=64, k=256)

    def call(kw):
        sgl_kernel.get_cutlass_w4a8_moe_mm_data(**kw)
        return {o: kw[o] for o in ROUTING_OUTPUTS}

    def twin(kw):
        return ref.moe_mm_data(kw["topk_ids"], kw["num_experts"], kw["n"], kw["k"])

    accepted = {"topk_ids": {"int32", "int64"}}
    accepted.update({o: {"int32"} for o in ROUTING_OUTPUTS})
    entry = Entry(f"moe_mm_data[{case}]", call, kw, ROUTING_OUTPUTS, twin, accepted)
    entry.shape_free = {"topk_ids"}  # routing.h: topk_ids of any shape, numel = slots
    return establish(entry)


@functools.lru_cache(maxsize=None)
def gemm_entry(case):
    experts, n, k, per_row = [(4, 16, 256, False), (3, 24, 512, True)][case]
    ids, _ = testing.make_routing(6, 2, experts, seed=10 + case, distinct=True)
    data = ref.moe_mm_data(ids, experts, n, k)
    rows = ids.size + 2  # two rows outside every group: never read nor written
    rng = np.random.default_rng(case)
    a = ref.round_e4m3(rng.standard_normal((rows, k)).astype(np.float32) * 4)
    w = testing.make_w4a8_int4_weights(experts, n, k, seed=20 + case)
    a_scales = rng.uniform(0.5, 2, size=rows if per_row else 1).astype(np.float32)
    sizes = data["problem_sizes2"].copy()
    sizes[:, 0], sizes[:, 2] = n, k
    kw = dict(d=np.zeros((rows, n), BF16), a=a, b=w.q, a_scales=a_scales, b_scales=w.scale,
              experts_offsets=data["expert_offsets"][:-1].copy(), problem_sizes=sizes,
              a_strides=np.full((experts, 3), k, np.int64), b_strides=np.full((experts, 3), k, np.int64),
              d_strides=np.full((experts, 3), n, np.int64), s_strides=np.full((experts, 3), n, np.int64),
              chunk_size=128, topk=2)

    def call(kw):
        sgl_kernel.cutlass_w4a8_moe_mm(**kw)
        return {"d": kw["d"]}

    def twin(kw):
        out = np.array(kw["d"], copy=True)
        return {"d": ref.w4a8_moe_mm(kw["a"], kw["b"], kw["a_scales"], kw["b_scales"], kw["experts_offsets"],
                                     kw["problem_sizes"], out=out)}

    accepted = dict(d={"bfloat16"}, a={"float8_e4m3fn", "uint8"}, b={"int8", "uint8"}, a_scales={"float32"},
                    b_scales={"bfloat16"}, experts_offsets={"int32"}, problem_sizes={"int32"},
                    a_strides={"int64"}, b_strides={"int64"}, d_strides={"int64"}, s_strides={"int64"})
    names = {"experts_offsets": {"expert_offsets"}}
    return establish(Entry(f"w4a8_moe_mm[{case}]", call, kw, ("d",), twin, accepted, names, tol=1e-6))


FUSED_MODES = ("w4a8_int4", "w4a16_int4", "w4a4", "w4a8", "w4a16")
_INT4_W = {"int8", "uint8"}
_FUSED_ACCEPTED = {
    "w4a8_int4": dict(x={"bfloat16", "float8_e4m3fn"}, x_scale={"float32"}, w1=_INT4_W, w2=_INT4_W,
                      w1_scale={"bfloat16"}, w2_scale={"bfloat16"}, fc2_input_scale={"float32"}),
    "w4a16_int4": dict(x={"bfloat16"}, w1=_INT4_W, w2=_INT4_W, w1_scale={"bfloat16"}, w2_scale={"bfloat16"}),
    "w4a4": dict(x={"uint8"}, x_scale={"float8_e4m3fn", "uint8"}, w1={"uint8"}, w2={"uint8"},
                 w1_scale={"float8_e4m3fn", "uint8"}, w2_scale={"float8_e4m3fn", "uint8"},
                 fc2_input_scale={"float32"}, per_token_scale={"float32"}),
    "w4a8": dict(x={"float8_e4m3fn"}, x_scale={"uint8", "float8_e8m0fnu"}, w1={"uint8"}, w2={"uint8"},
                 w1_scale={"uint8", "float8_e8m0fnu"}, w2_scale={"uint8", "float8_e8m0fnu"}),
    "w4a16": dict(x={"bfloat16"}, w1={"uint8"}, w2={"uint8"}, w1_scale={"float8_e4m3fn", "uint8"},
                  w2_scale={"float8_e4m3fn", "uint8"}),
}
_FUSED_SCALARS = ("quant_mode", "num_experts", "num_local_experts", "local_expert_offset", "activation",
                  "gate_up_layout", "deterministic", "situ_beta", "situ_linear_beta")


@functools.lru_cache(maxsize=None)
def fused_entry(mode, deterministic):
    per_token = mode == "w4a4" and not deterministic  # one w4a4 variant with per-token scales
    case = testing.make_fused_moe_case(mode, 5, 256, 128, 8, 2, seed=FUSED_MODES.index(mode), num_local_experts=4,
                                       local_expert_offset=2, per_token=per_token, out_of_range=1, minus_one=1)
    kw = {k: v for k, v in case.items() if v is not None}
    kw["deterministic"] = deterministic
    kw["out"] = np.zeros((5, 256), BF16)

    def call(kw):
        got = qmoe.fused_moe(**kw)
        assert got is kw["out"]
        return {"out": got}

    def twin(kw):
        return {"out": ref.fused_moe(**{k: v for k, v in kw.items() if k != "out"})}

    accepted = dict(_FUSED_ACCEPTED[mode], topk_ids={"int32"}, topk_weights={"float32"}, w1_alpha={"float32"},
                    w2_alpha={"float32"}, out={"bfloat16", "float16", "float32"})
    tol = testing.tolerance(mode, per_token)
    # The three expert counts are one constraint (offset + local <= E): an error may name any of them.
    experts = {"num_experts", "num_local_experts", "local_expert_offset"}
    names = {"out": {"output"}, **{n: experts for n in experts}}
    # A consistent but different local count: the weights (E_l leading axis) no longer fit.
    names["num_local_experts"] = experts | {"w1", "w2", "w1_scale", "w2_scale", "w1_alpha", "w2_alpha"}
    return establish(Entry(f"fused_moe[{mode}]", call, kw, ("out",), twin, accepted, names, tol))


# The FlashInfer entry names its own arguments (compat/flashinfer.py renames qmoe's native ones): no
# aliases are accepted for it.
FI_NAMES: dict = {}


@functools.lru_cache(maxsize=None)
def flashinfer_entry(mode):
    case = testing.make_fused_moe_case(mode, 6, 256, 128, 8, 2, seed=7, out_of_range=1)
    kw = dict(x=case["x"], x_sf=case.get("x_scale"), token_selected_experts=case["topk_ids"],
              token_final_scales=case["topk_weights"], w1_weight=case["w1"], w1_weight_sf=case["w1_scale"],
              w1_alpha=case.get("w1_alpha"), fc2_input_scale=case.get("fc2_input_scale"), w2_weight=case["w2"],
              w2_weight_sf=case["w2_scale"], w2_alpha=case.get("w2_alpha"), num_experts=8, top_k=2,
              quant_mode=mode, use_fused_finalize=False, moe_output=np.zeros((6, 256), BF16))

    def call(kw):
        got = flashinfer.cute_dsl_fused_moe(**kw)
        assert got is kw["moe_output"]
        return {"out": got}

    def twin(kw):
        c = dict(case, x=kw["x"], x_scale=kw["x_sf"], topk_ids=kw["token_selected_experts"],
                 topk_weights=kw["token_final_scales"], w1=kw["w1_weight"], w1_scale=kw["w1_weight_sf"],
                 w1_alpha=kw["w1_alpha"], fc2_input_scale=kw["fc2_input_scale"], w2=kw["w2_weight"],
                 w2_scale=kw["w2_weight_sf"], w2_alpha=kw["w2_alpha"])
        return {"out": ref.fused_moe(**c, deterministic=True)}

    acc = _FUSED_ACCEPTED[mode]
    accepted = dict(x=acc["x"], x_sf=acc.get("x_scale", set()), token_selected_experts={"int32"},
                    token_final_scales={"float32"}, w1_weight=acc["w1"], w1_weight_sf=acc["w1_scale"],
                    w1_alpha={"float32"}, fc2_input_scale={"float32"}, w2_weight=acc["w2"],
                    w2_weight_sf=acc["w2_scale"], w2_alpha={"float32"}, moe_output={"bfloat16", "float16", "float32"})
    return establish(Entry(f"cute_dsl_fused_moe[{mode}]", call, kw, ("moe_output",), twin, accepted, FI_NAMES,
                           testing.tolerance(mode)))


# ------------------------------------------------------------------------------------------------
# Mutations of one tensor argument
# ------------------------------------------------------------------------------------------------
def mutate_tensor(data, entry, arg, kinds):
    """Draw one tensor mutation of `arg` and check it. Returns the mutation kind."""
    a = entry.kw[arg]
    kind = data.draw(st.sampled_from(kinds), label="kind")
    kw = dict(entry.kw)
    seed = data.draw(st.integers(0, 2**16), label="seed")
    if kind == "dtype":
        wrong = [n for n in DTYPES if n not in entry.accepted.get(arg, set()) and DTYPES[n] != a.dtype]
        name = data.draw(st.sampled_from(wrong), label="dtype")
        kw[arg] = random_array(a.shape, DTYPES[name], seed)
        attempt(entry, kw, arg, legal=False)
    elif kind == "extra_axis":
        kw[arg] = a.reshape((1,) + a.shape) if data.draw(st.booleans()) else a.reshape(a.shape + (1,))
        attempt(entry, kw, arg, legal=arg in entry.shape_free, strict_name=False)
    elif kind == "flatten":
        if a.ndim == 1:
            kw[arg] = a.reshape(1, -1)
        else:
            kw[arg] = a.reshape(-1)
        attempt(entry, kw, arg, legal=arg in entry.shape_free, strict_name=False)
    elif kind in ("grow", "shrink", "empty"):
        if a.ndim == 0:
            return kind
        axis = data.draw(st.integers(0, a.ndim - 1), label="axis")
        shape = list(a.shape)
        shape[axis] = {"grow": shape[axis] + data.draw(st.integers(1, 3)), "shrink": max(shape[axis] - 1, 0),
                       "empty": 0}[kind]
        if shape[axis] == a.shape[axis]:
            return kind
        kw[arg] = random_array(tuple(shape), a.dtype, seed)
        attempt(entry, kw, arg, legal=False, strict_name=False)
    elif kind in ("strided", "fortran"):
        if a.ndim == 0:
            return kind
        view = strided(a, data.draw(st.integers(0, a.ndim - 1), label="axis")) if kind == "strided" else fortran(a)
        kw[arg] = view
        legal = qmoe_contiguous(view)
        attempt(entry, kw, arg, legal=legal)
    elif kind == "misaligned":
        kw[arg] = misaligned(a, data.draw(st.sampled_from([1, 2, 3, 4, 8]), label="offset"))
        attempt(entry, kw, arg, legal=True)
    elif kind == "alias":
        # An output that overlaps an input (or, for the routing op, another output).
        others = [k for k in entry.arrays() if k != arg]
        other = data.draw(st.sampled_from(others), label="other")
        out_name, in_name = (arg, other) if arg in entry.outputs else (other, arg)
        if out_name not in entry.outputs:
            return kind  # two inputs sharing memory is legal (read-only)
        shift = data.draw(st.sampled_from([0, 8, 16]), label="shift")
        if shift >= kw[in_name].nbytes:
            shift = 0
        kw = aliased_output(entry, kw, out_name, in_name, shift)
        if kw[in_name].nbytes == 0 or kw[out_name].nbytes == 0:
            return kind
        # No poisoning here (it would break the overlap); the shared buffer must stay as it was.
        attempt(entry, kw, arg, legal=False, strict_name=False, poison=False)
    return kind


# ------------------------------------------------------------------------------------------------
# The tests
# ------------------------------------------------------------------------------------------------
TENSOR_KINDS = ("dtype", "extra_axis", "flatten", "grow", "shrink", "empty", "strided", "fortran", "misaligned")


def check_any_ids(data, entry, kw):
    """Expert ids anywhere in int32: legal by design (outside [0, E) or the local range a slot is
    dropped); the result must match the numpy twin."""
    kw = dict(kw)
    ids = kw["topk_ids"].copy()
    for _ in range(data.draw(st.integers(1, ids.size))):
        ids.reshape(-1)[data.draw(st.integers(0, ids.size - 1))] = data.draw(
            st.integers(-3, 11) | st.integers(-2**31, 2**31 - 1), label="id")
    kw["topk_ids"] = ids
    attempt(entry, kw, "topk_ids", legal=True, compare="twin")


def check_any_weights(data, entry, kw):
    """One routing weight of 0, -0, -1, NaN, Inf, a denormal or 1e30: legal (NaN propagates)."""
    kw = dict(kw)
    w = kw["topk_weights"].copy()
    w.reshape(-1)[data.draw(st.integers(0, w.size - 1))] = data.draw(
        st.sampled_from([0.0, -0.0, -1.0, np.nan, np.inf, 1e-45, 1e30]), label="weight")
    kw["topk_weights"] = w
    attempt(entry, kw, "topk_weights", legal=True, compare="twin")


def _draw_array_arg(data, entry):
    return data.draw(st.sampled_from(sorted(entry.arrays())), label="arg")


def _maybe_recover(data, entry):
    if data.draw(st.integers(0, 7), label="recover?") == 0:
        _recover(entry)


@settings(max_examples=1500, **HYPO)
@given(st.data())
def test_moe_mm_data_hostile(data):
    entry = routing_entry(data.draw(st.integers(0, 2), label="case"))
    what = data.draw(st.sampled_from(["tensor", "tensor", "alias", "num_experts", "n", "k", "ids"]), label="what")
    kw = dict(entry.kw)
    if what in ("tensor", "alias"):
        arg = _draw_array_arg(data, entry)
        mutate_tensor(data, entry, arg, TENSOR_KINDS if what == "tensor" else ("alias",))
    elif what in ("num_experts", "n", "k"):
        bad = {"num_experts": [0, -1, 1025, 2**31, -2**40], "n": [0, -3, 2**30, 2**40], "k": [0, -1, 2**31, 2**40]}
        kw[what] = data.draw(st.sampled_from(bad[what]), label="value")
        attempt(entry, kw, what, legal=False)
    else:
        # Any id value is legal: outside [0, E) it is dropped (DESIGN 3b); int64 ids beyond int32 too.
        ids = np.array(kw["topk_ids"], dtype=data.draw(st.sampled_from([np.int32, np.int64]), label="ids dtype"))
        flat = ids.reshape(-1)
        info = np.iinfo(ids.dtype)
        picks = data.draw(st.lists(st.integers(0, flat.size - 1), min_size=1, max_size=flat.size), label="slots")
        for p in picks:
            flat[p] = data.draw(st.one_of(st.integers(-3, entry.kw["num_experts"] + 3),
                                          st.integers(int(info.min), int(info.max))), label="id")
        kw["topk_ids"] = ids
        attempt(entry, kw, "topk_ids", legal=True, compare="twin")
    _maybe_recover(data, entry)


def _blocks_legal(offsets, sizes, rows):
    blocks = sorted((int(o), int(o) + int(m)) for o, m in zip(offsets, sizes[:, 1]) if m != 0)
    if any(m < 0 for m in sizes[:, 1]) or any(b < 0 or e > rows for b, e in blocks):
        return False
    return all(blocks[i][0] >= blocks[i - 1][1] for i in range(1, len(blocks)))


@settings(max_examples=1500, **HYPO)
@given(st.data())
def test_cutlass_w4a8_moe_mm_hostile(data):
    entry = gemm_entry(data.draw(st.integers(0, 1), label="case"))
    what = data.draw(st.sampled_from(["tensor", "tensor", "tensor", "alias", "chunk_size", "topk", "no_strides",
                                      "stride_values", "groups", "a_scales_values", "a_values"]), label="what")
    kw = dict(entry.kw)
    experts, rows = kw["experts_offsets"].size, kw["a"].shape[0]
    if what in ("tensor", "alias"):
        mutate_tensor(data, entry, _draw_array_arg(data, entry), TENSOR_KINDS if what == "tensor" else ("alias",))
    elif what == "chunk_size":
        kw["chunk_size"] = data.draw(st.sampled_from([0, -128, 64, 127, 129, 256, 2**40]), label="value")
        attempt(entry, kw, "chunk_size", legal=False)
    elif what == "topk":
        value = data.draw(st.sampled_from([-1, 0, 1, 3, 8, 1000]), label="value")
        kw["topk"] = value
        attempt(entry, kw, "topk", legal=value >= 1)  # a tactic hint only: any value >= 1 is legal
    elif what == "no_strides":
        for name in data.draw(st.lists(st.sampled_from(["a_strides", "b_strides", "d_strides", "s_strides"]),
                                       min_size=1, unique=True), label="dropped"):
            kw[name] = None
        attempt(entry, kw, "a_strides", legal=True)
    elif what == "stride_values":
        name = data.draw(st.sampled_from(["a_strides", "b_strides", "d_strides", "s_strides"]), label="arg")
        s = kw[name].copy()
        s.reshape(-1)[data.draw(st.integers(0, s.size - 1))] += data.draw(st.sampled_from([-1, 1, 64, -2**40]))
        kw[name] = s
        attempt(entry, kw, name, legal=False)
    elif what == "groups":
        # Row groups (expert_offsets, problem_sizes values): legal when every non-empty block lies in
        # [0, R) and no two overlap (then rows outside every group stay unwritten); else an error.
        offsets, sizes = kw["experts_offsets"].copy(), kw["problem_sizes"].copy()
        e = data.draw(st.integers(0, experts - 1), label="expert")
        field = data.draw(st.sampled_from(["offset", "m", "n", "k"]), label="field")
        value = data.draw(st.integers(-2**31, 2**31 - 1) | st.integers(-2, rows + 2), label="value")
        if field == "offset":
            offsets[e] = value
        else:
            sizes[e, {"n": 0, "m": 1, "k": 2}[field]] = value
        kw["experts_offsets"], kw["problem_sizes"] = offsets, sizes
        n, k = kw["d"].shape[1], kw["a"].shape[1]
        legal = bool((sizes[:, 0] == n).all() and (sizes[:, 2] == k).all()) and _blocks_legal(offsets, sizes, rows)
        attempt(entry, kw, "problem_sizes" if field != "offset" else "experts_offsets", legal=legal,
                strict_name=False, compare="twin")
    elif what == "a_scales_values":
        s = kw["a_scales"].copy()
        s[data.draw(st.integers(0, s.size - 1))] = data.draw(
            st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 3e38]), label="value")
        kw["a_scales"] = s
        attempt(entry, kw, "a_scales", legal=True, compare="twin")
    else:
        a = kw["a"].copy()
        codes = a.view(np.uint8)
        for _ in range(data.draw(st.integers(1, 8))):
            codes.reshape(-1)[data.draw(st.integers(0, codes.size - 1))] = data.draw(
                st.sampled_from([0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x80, 0x01]), label="code")
        kw["a"] = a
        attempt(entry, kw, "a", legal=True, compare="twin")
    _maybe_recover(data, entry)


FUSED_BAD_SCALARS = {
    "quant_mode": ["w4a8_int5", "", "W4A4", "nvfp4", "fp8"],
    "activation": ["silu", "gelu", "", "SWIGLU"],
    "gate_up_layout": ["up_gate", "interleaved", ""],
    "num_experts": [0, -1, 1, 5],            # 5: local range [2, 6) does not fit
    "num_local_experts": [-1, 3, 5, 9],     # the weights hold 4 local experts
    "local_expert_offset": [-1, 5, 2**40],
    "routed_scaling_factor": [math.nan, math.inf, -math.inf],
    "tactic": ["not_a_tactic", "decode_m128_n8_k256"],
    "output_dtype": ["int8", "float64", "e4m3"],
    "situ_beta": [0.5],                      # a SiTU parameter with swiglu
    "situ_linear_beta": [1.5],
    "swiglu_limit": [0.0, -1.0, math.nan],
}


@settings(max_examples=2500, **HYPO)
@given(st.data())
def test_fused_moe_hostile(data):
    mode = data.draw(st.sampled_from(FUSED_MODES), label="mode")
    entry = fused_entry(mode, data.draw(st.booleans(), label="deterministic"))
    what = data.draw(st.sampled_from(["tensor"] * 4 + ["alias", "scalar", "ids", "weights", "scale_values",
                                                        "topk_too_big", "missing"]), label="what")
    kw = dict(entry.kw)
    if what in ("tensor", "alias"):
        mutate_tensor(data, entry, _draw_array_arg(data, entry), TENSOR_KINDS if what == "tensor" else ("alias",))
    elif what == "scalar":
        name = data.draw(st.sampled_from(sorted(FUSED_BAD_SCALARS)), label="scalar")
        kw[name] = data.draw(st.sampled_from(FUSED_BAD_SCALARS[name]), label="value")
        if name == "output_dtype":
            del kw["out"]  # output_dtype only matters when qmoe allocates the output
        attempt(entry, kw, name, legal=False)
    elif what == "ids":
        # Ids outside [0, E) and outside the local range are dropped by design.
        check_any_ids(data, entry, kw)
    elif what == "weights":
        check_any_weights(data, entry, kw)
    elif what == "scale_values":
        names = [n for n in ("x_scale", "w1_alpha", "w2_alpha", "fc2_input_scale", "per_token_scale")
                 if isinstance(kw.get(n), np.ndarray) and kw[n].dtype == np.float32]
        if not names:
            return
        name = data.draw(st.sampled_from(names), label="arg")
        s = kw[name].copy()
        s.reshape(-1)[data.draw(st.integers(0, s.size - 1))] = data.draw(
            st.sampled_from([np.nan, np.inf, 0.0, 1e-40, 1e-30]), label="value")
        kw[name] = s
        attempt(entry, kw, name, legal=True, compare="twin")
    elif what == "topk_too_big":
        top_k = data.draw(st.sampled_from([17, 32]), label="top_k")
        tokens = kw["topk_ids"].shape[0]
        kw["topk_ids"] = np.tile(kw["topk_ids"], (1, 16))[:, :top_k].copy()
        kw["topk_weights"] = np.tile(kw["topk_weights"], (1, 16))[:, :top_k].copy()
        assert kw["topk_ids"].shape == (tokens, top_k)
        attempt(entry, kw, "topk_ids", legal=False)
    else:
        # A tensor the mode requires, left out (or one it has no use for, added).
        if mode in ("w4a4", "w4a16"):
            name = data.draw(st.sampled_from(["w1_alpha", "w2_alpha"] + (["x_scale", "fc2_input_scale"]
                                                                         if mode == "w4a4" else [])))
            del kw[name]
        elif mode == "w4a8":
            name = "x_scale"
            del kw[name]
        else:
            name = data.draw(st.sampled_from(["per_token_scale", "x_scale"] if mode == "w4a16_int4"
                                             else ["per_token_scale"]))
            kw[name] = np.ones(kw["topk_ids"].shape[0], np.float32)
        attempt(entry, kw, name, legal=False)
    _maybe_recover(data, entry)


@settings(max_examples=1000, **HYPO)
@given(st.data())
def test_flashinfer_hostile(data):
    mode = data.draw(st.sampled_from(["w4a4", "w4a8", "w4a16", "w4a8_int4"]), label="mode")
    entry = flashinfer_entry(mode)
    what = data.draw(st.sampled_from(["tensor"] * 3 + ["alias", "scalar"]), label="what")
    kw = dict(entry.kw)
    if what in ("tensor", "alias"):
        mutate_tensor(data, entry, _draw_array_arg(data, entry), TENSOR_KINDS if what == "tensor" else ("alias",))
    else:
        name, value = data.draw(st.sampled_from([
            ("top_k", 1), ("top_k", 3), ("top_k", 0), ("quant_mode", "w4a2"), ("quant_mode", "w4a16_int4"),
            ("activation_type", flashinfer.ActivationType.Gelu), ("activation_type", 99),
            ("activation_type", flashinfer.ActivationType.InvalidType), ("num_experts", 0),
            ("situ_linear_beta", 1.0), ("output_dtype", "float64")]), label="scalar")
        kw[name] = value
        if name == "output_dtype":
            del kw["moe_output"]
        attempt(entry, kw, {"top_k": "token_selected_experts"}.get(name, name), legal=False)
    _maybe_recover(data, entry)


def test_flashinfer_wrapper_rejects_localized_weights_and_bad_hidden():
    for bad in (dict(localized_weights=[1]), dict(locality_streams=[0])):
        with pytest.raises(ValueError, match="'localized_weights'"):
            flashinfer.CuteDslMoEWrapper(8, 2, 256, 128, quant_mode="w4a16", **bad)
    entry = flashinfer_entry("w4a16")
    wrapper = flashinfer.CuteDslMoEWrapper(8, 2, 512, 128, quant_mode="w4a16", use_fused_finalize=False)
    kw = {k: entry.kw[k] for k in ("x", "x_sf", "token_selected_experts", "token_final_scales", "w1_weight",
                                     "w1_weight_sf", "w1_alpha", "fc2_input_scale", "w2_weight", "w2_weight_sf",
                                     "w2_alpha")}
    out = testing.poison((6, 256), BF16)
    with pytest.raises(ValueError, match="'w2_weight'"):
        wrapper.run(**kw, moe_output=out)
    assert testing.poisoned_mask(out).all()
    good = flashinfer.CuteDslMoEWrapper(8, 2, 256, 128, quant_mode="w4a16", use_fused_finalize=False)
    _same_bits(good.run(**kw, moe_output=out), entry.baseline["out"], "wrapper after an error")


# ---- T = 0 and E = 0 at every entry (explicit: a single-argument mutation cannot make them consistent) ----
def test_zero_tokens_are_legal_everywhere():
    experts = 4
    outs = [np.full(experts + 1, -7, np.int32), np.full((experts, 3), -7, np.int32), np.full((experts, 3), -7, np.int32),
            np.zeros(0, np.int32), np.zeros(0, np.int32)]
    sgl_kernel.get_cutlass_w4a8_moe_mm_data(np.zeros((0, 8), np.int32), *outs, experts, 64, 256)
    np.testing.assert_array_equal(outs[0], 0)
    np.testing.assert_array_equal(outs[1], [[128, 0, 256]] * experts)
    w = testing.make_w4a8_int4_weights(experts, 16, 256, seed=1)
    d = np.zeros((0, 16), BF16)
    sizes = np.array([[16, 0, 256]] * experts, np.int32)
    sgl_kernel.cutlass_w4a8_moe_mm(d, np.zeros((0, 256), E4M3), w.q, np.ones(1, np.float32), w.scale,
                                   np.zeros(experts, np.int32), sizes, None, None, None, None)
    for mode in FUSED_MODES:
        kw = dict(fused_entry(mode, True).kw)
        for name in ("x", "topk_ids", "topk_weights", "per_token_scale"):
            if name in kw:
                kw[name] = kw[name][:0]
        if kw.get("x_scale") is not None and kw["x_scale"].shape[0] != 1:
            kw["x_scale"] = kw["x_scale"][:0]
        kw["out"] = np.zeros((0, 256), BF16)
        assert qmoe.fused_moe(**kw).shape == (0, 256), mode


def test_zero_experts_are_refused_everywhere():
    ids = np.zeros((3, 2), np.int32)
    with pytest.raises(ValueError, match="'num_experts'"):
        sgl_kernel.get_cutlass_w4a8_moe_mm_data(ids, np.zeros(1, np.int32), np.zeros((0, 3), np.int32),
                                                np.zeros((0, 3), np.int32), np.zeros(6, np.int32),
                                                np.zeros(6, np.int32), 0, 64, 256)
    entry = gemm_entry(0)
    kw = dict(entry.kw, experts_offsets=np.zeros(0, np.int32), problem_sizes=np.zeros((0, 3), np.int32))
    attempt(entry, kw, "experts_offsets", legal=False)
    entry = fused_entry("w4a8_int4", True)
    attempt(entry, dict(entry.kw, num_experts=0, num_local_experts=0, local_expert_offset=0), "num_experts",
            legal=False)


# ---- found by this file and fixed: regression tests -----------------------------------------------
def _small_fused():
    case = testing.make_fused_moe_case("w4a16_int4", 3, 128, 128, 4, 2, seed=1)
    return {k: v for k, v in case.items() if v is not None}


def test_fused_local_range_overflow_is_rejected():
    out = testing.poison((3, 128), BF16)
    with pytest.raises(ValueError, match="'(local_expert_offset|num_local_experts)'"):
        qmoe.fused_moe(**dict(_small_fused(), local_expert_offset=2**63 - 1, num_local_experts=4), out=out)
    assert testing.poisoned_mask(out).all()


def test_read_only_inputs_are_accepted():
    entry = routing_entry(0)
    ids = entry.kw["topk_ids"].copy()
    ids.flags.writeable = False
    attempt(entry, dict(entry.kw, topk_ids=ids), "topk_ids", legal=True)


def test_odd_byte_strides_are_named():
    entry = routing_entry(0)
    tokens, top_k = entry.kw["topk_ids"].shape
    raw = np.zeros(tokens * (top_k * 4 + 1) + 8, np.uint8)
    odd = np.lib.stride_tricks.as_strided(raw[:4].view(np.int32), shape=(tokens, top_k), strides=(top_k * 4 + 1, 4))
    attempt(entry, dict(entry.kw, topk_ids=odd), "topk_ids", legal=False)


def test_huge_python_int_is_named():
    entry = routing_entry(0)
    attempt(entry, dict(entry.kw, num_experts=2**70), "num_experts", legal=False)
