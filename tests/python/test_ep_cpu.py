"""Expert parallelism on the CPU (python/qmoe/ep.py, docs/expert-parallel.md): W ranks simulated by the
loopback transport, each with its own tokens; every rank's EP output must equal
qmoe.fused_moe(all experts, deterministic=True) on that rank's tokens BIT FOR BIT. Also: the split
entry points (moe_expert_rows + moe_finalize == deterministic fused_moe), the plan binding, the scale
rule and capacity errors, and the NCCL loader's behaviour without a GPU."""
import os
import subprocess
import sys

import numpy as np
import pytest

import qmoe
from qmoe import _C, ops
from qmoe import testing as qt
from qmoe.ep import ExpertParallelMoE
from qmoe.ep_transport import LoopbackGroup, nccl_available, run_loopback

H, I = 256, 128


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _case(mode, ids, wts, seed=0, **kw):
    return qt.make_fused_moe_case(mode, ids.shape[0], H, I, int(kw.pop("num_experts")), ids.shape[1], seed,
                                  routing=(ids, wts), **kw)


def _slice_tokens(case, lo, hi):
    """The case restricted to tokens [lo, hi) (what one rank holds)."""
    out = dict(case)
    out["topk_ids"], out["topk_weights"] = case["topk_ids"][lo:hi], case["topk_weights"][lo:hi]
    total = case["topk_ids"].shape[0]
    for key in ("x", "x_scale", "per_token_scale"):
        v = case.get(key)
        if v is not None and np.shape(v)[0] == total and not (key == "x_scale" and np.size(v) == 1):
            out[key] = np.ascontiguousarray(v[lo:hi])
    return out


def _single(case, **kw):
    args = {k: v for k, v in case.items() if k not in ("num_local_experts", "local_expert_offset")}
    return ops.fused_moe(**args, deterministic=True, **kw)


def _run_ep(case, bounds, world, mode="throughput", max_tokens_per_rank=None, rsf=1.0, output_dtype="bfloat16",
            drop=(), group_calls=None, **layer_options):
    """Each rank r holds tokens [bounds[r], bounds[r+1]) and weights of experts [r*E/W, (r+1)*E/W)."""
    num_experts = case["num_experts"]
    per = num_experts // world

    def rank_fn(rank, transport):
        mine = _slice_tokens(case, bounds[rank], bounds[rank + 1])
        lo, hi = rank * per, (rank + 1) * per
        weights = {k: (None if case.get(k) is None else case[k][lo:hi])
                   for k in ("w1", "w1_scale", "w2", "w2_scale", "w1_alpha", "w2_alpha")}
        layer = ExpertParallelMoE(world, rank, num_experts, transport=transport, quant_mode=case["quant_mode"],
                                  activation=case["activation"], gate_up_layout=case["gate_up_layout"],
                                  routed_scaling_factor=rsf, output_dtype=output_dtype, **layer_options)
        extra = {k: mine.get(k) for k in ("x_scale", "fc2_input_scale", "per_token_scale") if k not in drop}
        return layer.forward(mine["x"], mine["topk_ids"], mine["topk_weights"], weights["w1"], weights["w1_scale"],
                             weights["w2"], weights["w2_scale"], w1_alpha=weights["w1_alpha"],
                             w2_alpha=weights["w2_alpha"], mode=mode,
                             max_tokens_per_rank=max_tokens_per_rank if mode == "low_latency" else None, **extra)

    return run_loopback(world, rank_fn)


def _check_equal_per_rank(case, bounds, outs, rsf=1.0, output_dtype="bfloat16", drop=()):
    used = 0.0
    for r, out in enumerate(outs):
        mine = _slice_tokens(case, bounds[r], bounds[r + 1])
        for k in drop:
            mine[k] = None
        want = _single(mine, routed_scaling_factor=rsf, output_dtype=output_dtype)
        assert out.shape == want.shape and out.dtype == want.dtype
        np.testing.assert_array_equal(_bits(out), _bits(want), err_msg=f"rank {r}: EP != single-GPU")
        used += float(np.sum(np.abs(want.astype(np.float32))))
    assert used > 0, "every output is zero: the case tests nothing"


def _routing(total, top_k, num_experts, seed, hot_lo=None, hot_hi=None, hot_share=0.0):
    """Random distinct experts per token; hot_share of the slots drawn from [hot_lo, hot_hi)."""
    rng = np.random.default_rng(seed)
    ids = np.empty((total, top_k), np.int32)
    for t in range(total):
        row = []
        while len(row) < top_k:
            e = int(rng.integers(hot_lo, hot_hi)) if hot_lo is not None and rng.random() < hot_share else \
                int(rng.integers(0, num_experts))
            if e not in row:
                row.append(e)
        ids[t] = row
    wts = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    return ids, wts


def _bounds(sizes):
    return np.cumsum([0] + list(sizes)).tolist()


