"""GPU tests of GEMM1's fused activation epilogue in the bf16 x 4-bit pipeline (w4a16, w4a16_int4, w4a4,
w4a8; src/cuda/gemm/bf16_act_requant.h): with a 128-row mma.sync decode tactic for GEMM1 (n8 or n16), a
gated activation in the up_gate_interleaved64 layout (or ReLU^2) and any requantization but w4a4's
per-token one, GEMM1's epilogue writes the bf16 intermediate A2 and s2 itself and never writes the fp32 h;
QMOE_FUSED_EPILOGUE=0 (read on every call) forces the separate kernels, =1 the fused epilogue wherever
supported (unset: the rule bf16_act_pays, which keeps n8's 3-CTA shape separate above 9 tiles per SM).

Every case runs the same device data through both paths with a caller-owned workspace poisoned with
0xAA bytes and a NaN-poisoned output, then checks:
  - A2 (bf16) and s2 (read from the workspace at the pipeline's offsets) are bit for bit equal between
    the two paths over the valid rows; s2 equals w2_alpha[e] (1 without it);
  - the deterministic output is bit for bit equal between the paths; both paths' outputs (both
    finalizes) are within qmoe.testing's tolerance of the C++ CPU engine;
  - which path ran: the fused path leaves h's bytes poisoned, the separate path writes them.

Coverage: every mode x every activation (swiglu, gpt-oss swiglu_oai, geglu_tanh, relu2, situ) x ragged
routing (T = 1, top-k 8 at T = 1, an empty expert with -1 / out-of-range ids, all tokens on one expert, a
hot expert with several token tiles, EP with local experts) x the n8 / n16 tactics forced and the
heuristic's; the rule on n8's 3-CTA shape when the variable is unset (fused up to 9 tiles per SM); packed FP4 weights;
I = 2880 (gpt-oss) and a ReLU^2 I whose last 128-row tile is partial; w1 / w2 alphas and PDL; the fallbacks
([gate; up] layout, w4a4 per-token scales, other tactics) write h and match the CPU engine; the switch is read
per call.
"""
from __future__ import annotations


import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_common import (  # noqa: E402
    ACTIVATION_CASES, ACTIVATION_IDS, assert_same_intermediate, bits, EPILOGUE_POISON, EPILOGUE_SHAPES,
    expected_offsets, fused_moe_dims, GPT_OSS, on_device, require_hopper, run_cpu, run_fused_moe_in_workspace,
    to_np)

torch = require_hopper()

from qmoe import quant  # noqa: E402
from qmoe import testing  # noqa: E402

MODES = ("w4a16", "w4a16_int4", "w4a4", "w4a8")
POISON = EPILOGUE_POISON
FUSED_TACTICS = ("decode_m128_n8_k256", "decode_m128_n16_k256")


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def expected_s2(case, offsets):
    """s2 of the valid rows: w2_alpha[e] (1 without it); w4a4 per-token mode excluded (never fused)."""
    _, local, *_ = fused_moe_dims(case)
    alpha = case.get("w2_alpha")
    alpha = np.ones(local, np.float32) if alpha is None else alpha.astype(np.float32)
    return np.repeat(alpha, np.diff(offsets)).astype(np.float32)


def run(case, dev, fused, deterministic, **options):
    """One GPU call through the chosen path (gpu_common.run_fused_moe_in_workspace)."""
    return run_fused_moe_in_workspace(case, dev, fused, deterministic, True, **options)


