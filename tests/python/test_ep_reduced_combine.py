"""The reduced combine of expert parallelism (ExpertParallelMoE.forward(deterministic=False), python/qmoe/ep.py;
docs/expert-parallel.md), on the CPU with the loopback transport: owners finalize their own slots and one
partial row per (token, owner) comes back. Each rank's output must be, bit for bit, the rank-order fp32
sum of the W partials fused_moe(its tokens, owner d's experts) rounded once to the output dtype, and
within 1e-2 relative RMS of fused_moe over all experts. Both modes, numpy and torch CPU tensors, ranks
with no token, skewed routing, every quant mode; argument errors before any exchange."""
import ml_dtypes
import numpy as np
import pytest

from qmoe import ops
from qmoe.ep import ExpertParallelMoE
from qmoe.ep_transport import run_loopback

from test_ep_cpu import _bits, _bounds, _case, _routing, _slice_tokens, _to_torch

WEIGHT_KEYS = ("w1", "w1_scale", "w2", "w2_scale", "w1_alpha", "w2_alpha")


def _experts(case, lo, hi):
    return {k: (None if case.get(k) is None else case[k][lo:hi]) for k in WEIGHT_KEYS}


def _run(case, bounds, world, mode, capacity=None, output_dtype="bfloat16", rsf=1.0, to=lambda a: a, **fwd):
    num_experts = case["num_experts"]
    per = num_experts // world

    def rank_fn(rank, transport):
        mine = _slice_tokens(case, bounds[rank], bounds[rank + 1])
        w = {k: to(v) for k, v in _experts(case, rank * per, (rank + 1) * per).items()}
        layer = ExpertParallelMoE(world, rank, num_experts, transport=transport, quant_mode=case["quant_mode"],
                                  activation=case["activation"], gate_up_layout=case["gate_up_layout"],
                                  routed_scaling_factor=rsf, output_dtype=output_dtype)
        extra = {k: to(mine.get(k)) for k in ("x_scale", "fc2_input_scale", "per_token_scale")}
        return layer.forward(to(mine["x"]), to(mine["topk_ids"]), to(mine["topk_weights"]), w["w1"], w["w1_scale"],
                             w["w2"], w["w2_scale"], w1_alpha=w["w1_alpha"], w2_alpha=w["w2_alpha"], mode=mode,
                             max_tokens_per_rank=capacity if mode == "low_latency" else None, deterministic=False,
                             **extra, **fwd)

    return run_loopback(world, rank_fn)


def _np_dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _check(case, bounds, world, outs, output_dtype="bfloat16", rsf=1.0):
    per = case["num_experts"] // world
    used = 0.0
    for r, out in enumerate(outs):
        mine = _slice_tokens(case, bounds[r], bounds[r + 1])
        base = {k: v for k, v in mine.items() if k not in ("num_local_experts", "local_expert_offset")}
        acc = None
        for d in range(world):  # owner d's partial of rank r's tokens
            part = ops.fused_moe(**{**base, **_experts(case, d * per, (d + 1) * per)}, num_local_experts=per,
                                 local_expert_offset=d * per, deterministic=False, routed_scaling_factor=rsf,
                                 output_dtype=output_dtype)
            acc = part.astype(np.float32) if acc is None else acc + part.astype(np.float32)
        want = acc.astype(_np_dtype(output_dtype))
        out = np.asarray(out)
        assert out.shape == want.shape and out.dtype == want.dtype
        np.testing.assert_array_equal(_bits(out), _bits(want), err_msg=f"rank {r}: not the rank-order partial sum")
        full = ops.fused_moe(**base, deterministic=False, routed_scaling_factor=rsf, output_dtype=output_dtype)
        g, f = out.astype(np.float64), full.astype(np.float64)
        if f.size:
            rel = np.sqrt(np.mean((g - f) ** 2)) / max(np.sqrt(np.mean(f ** 2)), 1e-30)
            assert rel <= 1e-2, f"rank {r}: rel RMS {rel:.3g} against fused_moe over all experts"
        used += float(np.abs(f).sum())
    assert used > 0, "every output is zero: the case tests nothing"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["throughput", "low_latency"])
def test_uniform_routing(world, mode):
    sizes = [5, 3, 4, 6][:world]
    ids, wts = _routing(sum(sizes), 4, 8, seed=510 + world)
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    bounds = _bounds(sizes)
    _check(case, bounds, world, _run(case, bounds, world, mode, capacity=6))