# ---- the split entry points ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["w4a8_int4", "w4a16_int4", "w4a4", "w4a8", "w4a16"])
def test_finalize_of_expert_rows_equals_deterministic_fused_moe(mode):
    ids, wts = _routing(9, 4, 8, seed=3)
    ids[0, 1], ids[2, 3], ids[5, 0] = -1, 8, 1  # invalid, out of range, and (below) non-local
    case = _case(mode, ids, wts, num_experts=8, num_local_experts=4, local_expert_offset=2)
    want = ops.fused_moe(**case, deterministic=True, routed_scaling_factor=1.75)
    rows = qt.poison((9 * 4, H), qt.ref.BF16)
    args = {k: v for k, v in case.items() if k not in ("topk_weights",)}
    ops.moe_expert_rows(**args, rows=rows)
    local = ((ids >= 2) & (ids < 6)).reshape(-1)
    assert local.any() and not local.all()
    assert not qt.poisoned_mask(rows[local]).any(), "a local slot's row was not written"
    assert qt.poisoned_mask(rows[~local]).all(), "a non-local slot's row was written"
    got = ops.moe_finalize(rows, ids, wts, num_experts=8, num_local_experts=4, local_expert_offset=2,
                           routed_scaling_factor=1.75)  # NaN rows of non-local slots must not be read
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_moe_finalize_errors_name_the_argument():
    ids, wts = _routing(3, 2, 4, seed=1)
    rows = np.ones((6, H), qt.ref.BF16)
    with pytest.raises(ValueError, match="'rows'"):
        ops.moe_finalize(rows[:5], ids, wts, num_experts=4)
    with pytest.raises(TypeError, match="'rows'"):
        ops.moe_finalize(rows.astype(np.float32), ids, wts, num_experts=4)
    with pytest.raises(ValueError, match="'num_local_experts'"):
        ops.moe_finalize(rows, ids, wts, num_experts=4, num_local_experts=3, local_expert_offset=2)
    with pytest.raises(ValueError, match="'output'"):
        ops.moe_finalize(rows, ids, wts, num_experts=4, out=np.empty((3, 128), qt.ref.BF16))