def compare_paths(case, tactic=None, expect_fused=True, cpu=None, **options):
    """Both paths on the same device data (module docstring). expect_fused: whether GEMM1 takes the fused
    epilogue when allowed (None: not checked). cpu: the CPU engine's outputs {deterministic: array}."""
    packed = options.get("fp4_weights_packed", False)
    dev = on_device(dict(case, w1=quant.pack_fp4_weights(case["w1"]), w2=quant.pack_fp4_weights(case["w2"]))
                    if packed else case)
    opts = dict(options)
    if tactic is not None:
        opts["tactic"] = tactic
    cpu_opts = {k: v for k, v in options.items() if k != "fp4_weights_packed"}
    what = f"{case['quant_mode']} {case['activation']} {case['gate_up_layout']} tactic={tactic}"
    want_offsets = expected_offsets(case)
    cpu = cpu if cpu is not None else {}
    tol_key = "w4a4_per_token" if case.get("per_token_scale") is not None else case["quant_mode"]
    for deterministic in (True, False):
        fused = run(case, dev, True, deterministic, **opts)
        sep = run(case, dev, False, deterministic, **opts)
        assert_same_intermediate(fused, sep, what, want_offsets, expect_fused, deterministic)
        if case.get("per_token_scale") is None:
            assert np.array_equal(fused["s2"].cpu().numpy().view(np.uint32),
                                  expected_s2(case, want_offsets).view(np.uint32)), f"{what}: s2 != w2_alpha[e]"
        if deterministic not in cpu:
            cpu[deterministic] = run_cpu(case, deterministic=deterministic, **cpu_opts)
        for r, name in ((fused, "fused"), (sep, "separate")):
            testing.assert_close(to_np(r["out"]), cpu[deterministic], case["quant_mode"],
                                 tol=testing.TOLERANCES[tol_key], what=f"{what} {name} det={deterministic} vs CPU")
    return cpu


def make_case(mode, tokens, top_k, experts, activation, params, layout="up_gate_interleaved64", hidden=256,
              inter=128, seed=0, **kw):
    case = testing.make_fused_moe_case(mode, tokens, hidden, inter, experts, top_k, seed, activation=activation,
                                       gate_up_layout=layout, **kw)
    case.update(params)
    if mode == "w4a4" and case.get("per_token_scale") is None:
        # re-aim the intermediate's encode scale at |act| <= amax (make_fused_moe_case aims at 8; ReLU^2
        # reaches ~20), keeping alpha2 = 1 / (fc2 * gs_w2)
        amax = 32.0 if activation == "relu2" else 8.0
        old, new = np.float32(case["fc2_input_scale"][0]), np.float32(448 * 6 / amax)
        case["fc2_input_scale"] = np.array([new], np.float32)
        case["w2_alpha"] = (case["w2_alpha"] * (old / new)).astype(np.float32)
    return case