@pytest.mark.parametrize("mode", ["throughput", "low_latency"])
def test_skewed_routing_empty_rank_and_scaling_factor(mode):
    world, sizes = 4, [6, 0, 5, 2]  # rank 1 brings no token
    ids, wts = _routing(sum(sizes), 3, 16, seed=520, hot_lo=4, hot_hi=8, hot_share=0.8)
    case = _case("w4a8_int4", ids, wts, num_experts=16)
    bounds = _bounds(sizes)
    _check(case, bounds, world, _run(case, bounds, world, mode, capacity=6, rsf=2.5), rsf=2.5)


@pytest.mark.parametrize("output_dtype", ["bfloat16", "float16", "float32"])
def test_output_dtypes_and_invalid_ids(output_dtype):
    world, sizes = 2, [5, 4]
    ids, wts = _routing(sum(sizes), 2, 8, seed=530)
    ids[0, 1], ids[3, 0] = -1, 8  # dropped slots
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    bounds = _bounds(sizes)
    for mode in ("throughput", "low_latency"):
        _check(case, bounds, world, _run(case, bounds, world, mode, capacity=5, output_dtype=output_dtype),
               output_dtype=output_dtype)


@pytest.mark.parametrize("quant_mode", ["w4a16_int4", "w4a16", "w4a4", "w4a8"])
def test_other_quant_modes(quant_mode):
    world, sizes = 2, [4, 5]
    ids, wts = _routing(sum(sizes), 2, 8, seed=540)
    case = _case(quant_mode, ids, wts, num_experts=8)
    bounds = _bounds(sizes)
    _check(case, bounds, world, _run(case, bounds, world, "low_latency", capacity=5))


def test_torch_cpu_tensors_and_given_out():
    torch = pytest.importorskip("torch")
    world, sizes = 2, [5, 4]
    ids, wts = _routing(sum(sizes), 4, 8, seed=550)
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    bounds = _bounds(sizes)

    to = _to_torch

    for mode in ("throughput", "low_latency"):
        outs = _run(case, bounds, world, mode, capacity=5, to=to)
        assert all(isinstance(o, torch.Tensor) for o in outs)
        _check(case, bounds, world, [o.view(torch.int16).numpy().view(ml_dtypes.bfloat16) for o in outs])

    def rank_fn(rank, transport):  # out= is written in place
        mine = _slice_tokens(case, bounds[rank], bounds[rank + 1])
        w = _experts(case, rank * 4, (rank + 1) * 4)
        layer = ExpertParallelMoE(world, rank, 8, transport=transport)
        out = np.full((bounds[rank + 1] - bounds[rank], case["w2"].shape[1]), np.nan, ml_dtypes.bfloat16)
        got = layer.forward(mine["x"], mine["topk_ids"], mine["topk_weights"], w["w1"], w["w1_scale"], w["w2"],
                            w["w2_scale"], w1_alpha=w["w1_alpha"], w2_alpha=w["w2_alpha"], x_scale=mine["x_scale"],
                            fc2_input_scale=mine["fc2_input_scale"], mode="low_latency", max_tokens_per_rank=5,
                            out=out, deterministic=False)
        assert got is out
        return out

    _check(case, bounds, world, run_loopback(world, rank_fn))


def test_errors_before_any_exchange():
    ids, wts = _routing(5, 2, 8, seed=560)
    case = _case("w4a8_int4", ids, wts, num_experts=8)

    class NoExchange:
        world_size, rank = 2, 0

        def all_to_all(self, *a, **k):
            raise AssertionError("an exchange started before the argument check")

    layer = ExpertParallelMoE(2, 0, 8, transport=NoExchange())
    w = _experts(case, 0, 4)
    args = (case["x"], case["topk_ids"], case["topk_weights"], w["w1"], w["w1_scale"], w["w2"], w["w2_scale"])
    kw = dict(x_scale=case["x_scale"], fc2_input_scale=case["fc2_input_scale"], mode="low_latency",
              max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="'chunks'"):
        layer.forward(*args, **kw, chunks=2, deterministic=False)
    with pytest.raises(ValueError, match="'topk_weights'"):
        layer.forward(*args[:2], case["topk_weights"][:, :1], *args[3:], **kw, deterministic=False)
    with pytest.raises(TypeError, match="'deterministic'"):
        layer.forward(*args, **kw, deterministic="no")