def _index_case(seed, tokens=11, top_k=5, experts=10, num_rows=40, hidden=H):
    """Random rows [R, H], routing with dropped slots, and a row index with -1 and out-of-range
    entries; rows no kept slot points at are NaN (the finalize must never read them)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, experts, (tokens, top_k)).astype(np.int32)
    ids[0, 0], ids[1, 2], ids[2, 4] = -1, experts, 77  # dropped by the routing rule
    wts = rng.uniform(-1, 1, (tokens, top_k)).astype(np.float32)
    index = rng.integers(0, num_rows, (tokens, top_k)).astype(np.int32)  # rows may be shared
    index[3, 1], index[4, 0], index[5, 3] = -1, num_rows, -7  # dropped by the index
    rows = qt.ref.round_bf16(rng.standard_normal((num_rows, hidden)).astype(np.float32) * 3)
    kept = (ids >= 2) & (ids < 8) & (index >= 0) & (index < num_rows)  # local range [2, 8) below
    referenced = np.zeros(num_rows, bool)
    referenced[index[kept]] = True
    rows[~referenced] = np.nan
    assert kept.any() and not kept.all() and referenced.any() and not referenced.all()
    return rows, ids, wts, index, kept


@pytest.mark.parametrize("output_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("flat", [True, False])
def test_finalize_with_row_index_equals_finalize_of_gathered_rows(output_dtype, flat):
    """moe_finalize(rows, row_index=i) == moe_finalize(rows[i]) bit for bit; a slot whose index is
    outside [0, R) is dropped like an invalid id (ids set to -1 on the gathered side)."""
    rows, ids, wts, index, kept = _index_case(seed=5)
    kw = dict(num_experts=10, num_local_experts=6, local_expert_offset=2, routed_scaling_factor=1.75,
              output_dtype=output_dtype)
    in_range = (index >= 0) & (index < rows.shape[0])
    gathered = np.full((ids.size, H), np.nan, qt.ref.BF16)
    gathered[in_range.reshape(-1)] = rows[index[in_range]]
    want = ops.moe_finalize(gathered, np.where(in_range, ids, -1).astype(np.int32), wts, **kw)
    out = qt.poison(want.shape, want.dtype)
    got = ops.moe_finalize(rows, ids, wts, **kw, out=out, row_index=index.reshape(-1) if flat else index)
    assert got is out
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert not np.isnan(np.asarray(got, np.float32)).any(), "a row no kept slot points at was read"
    assert np.abs(np.asarray(got, np.float32)).sum() > 0
    # Every index in range: the gathered side needs no id change.
    index_all = np.where(in_range, index, 0).astype(np.int32)
    rows_all = (np.nan_to_num(np.asarray(rows, np.float32)) + 0.5).astype(qt.ref.BF16)
    np.testing.assert_array_equal(_bits(ops.moe_finalize(rows_all, ids, wts, **kw, row_index=index_all)),
                                  _bits(ops.moe_finalize(rows_all[index_all.reshape(-1)], ids, wts, **kw)))


def test_finalize_with_row_index_and_no_rows():
    """R = 0 (a rank that got no row back): every slot is dropped, the output is written as zeros."""
    _, ids, wts, _, _ = _index_case(seed=6)
    out = qt.poison((ids.shape[0], H), qt.ref.BF16)
    got = ops.moe_finalize(np.empty((0, H), qt.ref.BF16), ids, wts, num_experts=10, out=out,
                           row_index=np.full(ids.shape, -1, np.int32))
    assert not qt.poisoned_mask(got).any()
    np.testing.assert_array_equal(np.asarray(got, np.float32), 0.0)


def test_finalize_row_index_errors_name_the_argument():
    rows, ids, wts, index, _ = _index_case(seed=7)
    kw = dict(num_experts=10)
    with pytest.raises(TypeError, match="'row_index'"):
        ops.moe_finalize(rows, ids, wts, **kw, row_index=index.astype(np.int64))
    with pytest.raises(ValueError, match="'row_index'"):
        ops.moe_finalize(rows, ids, wts, **kw, row_index=index[:-1])
    with pytest.raises(ValueError, match="'row_index'"):
        ops.moe_finalize(rows, ids, wts, **kw, row_index=index.reshape(-1)[:-1])
    with pytest.raises(ValueError, match="'row_index'"):
        ops.moe_finalize(rows, ids, wts, **kw, row_index=index.T)  # [k, T]: neither accepted shape
    with pytest.raises(ValueError, match="'row_index'"):
        ops.moe_finalize(rows, ids, wts, **kw, row_index=np.asfortranarray(index))  # not contiguous
    out = qt.poison((ids.shape[0], H), qt.ref.BF16)
    with pytest.raises(ValueError, match="'row_index'"):
        ops.moe_finalize(rows, ids, wts, **kw, row_index=index[:, :-1], out=out)
    assert qt.poisoned_mask(out).all(), "the output was written although validation failed"


def test_moe_expert_rows_error_names_rows():
    ids, wts = _routing(3, 2, 4, seed=1)
    case = _case("w4a8_int4", ids, wts, num_experts=4)
    args = {k: v for k, v in case.items() if k != "topk_weights"}
    with pytest.raises(ValueError, match="'rows'"):
        ops.moe_expert_rows(**args, rows=np.empty((3, H), qt.ref.BF16))


# ---- the plan binding ------------------------------------------------------------------------------

def test_plan_worked_example():
    ids = np.array([[0, 3], [1, 0], [2, 9]], np.int32)
    plan = _C.ep_plan(qmoe._tensors.arg(ids), 4, 2)
    assert plan["send_counts"] == [2, 2] and plan["send_tokens"] == [0, 1, 0, 2]
    assert plan["return_counts"] == [3, 2] and plan["return_slots"] == [0, 2, 3, 1, 4]
    with pytest.raises(ValueError, match="'num_experts'"):
        _C.ep_plan(qmoe._tensors.arg(ids), 6, 4)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_array_plan_matches_the_cpp_plan(world):
    """ep.py plans with array ops (on the GPU for CUDA tensors); it must match include/qmoe/expert_parallel.h:
    send order (grouped by destination, ascending token) and the home position of every returned row."""
    from qmoe import ep

    rng = np.random.default_rng(100 + world)
    num_experts, top_k = 16, 4
    ids = rng.integers(-2, num_experts + 3, size=(23, top_k)).astype(np.int32)  # invalid ids included
    ids[3] = [5, 5, 5, 5]  # one expert four times
    plan = _C.ep_plan(qmoe._tensors.arg(ids), num_experts, world)
    xp = ep._Arrays(ids)
    routing = ep._Routing(xp, ids, num_experts, world)
    assert routing.send_counts.tolist() == plan["send_counts"]
    assert routing.return_counts.tolist() == plan["return_counts"]
    base = np.asarray(plan["send_offsets"][:-1], np.int64)
    src = ep._send_index(xp, routing, base, plan["send_offsets"][-1])
    assert src.tolist() == plan["send_tokens"]
    # Low-latency positions: token i of d's list at d*C + i, the pad row (T) elsewhere.
    capacity = 23
    src_ll = ep._send_index(xp, routing, np.arange(world) * capacity, world * capacity)
    for d in range(world):
        mine = plan["send_tokens"][plan["send_offsets"][d]:plan["send_offsets"][d + 1]]
        got = src_ll[d * capacity:(d + 1) * capacity].tolist()
        assert got == mine + [23] * (capacity - len(mine))
    # Owner side: the C++ owner order, from the receive buffers the plan implies.
    for owner in range(world):
        lo, hi = plan["send_offsets"][owner], plan["send_offsets"][owner + 1]
        recv_ids = ids[plan["send_tokens"][lo:hi]]
        want = _C.ep_owner_return_slots(qmoe._tensors.arg(np.ascontiguousarray(recv_ids)), num_experts, world, owner)
        per = num_experts // world
        flat = recv_ids.reshape(-1).astype(np.int64)
        owned = (flat >= owner * per) & (flat < (owner + 1) * per)
        assert np.flatnonzero(owned).tolist() == list(want)
    # Home side: where each slot's row sits in the combine's receive buffer (the finalize's row_index).
    valid = ((ids >= 0) & (ids < num_experts)).reshape(-1)
    index = routing.throughput_row_index(xp)
    assert index.dtype == np.int32 and index.shape == (23 * top_k,)
    want_index = np.full(23 * top_k, -1, np.int32)
    want_index[np.asarray(plan["return_slots"], np.int64)] = np.arange(len(plan["return_slots"]))
    np.testing.assert_array_equal(index, want_index)
    assert (index[valid] >= 0).all() and (index[~valid] == -1).all()
    index_ll = routing.low_latency_row_index(xp, capacity)
    want_ll = np.full(23 * top_k, -1, np.int32)
    for d in range(world):
        mine = plan["send_tokens"][plan["send_offsets"][d]:plan["send_offsets"][d + 1]]
        for position, t in enumerate(mine):
            for j in range(top_k):
                if valid[t * top_k + j] and ids[t, j] // (num_experts // world) == d:
                    want_ll[t * top_k + j] = (d * capacity + position) * top_k + j
    np.testing.assert_array_equal(index_ll, want_ll)


def _torch_or_skip():
    return pytest.importorskip("torch")


def _to_torch(a):
    """A numpy array as a torch CPU tensor sharing its bytes (bf16 and e4m3 reinterpreted); others as given."""
    import torch

    if a is None or not isinstance(a, np.ndarray):
        return a
    a = np.ascontiguousarray(a)
    if a.dtype == qt.ref.BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype.itemsize == 1 and a.dtype.kind not in "iu":
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(a)


@pytest.mark.parametrize("mode", ["throughput", "low_latency"])
@pytest.mark.parametrize("quant_mode", ["w4a8_int4", "w4a4"])
def test_torch_cpu_tensors_take_the_same_path(mode, quant_mode):
    """The torch branch of ep.py's array ops (the one CUDA tensors take, minus NCCL) on torch CPU tensors."""
    torch = _torch_or_skip()
    world, sizes = 2, [5, 4]
    ids, wts = _routing(9, 4, 8, seed=110)
    case = _case(quant_mode, ids, wts, num_experts=8)
    bounds = _bounds(sizes)

    to_torch = _to_torch

    def rank_fn(rank, transport):
        mine = _slice_tokens(case, bounds[rank], bounds[rank + 1])
        lo, hi = rank * 4, (rank + 1) * 4
        w = {k: (None if case.get(k) is None else to_torch(case[k][lo:hi]))
             for k in ("w1", "w1_scale", "w2", "w2_scale", "w1_alpha", "w2_alpha")}
        layer = ExpertParallelMoE(world, rank, 8, transport=transport, quant_mode=quant_mode,
                                  activation=case["activation"], gate_up_layout=case["gate_up_layout"])
        extra = {k: to_torch(mine.get(k)) for k in ("x_scale", "fc2_input_scale", "per_token_scale")}
        out = layer.forward(to_torch(mine["x"]), to_torch(mine["topk_ids"]).long(), to_torch(mine["topk_weights"]),
                            w["w1"], w["w1_scale"], w["w2"], w["w2_scale"], w1_alpha=w["w1_alpha"],
                            w2_alpha=w["w2_alpha"], mode=mode,
                            max_tokens_per_rank=5 if mode == "low_latency" else None, **extra)
        assert isinstance(out, torch.Tensor)
        return out.view(torch.int16).numpy().view(qt.ref.BF16)

    _check_equal_per_rank(case, bounds, run_loopback(world, rank_fn))


