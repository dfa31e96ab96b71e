"""GPU tests of the decode gathers that find their own rows (both pipelines: src/cuda/fused/moe_gather_quantize.cu,
moe_gather_dequant.cu, own_slot_rows.cuh; gather_finds_rows in moe_pipeline_steps.cu): up to kOwnRowsMaxSlots = 512
slots the gather ranks each slot among all ids itself and runs before the routing kernel, which then runs alongside
it (PDL) and waits for it at its end. QMOE_GATHER_OWN_ROWS=0 (read on every call) keeps the routing kernel first and
the gather reading the permutations.

Each case runs the same device data both ways into workspaces poisoned with 0xAA bytes and NaN-poisoned outputs
(deterministic finalize), with PDL off and on, and checks bit for bit: every routing buffer (expert offsets,
both problem sizes, both permutations), GEMM1's operand A1 and scale s1 over the valid rows, and the output; and
the output against the C++ CPU engine (qmoe.testing tolerance). Routings: one token, k = 8, dropped ids (-1 and
out of range), an empty expert, all tokens on one expert, the same expert twice in a token (the rank keeps slot
order), expert parallelism with tokens that have no local slot, 512 slots (the largest own-rows count) and 520
(the routing-first path either way); every quant mode; w4a8_int4 with static, per-token and dynamic x scales,
w4a4 with and without per_token_scale.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_common import (  # noqa: E402
    env_var, on_device, replay_with_new_routings, require_hopper, run_cpu, run_fused_moe_in_workspace, to_np)

torch = require_hopper()

import qmoe  # noqa: E402
from qmoe import testing, tune  # noqa: E402

MODE = "w4a8_int4"
# quant mode -> the scale variants tested (make_case)
MODES = {"w4a8_int4": ("static", "per_token", "dynamic"), "w4a4": ("static", "per_token"), "w4a8": ("static",),
         "w4a16": ("static",), "w4a16_int4": ("static",)}
ENV = "QMOE_GATHER_OWN_ROWS"

# name -> (tokens, top_k, experts, make_fused_moe_case keywords)
CASES = {
    "T1_k1": (1, 1, 8, {}),
    "T1_k8": (1, 8, 64, {}),
    "T7_dropped_empty": (7, 4, 16, dict(empty_expert=3, minus_one=3, out_of_range=2)),
    "T9_one_expert": (9, 1, 16, dict(expert_range=(5, 6))),
    "T6_repeated": (6, 4, 3, dict(distinct=False)),
    "T13_ep": (13, 4, 16, dict(num_local_experts=6, local_expert_offset=5, expert_range=(3, 13))),
    "T64_k8_512_slots": (64, 8, 128, {}),
    "T65_k8_520_slots": (65, 8, 128, {}),
}


def own_rows(enabled):
    """QMOE_GATHER_OWN_ROWS for the calls inside: unset (the pipeline's rule: own rows up to 512 slots) or "0"."""
    return env_var(ENV, None if enabled else "0")


def run(case, dev, enabled, **options):
    """One call into a poisoned workspace (gpu_common.run_fused_moe_in_workspace, the fused-epilogue rule unset)."""
    with own_rows(enabled):
        r = run_fused_moe_in_workspace(case, dev, None, True, case["quant_mode"] != "w4a8_int4", **options)
    r["out"] = r["out"].view(torch.int16)
    return r


def make_case(name, scales, mode=MODE):
    tokens, top_k, experts, kw = CASES[name]
    if mode == "w4a4":
        kw = dict(kw, per_token=scales == "per_token")
    elif mode == "w4a8_int4":
        kw = dict(kw, static_scales=scales != "dynamic")
    case = testing.make_fused_moe_case(mode, tokens, 256, 128, experts, top_k, seed=tokens + 3 * top_k, **kw)
    if mode == "w4a8_int4" and scales == "per_token":
        x = case["x"].astype(np.float32)
        case["x_scale"] = (np.abs(x).max(axis=1) / 448 + 1e-3).astype(np.float32)
    return case


@pytest.mark.parametrize("mode,scales", [(m, s) for m, variants in MODES.items() for s in variants])
@pytest.mark.parametrize("name", list(CASES))
def test_own_rows_match_the_routed_gather(name, mode, scales):
    case = make_case(name, scales, mode)
    dev = on_device(case)
    cpu = run_cpu(case, deterministic=True)
    for pdl in (False, True):
        ref = run(case, dev, False, enable_pdl=pdl)
        got = run(case, dev, True, enable_pdl=pdl)
        what = f"{name} {mode} {scales} pdl={pdl}"
        for key in ("offsets", "sizes1", "sizes2", "input_permutation", "output_permutation", "a1", "s1", "out"):
            assert torch.equal(ref[key], got[key]), f"{what}: {key} differs between the two gathers"
        testing.assert_close(to_np(got["out"].view(torch.bfloat16)), cpu, mode, tol=tolerance(case),
                             what=f"{what} vs CPU")


def tolerance(case):
    """The mode's, or testing.FEW_TOKENS_WGMMA_TOLERANCE where the heuristic runs w4a8_int4 on a WGMMA tile (T13_ep:
    ~9 rows per local expert along K = 256)."""
    tokens, top_k = case["topk_ids"].shape
    if case["quant_mode"] != "w4a8_int4" or tokens * top_k >= 64:
        return None
    local = case["num_local_experts"] or case["num_experts"]
    hidden, inter = case["w2"].shape[1], 2 * case["w2"].shape[2]
    picks = (qmoe.select_tactic(2 * inter, hidden, tokens * top_k, local, top_k),
             qmoe.select_tactic(hidden, inter, tokens * top_k, local, top_k))
    return testing.FEW_TOKENS_WGMMA_TOLERANCE if any(t in tune.WGMMA_TACTICS for t in picks) else None


def test_graph_replay_with_pdl_reroutes():
    """A CUDA graph captured with own rows and PDL replays new routings of the same shape correctly."""
    case = make_case("T7_dropped_empty", "static")
    dev = on_device(case)
    out = torch.empty((case["topk_ids"].shape[0], case["w2"].shape[1]), dtype=torch.bfloat16, device="cuda")
    routings = [(11, dict(minus_one=2, empty_expert=1)), (12, dict(hot_expert=0)), (13, dict(out_of_range=5))]
    body = lambda: qmoe.fused_moe(**dev, out=out, deterministic=True, enable_pdl=True)  # noqa: E731
    with own_rows(True):
        for seed, new, got in replay_with_new_routings(case, dev, out, body, routings):
            testing.assert_close(got, run_cpu(new, deterministic=True), MODE, what=f"graph replay {seed}")
