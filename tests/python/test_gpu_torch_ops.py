"""torch.library registration of qmoe's ops: schema/fake checks (torch.library.opcheck), a
torch.compile(fullgraph=True) graph holding the SGLang ops, and the fused op on CPU tensors."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import qmoe  # noqa: E402
from qmoe import reference as ref  # noqa: E402
from qmoe import testing  # noqa: E402

pytestmark = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                  reason="needs an sm_90 GPU")


def _gemm_inputs(device, experts=4, n=256, k=512, tokens=6, top_k=2):
    rng = np.random.default_rng(0)
    ids = torch.tensor(rng.integers(0, experts, size=(tokens, top_k)), dtype=torch.int32, device=device)
    w = testing.make_w4a8_int4_weights(experts, n, k, seed=1)
    rows = tokens * top_k
    a = torch.randn(rows, k, device=device).to(torch.float8_e4m3fn)
    b = torch.from_numpy(w.q).to(device)
    s = torch.from_numpy(w.scale.view(np.int16)).view(torch.bfloat16).to(device)
    a_scales = torch.tensor([0.5], device=device)
    outs = dict(expert_offsets=torch.empty(experts + 1, dtype=torch.int32, device=device),
                problem_sizes1=torch.empty(experts, 3, dtype=torch.int32, device=device),
                problem_sizes2=torch.empty(experts, 3, dtype=torch.int32, device=device),
                input_permutation=torch.empty(rows, dtype=torch.int32, device=device),
                output_permutation=torch.empty(rows, dtype=torch.int32, device=device))
    strides_k = torch.full((experts, 3), k, dtype=torch.int64, device=device)
    strides_n = torch.full((experts, 3), n, dtype=torch.int64, device=device)
    return ids, outs, a, b, s, a_scales, strides_k, strides_n, experts, n, k


def _layer(ids, outs, a, b, s, a_scales, strides_k, strides_n, experts, n, k):
    torch.ops.qmoe.get_cutlass_w4a8_moe_mm_data(ids, outs["expert_offsets"], outs["problem_sizes1"],
                                                outs["problem_sizes2"], outs["input_permutation"],
                                                outs["output_permutation"], experts, n // 2, k)
    d = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device=a.device)
    torch.ops.qmoe.cutlass_w4a8_moe_mm(d, a, b, a_scales, s, outs["expert_offsets"][:-1], outs["problem_sizes1"],
                                       strides_k, strides_k, strides_n, strides_n, 128, 2)
    return d


@needs_hopper
def test_opcheck_sglang_ops():
    ids, outs, a, b, s, a_scales, strides_k, strides_n, experts, n, k = _gemm_inputs("cuda")
    for out in outs.values():  # opcheck clones the arguments: poisoned, not uninitialized (initcheck)
        out.fill_(-1)
    torch.library.opcheck(torch.ops.qmoe.get_cutlass_w4a8_moe_mm_data.default,
                          (ids, *outs.values(), experts, n // 2, k))
    # opcheck may run the op on copies: fill the routing outputs the GEMM reads for real.
    torch.ops.qmoe.get_cutlass_w4a8_moe_mm_data(ids, *outs.values(), experts, n // 2, k)
    d = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    # opcheck's schema and AOT checks do arithmetic on the inputs, which torch does not implement
    # for float8_e4m3fn ("mul_cuda not implemented"): check the fake implementation only.
    torch.library.opcheck(torch.ops.qmoe.cutlass_w4a8_moe_mm.default,
                          (d, a, b, a_scales, s, outs["expert_offsets"][:-1], outs["problem_sizes1"], strides_k,
                           strides_k, strides_n, strides_n, 128, 2), test_utils=("test_faketensor",))


@needs_hopper
def test_torch_compile_fullgraph_matches_eager():
    args = _gemm_inputs("cuda")
    eager = _layer(*args)
    compiled = torch.compile(_layer, fullgraph=True)(*args)
    torch.cuda.synchronize()
    assert torch.equal(eager.view(torch.int16), compiled.view(torch.int16))


def test_fused_moe_custom_op_on_cpu_tensors_matches_reference():
    case = testing.make_fused_moe_case("w4a8_int4", 5, 256, 128, 8, 2, seed=2)
    t = {k: (torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if getattr(v, "dtype", None) == ref.BF16
             else torch.from_numpy(v)) if isinstance(v, np.ndarray) else v for k, v in case.items()}
    got = torch.ops.qmoe.fused_moe(t["x"], t["topk_ids"], t["topk_weights"], t["w1"], t["w1_scale"], t["w2"],
                                   t["w2_scale"], "w4a8_int4", 8, x_scale=t["x_scale"],
                                   fc2_input_scale=t["fc2_input_scale"], deterministic=True)
    want = ref.fused_moe(**case, deterministic=True)
    testing.assert_close(got.float().numpy(), want, "w4a8_int4")
    fake = torch.library.opcheck(torch.ops.qmoe.fused_moe.default,
                                 (t["x"], t["topk_ids"], t["topk_weights"], t["w1"], t["w1_scale"], t["w2"],
                                  t["w2_scale"], "w4a8_int4", 8),
                                 dict(x_scale=t["x_scale"], fc2_input_scale=t["fc2_input_scale"], deterministic=True))
    assert fake is not None