# ---- EP == single GPU, bit for bit -----------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["throughput", "low_latency"])
def test_uniform_routing(world, mode):
    sizes = [5, 3, 4, 6][:world]
    ids, wts = _routing(sum(sizes), 4, 8, seed=10 + world)
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    bounds = _bounds(sizes)
    outs = _run_ep(case, bounds, world, mode, max_tokens_per_rank=6 if mode == "low_latency" else None)
    _check_equal_per_rank(case, bounds, outs)
    # Static a1/a2: the ranks' outputs together are also the single-GPU output of the whole batch.
    np.testing.assert_array_equal(_bits(np.concatenate(outs)), _bits(_single(case)))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["throughput", "low_latency"])
def test_skewed_routing_80_percent_to_one_rank(world, mode):
    sizes = [7] * world
    per = 16 // world
    ids, wts = _routing(sum(sizes), 4, 16, seed=20 + world, hot_lo=per, hot_hi=2 * per, hot_share=0.8)
    owners = ids // per
    assert np.mean(owners == 1) > 0.6  # rank 1's experts take most slots
    case = _case("w4a8_int4", ids, wts, num_experts=16)
    bounds = _bounds(sizes)
    _check_equal_per_rank(case, bounds, _run_ep(case, bounds, world, mode, max_tokens_per_rank=8))


@pytest.mark.parametrize("mode", ["throughput", "low_latency"])
def test_a_rank_receives_no_tokens(mode):
    world, sizes = 4, [4, 5, 3, 2]
    ids, wts = _routing(sum(sizes), 2, 6, seed=30)  # experts 0..5 of 8: rank 3 (experts 6, 7) gets nothing
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    assert not (ids >= 6).any()
    bounds = _bounds(sizes)
    _check_equal_per_rank(case, bounds, _run_ep(case, bounds, world, mode, max_tokens_per_rank=5))


@pytest.mark.parametrize("mode", ["throughput", "low_latency"])
def test_one_token_per_rank_and_scaling_factor(mode):
    world = 4
    ids, wts = _routing(world, 3, 8, seed=40)
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    bounds = _bounds([1] * world)
    outs = _run_ep(case, bounds, world, mode, max_tokens_per_rank=1, rsf=2.5, output_dtype="float32")
    _check_equal_per_rank(case, bounds, outs, rsf=2.5, output_dtype="float32")


def test_invalid_ids_and_repeated_expert():
    world, sizes = 2, [4, 4]
    ids, wts = _routing(8, 4, 8, seed=50)
    ids[0, 0], ids[3, 2], ids[6, 1] = -1, 8, 100
    ids[1] = [5, 5, 5, 2]  # the same expert three times counts three times
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    bounds = _bounds(sizes)
    _check_equal_per_rank(case, bounds, _run_ep(case, bounds, world))


@pytest.mark.parametrize("a1", ["per_token", "dynamic", "e4m3_input"])
def test_a1_variants_travel_with_the_tokens(a1):
    world, sizes = 2, [6, 5]
    ids, wts = _routing(11, 4, 8, seed=60)
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    drop = ()
    if a1 == "per_token":
        case["x_scale"] = (np.abs(case["x"].astype(np.float32)).max(axis=1) / 448).astype(np.float32)
    elif a1 == "dynamic":  # amax over each HOME rank's x: equals fused_moe on that rank's tokens
        drop = ("x_scale",)
    else:
        case["x"], scale = qmoe.quant.quantize_fp8(case["x"], per_token=True)
        case["x_scale"] = scale.reshape(-1)
    bounds = _bounds(sizes)
    _check_equal_per_rank(case, bounds, _run_ep(case, bounds, world, drop=drop), drop=drop)


@pytest.mark.parametrize("mode", ["w4a16_int4", "w4a4", "w4a4_per_token", "w4a8", "w4a16"])
def test_other_quant_modes(mode):
    per_token = mode == "w4a4_per_token"
    quant_mode = "w4a4" if per_token else mode
    world, sizes = 2, [5, 4]
    ids, wts = _routing(9, 4, 8, seed=70)
    case = _case(quant_mode, ids, wts, num_experts=8, per_token=per_token)
    bounds = _bounds(sizes)
    for ep_mode in ("throughput", "low_latency"):
        _check_equal_per_rank(case, bounds, _run_ep(case, bounds, world, ep_mode, max_tokens_per_rank=5))


