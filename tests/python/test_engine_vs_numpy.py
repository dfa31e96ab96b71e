"""The C++ CPU engine (through the public Python API on numpy arrays) against the independent
numpy twin (qmoe.reference), on fresh random data: routing metadata exactly, the W4A8 grouped GEMM
and the fused MoE of every quant mode / activation / finalize / expert-parallel setting within
the tolerance policy of qmoe.testing."""
import itertools

import numpy as np
import pytest

import qmoe
from qmoe import reference as ref
from qmoe import testing
from qmoe.compat import sgl_kernel

ROUTING_KEYS = ("expert_offsets", "problem_sizes1", "problem_sizes2", "input_permutation", "output_permutation")


def _run_mm_data(ids, experts, n, k):
    numel = ids.size
    out = dict(expert_offsets=np.full(experts + 1, -7, np.int32), problem_sizes1=np.full((experts, 3), -7, np.int32),
               problem_sizes2=np.full((experts, 3), -7, np.int32), input_permutation=np.full(numel, -7, np.int32),
               output_permutation=np.full(numel, -7, np.int32))
    sgl_kernel.get_cutlass_w4a8_moe_mm_data(ids, out["expert_offsets"], out["problem_sizes1"], out["problem_sizes2"],
                                            out["input_permutation"], out["output_permutation"], experts, n, k)
    return out


@pytest.mark.parametrize("tokens,top_k,experts,id_dtype", [
    (1, 1, 1, np.int32), (7, 2, 8, np.int32), (33, 8, 256, np.int64), (257, 16, 1024, np.int32),
    (1000, 6, 60, np.int64)])
def test_routing_matches_numpy_twin(tokens, top_k, experts, id_dtype):
    rng = np.random.default_rng(tokens * 31 + experts)
    ids = rng.integers(-2, experts + 3, size=(tokens, top_k)).astype(id_dtype)
    got = _run_mm_data(ids, experts, 96, 512)
    want = ref.moe_mm_data(ids, experts, 96, 512)
    for key in ROUTING_KEYS:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _gemm_case(rng, experts, n, k, counts, per_row=False, gap=3):
    """Expert blocks with `gap` poisoned rows between them and after the last one."""
    starts, rows = [], 0
    for c in counts:
        starts.append(rows)
        rows += c + gap
    a = (rng.standard_normal((rows, k)) * 4).astype(np.float32).astype(ref.E4M3)
    w = testing.make_w4a8_int4_weights(experts, n, k, seed=int(rng.integers(1 << 30)))
    a_scales = (rng.uniform(0.5, 2, rows) if per_row else rng.uniform(-2, 2, 1)).astype(np.float32)
    ps = np.array([[n, c, k] for c in counts], np.int32)
    return a, w, a_scales, np.array(starts, np.int32), ps, rows


@pytest.mark.parametrize("experts,n,k,counts,per_row", [
    (1, 64, 128, [1], False), (3, 128, 256, [5, 0, 17], False), (4, 256, 512, [3, 7, 0, 16], True),
    (2, 96, 384, [9, 1], True), (2, 512, 2048, [4, 6], False), (2, 64, 7168, [2, 3], False)])
def test_w4a8_moe_mm_matches_numpy_twin(experts, n, k, counts, per_row):
    rng = np.random.default_rng(n + k)
    a, w, a_scales, starts, ps, rows = _gemm_case(rng, experts, n, k, counts, per_row)
    strides = np.full((experts, 3), k, np.int64)
    d_strides = np.full((experts, 3), n, np.int64)
    d = testing.poison((rows, n), ref.BF16)
    sgl_kernel.cutlass_w4a8_moe_mm(d, a, w.q, a_scales, w.scale, starts, ps, strides, strides, d_strides, d_strides)
    want = ref.w4a8_moe_mm(a, w.q, a_scales, w.scale, starts, ps)
    in_group = np.zeros(rows, bool)
    for s, c in zip(starts, counts):
        in_group[s:s + c] = True
    assert testing.poisoned_mask(d[~in_group]).all(), "rows outside every group were written"
    assert not testing.poisoned_mask(d[in_group]).any(), "rows of a group were left unwritten"
    testing.assert_close(d[in_group], want[in_group], "grouped_gemm")


MODES = ("w4a8_int4", "w4a16_int4", "w4a4", "w4a8", "w4a16")
ACTIVATIONS = ("swiglu", "geglu_tanh", "relu2", "situ")


def _activation_kwargs(activation):
    if activation == "swiglu":
        return dict(swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0)  # gpt-oss swiglu_oai
    if activation == "situ":
        return dict(situ_beta=1.75, situ_linear_beta=1.5)
    return {}


@pytest.mark.parametrize("mode,activation,deterministic,ep", list(itertools.product(
    MODES, ACTIVATIONS, (True, False), (False, True))))
def test_fused_moe_matches_numpy_twin(mode, activation, deterministic, ep):
    experts, top_k, tokens, hidden, inter = 8, 2, 7, 256, 128
    local = dict(num_local_experts=4, local_expert_offset=2) if ep else {}
    case = testing.make_fused_moe_case(mode, tokens, hidden, inter, experts, top_k, seed=hash((mode, activation)) % 997,
                                       activation=activation, **local)
    case.update(_activation_kwargs(activation), deterministic=deterministic, routed_scaling_factor=2.5)
    want = ref.fused_moe(**case)
    got = qmoe.fused_moe(**case)
    assert got.shape == want.shape and got.dtype == want.dtype
    testing.assert_close(got, want, mode)


@pytest.mark.parametrize("mode", MODES)
def test_fused_moe_per_token_dynamic_and_dtypes(mode):
    experts, top_k, tokens, hidden, inter = 6, 3, 5, 256, 128
    extra = {}
    if mode == "w4a4":
        extra = dict(per_token=True)
    elif mode == "w4a8_int4":
        extra = dict(static_scales=False)  # dynamic a1 / a2
    case = testing.make_fused_moe_case(mode, tokens, hidden, inter, experts, top_k, seed=5, **extra)
    for output_dtype in ("bfloat16", "float16", "float32"):
        case.update(output_dtype=output_dtype, deterministic=True)
        testing.assert_close(qmoe.fused_moe(**case), ref.fused_moe(**case), mode)


def test_fused_moe_token_without_local_expert_is_zero():
    case = testing.make_fused_moe_case("w4a8_int4", 4, 256, 128, 8, 2, seed=9, num_local_experts=2,
                                       local_expert_offset=0)
    case["topk_ids"][1] = [5, 7]  # token 1 has no local expert
    got = qmoe.fused_moe(**case, deterministic=True)
    assert np.all(got[1].astype(np.float32) == 0)
    testing.assert_close(got, ref.fused_moe(**case, deterministic=True), "w4a8_int4")


@pytest.mark.parametrize("model", ["qwen3_30b_a3b", "deepseek_v3"])
def test_fused_moe_real_model_shape(model):
    experts, top_k, hidden, inter = testing.MODEL_SHAPES[model]
    tokens = 3
    case = testing.make_fused_moe_case("w4a8_int4", tokens, hidden, inter, experts, top_k, seed=3)
    case["deterministic"] = True
    testing.assert_close(qmoe.fused_moe(**case), ref.fused_moe(**case), "w4a8_int4")
