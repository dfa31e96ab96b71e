"""GPU tests of GEMM1's fused activation epilogue in the w4a8_int4 pipeline (docs/design.md 6.3;
src/cuda/gemm/w4a8_act_requant.h): with a static a2 (fc2_input_scale) and an mma.sync decode tactic
for GEMM1, GEMM1's epilogue writes e4m3 A2 = e4m3(act(h) / a2) and s2 = a2 * w2_alpha[e] itself and
never writes the fp32 h; QMOE_FUSED_EPILOGUE=0 (read on every call) forces the separate kernels.

Every case runs the same device data through both paths with a caller-owned workspace poisoned with
0xAA bytes and a NaN-poisoned output, then checks:
  - A2 and s2 (read from the workspace at the pipeline's offsets) are bit for bit equal between the
    two paths over the valid rows; s2 equals a2 * w2_alpha[e] (fp32) exactly;
  - the deterministic output is bit for bit equal between the paths; the fused-finalize output of
    both is within qmoe.testing's tolerance of the C++ CPU engine;
  - which path ran: the fused path leaves h's bytes poisoned, the separate path writes them (so a
    silent fallback cannot pass as "bitwise equal").
The workspace offsets are recomputed in the tests (gpu_common.workspace_offsets, fused_moe_workspace.h); the
routing offsets read back from them must equal the ones computed from the routing, which checks the
recomputation.

Coverage: every gated activation (swiglu, gpt-oss swiglu_oai, geglu_tanh, situ) and relu2; both
gate/up layouts ([gate; up] and up_gate_interleaved64); both weight-scale layouts (H = 256: [E, K/128, N],
H = 512: [E, K/512, 4N]); I in {128, 256, 384}; ragged routing: T = 1, odd T, an empty expert, all
tokens on one expert, ids that are -1 / out of range, EP with local experts (and tokens with no
local slot); every decode tactic forced plus the heuristic's; w1/w2 alphas; PDL. The WGMMA tiles
(prefill, all five token tiles) take an in-register version of the epilogue with QMOE_WGMMA_FUSED_EPILOGUE=1
(opt-in): every gated activation, both layouts, both scale layouts, several token tiles per expert, EP.
Fallbacks: dynamic a2, the prefill tactics without the opt-in (and the mma.sync n64 tile), ReLU^2 on the
WGMMA tiles, and the switch write h and match the CPU engine.
"""
from __future__ import annotations


import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_common import (  # noqa: E402
    ACTIVATION_CASES, ACTIVATION_IDS, assert_same_intermediate, bits, EPILOGUE_POISON, EPILOGUE_SHAPES, expected_offsets,
    fused_epilogue, fused_moe_dims, local_slots, on_device, require_hopper, run_cpu, run_fused_moe_in_workspace,
    to_np)

torch = require_hopper()

import qmoe  # noqa: E402
from qmoe import testing, tune  # noqa: E402

MODE = "w4a8_int4"
POISON = EPILOGUE_POISON
DECODE_TACTICS = ("decode_m128_n8_k256", "decode_m128_n16_k256", "decode_m128_n24_k256", "decode_m128_n32_k256",
                  "decode_m64_n8_k512", "decode_m64_n32_k512")
WGMMA_TACTICS = ("prefill_m128_n160_k128", "prefill_m128_n128_k128", "prefill_m128_n96_k128", "prefill_m128_n64_k128",
                 "prefill_m128_n48_k128", "prefill_m128_n32_k128")
WGMMA_ENV = "QMOE_WGMMA_FUSED_EPILOGUE"  # the WGMMA tiles' fused epilogue is opt-in (w4a8_act_requant.h)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def run(case, dev, fused, deterministic, **options):
    """One GPU call through the chosen path (gpu_common.run_fused_moe_in_workspace)."""
    return run_fused_moe_in_workspace(case, dev, fused, deterministic, False, **options)


def expected_s2(case, offsets):
    """s2 of the valid rows: a2 * w2_alpha[e] in fp32 (w2_alpha 1 when absent)."""
    a2 = np.float32(case["fc2_input_scale"][0])
    _, local, *_ = fused_moe_dims(case)
    alpha = case.get("w2_alpha")
    alpha = np.ones(local, np.float32) if alpha is None else alpha.astype(np.float32)
    counts = np.diff(offsets)
    return np.repeat(a2 * alpha, counts).astype(np.float32)