@pytest.mark.parametrize("mode", ["w4a4", "w4a8"])
def test_packed_fp4_weights(mode):
    """Every rank's local experts with packed FP4 words (qmoe.quant.pack_fp4_weights) and fp4_weights_packed=True:
    the same bits as single-GPU fused_moe on the plain weights, in both EP modes."""
    world, sizes = 2, [6, 3]
    ids, wts = _routing(9, 4, 8, seed=71)
    case = _case(mode, ids, wts, num_experts=8)
    packed = dict(case, w1=qmoe.quant.pack_fp4_weights(case["w1"]), w2=qmoe.quant.pack_fp4_weights(case["w2"]))
    bounds = _bounds(sizes)
    for ep_mode in ("throughput", "low_latency"):
        outs = _run_ep(packed, bounds, world, ep_mode, max_tokens_per_rank=6, fp4_weights_packed=True)
        _check_equal_per_rank(case, bounds, outs)


# ---- the rules ----------------------------------------------------------------------------------------

def test_dynamic_a2_is_refused_with_a_clear_error():
    ids, wts = _routing(4, 2, 4, seed=80)
    case = _case("w4a8_int4", ids, wts, num_experts=4)
    with pytest.raises(ValueError, match="'fc2_input_scale'.*static a2"):
        _run_ep(case, _bounds([2, 2]), 2, drop=("fc2_input_scale",))


def test_low_latency_capacity_error_names_max_tokens_per_rank():
    ids, wts = _routing(7, 2, 4, seed=90)
    case = _case("w4a8_int4", ids, wts, num_experts=4)
    with pytest.raises(ValueError, match="'max_tokens_per_rank'.*T = 4"):
        _run_ep(case, _bounds([3, 4]), 2, "low_latency", max_tokens_per_rank=3)  # rank 1 holds 4 tokens
    with pytest.raises(ValueError, match="'max_tokens_per_rank'"):
        _run_ep(case, _bounds([3, 4]), 2, "low_latency", max_tokens_per_rank=None)


def test_max_tokens_per_rank_is_refused_in_throughput_mode():
    group = LoopbackGroup(1)
    ids, wts = _routing(2, 2, 4, seed=92)
    case = _case("w4a8_int4", ids, wts, num_experts=4)
    layer = ExpertParallelMoE(1, 0, 4, transport=group.transport(0))
    with pytest.raises(ValueError, match="'max_tokens_per_rank'"):
        layer.forward(case["x"], ids, wts, case["w1"], case["w1_scale"], case["w2"], case["w2_scale"],
                      x_scale=case["x_scale"], fc2_input_scale=case["fc2_input_scale"], max_tokens_per_rank=4)


def test_low_latency_exchanges_no_counts():
    """Throughput: counts + one packed dispatch (e4m3 x, a1, topk_ids in one byte row) + rows back;
    low latency: no counts."""
    ids, wts = _routing(6, 2, 4, seed=91)
    case = _case("w4a8_int4", ids, wts, num_experts=4)
    calls = {}
    for mode in ("throughput", "low_latency"):
        group = LoopbackGroup(2)

        def rank_fn(rank, transport, mode=mode):
            mine = _slice_tokens(case, 3 * rank, 3 * rank + 3)
            layer = ExpertParallelMoE(2, rank, 4, transport=transport)
            sl = slice(2 * rank, 2 * rank + 2)
            return layer.forward(mine["x"], mine["topk_ids"], mine["topk_weights"], case["w1"][sl],
                                 case["w1_scale"][sl], case["w2"][sl], case["w2_scale"][sl],
                                 x_scale=case["x_scale"], fc2_input_scale=case["fc2_input_scale"], mode=mode,
                                 max_tokens_per_rank=3 if mode == "low_latency" else None)

        outs = run_loopback(2, rank_fn, group=group)
        _check_equal_per_rank(case, [0, 3, 6], outs)
        calls[mode] = group.calls
    assert calls == {"throughput": 3, "low_latency": 2}


def test_constructor_checks():
    group = LoopbackGroup(2)
    with pytest.raises(ValueError, match="'num_experts'"):
        ExpertParallelMoE(2, 0, 7, transport=group.transport(0))
    with pytest.raises(ValueError, match="'transport'"):
        ExpertParallelMoE(2, 0, 8, transport=group.transport(1))
    with pytest.raises(ValueError, match="'quant_mode'"):
        ExpertParallelMoE(2, 0, 8, transport=group.transport(0), quant_mode="fp8")
    for bad in (-1, 2.5, True, "16"):
        with pytest.raises(ValueError, match="'comm_sms'"):
            ExpertParallelMoE(2, 0, 8, transport=group.transport(0), comm_sms=bad)
    assert ExpertParallelMoE(2, 0, 8, transport=group.transport(0)).comm_sms == 16
    assert ExpertParallelMoE(2, 0, 8, transport=group.transport(0), comm_sms=np.int64(0)).comm_sms == 0
    with pytest.raises(ValueError, match="'low_latency_engine'"):
        ExpertParallelMoE(2, 0, 8, transport=group.transport(0), low_latency_engine="cuda")


def test_chunked_forward_on_the_cpu_leaves_the_sm_limit_alone():
    """comm_sms limits the GEMMs of a chunked forward on CUDA tensors only (qmoe.limit_sms); on the CPU
    the caller's own limit stays as it was, during and after the call, and the bits do not change."""
    ids, wts = _routing(6, 2, 4, seed=221)
    case = _case("w4a8_int4", ids, wts, num_experts=4)
    layer = ExpertParallelMoE(1, 0, 4, transport=LoopbackGroup(1).transport(0), comm_sms=8)
    assert layer._expert_sm_limit(case["x"]) is None
    base = (case["x"], ids, wts, case["w1"], case["w1_scale"], case["w2"], case["w2_scale"])
    kw = dict(x_scale=case["x_scale"], fc2_input_scale=case["fc2_input_scale"])
    with qmoe.limit_sms(3):
        got = layer.forward(*base, **kw, mode="low_latency", max_tokens_per_rank=6, chunks=2)
        assert qmoe.sm_limit() == 3
    np.testing.assert_array_equal(_bits(got), _bits(_single(case)))


