"""GPU: qmoe.limit_sms changes the persistent GEMM grids only, never the result (include/qmoe/sm_limit.h).
Every tactic of the fused w4a8_int4 / w4a16 layers under limits of 1, 7 and 200 SMs (200: above the
device's count, i.e. all) give the bits of the unlimited call, also when captured in a CUDA graph."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_common import require_hopper, to_dev  # noqa: E402

import qmoe  # noqa: E402
from qmoe import testing  # noqa: E402


@pytest.mark.parametrize("mode", ["w4a8_int4", "w4a16"])
@pytest.mark.parametrize("tokens", [3, 300])
def test_fused_moe_same_bits_under_any_limit(mode, tokens):
    torch = require_hopper()
    case = {k: to_dev(v) for k, v in testing.make_fused_moe_case(mode, tokens, 512, 256, 16, 4, seed=11).items()}
    bf16 = mode != "w4a8_int4"
    tactics = sorted(set(qmoe.valid_tactics(512, 512, tokens * 4, 16, 4, bf16))  # GEMM1 (N 2I, K H) and
                     & set(qmoe.valid_tactics(512, 256, tokens * 4, 16, 4, bf16)))  # GEMM2 (N H, K I)
    for tactic in tactics:
        free = qmoe.fused_moe(**case, deterministic=True, tactic=tactic)
        for sms in (1, 7, 200):
            out = torch.full_like(free, float("nan"))
            with qmoe.limit_sms(sms):
                qmoe.fused_moe(**case, deterministic=True, tactic=tactic, out=out)
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), free.view(torch.int16)), (mode, tokens, tactic, sms)
    assert qmoe.sm_limit() == 0


def test_graph_keeps_the_limit_of_its_capture():
    torch = require_hopper()
    case = {k: to_dev(v) for k, v in testing.make_fused_moe_case("w4a8_int4", 64, 512, 256, 16, 4, seed=12).items()}
    free = qmoe.fused_moe(**case, deterministic=True)
    out = torch.full_like(free, float("nan"))
    with qmoe.limit_sms(5):
        qmoe.fused_moe(**case, deterministic=True, out=out)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            qmoe.fused_moe(**case, deterministic=True, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), free.view(torch.int16))
