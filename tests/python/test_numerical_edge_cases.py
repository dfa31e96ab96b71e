"""Numerical edge cases on the CPU engine (reliability issue, part 3), each against the numpy twin
(qmoe.reference) AND against the behaviour the contract states (DESIGN.md 3b, include/qmoe/formats.h):

  * NaN propagates to the output of the op, never hidden, and only where it flows (a NaN token's row,
    the tokens of a NaN expert); a NaN in a per-tensor scale reaches every output.
  * fp8 e4m3 saturates to +-448 (inf included); so an inf or huge bf16 x under a STATIC a1 gives a
    finite result, while a DYNAMIC a1 (amax / 448) becomes inf and the result NaN.
  * zero scales give zeros (or NaN where 0 * inf / 0 / 0 arise, as the twin says), denormal scales are
    honoured (no flush to zero), zero routing weights contribute nothing.
  * very large T: routing with 256K slots and the grouped GEMM over 256K rows, exact / within tolerance.
  * all slots on one expert.
Every test runs under an alarm (a hang fails the test instead of blocking the run).
"""
from __future__ import annotations

import signal
import warnings

import numpy as np
import pytest

import qmoe
from qmoe import quant
from qmoe import reference as ref
from qmoe import testing
from qmoe.compat import sgl_kernel

BF16 = ref.BF16


@pytest.fixture(autouse=True)
def _no_hang():
    def fail(signum, frame):
        raise TimeoutError("the call did not return within 120 s (hang?)")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(120)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the twin computes inf / NaN on purpose
        yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _f32(a):
    return np.asarray(a).astype(np.float32)


def _same_pattern_and_close(got, want, tol, what):
    g, w = _f32(got), _f32(want)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{what}: NaN pattern")
    np.testing.assert_array_equal(np.isposinf(g), np.isposinf(w), err_msg=f"{what}: +inf pattern")
    np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg=f"{what}: -inf pattern")
    fin = np.isfinite(w)
    if fin.any() and np.any(w[fin] != 0):
        testing.assert_close(g[fin], w[fin], tol=tol, what=what)
    else:
        np.testing.assert_array_equal(g[fin], w[fin], err_msg=what)


def _fused(case, **over):
    kw = {k: v for k, v in dict(case, **over).items() if v is not None}
    out = testing.poison((kw["topk_ids"].shape[0], kw["w2"].shape[1]), BF16)
    got = qmoe.fused_moe(**kw, deterministic=True, out=out)
    assert got is out
    want = ref.fused_moe(**kw, deterministic=True)
    return _f32(got), _f32(want)


def _case(mode, tokens=6, seed=0, **kw):
    return testing.make_fused_moe_case(mode, tokens, 256, 128, 8, 2, seed=seed, **kw)


# ---- NaN / inf in x --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["w4a16_int4", "w4a8_int4", "w4a16"])
def test_nan_in_x_reaches_only_its_token(mode):
    case = _case(mode, seed=1)
    x = case["x"].copy()
    x[2, 17] = np.nan
    got, want = _fused(case, x=x)
    _same_pattern_and_close(got, want, testing.tolerance(mode), mode)
    assert np.isnan(got[2]).all(), "a NaN in x[2] must reach every element of out[2]"
    assert np.isfinite(np.delete(got, 2, axis=0)).all(), "the NaN leaked into other tokens"


def test_nan_in_x_with_dynamic_a1_poisons_everything():
    # a1 = amax(x) / 448 over the whole tensor: NaN, so every token's quantized x is NaN (never hidden).
    case = _case("w4a8_int4", seed=2, static_scales=False)
    x = case["x"].copy()
    x[0, 0] = np.nan
    got, want = _fused(case, x=x)
    _same_pattern_and_close(got, want, 1e-2, "dynamic a1")
    assert np.isnan(got).all()


def test_inf_in_x_saturates_under_static_a1_and_is_nan_under_dynamic():
    case = _case("w4a8_int4", seed=3)
    x = case["x"].copy()
    x[1, 5], x[3, 9] = np.inf, -np.inf
    got, want = _fused(case, x=x)  # static a1: e4m3(+-inf / a1) = +-448
    _same_pattern_and_close(got, want, 1e-2, "static a1")
    assert np.isfinite(got).all()
    dyn = _case("w4a8_int4", seed=3, static_scales=False)
    got, want = _fused(dyn, x=x)  # a1 = inf: x / a1 is 0 or NaN
    _same_pattern_and_close(got, want, 1e-2, "dynamic a1")
    assert np.isnan(got).any()


def test_fp8_x_nan_code_and_mx_nan_scale_propagate():
    case = _case("w4a8", seed=4)
    x = case["x"].copy()
    x.view(np.uint8)[4, 3] = 0x7F  # e4m3 NaN code
    sf = case["x_scale"].copy()
    sf[1, 2] = 0xFF  # ue8m0 NaN code
    got, want = _fused(case, x=x, x_scale=sf)
    _same_pattern_and_close(got, want, 1e-2, "w4a8")
    assert np.isnan(got[4]).all() and np.isnan(got[1]).all()
    assert np.isfinite(got[[0, 2, 3, 5]]).all()