# ---- NCCL loader (no GPU needed) ----------------------------------------------------------------------

def test_nccl_all_to_all_checks_arguments_before_loading():
    with pytest.raises(ValueError, match="'comm'"):
        _C.nccl_all_to_all_v(0, [], [], 0)


def test_nccl_missing_library_is_a_clear_error():
    code = ("import qmoe\nfrom qmoe import _C\nassert not _C.nccl_available()\n"
            "try:\n    _C.nccl_version()\nexcept RuntimeError as e:\n    print(e)\n")
    env = dict(os.environ, QMOE_NCCL_LIBRARY="/nonexistent/libnccl.so.2")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "'nccl'" in res.stdout and "/nonexistent/libnccl.so.2" in res.stdout and "QMOE_NCCL_LIBRARY" in res.stdout


def test_nccl_loads_when_installed():
    if not nccl_available():
        pytest.skip("no libnccl on this machine")
    assert _C.nccl_version() >= 20700  # send/recv need NCCL >= 2.7
    assert "nccl" in _C.nccl_library()


# ---- chunks: the low-latency layer pipelined over token chunks (bitwise == chunks=1 == single GPU) ----

def _run_ep_chunks(case, bounds, world, capacity, chunks, drop=(), tactic=None, out_of=None, to_framework=None):
    """Low-latency EP with forward(chunks=...); returns (outputs, per-rank (last_chunks, last_tactic),
    exchanges made). to_framework: converts the rank's arrays (torch CPU tensors)."""
    num_experts = case["num_experts"]
    per = num_experts // world
    conv = to_framework or (lambda a: a)
    group = LoopbackGroup(world)
    used = [None] * world

    def rank_fn(rank, transport):
        mine = _slice_tokens(case, bounds[rank], bounds[rank + 1])
        lo, hi = rank * per, (rank + 1) * per
        w = {k: (None if case.get(k) is None else conv(case[k][lo:hi]))
             for k in ("w1", "w1_scale", "w2", "w2_scale", "w1_alpha", "w2_alpha")}
        layer = ExpertParallelMoE(world, rank, num_experts, transport=transport, quant_mode=case["quant_mode"],
                                  activation=case["activation"], gate_up_layout=case["gate_up_layout"])
        extra = {k: conv(mine.get(k)) for k in ("x_scale", "fc2_input_scale", "per_token_scale") if k not in drop}
        out = layer.forward(conv(mine["x"]), conv(mine["topk_ids"]), conv(mine["topk_weights"]), w["w1"],
                            w["w1_scale"], w["w2"], w["w2_scale"], w1_alpha=w["w1_alpha"], w2_alpha=w["w2_alpha"],
                            mode="low_latency", max_tokens_per_rank=capacity, chunks=chunks, tactic=tactic,
                            out=None if out_of is None else out_of(rank), **extra)
        used[rank] = (layer.last_chunks, layer.last_tactic)
        return out

    outs = run_loopback(world, rank_fn, group=group)
    return outs, used, group.calls


@pytest.mark.parametrize("world, sizes, capacity", [(2, [7, 5], 7), (4, [7, 5, 2, 0], 7), (2, [1, 2], 2),
                                                    (4, [0, 1, 0, 2], 3)])
def test_chunks_are_bitwise_chunks_1_and_single_gpu(world, sizes, capacity):
    """chunks in {1, 2, 3}: uneven chunk sizes (T not divisible), T < chunks (empty chunks), a rank
    holding no token; every chunk is exchanged on every rank (2 exchanges per chunk)."""
    ids, wts = _routing(sum(sizes), 4, 8, seed=120 + world + capacity)
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    bounds = _bounds(sizes)
    first, _, calls = _run_ep_chunks(case, bounds, world, capacity, chunks=1)
    assert calls == 2
    _check_equal_per_rank(case, bounds, first)
    for chunks in (2, 3):
        outs, used, calls = _run_ep_chunks(case, bounds, world, capacity, chunks)
        assert calls == 2 * chunks and all(u[0] == chunks for u in used)
        _check_equal_per_rank(case, bounds, outs)
        for a, b in zip(outs, first):
            np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("chunks", [2, 3])
def test_chunks_with_a_rank_receiving_no_tokens_and_skewed_routing(chunks):
    world, sizes = 4, [6, 5, 7, 4]
    ids, wts = _routing(sum(sizes), 2, 6, seed=130)  # experts 0..5 of 8: rank 3 receives nothing
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    bounds = _bounds(sizes)
    _check_equal_per_rank(case, bounds, _run_ep_chunks(case, bounds, world, 8, chunks)[0])
    ids, wts = _routing(14, 4, 16, seed=131, hot_lo=8, hot_hi=16, hot_share=0.8)
    case = _case("w4a8_int4", ids, wts, num_experts=16)
    _check_equal_per_rank(case, [0, 9, 14], _run_ep_chunks(case, [0, 9, 14], 2, 9, chunks)[0])