def compare_paths(case, tactic=None, expect_fused=True, cpu=None, **options):
    """Both paths on the same device data (module docstring). expect_fused: whether GEMM1 takes the
    fused epilogue when allowed (None: not checked; an untuned call may use an autotuner's cached
    tactic). cpu: the CPU engine's outputs {deterministic: array} (computed if None)."""
    dev = on_device(case)
    opts = dict(options)
    if tactic is not None:
        opts["tactic"] = tactic
    what = f"{case['activation']} {case['gate_up_layout']} tactic={tactic}"
    want_offsets = expected_offsets(case)
    cpu = cpu if cpu is not None else {}
    for deterministic in (True, False):
        fused = run(case, dev, True, deterministic, **opts)
        sep = run(case, dev, False, deterministic, **opts)
        assert_same_intermediate(fused, sep, what, want_offsets, expect_fused, deterministic)
        if case.get("fc2_input_scale") is not None:
            assert np.array_equal(fused["s2"].cpu().numpy().view(np.uint32),
                                  expected_s2(case, want_offsets).view(np.uint32)), f"{what}: s2 != a2 * w2_alpha"
        if deterministic not in cpu:
            cpu[deterministic] = run_cpu(case, deterministic=deterministic, **options)
        tokens, top_k = case["topk_ids"].shape
        few_wgmma = tactic in tune.WGMMA_TACTICS and tokens * top_k < 64  # (testing.FEW_TOKENS_WGMMA_TOLERANCE)
        for r, name in ((fused, "fused"), (sep, "separate")):
            testing.assert_close(to_np(r["out"]), cpu[deterministic], MODE,
                                 tol=testing.FEW_TOKENS_WGMMA_TOLERANCE if few_wgmma else None,
                                 what=f"{what} {name} det={deterministic} vs CPU")
            assert not torch.isnan(r["out"].float()).any() or np.isnan(cpu[deterministic].astype(np.float32)).any()
    return cpu


def make_case(tokens, top_k, experts, activation, layout, params, hidden=256, inter=128, seed=0, **kw):
    case = testing.make_fused_moe_case(MODE, tokens, hidden, inter, experts, top_k, seed, activation=activation,
                                       gate_up_layout=layout, **kw)
    case.update(params)
    # a static a2 sized for the activation's range (relu2 of O(1) inputs reaches ~20)
    case["fc2_input_scale"] = np.array([(32.0 if activation == "relu2" else 8.0) / 448], np.float32)
    return case


def decode_tactics(case):
    slots, local, hidden, inter, rows1 = fused_moe_dims(case)
    k = case["topk_ids"].shape[1]
    g1 = qmoe.valid_tactics(rows1, hidden, slots, local, k)
    g2 = qmoe.valid_tactics(hidden, inter, slots, local, k)
    return [t for t in DECODE_TACTICS if t in g1 and t in g2]


# ------------------------------------------------------------------------------------------------
# ragged shapes x activations x layouts: every decode tactic and the heuristic
# ------------------------------------------------------------------------------------------------
SHAPES = EPILOGUE_SHAPES


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", ["gate_up", "up_gate_interleaved64"])
@pytest.mark.parametrize("activation,params", ACTIVATION_CASES, ids=ACTIVATION_IDS)
def test_fused_epilogue_matches_separate_path(activation, params, layout, shape):
    if activation == "relu2" and layout != "gate_up":
        pytest.skip("relu2 has no gate/up halves")
    tokens, top_k, experts, kw = SHAPES[shape]
    case = make_case(tokens, top_k, experts, activation, layout, params, seed=tokens + 7 * top_k, **kw)
    tactics = decode_tactics(case)
    assert len(tactics) == len(DECODE_TACTICS), tactics
    cpu = {}
    for tactic in tactics:
        cpu = compare_paths(case, tactic, expect_fused=True, cpu=cpu, routed_scaling_factor=1.5)
    compare_paths(case, None, expect_fused=None, cpu=cpu, routed_scaling_factor=1.5)


def test_ep_tokens_without_local_slot_are_zero():
    case = make_case(33, 2, 16, "swiglu", "gate_up", {}, seed=3, num_local_experts=4, local_expert_offset=8,
                     expert_range=(6, 14))
    ids = case["topk_ids"].copy()
    ids[2] = [0, 15]
    ids[5] = [-1, 99]
    case["topk_ids"] = ids
    compare_paths(case, "decode_m128_n8_k256")
    none = ~local_slots(case).any(axis=1)
    assert none[2] and none[5]
    with fused_epilogue(True):
        out = qmoe.fused_moe(**on_device(case), tactic="decode_m128_n8_k256", deterministic=True)
    torch.cuda.synchronize()
    assert np.all(to_np(out)[none].astype(np.float32) == 0)