# ---- NaN / inf / zero / denormal scales -------------------------------------------------------------
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_expert_alpha_reaches_its_tokens_only(value):
    case = _case("w4a16", seed=5)
    ids = case["topk_ids"]
    expert = int(ids[0, 0])
    alpha = case["w2_alpha"].copy()
    alpha[expert] = value
    got, want = _fused(case, w2_alpha=alpha)
    _same_pattern_and_close(got, want, 1e-2, f"w2_alpha {value}")
    hit = (ids == expert).any(axis=1)
    assert (~np.isfinite(got[hit])).any(axis=1).all(), "a token of the non-finite expert stayed finite"
    assert np.isfinite(got[~hit]).all(), "the non-finite alpha leaked into other tokens"


@pytest.mark.parametrize("name", ["x_scale", "fc2_input_scale"])
@pytest.mark.parametrize("value", [np.nan, np.inf, 0.0, 1e-40])
def test_per_tensor_activation_scale_edge_values(name, value):
    """w4a8_int4 a1 / a2 (dequant scales): NaN -> all NaN; inf and 0 -> as the twin computes (x / 0
    saturates to 448, 0 * 448 and inf * 0 give NaN); a denormal is honoured (not flushed)."""
    case = _case("w4a8_int4", seed=6)
    got, want = _fused(case, **{name: np.array([value], np.float32)})
    _same_pattern_and_close(got, want, 1e-2, f"{name}={value}")
    if np.isnan(value):
        assert np.isnan(got).all()


def test_zero_and_denormal_weight_scales():
    case = _case("w4a16_int4", seed=7)
    zero = np.zeros_like(case["w2_scale"])
    got, want = _fused(case, w2_scale=zero)
    np.testing.assert_array_equal(got, 0.0)  # every dequantized W2 element is 0
    np.testing.assert_array_equal(want, 0.0)
    tiny = (case["w2_scale"].astype(np.float32) * np.float32(2.0**-120)).astype(BF16)  # bf16 denormals
    assert (np.abs(tiny.astype(np.float32)) < np.finfo(np.float32).tiny).any()
    got, want = _fused(case, w2_scale=tiny, w2_alpha=np.full(8, 2.0**100, np.float32))
    _same_pattern_and_close(got, want, 1e-2, "denormal weight scales")
    assert np.abs(got).max() > 0, "denormal scales were flushed to zero"


def test_grouped_gemm_zero_nan_inf_denormal_row_scales():
    experts, n, k = 3, 16, 256
    ids, _ = testing.make_routing(8, 2, experts, seed=8, distinct=True)
    data = ref.moe_mm_data(ids, experts, n, k)
    rows = ids.size
    rng = np.random.default_rng(8)
    a = ref.round_e4m3(rng.standard_normal((rows, k)).astype(np.float32) * 8)
    w = testing.make_w4a8_int4_weights(experts, n, k, seed=9)
    scales = rng.uniform(0.5, 2, rows).astype(np.float32)
    scales[:5] = [0.0, np.nan, np.inf, 1e-42, -0.0]
    sizes = data["problem_sizes2"].copy()
    sizes[:, 0], sizes[:, 2] = n, k
    d = testing.poison((rows, n), BF16)
    sgl_kernel.cutlass_w4a8_moe_mm(d, a, w.q, scales, w.scale, data["expert_offsets"][:-1], sizes, None, None,
                                   None, None)
    want = ref.w4a8_moe_mm(a, w.q, scales, w.scale, data["expert_offsets"][:-1], sizes)
    _same_pattern_and_close(d, want, 1e-2, "row scales")
    g = _f32(d)
    assert (g[0] == 0).all() and np.isnan(g[1]).all() and (np.abs(g[3]) < 1e-30).all()
    assert np.all(np.isinf(g[2]) | (g[2] == 0) | np.isnan(g[2]))


# ---- fp8 saturation ----------------------------------------------------------------------------------
def test_fp8_quantization_saturates_and_keeps_nan():
    x = np.array([[0.0, 447.9, 448.0, 464.0, 1e30, np.inf, -np.inf, -1e30, np.nan, -np.nan, 2.0**-10, 1e-45]
                  + [1.0] * 20], np.float32)
    q, _ = quant.quantize_fp8(x, np.array([1.0], np.float32))
    v = q.astype(np.float32)[0]
    assert v[2] == 448 and v[3] == 448 and v[4] == 448 and v[5] == 448, v[:8]
    assert v[6] == -448 and v[7] == -448
    assert np.isnan(v[8]) and np.isnan(v[9])
    assert v[10] == 0.0 and v[11] == 0.0  # 2^-10 is the tie below the smallest subnormal: even code 0
    np.testing.assert_array_equal(q.view(np.uint8), ref.quantize_fp8(x, np.float32(1)).view(np.uint8))


