"""GPU tests of the W4A8 GEMM's activation slots (W4A8MoeMmArgs::a_slots, qmoe/grouped_gemm.h): with an [R, 2K + K/32]
uint8 scratch the 16-token decode tile converts the activations once into the fp16 operands of its MMAs and their bias
sums (src/cuda/gemm/e4m3_to_f16_slots.h) and reads them as they are, so its results must be the bits of the tile that
computes them itself, and of every other mma.sync tactic.

Checked on fresh random data, d poisoned with NaN and a's rows outside every group set to e4m3 NaN, ragged
groups (empty experts, 1 row, odd counts, gaps): (1) forced n16 with and without the scratch, bitwise equal and
within tolerance of the float64 twin; (2) the scratch holds the documented layout (slots exactly, bias sums to fp32 rounding); (3) the SGLang wrapper passes a
scratch exactly where qmoe._C.w4a8_activation_slots says so, and its result equals the 8-token tile's bits;
(4) the wrapper inside a CUDA graph (the scratch from torch's graph pool) replays to the same bits.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

from gpu_common import require_hopper  # noqa: E402

torch = require_hopper()

from qmoe import _C  # noqa: E402
from qmoe._tensors import arg  # noqa: E402
from qmoe.compat import sgl_kernel as sgl  # noqa: E402
from test_gpu_w4a8 import (DEV, TOL, gpu_rel_errors, layout, make_activations, make_weights, sgl_strides,  # noqa: E402
                           twin_gemm)

N16 = "decode_m128_n16_k256"


def problem(counts, n, k, *, seed, gap=1, tail=2, per_row=False):
    gen = torch.Generator(device=DEV)
    gen.manual_seed(seed)
    experts = len(counts)
    q, s, stored = make_weights(experts, n, k, gen)
    starts, rows, mask = layout(counts, gap, tail=tail)
    a, a_scales = make_activations(rows, k, gen, per_row=per_row)
    a.view(torch.uint8)[~mask] = 0x7F  # e4m3 NaN: rows outside every group are not read
    offsets = torch.tensor(starts, dtype=torch.int32, device=DEV)
    sizes = torch.tensor([[n, c, k] for c in counts], dtype=torch.int32, device=DEV).reshape(experts, 3)
    return dict(q=q, s=s, stored=stored, starts=starts, counts=counts, rows=rows, mask=mask, a=a, a_scales=a_scales,
                offsets=offsets, sizes=sizes, n=n, k=k)


def run(p, tactic, slots):
    """The C++ op through the binding: d (NaN-poisoned) for this tactic, with or without the scratch."""
    d = torch.full((p["rows"], p["n"]), float("nan"), dtype=torch.bfloat16, device=DEV)
    strides = sgl_strides(len(p["counts"]), p["k"], p["n"])
    call = [arg(d, "d", output=True)] + [arg(t) for t in (p["a"], p["q"], p["a_scales"], p["stored"], p["offsets"],
                                                          p["sizes"], *strides)]
    _C.w4a8_moe_mm(*call, 128, 8, torch.cuda.current_stream().cuda_stream, tactic,
                   None if slots is None else arg(slots, "a_slots", output=True))
    torch.cuda.synchronize()
    return d


def expected_slots(a: torch.Tensor) -> torch.Tensor:
    """The documented layout: per 8 K, fp16 pairs (a0, a4), (a2, a6), (a1/16, a5/16), (a3/16, a7/16)."""
    x = a.float().half().reshape(a.shape[0], -1, 8)
    order = [0, 4, 2, 6, 1, 5, 3, 7]
    out = x[:, :, order].clone()
    out[:, :, 4:] = out[:, :, 4:] / 16  # exact: a power of two inside fp16's range for every e4m3 value
    return out.reshape(a.shape[0], -1)


CASES = [
    # (counts per expert, N, K): ragged groups on shapes where the scratch pays (N >= 3072, K >= 2048)
    ([9, 0, 1, 16, 3, 12, 0, 7], 3072, 2048),
    ([17, 5, 0, 33, 16, 1], 4096, 4096),
    ([1], 3072, 7168),
    ([40] + [0] * 6 + [2], 7168, 2048),
]


@pytest.mark.parametrize("counts,n,k", CASES)
@pytest.mark.parametrize("per_row", [False, True], ids=["per_tensor", "per_row"])
def test_forced_n16_same_bits_with_and_without_slots(counts, n, k, per_row):
    p = problem(counts, n, k, seed=n + k + len(counts), per_row=per_row)
    assert _C.w4a8_activation_slots(n, k, p["rows"], len(counts), 8, N16)
    slots = torch.randint(0, 256, (p["rows"], 2 * k + k // 32), dtype=torch.uint8, device=DEV)  # scratch: any bytes
    plain = run(p, N16, None)
    fast = run(p, N16, slots)
    mask = p["mask"]
    assert torch.equal(fast.view(torch.int16), plain.view(torch.int16)), "a_slots changed the results"
    assert bool(torch.isnan(fast[~mask]).all()), "rows outside every group were written"
    inside = fast[mask]
    assert bool(torch.isfinite(inside).all())
    rel, worst = gpu_rel_errors(inside.float(), twin_gemm(p["a"], p["q"], p["s"], p["a_scales"], p["starts"],
                                                          counts)[mask].float())
    assert rel <= TOL, f"rel_rms {rel:.3e} > {TOL} (max_rel {worst:.3e})"
    # The scratch now holds every row of a in the documented layout (rows outside the groups too: NaN bytes).
    rows = mask.nonzero().flatten()
    got = slots[rows, :2 * k].contiguous().view(torch.float16)
    assert torch.equal(got.view(torch.int16), expected_slots(p["a"][rows]).view(torch.int16))
    # ... and after them the bias sums: sum over each K group of a x (-8 2^-24), as the tensor cores add them up
    bias = slots[rows, 2 * k:].contiguous().view(torch.float32)
    want = p["a"][rows].float().double().reshape(len(rows), k // 128, 128).sum(-1) * (-8.0 * 2.0 ** -24)
    assert torch.allclose(bias.double(), want, rtol=1e-5, atol=1e-8), float((bias.double() - want).abs().max())


def test_wrapper_uses_slots_where_they_pay_and_keeps_the_bits():
    """SGLang call at 8 rows per expert over 64 experts (N 3072, K 2048): the heuristic picks n16 with the scratch
    (n8 without), and the bits are the n8 tile's."""
    counts = [8] * 60 + [3, 13, 0, 16]
    n, k = 3072, 2048
    p = problem(counts, n, k, seed=5, gap=0, tail=0)  # R = 512: 8 rows per expert
    assert _C.w4a8_activation_slots(n, k, p["rows"], len(counts), 8, None)
    assert _C.select_tactic(n, k, p["rows"], len(counts), 8) == "decode_m128_n8_k256"
    assert not _C.w4a8_activation_slots(n, k, p["rows"], len(counts), 8, "decode_m128_n8_k256")
    assert not _C.w4a8_activation_slots(1536, k, p["rows"], len(counts), 8, None)  # N below the threshold
    d = torch.full((p["rows"], n), float("nan"), dtype=torch.bfloat16, device=DEV)
    sgl.cutlass_w4a8_moe_mm(d, p["a"], p["q"], p["a_scales"], p["stored"], p["offsets"], p["sizes"],
                            *sgl_strides(len(counts), k, n), 128, 8)
    torch.cuda.synchronize()
    n8 = run(p, "decode_m128_n8_k256", None)
    assert torch.equal(d.view(torch.int16), n8.view(torch.int16))


def test_wrapper_in_a_cuda_graph():
    counts = [8] * 64
    n, k = 4096, 2048
    p = problem(counts, n, k, seed=11, gap=0, tail=0)
    assert _C.w4a8_activation_slots(n, k, p["rows"], len(counts), 8, None)  # the wrapper allocates in the capture
    d = torch.full((p["rows"], n), float("nan"), dtype=torch.bfloat16, device=DEV)
    args = (d, p["a"], p["q"], p["a_scales"], p["stored"], p["offsets"], p["sizes"], *sgl_strides(64, k, n), 128, 8)
    sgl.cutlass_w4a8_moe_mm(*args)  # eager (and warm-up)
    torch.cuda.synchronize()
    eager = d.clone()
    d.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            sgl.cutlass_w4a8_moe_mm(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(d.view(torch.int16), eager.view(torch.int16))