# ------------------------------------------------------------------------------------------------
# sizes: both weight-scale layouts of GEMM1 (K = H), several 64-groups of I
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden,inter", [(512, 128), (256, 256), (512, 384)])
@pytest.mark.parametrize("layout", ["gate_up", "up_gate_interleaved64"])
@pytest.mark.parametrize("activation,params", [ACTIVATION_CASES[1], ACTIVATION_CASES[3]],
                         ids=[ACTIVATION_IDS[1], ACTIVATION_IDS[3]])
def test_hidden_and_inter_sizes(activation, params, layout, hidden, inter):
    if activation == "relu2" and layout != "gate_up":
        pytest.skip("relu2 has no gate/up halves")
    case = make_case(19, 4, 8, activation, layout, params, hidden=hidden, inter=inter, seed=hidden + inter)
    cpu = {}
    for tactic in decode_tactics(case):
        cpu = compare_paths(case, tactic, cpu=cpu)


def test_alphas_and_pdl():
    case = make_case(23, 4, 8, "geglu_tanh", "up_gate_interleaved64", {}, seed=12)
    rng = np.random.default_rng(3)
    case["w1_alpha"] = rng.uniform(0.5, 2.0, 8).astype(np.float32)
    case["w2_alpha"] = rng.uniform(0.5, 2.0, 8).astype(np.float32)
    cpu = {}
    for tactic in decode_tactics(case):
        cpu = compare_paths(case, tactic, cpu=cpu, enable_pdl=True)


@pytest.mark.parametrize("layout", ["gate_up", "up_gate_interleaved64"])
@pytest.mark.parametrize("activation,params", [ACTIVATION_CASES[0], ACTIVATION_CASES[3]],
                         ids=[ACTIVATION_IDS[0], ACTIVATION_IDS[3]])
