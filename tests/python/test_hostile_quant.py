"""Hostile inputs at qmoe.quant.* (reliability issue, part 1), CPU backend: the quantizers allocate
their outputs, so each mutated input must either raise a ValueError / TypeError naming it (input left
as it was) or give exactly the numpy twin's codes (qmoe.reference). Designed behaviour read from
python/qmoe/quant.py and include/qmoe/formats.h: real inputs of any real dtype are converted to
float32 (bool is refused), code inputs take int8 / uint8 / float8_e4m3fn / float8_e8m0fnu bytes as
raw codes (any other dtype, bool included, is refused), a 0-d x / scale of quantize_fp8 reads as one
element, non-contiguous and misaligned inputs are copied, NaN / Inf / huge /
denormal values are legal (saturation and NaN codes per formats.h). Machinery shared with
test_hostile_inputs.py (imported from it)."""
from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qmoe import quant
from qmoe import reference as ref
from test_hostile_inputs import HYPO, _bytes, _named, misaligned, strided

CALLS = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    lines = [f"  {entry:28s} {outcome:9s} {n}" for (entry, outcome), n in sorted(CALLS.items())]
    print(f"\n[test_hostile_quant] {sum(CALLS.values())} mutated calls\n" + "\n".join(lines))


def _quant_cases():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 256)) * 3).astype(np.float32)
    q8, sf8 = ref.quantize_mxfp8(x)
    qn, sfn = ref.quantize_nvfp4(x, np.float32(300.0))
    return {
        "quantize_int4_g128": (quant.quantize_int4_g128, dict(w=x),
                               lambda w: ref.quantize_int4_g128(w.reshape((1,) + w.shape)), {"w": 128}),
        "quantize_fp8": (quant.quantize_fp8, dict(x=x, scale=np.array([0.01], np.float32)),
                         lambda x, scale: ref.quantize_fp8(x, scale), {"x": 1}),
        "quantize_nvfp4": (quant.quantize_nvfp4, dict(x=x, global_scale=300.0),
                           lambda x, global_scale: ref.quantize_nvfp4(x, np.float32(global_scale)), {"x": 16}),
        "quantize_mxfp4": (quant.quantize_mxfp4, dict(x=x), ref.quantize_mxfp4, {"x": 32}),
        "quantize_mxfp8": (quant.quantize_mxfp8, dict(x=x), ref.quantize_mxfp8, {"x": 32}),
        "dequantize_mxfp8": (quant.dequantize_mxfp8, dict(q=q8, sf=sf8), ref.dequantize_mxfp8, {}),
        "dequantize_nvfp4": (quant.dequantize_nvfp4, dict(q=qn, sf=sfn, global_scale=300.0),
                             lambda q, sf, global_scale: ref.dequantize_nvfp4(q, sf, np.float32(global_scale)), {}),
        "swizzle_scales_128x4": (quant.swizzle_scales_128x4, dict(sf=sf8), ref.swizzle_128x4, {}),
    }


QUANT_CASES = _quant_cases()


def _as_tuple(v):
    return v if isinstance(v, tuple) else (v,)