# ------------------------------------------------------------------------------------------------
# modes x activations x ragged shapes: the n8 / n16 tactics forced and the heuristic's
# ------------------------------------------------------------------------------------------------
SHAPES = EPILOGUE_SHAPES


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("activation,params", ACTIVATION_CASES, ids=ACTIVATION_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_fused_epilogue_matches_separate_path(mode, activation, params, shape):
    tokens, top_k, experts, kw = SHAPES[shape]
    layout = "gate_up" if activation == "relu2" else "up_gate_interleaved64"
    case = make_case(mode, tokens, top_k, experts, activation, params, layout=layout,
                     seed=tokens + 7 * top_k + 13 * MODES.index(mode), **kw)
    cpu = {}
    for tactic in FUSED_TACTICS:
        cpu = compare_paths(case, tactic, expect_fused=True, cpu=cpu, routed_scaling_factor=1.5)
    compare_paths(case, None, expect_fused=None, cpu=cpu, routed_scaling_factor=1.5)


@pytest.mark.parametrize("mode", ("w4a16", "w4a4", "w4a8"))
def test_packed_weights(mode):
    case = make_case(mode, 19, 4, 8, "swiglu", GPT_OSS, seed=31)
    cpu = {}
    for tactic in FUSED_TACTICS:
        cpu = compare_paths(case, tactic, cpu=cpu, fp4_weights_packed=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("activation,hidden,inter", [("swiglu", 256, 2880), ("relu2", 512, 160),
                                                     ("geglu_tanh", 512, 384)])
def test_sizes(mode, activation, hidden, inter):
    """I = 2880 (gpt-oss: 45 64-groups), a ReLU^2 I = 160 (its second 128-row tile has 32 rows), I = 384."""
    if mode == "w4a16_int4" and inter % 128 != 0:
        pytest.skip("int4-g128 weights need I % 128 == 0")
    layout = "gate_up" if activation == "relu2" else "up_gate_interleaved64"
    case = make_case(mode, 9, 4, 8, activation, {}, layout=layout, hidden=hidden, inter=inter,
                     seed=hidden + inter + MODES.index(mode))
    cpu = {}
    for tactic in FUSED_TACTICS:
        cpu = compare_paths(case, tactic, cpu=cpu)


@pytest.mark.parametrize("mode", MODES)
def test_alphas_and_pdl(mode):
    case = make_case(mode, 23, 4, 8, "geglu_tanh", {}, seed=12)
    rng = np.random.default_rng(3)
    case["w1_alpha"] = rng.uniform(0.5, 2.0, 8).astype(np.float32)
    case["w2_alpha"] = (rng.uniform(0.5, 2.0, 8) * (case["w2_alpha"] if case.get("w2_alpha") is not None else 1)
                        ).astype(np.float32)
    cpu = {}
    for tactic in FUSED_TACTICS:
        cpu = compare_paths(case, tactic, cpu=cpu, enable_pdl=True)


# ------------------------------------------------------------------------------------------------
# fallbacks: the separate kernels run (h written) and the result matches the CPU engine
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_gate_up_layout_falls_back(mode):
    case = make_case(mode, 17, 4, 8, "swiglu", {}, layout="gate_up", seed=21)
    compare_paths(case, "decode_m128_n8_k256", expect_fused=False)


def test_w4a4_per_token_scale_falls_back():
    case = make_case("w4a4", 17, 4, 8, "swiglu", {}, seed=22, per_token=True)
    assert case.get("per_token_scale") is not None
    compare_paths(case, "decode_m128_n8_k256", expect_fused=False)


@pytest.mark.parametrize("tactic", ["decode_m64_n8_k256", "decode_m128_n24_k256", "decode_m128_n32_k256",
                                    "prefill_m128_n64_k128"])
def test_other_tactics_fall_back(tactic):
    case = make_case("w4a4", 40, 4, 8, "swiglu", {}, seed=23)
    compare_paths(case, tactic, expect_fused=False)


def test_rule_at_the_three_cta_n8_shape():
    """Unset, the rule (bf16_act_pays) fuses at a small grid and on n8's 3-CTA shape (>= 6 x SMs tiles) up to 9
    tiles per SM (here 4 tokens x 8 over 32 experts: (4 + 32) x 32 feature tiles = 1152), and keeps the separate
    kernels above (8 tokens over 64 experts: 2304); "1" fuses there too (its 3-CTA instantiation), with the same
    A2 bits."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for tokens, experts, fused in ((4, 32, True), (8, 64, False)):
        big = make_case("w4a4", tokens, 8, experts, "swiglu", {}, inter=2048, seed=25 + tokens)
        bound = (tokens * 8 // 8 + min(tokens * 8, experts)) * (2 * 2048 // 128)
        assert 6 * sms <= bound and (bound <= 9 * sms) == fused, bound
        dev = on_device(big)
        rule = run(big, dev, None, True, tactic="decode_m128_n8_k256")
        forced = run(big, dev, True, True, tactic="decode_m128_n8_k256")
        assert bool((rule["h"] == POISON).all()) == fused, f"T={tokens}: rule fused={fused} expected"
        assert bool((forced["h"] == POISON).all()), "QMOE_FUSED_EPILOGUE=1: fused expected"
        assert torch.equal(rule["a2"], forced["a2"]) and torch.equal(bits(rule["out"]), bits(forced["out"]))
    small = make_case("w4a4", 1, 8, 64, "swiglu", {}, seed=26)
    assert bool((run(small, on_device(small), None, True, tactic="decode_m128_n8_k256")["h"] == POISON).all())


def test_switch_is_read_per_call():
    """Alternating the variable between calls in one process alternates the path (h poisoned or not)."""
    case = make_case("w4a8", 5, 2, 8, "situ", ACTIVATION_CASES[4][1], seed=24)
    dev = on_device(case)
    for fused in (True, False, True, False):
        r = run(case, dev, fused, True, tactic="decode_m128_n16_k256")
        assert bool((r["h"] == POISON).all()) == fused