def test_fused_saturating_intermediate_matches_twin():
    # A tiny a2 drives every intermediate value past 448: the e4m3 requant saturates (no inf, no NaN).
    case = _case("w4a8_int4", seed=10)
    got, want = _fused(case, fc2_input_scale=np.array([1e-6], np.float32))
    _same_pattern_and_close(got, want, 1e-2, "saturated intermediate")
    assert np.isfinite(got).all()


# ---- routing weights, hot expert, large T ------------------------------------------------------------
def test_zero_routing_weights_contribute_nothing():
    case = _case("w4a8", seed=11)
    w = case["topk_weights"].copy()
    w[1] = 0.0          # token 1: nothing
    w[3, 0] = 0.0       # token 3: only its second slot
    got, want = _fused(case, topk_weights=w)
    _same_pattern_and_close(got, want, 1e-2, "zero weights")
    assert (got[1] == 0).all()
    only = dict(case, topk_ids=case["topk_ids"][3:4, 1:], topk_weights=case["topk_weights"][3:4, 1:],
                x=case["x"][3:4], x_scale=case["x_scale"][3:4])
    single, _ = _fused(only)
    np.testing.assert_allclose(got[3], single[0], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("mode", ["w4a8_int4", "w4a4"])
def test_all_slots_on_one_expert(mode):
    tokens, top_k = 9, 2
    ids = np.full((tokens, top_k), 3, np.int32)  # the same expert twice per token: counts twice
    weights = np.random.default_rng(12).uniform(0.1, 1, (tokens, top_k)).astype(np.float32)
    case = _case(mode, tokens=tokens, seed=12, routing=(ids, weights))
    got, want = _fused(case)
    _same_pattern_and_close(got, want, testing.tolerance(mode), "hot expert")
    data = {k: np.empty(s, np.int32) for k, s in (("o", 9), ("p1", (8, 3)), ("p2", (8, 3)), ("i", 18), ("u", 18))}
    sgl_kernel.get_cutlass_w4a8_moe_mm_data(ids, data["o"], data["p1"], data["p2"], data["i"], data["u"], 8, 64, 256)
    np.testing.assert_array_equal(data["o"], [0, 0, 0, 0, 18, 18, 18, 18, 18])
    np.testing.assert_array_equal(data["i"], np.arange(18))


def test_routing_256k_slots_exact():
    tokens, top_k, experts = 32768, 8, 256  # 262144 slots
    rng = np.random.default_rng(13)
    ids = rng.integers(-2, experts + 2, size=(tokens, top_k)).astype(np.int32)
    ids[:, 0] = 7  # a hot expert as well
    slots = ids.size
    out = dict(expert_offsets=np.empty(experts + 1, np.int32), problem_sizes1=np.empty((experts, 3), np.int32),
               problem_sizes2=np.empty((experts, 3), np.int32), input_permutation=np.empty(slots, np.int32),
               output_permutation=np.empty(slots, np.int32))
    sgl_kernel.get_cutlass_w4a8_moe_mm_data(ids, **out, num_experts=experts, n=2048, k=7168)
    want = ref.moe_mm_data(ids, experts, 2048, 7168)
    for name, value in out.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_grouped_gemm_256k_rows():
    experts, n, k, rows = 4, 8, 128, 262144
    ids = np.random.default_rng(14).integers(0, experts, size=rows).astype(np.int32)
    data = ref.moe_mm_data(ids, experts, n, k)
    rng = np.random.default_rng(15)
    a = ref.round_e4m3(rng.standard_normal((rows, k)).astype(np.float32))
    w = testing.make_w4a8_int4_weights(experts, n, k, seed=16)
    sizes = data["problem_sizes2"].copy()
    sizes[:, 0], sizes[:, 2] = n, k
    scale = np.array([0.5], np.float32)
    d = testing.poison((rows, n), BF16)
    sgl_kernel.cutlass_w4a8_moe_mm(d, a, w.q, scale, w.scale, data["expert_offsets"][:-1], sizes, None, None, None,
                                   None)
    want = ref.w4a8_moe_mm(a, w.q, scale, w.scale, data["expert_offsets"][:-1], sizes)
    assert not testing.poisoned_mask(d).any()
    testing.assert_close(d, want, "grouped_gemm")


def test_fused_zero_tokens():
    case = _case("w4a16_int4", tokens=3, seed=17)
    empty = dict(case, x=case["x"][:0], topk_ids=case["topk_ids"][:0], topk_weights=case["topk_weights"][:0])
    out = np.empty((0, 256), BF16)
    assert qmoe.fused_moe(**{k: v for k, v in empty.items() if v is not None}, out=out).shape == (0, 256)