def test_chunks_keep_the_whole_batch_dynamic_a1():
    """Dynamic a1 is the amax over the rank's WHOLE x (as fused_moe on its tokens), not per chunk;
    the chunks' own amaxes differ here, so a per-chunk quantization would not be bitwise."""
    world, sizes = 2, [8, 7]
    ids, wts = _routing(15, 4, 8, seed=140)
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    case["x"] = case["x"].copy()
    case["x"][1] = (case["x"][1].astype(np.float32) * 6).astype(case["x"].dtype)  # chunk 0 of rank 0: larger amax
    bounds = _bounds(sizes)
    amax = [np.abs(case["x"][a:b].astype(np.float32)).max() for a, b in ((0, 4), (4, 8))]
    assert amax[0] > 2 * amax[1]
    outs = _run_ep_chunks(case, bounds, world, 8, 2, drop=("x_scale",))[0]
    _check_equal_per_rank(case, bounds, outs, drop=("x_scale",))


@pytest.mark.parametrize("mode", ["w4a16_int4", "w4a4_per_token", "w4a8", "w4a16"])
def test_chunks_other_quant_modes(mode):
    per_token = mode == "w4a4_per_token"
    quant_mode = "w4a4" if per_token else mode
    ids, wts = _routing(11, 4, 8, seed=150)
    case = _case(quant_mode, ids, wts, num_experts=8, per_token=per_token)
    bounds = _bounds([6, 5])
    _check_equal_per_rank(case, bounds, _run_ep_chunks(case, bounds, 2, 6, 3)[0])


@pytest.mark.parametrize("quant_mode", ["w4a8_int4", "w4a4"])
def test_chunks_on_torch_cpu_tensors(quant_mode):
    """The torch branch of the chunk plan (the one CUDA tensors take, minus the side stream)."""
    torch = _torch_or_skip()
    ids, wts = _routing(13, 4, 8, seed=160)
    case = _case(quant_mode, ids, wts, num_experts=8)
    bounds = _bounds([7, 6])

    to_torch = _to_torch

    for chunks in (2, 3):
        outs, used, calls = _run_ep_chunks(case, bounds, 2, 7, chunks, to_framework=to_torch)
        assert calls == 2 * chunks and all(isinstance(o, torch.Tensor) for o in outs)
        _check_equal_per_rank(case, bounds, [o.view(torch.int16).numpy().view(qt.ref.BF16) for o in outs])


def test_chunks_write_into_the_given_out():
    ids, wts = _routing(9, 4, 8, seed=170)
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    bounds = _bounds([5, 4])
    buffers = [qt.poison((5, H), qt.ref.BF16), qt.poison((4, H), qt.ref.BF16)]
    outs = _run_ep_chunks(case, bounds, 2, 5, 2, out_of=lambda r: buffers[r])[0]
    assert all(o is b for o, b in zip(outs, buffers)) and not any(qt.poisoned_mask(b).any() for b in buffers)
    _check_equal_per_rank(case, bounds, outs)


