"""GPU tests of the split-K decode tactics decode_m64_n8_k512_s4 / _s8 (src/cuda/gemm/split_k.cuh): a
cluster of 4 or 8 CTAs shares each tile's K groups and promotes them in the unsplit order, so the result
must equal the unsplit m64 n8 tile's bit for bit (and with it every mma.sync tactic's).

Offered only with QMOE_SPLIT_K_TACTICS=1 (set per test here). Checked: the public GEMM (bf16 out) on
ragged experts (empty ones, one row, all rows on one expert), K from 1 group (three of the four CTAs
get no group) to 64 groups (slices of 16, the buffer's limit), N tails, both scale layouts, per-tensor
and per-row activation scales, rows outside every group left poisoned; and the fused layer forced to
the tactic (GEMM1's fused activation epilogue, the separate fp32 path, ReLU^2, expert parallelism, the
fused finalize, a CUDA-graph replay) against the unsplit tactic."""
from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_common import on_device, require_hopper, to_dev  # noqa: E402

torch = require_hopper()

import qmoe  # noqa: E402
from qmoe import reference as ref  # noqa: E402
from qmoe import testing  # noqa: E402
from qmoe.compat import sgl_kernel as sgl  # noqa: E402

SPLITS = ["decode_m64_n8_k512_s4", "decode_m64_n8_k512_s8"]
SPLIT = SPLITS[0]
UNSPLIT = "decode_m64_n8_k512"


@pytest.fixture(autouse=True)
def split_k_on(monkeypatch):
    monkeypatch.setenv("QMOE_SPLIT_K_TACTICS", "1")


def gemm(experts, n, k, counts, seed, per_row, tactic, gap=2):
    """One cutlass_w4a8_moe_mm call with `tactic` forced on fresh data; expert e's rows start after a
    gap of unread rows (e4m3 NaN). Returns (d, mask of the rows inside a group)."""
    w = testing.make_w4a8_int4_weights(experts, n, k, seed=seed)
    starts, rows = [], gap
    for c in counts:
        starts.append(rows)
        rows += c + gap
    rng = np.random.default_rng(seed)
    a = ref.round_e4m3(rng.standard_normal((rows, k)).astype(np.float32))
    mask = np.zeros(rows, bool)
    for s, c in zip(starts, counts):
        mask[s:s + c] = True
    a_dev = to_dev(a)
    a_dev.view(torch.uint8)[torch.from_numpy(~mask).cuda()] = 0x7F  # never read
    a_scales = (rng.uniform(0.5, 2.0, rows) if per_row else np.array([0.75])).astype(np.float32)
    sizes = np.array([[n, c, k] for c in counts], np.int32)
    d = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    sgl.cutlass_w4a8_moe_mm(d, a_dev, to_dev(w.q), to_dev(a_scales), to_dev(w.scale),
                            to_dev(np.array(starts, np.int32)), to_dev(sizes), None, None, None, None, 128, 8,
                            tactic=tactic)
    torch.cuda.synchronize()
    return d, torch.from_numpy(mask).cuda()


GEMM_CASES = {
    # name: (experts, n, k, counts)
    "k128_one_group": (4, 64, 128, [1, 0, 3, 8]),
    "k640_packed1": (3, 200, 640, [5, 1, 0]),
    "k2048_q30": (16, 1536, 2048, [1, 0, 0, 2, 1, 0, 7, 1, 0, 0, 1, 3, 0, 1, 0, 8]),
    "k768_q30_g2": (8, 2048, 768, [1, 0, 2, 1, 0, 3, 1, 0]),  # 6 groups: slices of 2 (s4) and 1 (s8)
    "k7168_dsv3": (8, 512, 7168, [1, 2, 0, 1, 1, 0, 3, 1]),
    "k8192_limit": (2, 128, 8192, [4, 1]),
    "k14336_mixtral_g2": (2, 256, 14336, [1, 1]),  # s8 only (s4 slices would need 28 groups)
    "all_on_one_expert": (6, 256, 1024, [0, 0, 8, 0, 0, 0]),
    "many_single_rows": (64, 128, 512, [1] * 64),
}


@pytest.mark.parametrize("per_row", [False, True], ids=["per_tensor", "per_row"])
@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_split_gemm_same_bits_as_unsplit(case, per_row):
    experts, n, k, counts = GEMM_CASES[case]
    valid = qmoe.valid_tactics(n, k, sum(counts), experts)
    splits = [t for t in SPLITS if t in valid]
    assert splits == ([SPLITS[1]] if k > 8192 else SPLITS), valid
    unsplit, _ = gemm(experts, n, k, counts, seed=7, per_row=per_row, tactic=UNSPLIT)
    for tactic in splits:
        split, mask = gemm(experts, n, k, counts, seed=7, per_row=per_row, tactic=tactic)
        assert torch.isnan(split[~mask].float()).all(), f"{tactic}: rows outside every group were written"
        assert torch.isfinite(split[mask].float()).all(), f"{tactic}: group rows unwritten or not finite"
        assert torch.equal(split.view(torch.int16), unsplit.view(torch.int16)), f"{tactic} changed the bits"