def test_n8_three_cta_shape(activation, params, layout):
    """The n8 tile with many tiles runs its 3-stage, 3-CTA-per-SM shape (resident_ctas.h
    n8_tiles_fill_three_per_sm: >= 6 tiles per SM); its fused-epilogue instantiation is checked here
    (I = 2048: 32 feature tiles x (rows / 8 + experts hit) >= 792), with several 64-row feature groups."""
    if activation == "relu2" and layout != "gate_up":
        pytest.skip("relu2 has no gate/up halves")
    case = make_case(64, 4, 32, activation, layout, params, hidden=256, inter=2048, seed=31, empty_expert=5)
    slots, local, hidden, inter, rows1 = fused_moe_dims(case)
    tiles = (slots // 8 + local) * (rows1 // 128)
    assert tiles >= 6 * 132, tiles
    compare_paths(case, "decode_m128_n8_k256", expect_fused=True)


def test_rule_at_the_three_cta_n8_shape():
    """Unset, the rule (act_requant_pays) fuses on n8's 3-CTA shape up to 15 tiles per SM (tile bound
    (rows / 8 + experts hit) x feature tiles; 132 SMs: 792 .. 1980) and keeps the separate kernels above;
    both give the bits of the forced paths."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for tokens, experts, fused in ((8, 32, True), (32, 64, False)):
        case = make_case(tokens, 8, experts, "swiglu", "gate_up", {}, inter=2048, seed=33 + tokens)
        slots, local, hidden, inter, rows1 = fused_moe_dims(case)
        bound = (slots // 8 + min(slots, local)) * (rows1 // 128)
        assert 6 * sms <= bound and (bound <= 15 * sms) == fused, bound
        dev = on_device(case)
        rule = run(case, dev, None, True, tactic="decode_m128_n8_k256")
        forced = run(case, dev, fused, True, tactic="decode_m128_n8_k256")
        assert bool((rule["h"] == POISON).all()) == fused, f"T={tokens}: fused={fused} expected by the rule"
        assert torch.equal(rule["a2"], forced["a2"]) and torch.equal(bits(rule["out"]), bits(forced["out"]))


# ------------------------------------------------------------------------------------------------
# fallbacks: the separate kernels run (h written) and the result matches the CPU engine
# ------------------------------------------------------------------------------------------------
def test_dynamic_a2_falls_back():
    case = make_case(17, 4, 8, "swiglu", "gate_up", {}, seed=21)
    case["fc2_input_scale"] = None
    compare_paths(case, "decode_m128_n8_k256", expect_fused=False)


def test_prefill_tactics_fall_back(monkeypatch):
    """Without QMOE_WGMMA_FUSED_EPILOGUE=1 the WGMMA tiles keep the separate kernels (opt-in until timed),
    and the mma.sync n64 tile has no fused epilogue."""
    monkeypatch.delenv(WGMMA_ENV, raising=False)
    case = make_case(40, 4, 8, "swiglu", "up_gate_interleaved64", {}, seed=22)
    slots, local, hidden, inter, rows1 = fused_moe_dims(case)
    prefill = [t for t in qmoe.valid_tactics(rows1, hidden, slots, local, 4) if t.startswith("prefill")]
    assert prefill
    cpu = {}
    for tactic in prefill:
        cpu = compare_paths(case, tactic, expect_fused=False, cpu=cpu)


@pytest.mark.parametrize("tactic", WGMMA_TACTICS)
def test_wgmma_relu2_falls_back_even_when_enabled(monkeypatch, tactic):
    """The WGMMA tiles' in-register epilogue is for gated activations only: with QMOE_WGMMA_FUSED_EPILOGUE=1
    ReLU^2 keeps the separate kernels (h written) and the same results."""
    monkeypatch.setenv(WGMMA_ENV, "1")
    activation, params = ACTIVATION_CASES[ACTIVATION_IDS.index("relu2")]
    case = make_case(129, 4, 16, activation, "gate_up", params, hidden=256, inter=384, seed=24, hot_expert=2)
    compare_paths(case, tactic, expect_fused=False)


def test_switch_is_read_per_call():
    """Alternating the variable between calls in one process alternates the path (h poisoned or not)."""
    case = make_case(5, 2, 8, "situ", "gate_up", ACTIVATION_CASES[4][1], seed=23)
    dev = on_device(case)
    for fused in (True, False, True, False):
        r = run(case, dev, fused, True, tactic="decode_m128_n16_k256")
        assert bool((r["h"] == POISON).all()) == fused


# ------------------------------------------------------------------------------------------------
# the WGMMA tiles (prefill) with QMOE_WGMMA_FUSED_EPILOGUE=1: a feature's gate and up values in one thread
# ------------------------------------------------------------------------------------------------
WGMMA_SHAPES = {
    # name: (tokens, top_k, experts, hidden, inter, make_case keywords)
    "T1": (1, 1, 8, 256, 128, {}),
    "T40_packed4": (40, 4, 8, 512, 256, {}),
    "T129_hot_expert": (129, 4, 16, 256, 384, dict(hot_expert=2)),  # > 128 rows: several token tiles
    "T33_ep": (33, 2, 16, 256, 128, dict(num_local_experts=6, local_expert_offset=5, expert_range=(3, 13))),
}


@pytest.mark.parametrize("shape", list(WGMMA_SHAPES))
@pytest.mark.parametrize("layout", ["gate_up", "up_gate_interleaved64"])
@pytest.mark.parametrize("activation,params", ACTIVATION_CASES, ids=ACTIVATION_IDS)
def test_wgmma_fused_epilogue_matches_separate_path(activation, params, layout, shape, monkeypatch):
    if activation == "relu2" and layout != "gate_up":
        pytest.skip("relu2 has no gate/up halves")
    monkeypatch.setenv(WGMMA_ENV, "1")
    tokens, top_k, experts, hidden, inter, kw = WGMMA_SHAPES[shape]
    case = make_case(tokens, top_k, experts, activation, layout, params, hidden=hidden, inter=inter,
                     seed=3 * tokens + top_k, **kw)
    slots, local, hidden, inter, rows1 = fused_moe_dims(case)
    g1 = qmoe.valid_tactics(rows1, hidden, slots, local, top_k)
    g2 = qmoe.valid_tactics(hidden, inter, slots, local, top_k)
    tactics = [t for t in WGMMA_TACTICS if t in g1 and t in g2]
    assert tactics == list(WGMMA_TACTICS), tactics
    cpu = {}
    for tactic in tactics:  # (ReLU^2 keeps the separate kernels on the WGMMA tiles)
        cpu = compare_paths(case, tactic, expect_fused=activation != "relu2", cpu=cpu, routed_scaling_factor=1.5)