@pytest.mark.parametrize("name", sorted(QUANT_CASES))
@settings(max_examples=150, **HYPO)
@given(data=st.data())
def test_quant_hostile(name, data):
    fn, kw, twin, last_axis = QUANT_CASES[name]
    kw = dict(kw)
    arg = data.draw(st.sampled_from([k for k, v in kw.items() if isinstance(v, np.ndarray)]), label="arg")
    a = kw[arg]
    kind = data.draw(st.sampled_from(["nonfinite", "strided", "misaligned", "last_axis", "bool", "zero_d",
                                      "empty_rows"]), label="kind")
    legal = True
    if kind == "nonfinite":
        if a.dtype.kind != "f":
            return
        a = a.copy()
        a.reshape(-1)[data.draw(st.integers(0, a.size - 1))] = data.draw(
            st.sampled_from([np.nan, np.inf, -np.inf, 1e38, 1e-42, 0.0]))
    elif kind == "strided":
        a = strided(a, data.draw(st.integers(0, a.ndim - 1)))
    elif kind == "misaligned":
        a = misaligned(a, 1)
    elif kind == "last_axis":
        if arg not in last_axis:
            return
        a = a[..., : a.shape[-1] - last_axis[arg] // 2 - 1] if last_axis[arg] > 1 else a[..., :0]
        legal = last_axis[arg] == 1
    elif kind == "bool":
        # Only for real inputs here; code inputs of another 1-byte dtype: test_code_inputs_refuse_other_dtypes.
        if a.dtype.kind != "f":
            return
        a = a.astype(bool)
        # quantize_fp8's scale: np.asarray(float32).
        legal = arg == "scale"
    elif kind == "zero_d":
        a = a.reshape(-1)[0]
        a = np.asarray(a)
        legal = name == "quantize_fp8"  # quant.py reads a 0-d x or scale as one element ([1]); K = 1 is fine
    else:
        if a.ndim < 2 or name.startswith("swizzle"):
            return
        a = a[:0]
        # Legal when nothing else has a row count: one input, or quantize_fp8's per-tensor scale.
        legal = len([v for v in kw.values() if isinstance(v, np.ndarray)]) == 1 or name == "quantize_fp8" and arg == "x"
    kw[arg] = a
    before = _bytes(np.ascontiguousarray(a))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _as_tuple(fn(**kw))
    except (ValueError, TypeError) as err:
        CALLS[(f"quant.{name}", "rejected")] += 1
        assert not legal or (kind == "nonfinite" and "global_scale" in str(err)), f"{name}: {err}"
        named = _named(err)
        if kind == "empty_rows":  # the other operand's shape no longer fits: either may be blamed
            assert named, f"{name}: {err}"
        else:
            assert any(n == arg or n.startswith(arg + " ") for n in named), f"{name}: error about '{arg}': {err}"
        return
    CALLS[(f"quant.{name}", "accepted")] += 1
    assert legal, f"{name}: illegal input '{arg}' ({kind}) accepted"
    assert _bytes(np.ascontiguousarray(kw[arg])) == before, f"{name}: input written"
    if a.size == 0:  # the numpy twin does not take empty arrays; qmoe returns empty results
        assert np.asarray(got[0]).size == 0, f"{name}: empty input, non-empty result"
        return
    with np.errstate(all="ignore"):
        want = _as_tuple(twin(**kw))
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape and g.size == w.size:
            w = w.reshape(g.shape)  # the twins keep a leading expert axis of 1; quant.py makes 0-d 1-D
        assert g.shape == w.shape, f"{name}: {g.shape} vs {w.shape}"
        gf, wf = g.astype(np.float32) if g.dtype != np.uint8 else g, w.astype(np.float32) if w.dtype != np.uint8 else w
        np.testing.assert_array_equal(gf, wf, err_msg=f"{name} after {kind} of {arg}")


def _code_args(kw):
    return [k for k, v in kw.items() if isinstance(v, np.ndarray) and v.dtype.itemsize == 1]


@pytest.mark.parametrize("dtype", ["bool", "float8_e5m2"])
@pytest.mark.parametrize("name", sorted(n for n, case in QUANT_CASES.items() if _code_args(case[1])))
def test_code_inputs_refuse_other_dtypes(name, dtype):
    """A 1-byte code input (q, packed, sf, swizzled) of another 1-byte dtype is refused naming it: its
    bytes are not the documented codes (bool read as 0/1 codes, e5m2 bytes as e4m3 ones)."""
    import ml_dtypes

    fn, kw, _, _ = QUANT_CASES[name]
    dt = np.dtype(bool) if dtype == "bool" else np.dtype(getattr(ml_dtypes, dtype))
    for arg in _code_args(kw):
        with pytest.raises(TypeError, match=f"'{arg}'"):
            fn(**{**kw, arg: kw[arg].view(np.uint8).view(dt)})