def test_split_tactic_refused_past_its_k_limit():
    """K = 8320 (65 groups): an s4 slice would need 17 groups > 16, so s4 is not offered and forcing it
    raises before any launch; K = 16512 (129 groups) is past s8's limit too."""
    assert SPLITS[0] not in qmoe.valid_tactics(128, 8320, 4, 2) and SPLITS[1] in qmoe.valid_tactics(128, 8320, 4, 2)
    with pytest.raises(ValueError, match="tactic"):
        gemm(2, 128, 8320, [3, 1], seed=1, per_row=False, tactic=SPLITS[0])
    assert not set(SPLITS) & set(qmoe.valid_tactics(128, 16512, 4, 2))


FUSED_CASES = {
    # name: (tokens, top_k, experts, hidden, inter, make_fused_moe_case keywords, fused_moe keywords)
    "swiglu_fused_epilogue": (1, 8, 16, 2048, 768, {}, {}),
    "swiglu_fused_epilogue_packed1": (3, 4, 16, 640, 256, {}, {}),  # GEMM1 K = 640: one scale per group row
    "swiglu_interleaved64": (6, 4, 16, 1024, 256, dict(gate_up_layout="up_gate_interleaved64"), {}),
    "swiglu_dynamic_a2": (3, 4, 16, 512, 256, dict(static_scales=False), {}),
    "relu2": (5, 2, 8, 1024, 512, dict(activation="relu2"), {}),
    "ep_local_experts": (7, 4, 32, 512, 256, dict(num_local_experts=12, local_expert_offset=8), {}),
}


@pytest.mark.parametrize("tactic", SPLITS)
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_split_fused_layer_same_bits_as_unsplit(case, tactic):
    tokens, top_k, experts, hidden, inter, make_kw, kw = FUSED_CASES[case]
    dev = on_device(testing.make_fused_moe_case("w4a8_int4", tokens, hidden, inter, experts, top_k, seed=11,
                                                **make_kw))
    split = qmoe.fused_moe(**dev, deterministic=True, tactic=tactic, **kw)
    unsplit = qmoe.fused_moe(**dev, deterministic=True, tactic=UNSPLIT, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(split.float()).all()
    assert torch.equal(split.view(torch.int16), unsplit.view(torch.int16))


@pytest.mark.parametrize("tactic", SPLITS)
def test_split_fused_finalize_and_graph_replay(tactic):
    """The fused finalize (GEMM2 adds into the zeroed output: atomics, so compared with a tolerance) and a
    captured deterministic call replayed on new routing."""
    case = testing.make_fused_moe_case("w4a8_int4", 4, 1024, 512, 16, 4, seed=12)
    dev = on_device(case)
    fused = qmoe.fused_moe(**dev, deterministic=False, tactic=tactic)
    det = qmoe.fused_moe(**dev, deterministic=True, tactic=UNSPLIT)
    torch.cuda.synchronize()
    testing.assert_close(fused.float().cpu().numpy(), det.float().cpu().numpy(), "w4a8_int4", what="fused finalize")
    out = torch.full_like(det, float("nan"))
    qmoe.fused_moe(**dev, deterministic=True, tactic=tactic, out=out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qmoe.fused_moe(**dev, deterministic=True, tactic=tactic, out=out)
    new_ids, new_weights = testing.make_routing(4, 4, 16, seed=13)
    dev["topk_ids"].copy_(torch.from_numpy(new_ids))
    dev["topk_weights"].copy_(torch.from_numpy(new_weights))
    out.fill_(float("nan"))
    graph.replay()
    want = qmoe.fused_moe(**dev, deterministic=True, tactic=UNSPLIT)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("sms", [1, 7])
def test_split_same_bits_with_few_clusters(sms):
    """qmoe.limit_sms(1): one cluster walks every tile (the next tile's group sums written while nothing
    of the previous one may still be read); 7: a few clusters. Same bits as the unsplit tile."""
    experts, n, k, counts = GEMM_CASES["k2048_q30"]
    unsplit, _ = gemm(experts, n, k, counts, seed=9, per_row=True, tactic=UNSPLIT)
    for tactic in SPLITS:
        with qmoe.limit_sms(sms):
            split, mask = gemm(experts, n, k, counts, seed=9, per_row=True, tactic=tactic)
        assert torch.isnan(split[~mask].float()).all()
        assert torch.equal(split.view(torch.int16), unsplit.view(torch.int16)), f"{tactic} under {sms} SMs"


@pytest.mark.skipif(bool(os.environ.get("QMOE_SANITIZER")),
                    reason="CUPTI (torch.profiler) does not run under compute-sanitizer")
@pytest.mark.parametrize("tactic", SPLITS)
def test_split_tactic_runs_the_cluster_kernel(tactic):
    """The forced tactic launches the split kernel (its last template argument is the cluster size), not
    the unsplit one: bitwise equality alone would not notice a fallback."""
    from torch.profiler import ProfilerActivity, profile

    experts, n, k, counts = GEMM_CASES["k2048_q30"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gemm(experts, n, k, counts, seed=3, per_row=False, tactic=tactic)
    names = [e.name for e in prof.events() if "sm90_grouped_gemm_w4a8_int4_kernel" in e.name]
    cluster = tactic.rsplit("_s", 1)[1]
    assert any(f", {cluster}>(" in name for name in names), names
