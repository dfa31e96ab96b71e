"""Drop-in for sgl_kernel's CUTLASS W4A8 MoE ops (same names, signatures and layouts).

    from qmoe.compat.sgl_kernel import get_cutlass_w4a8_moe_mm_data, cutlass_w4a8_moe_mm

Differences from SGLang, all on the side of safety: every argument is validated (clear
ValueError/TypeError before any launch, where SGLang silently computes garbage: K % 128 != 0,
chunk_size != 128, E > 1024, fp16 `d`, int64 offsets); `input_permutation` and
`output_permutation` are filled (SGLang leaves them unwritten); `a_scales` of shape [R] gives
per-row activation scales (SGLang reads element 0 only); int64 `topk_ids` are accepted.
"""
from __future__ import annotations

import math

from .. import _C, tune
from .._tensors import arg, as_int, current_stream


def get_cutlass_w4a8_moe_mm_data(topk_ids, expert_offsets, problem_sizes1, problem_sizes2, input_permutation,
                                 output_permutation, num_experts: int, n: int, k: int) -> None:
    """Routing -> expert_offsets [E+1], problem_sizes1/2 [E,3], permutations [numel] (all int32, in place)."""
    _C.moe_mm_data(arg(topk_ids, "topk_ids"), arg(expert_offsets, "expert_offsets", output=True),
                   arg(problem_sizes1, "problem_sizes1", output=True), arg(problem_sizes2, "problem_sizes2", output=True),
                   arg(input_permutation, "input_permutation", output=True),
                   arg(output_permutation, "output_permutation", output=True),
                   as_int(num_experts, "num_experts"), as_int(n, "n"), as_int(k, "k"), current_stream(topk_ids))


def cutlass_w4a8_moe_mm(d, a, b, a_scales, b_scales, experts_offsets, problem_sizes, a_strides, b_strides,
                        d_strides, s_strides, chunk_size: int = 128, topk: int = 8, *, tactic=None) -> None:
    """Grouped int4 x fp8 GEMM: d[r] = bf16(a_scale * sum_g S[e,:,g] * (a[r] . q[e,:,g])) for expert e's rows.

    `tactic` (qmoe extension) forces a kernel tactic by name (see qmoe.valid_tactics); without it,
    CUDA tensors use the autotuner's cached winner (or, inside qmoe.tune.autotune(), the fastest
    tactic timed on this call), else the heuristic.
    """
    call = (arg(d, "d", output=True), arg(a, "a"), arg(b, "b"), arg(a_scales, "a_scales"), arg(b_scales, "b_scales"),
            arg(experts_offsets, "experts_offsets"), arg(problem_sizes, "problem_sizes"),
            arg(a_strides, "a_strides"), arg(b_strides, "b_strides"), arg(d_strides, "d_strides"),
            arg(s_strides, "s_strides"), as_int(chunk_size, "chunk_size"), as_int(topk, "topk"), current_stream(a))
    if tactic is None and tune.is_cuda(a) and _C.kernels_built() and len(d.shape) == 2 and len(a.shape) == 2 \
            and len(experts_offsets.shape) == 1:
        # Shapes that are wrong for the op are left to the C++ checks (a clear error, not a key).
        per_row = math.prod(getattr(a_scales, "shape", ())) > 1
        tactic = tune.moe_mm_tactic(a.shape[0], d.shape[1], a.shape[1], experts_offsets.shape[0], int(topk), per_row,
                                    lambda name: _C.w4a8_moe_mm(*call, name), device=a.device)
    slots = _activation_slots(d, a, experts_offsets, topk, tactic)
    _C.w4a8_moe_mm(*call, tactic, a_slots=arg(slots, "a_slots", output=True))


def _activation_slots(d, a, experts_offsets, topk, tactic):
    """Scratch [R, 2K + K/32] uint8 for the activations in the 16-token decode tile's fp16 operand slots (and their
    bias sums), where the op uses one (qmoe._C.w4a8_activation_slots; same results, a faster tile), else None."""
    if not (tune.is_cuda(a) and _C.kernels_built() and len(d.shape) == 2 and len(a.shape) == 2
            and len(experts_offsets.shape) == 1):
        return None
    try:
        wanted = _C.w4a8_activation_slots(d.shape[1], a.shape[1], a.shape[0], experts_offsets.shape[0], int(topk),
                                          tactic)
    except Exception:  # a bad argument: the op itself raises the clear error
        return None
    if not wanted:
        return None
    import torch

    return torch.empty((a.shape[0], 2 * a.shape[1] + a.shape[1] // 32), dtype=torch.uint8, device=a.device)
