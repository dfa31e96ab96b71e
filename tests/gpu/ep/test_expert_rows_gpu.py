"""One-GPU tests of the two halves of the deterministic layer on CUDA tensors (include/qmoe/fused_moe.h):
qmoe.ops.moe_expert_rows (the fused pipeline up to GEMM2, rows per flat slot) and qmoe.ops.moe_finalize
(src/cuda/fused/moe_finalize.cu).

  - moe_finalize on the GPU == the CPU reference bit for bit: output dtypes bf16 / f16 / f32, the
    vectorized (H % 8 == 0) and scalar (odd H) paths, routed_scaling_factor, invalid / non-local ids;
    rows of slots the routing rule drops are NaN-poisoned and must never be read;
  - moe_finalize with row_index (rows [R, H] read through slot -> row, -1 / out of range: dropped)
    == the CPU reference with the same index == the GPU finalize of the gathered rows, bit for bit;
    rows no kept slot points at are NaN and must never be read; R = 0; capture in a CUDA graph;
  - moe_expert_rows on the GPU: rows of kept slots written, rows of dropped / non-local slots left
    untouched (poisoned), and moe_finalize(moe_expert_rows(p)) == fused_moe(p, deterministic=True)
    bit for bit on the GPU for each pinned GEMM tactic; its rows == the CPU reference within the
    fused-MoE tolerance;
  - the workspace error names 'workspace'; graph capture of the two calls replays.
Run: python3 -m pytest -q tests/gpu/ep/test_expert_rows_gpu.py (PYTHONPATH: the device build's package).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - CPU machines
    pytest.skip("no CUDA device", allow_module_level=True)

from qmoe import _C, ops, testing  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
BF16 = np.dtype(ml_dtypes.bfloat16)


def to_dev(a):
    if not isinstance(a, np.ndarray):
        return a
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).to(DEV).view(torch.bfloat16)
    if a.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return torch.from_numpy(a.view(np.uint8)).to(DEV).view(torch.float8_e4m3fn)
    return torch.from_numpy(a).to(DEV)


def bits_np(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()


def nan_bf16(shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEV)


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("hidden", [256, 100])  # 100: the scalar (unvectorized) path
def test_moe_finalize_gpu_equals_cpu_bitwise(out_dtype, hidden):
    rng = np.random.default_rng(1)
    tokens, top_k, experts = 37, 6, 12
    ids = rng.integers(0, experts, (tokens, top_k)).astype(np.int32)
    ids[0, 0], ids[1, 2], ids[2, 5] = -1, experts, 99  # dropped slots
    wts = rng.uniform(-1, 1, (tokens, top_k)).astype(np.float32)
    rows = testing.ref.round_bf16(rng.standard_normal((tokens * top_k, hidden)).astype(np.float32) * 3)
    kw = dict(num_experts=experts, num_local_experts=8, local_expert_offset=2, routed_scaling_factor=2.5,
              output_dtype=out_dtype)
    kept = ((ids >= 2) & (ids < 10)).reshape(-1)
    assert kept.any() and not kept.all()
    rows_dev = to_dev(rows)
    rows_dev[torch.as_tensor(~kept, device=DEV)] = float("nan")  # dropped slots must never be read
    want = ops.moe_finalize(rows, ids, wts, **kw)
    got = ops.moe_finalize(rows_dev, to_dev(ids), to_dev(wts), **kw)
    torch.cuda.synchronize()
    assert got.is_cuda and str(got.dtype) == f"torch.{out_dtype}"
    np.testing.assert_array_equal(bits_np(got), np.asarray(want).view(np.int16 if want.itemsize == 2 else np.int32))
    assert np.abs(np.asarray(want, np.float32)).sum() > 0


def _index_case(seed, hidden, tokens=41, top_k=8, experts=12, num_rows=150):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, experts, (tokens, top_k)).astype(np.int32)
    ids[0, 0], ids[1, 2], ids[2, 5] = -1, experts, 99  # dropped by the routing rule
    wts = rng.uniform(-1, 1, (tokens, top_k)).astype(np.float32)
    index = rng.integers(0, num_rows, (tokens, top_k)).astype(np.int32)
    index[3, 1], index[4, 0], index[5, 7] = -1, num_rows, -9  # dropped by the index
    rows = testing.ref.round_bf16(rng.standard_normal((num_rows, hidden)).astype(np.float32) * 3)
    kept = (ids >= 2) & (ids < 10) & (index >= 0) & (index < num_rows)
    referenced = np.zeros(num_rows, bool)
    referenced[index[kept]] = True
    rows[~referenced] = np.nan  # a row no kept slot points at must never be read
    assert kept.any() and not kept.all() and not referenced.all()
    return rows, ids, wts, index


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hidden", [256, 100])  # 100: the scalar (unvectorized) path
def test_moe_finalize_gpu_row_index_equals_gathered_bitwise(out_dtype, hidden):
    rows, ids, wts, index = _index_case(11, hidden)
    kw = dict(num_experts=12, num_local_experts=8, local_expert_offset=2, routed_scaling_factor=2.5,
              output_dtype=out_dtype)
    want_cpu = ops.moe_finalize(rows, ids, wts, **kw, row_index=index)
    out = torch.full((ids.shape[0], hidden), float("nan"), dtype=getattr(torch, out_dtype), device=DEV)
    got = ops.moe_finalize(to_dev(rows), to_dev(ids), to_dev(wts), **kw, out=out, row_index=to_dev(index.reshape(-1)))
    # The same on the gathered rows (slots dropped by the index get id -1 there).
    in_range = (index >= 0) & (index < rows.shape[0])
    gathered = np.full((ids.size, hidden), np.nan, BF16)
    gathered[in_range.reshape(-1)] = rows[index[in_range]]
    want_gpu = ops.moe_finalize(to_dev(gathered), to_dev(np.where(in_range, ids, -1).astype(np.int32)), to_dev(wts),
                                **kw)
    torch.cuda.synchronize()
    assert got is out
    np.testing.assert_array_equal(bits_np(got), bits_np(want_gpu))
    np.testing.assert_array_equal(bits_np(got), np.asarray(want_cpu).view(np.int16 if want_cpu.itemsize == 2
                                                                          else np.int32))
    assert not torch.isnan(got.float()).any() and got.float().abs().sum() > 0


def test_moe_finalize_gpu_row_index_no_rows_and_graph():
    rows, ids, wts, index = _index_case(12, 256)
    out = torch.full((ids.shape[0], 256), float("nan"), dtype=torch.bfloat16, device=DEV)
    ops.moe_finalize(torch.empty((0, 256), dtype=torch.bfloat16, device=DEV), to_dev(ids), to_dev(wts),
                     num_experts=12, out=out, row_index=torch.full(ids.shape, -1, dtype=torch.int32, device=DEV))
    torch.cuda.synchronize()
    assert (out.float() == 0).all()
    # Captured, then replayed with a new index written in place.
    clean = np.nan_to_num(np.asarray(rows, np.float32)).astype(BF16)  # every row may be read after the flip
    rows_dev, ids_dev, wts_dev, index_dev = to_dev(clean), to_dev(ids), to_dev(wts), to_dev(index)
    kw = dict(num_experts=12, routed_scaling_factor=1.5)
    ops.moe_finalize(rows_dev, ids_dev, wts_dev, **kw, out=out, row_index=index_dev)  # warm up, eager
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.moe_finalize(rows_dev, ids_dev, wts_dev, **kw, out=out, row_index=index_dev)
    flipped = np.ascontiguousarray(np.flip(index, 0))
    index_dev.copy_(to_dev(flipped))
    graph.replay()
    torch.cuda.synchronize()
    want = ops.moe_finalize(clean, ids, wts, **kw, row_index=flipped)
    np.testing.assert_array_equal(bits_np(out), np.asarray(want).view(np.int16))


def test_moe_finalize_gpu_empty_and_errors():
    out = ops.moe_finalize(torch.empty((0, 128), dtype=torch.bfloat16, device=DEV),
                           torch.empty((0, 4), dtype=torch.int32, device=DEV),
                           torch.empty((0, 4), dtype=torch.float32, device=DEV), num_experts=4)
    assert out.shape == (0, 128)
    with pytest.raises(ValueError, match="'topk_ids'"):  # on another device than rows
        ops.moe_finalize(torch.zeros((8, 128), dtype=torch.bfloat16, device=DEV), np.zeros((2, 4), np.int32),
                         torch.ones((2, 4), dtype=torch.float32, device=DEV), num_experts=4)


def _case(tokens=29, hidden=256, inter=256, experts=8, top_k=4, seed=3, local=4, offset=2):
    ids, wts = testing.make_routing(tokens, top_k, experts, seed)
    ids = np.array(ids, np.int32)
    ids[0, 0], ids[3, 1] = -1, experts + 2
    case = testing.make_fused_moe_case("w4a8_int4", tokens, hidden, inter, experts, top_k, seed, routing=(ids, wts),
                                       num_local_experts=local, local_expert_offset=offset)
    return case, ids, wts


@pytest.mark.parametrize("tactic", ["decode_m128_n16_k256", "prefill_m128_n128_k128", None])
def test_expert_rows_then_finalize_equals_deterministic_fused_moe(tactic):
    case, ids, wts = _case()
    dev = {k: to_dev(v) for k, v in case.items()}
    num_tokens, top_k = ids.shape
    hidden = case["w2"].shape[1]
    rows = nan_bf16((num_tokens * top_k, hidden))
    args = {k: v for k, v in dev.items() if k != "topk_weights"}
    ops.moe_expert_rows(**args, rows=rows, tactic=tactic)
    local = ((ids >= 2) & (ids < 6)).reshape(-1)
    written = ~torch.isnan(rows.float()).all(1).cpu().numpy()
    assert (written == local).all(), "rows of kept slots written, others untouched"
    got = ops.moe_finalize(rows, dev["topk_ids"], dev["topk_weights"], num_experts=8, num_local_experts=4,
                           local_expert_offset=2, routed_scaling_factor=1.5)
    want = ops.fused_moe(**dev, deterministic=True, routed_scaling_factor=1.5, tactic=tactic)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(bits_np(got), bits_np(want))
    # And the rows are the CPU reference's within the fused-MoE tolerance.
    rows_ref = testing.poison((num_tokens * top_k, hidden), BF16)
    ops.moe_expert_rows(**{k: v for k, v in case.items() if k != "topk_weights"}, rows=rows_ref)
    testing.assert_close(rows.float().cpu().numpy()[local], np.asarray(rows_ref, np.float32)[local], "w4a8_int4")


def test_expert_rows_workspace_error_and_graph():
    case, ids, wts = _case(tokens=16)
    dev = {k: to_dev(v) for k, v in case.items()}
    args = {k: v for k, v in dev.items() if k != "topk_weights"}
    rows = nan_bf16((16 * 4, case["w2"].shape[1]))
    call = ops._layer_call("w4a8_int4", dev["x"], dev["x_scale"], dev["topk_ids"],
                           torch.ones((16, 4), dtype=torch.float32, device=DEV), dev["w1"], dev["w1_scale"], None,
                           dev["fc2_input_scale"], dev["w2"], dev["w2_scale"], None, None, (rows, "rows"), 8, 4, 2,
                           "swiglu", 1.0, 0.0, float("inf"), 1.0, None, "gate_up", True, 1.0, None)
    assert _C.moe_expert_rows_workspace_size(call) > 0
    with pytest.raises(ValueError, match="'workspace'"):
        _C.moe_expert_rows(call, None, torch.cuda.current_stream().cuda_stream)
    # Capture both halves; replay after changing the routing in place.
    out = torch.empty((16, case["w2"].shape[1]), dtype=torch.bfloat16, device=DEV)

    def run():
        ops.moe_expert_rows(**args, rows=rows)
        ops.moe_finalize(rows, dev["topk_ids"], dev["topk_weights"], num_experts=8, num_local_experts=4,
                         local_expert_offset=2, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    dev["topk_ids"].copy_(dev["topk_ids"].flip(0))
    graph.replay()
    torch.cuda.synchronize()
    want = ops.fused_moe(**dev, deterministic=True)
    np.testing.assert_array_equal(bits_np(out), bits_np(want))