def test_chunks_pin_one_tactic_for_every_chunk(monkeypatch):
    """tactic=None: every chunk's moe_expert_rows gets the tactic the heuristic picks for the
    UNCHUNKED owner call (W * max_tokens_per_rank rows of k slots over E/W experts); a caller's tactic
    passes through to every chunk. The CPU engine takes no tactic, so the GPU rule is switched on and
    the recorded name dropped before the reference runs."""
    from qmoe import ep

    seen, real = [], ops.moe_expert_rows

    def recording(*args, tactic=None, **kw):
        seen.append(tactic)
        return real(*args, tactic=None, **kw)

    monkeypatch.setattr(ep.ops, "moe_expert_rows", recording)
    monkeypatch.setattr(ep, "_engine_takes_tactics", lambda x: True)
    world, capacity, top_k = 2, 6, 4
    ids, wts = _routing(11, top_k, 8, seed=180)
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    bounds = _bounds([6, 5])
    want = ops.select_tactic(2 * I, H, world * capacity * top_k, 8 // world, top_k)
    assert want == ops.select_tactic(H, I, world * capacity * top_k, 8 // world, top_k)
    # The per-chunk problem alone would pick another tactic here: pinning matters.
    assert ops.select_tactic(2 * I, H, world * 2 * top_k, 8 // world, top_k) != want
    outs, used, _ = _run_ep_chunks(case, bounds, world, capacity, 3)
    assert seen == [want] * (3 * world) and used == [(3, want)] * world
    _check_equal_per_rank(case, bounds, outs)
    seen.clear()
    outs, used, _ = _run_ep_chunks(case, bounds, world, capacity, 2, tactic="decode_m128_n16_k256")
    assert seen == ["decode_m128_n16_k256"] * (2 * world) and used == [(2, "decode_m128_n16_k256")] * world
    _check_equal_per_rank(case, bounds, outs)
    seen.clear()
    _run_ep_chunks(case, bounds, world, capacity, 1)  # chunks=1: today's call, the heuristic per call
    assert seen == [None] * world


def test_pinned_tactic_is_the_heuristic_of_both_gemms_or_none():
    from qmoe.ep import pinned_tactic

    for quant_mode, bf16, fp4 in (("w4a8_int4", False, False), ("w4a16", True, True), ("w4a16_int4", True, False)):
        for tokens in (1, 8, 64, 512, 8192):
            got = pinned_tactic(quant_mode, "swiglu", 7168, 2048, tokens, 8, 128)
            first = ops.select_tactic(4096, 7168, tokens * 8, 128, 8, bf16, fp4)
            second = ops.select_tactic(7168, 2048, tokens * 8, 128, 8, bf16, fp4)
            assert got == (first if first == second else None)
    # Qwen3-235B-like GEMMs (N1 = 3072: 24 tiles, N2 = 4096: 32 tiles) at 5 slots over 64 experts:
    # the decode grid rule picks half-height tiles for GEMM1 only -> no single name pins both.
    first = ops.select_tactic(3072, 4096, 5, 64, 1)
    second = ops.select_tactic(4096, 1536, 5, 64, 1)
    assert first != second
    assert pinned_tactic("w4a8_int4", "swiglu", 4096, 1536, 5, 1, 64) is None
    # relu2: GEMM1 has N = I rows (not 2I): H = I = 3072 gives the same pick for both GEMMs, swiglu not.
    assert pinned_tactic("w4a8_int4", "relu2", 3072, 3072, 5, 1, 64) == ops.select_tactic(3072, 3072, 5, 64, 1)
    assert pinned_tactic("w4a8_int4", "swiglu", 3072, 3072, 5, 1, 64) is None


def test_chunks_fall_back_to_one_when_no_tactic_pins_both_gemms(monkeypatch):
    from qmoe import ep

    monkeypatch.setattr(ep, "pinned_tactic", lambda *a: None)
    ids, wts = _routing(9, 4, 8, seed=190)
    case = _case("w4a8_int4", ids, wts, num_experts=8)
    bounds = _bounds([5, 4])
    outs, used, calls = _run_ep_chunks(case, bounds, 2, 5, 2)
    assert calls == 2 and used == [(1, None)] * 2
    _check_equal_per_rank(case, bounds, outs)


def test_chunk_capacity_fits_every_chunk():
    """Capacity per chunk = ceil(max_tokens_per_rank / chunks); chunk c = [c*T//n, (c+1)*T//n)."""
    from qmoe.ep import chunk_bounds, chunk_capacity

    for capacity in range(1, 13):
        for tokens in range(0, capacity + 1):
            for chunks in range(1, 6):
                b = chunk_bounds(tokens, chunks)
                assert b[0] == 0 and b[-1] == tokens and len(b) == chunks + 1
                sizes = [hi - lo for lo, hi in zip(b, b[1:])]
                assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
                assert max(sizes) <= chunk_capacity(capacity, chunks) == -(-capacity // chunks)


@pytest.mark.parametrize("chunks", [2, 3])
def test_chunks_capacity_error_before_any_exchange(chunks):
    """T > max_tokens_per_rank is refused per layer call (not per chunk) whatever the chunk count:
    every rank refuses before its first exchange."""
    ids, wts = _routing(10, 2, 4, seed=200)
    case = _case("w4a8_int4", ids, wts, num_experts=4)
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        mine = _slice_tokens(case, 5 * rank, 5 * rank + 5)
        layer = ExpertParallelMoE(2, rank, 4, transport=transport)
        sl = slice(2 * rank, 2 * rank + 2)
        return layer.forward(mine["x"], mine["topk_ids"], mine["topk_weights"], case["w1"][sl], case["w1_scale"][sl],
                             case["w2"][sl], case["w2_scale"][sl], x_scale=case["x_scale"],
                             fc2_input_scale=case["fc2_input_scale"], mode="low_latency", max_tokens_per_rank=4,
                             chunks=chunks)

    with pytest.raises(ValueError, match="'max_tokens_per_rank'.*T = 5"):
        run_loopback(2, rank_fn, group=group)
    assert group.calls == 0


def test_default_is_one_chunk():
    """chunks=None: one chunk (chunking is opt-in until measured on GPUs), whatever the capacity;
    the throughput mode never chunks."""
    ids, wts = _routing(5, 2, 4, seed=210)
    case = _case("w4a8_int4", ids, wts, num_experts=4)
    bounds = _bounds([3, 2])
    for capacity in (1024, 1023):
        outs, used, calls = _run_ep_chunks(case, bounds, 2, capacity, None)
        assert used[0][0] == 1 and calls == 2
        _check_equal_per_rank(case, bounds, outs)
    layer = ExpertParallelMoE(1, 0, 4, transport=LoopbackGroup(1).transport(0))
    assert layer._resolve_chunks(None, "throughput", None) == 1


def test_chunks_argument_errors_before_any_exchange():
    ids, wts = _routing(6, 2, 4, seed=220)
    case = _case("w4a8_int4", ids, wts, num_experts=4)
    group = LoopbackGroup(1)
    layer = ExpertParallelMoE(1, 0, 4, transport=group.transport(0))
    base = (case["x"], ids, wts, case["w1"], case["w1_scale"], case["w2"], case["w2_scale"])
    kw = dict(x_scale=case["x_scale"], fc2_input_scale=case["fc2_input_scale"])
    for bad in (0, -1, 2.5, True, "2"):
        with pytest.raises(ValueError, match="'chunks'"):
            layer.forward(*base, **kw, mode="low_latency", max_tokens_per_rank=6, chunks=bad)
    with pytest.raises(ValueError, match="'chunks'.*'throughput'"):
        layer.forward(*base, **kw, mode="throughput", chunks=2)
    out = qt.poison((5, H), qt.ref.BF16)
    with pytest.raises(ValueError, match="'out'"):
        layer.forward(*base, **kw, mode="low_latency", max_tokens_per_rank=6, chunks=2, out=out)
    with pytest.raises(ValueError, match="'topk_weights'"):
        layer.forward(*base[:2], wts[:, :1].copy(), *base[3:], **kw, mode="low_latency", max_tokens_per_rank=6,
                      chunks=2)
    with pytest.raises(TypeError, match="'topk_weights'"):
        layer.forward(*base[:2], wts.astype(np.float64), *base[3:], **kw, mode="low_latency",
                      max_tokens_per_rank=6, chunks=2)
    assert group.calls == 0 and qt.poisoned_mask(out).all()
    # numpy integer chunk counts are accepted (one rank: the chunked path with W = 1)
    got = layer.forward(*base, **kw, mode="low_latency", max_tokens_per_rank=6, chunks=np.int64(2))
    np.testing.assert_array_equal(_bits(got), _bits(_single(case)))
    assert group.calls == 4
