"""The compat layers on the CPU backend: FlashInfer's cute_dsl_fused_moe / CuteDslMoEWrapper with
FlashInfer's own layouts (6-D MMA scale view, [T, H/16, 1] x_sf), and SGLang's MoE-layer call
sequence built from get_cutlass_w4a8_moe_mm_data + cutlass_w4a8_moe_mm, both against the numpy twin."""
import numpy as np
import pytest

import qmoe
from qmoe import reference as ref
from qmoe import testing
from qmoe.compat import flashinfer, sgl_kernel


def _to_6d(swizzled):
    """qmoe's [E, Mt*128, Kt*4] swizzled bytes -> FlashInfer's 6-D MMA view (32, 4, Mt, 4, Kt, E)."""
    experts, rows, cols = swizzled.shape
    mt, kt = rows // 128, cols // 4
    return np.transpose(swizzled.reshape(experts, mt, kt, 32, 4, 4), (3, 4, 1, 5, 2, 0))


def _flashinfer_call(case, **kw):
    x_sf = case.get("x_scale")
    if case["quant_mode"] == "w4a4":
        x_sf = x_sf.reshape(x_sf.shape[0], x_sf.shape[1], 1)  # FlashInfer tests pass [T, H/16, 1]
    return flashinfer.cute_dsl_fused_moe(
        case["x"], x_sf, case["topk_ids"], case["topk_weights"], case["w1"], _to_6d(case["w1_scale"]),
        case.get("w1_alpha"), case.get("fc2_input_scale"), case["w2"], _to_6d(case["w2_scale"]), case.get("w2_alpha"),
        case["num_experts"], case["topk_ids"].shape[1], num_local_experts=case.get("num_local_experts"),
        local_expert_offset=case.get("local_expert_offset", 0), quant_mode=case["quant_mode"],
        per_token_scale=case.get("per_token_scale"), **kw)


@pytest.mark.parametrize("mode", ["w4a4", "w4a8", "w4a16"])
@pytest.mark.parametrize("fused_finalize", [True, False])
def test_cute_dsl_fused_moe_matches_reference(mode, fused_finalize):
    case = testing.make_fused_moe_case(mode, 9, 256, 128, 16, 4, seed=11, num_local_experts=8, local_expert_offset=4)
    got = _flashinfer_call(case, use_fused_finalize=fused_finalize)
    want = ref.fused_moe(**case, deterministic=not fused_finalize)
    testing.assert_close(got, want, mode)


def test_cute_dsl_fused_moe_situ_geglu_relu2_and_moe_output():
    for activation, kw in (("situ", dict(situ_beta=0.8, situ_linear_beta=1.5)), ("geglu_tanh", {}), ("relu2", {})):
        case = testing.make_fused_moe_case("w4a4", 5, 256, 128, 8, 2, seed=3, activation=activation)
        if activation == "geglu_tanh":
            kw = dict(activation_type=flashinfer.ActivationType.GegluTanh)
        elif activation == "relu2":
            kw = dict(activation_type=flashinfer.ActivationType.Relu2)
        out = testing.poison((5, 256), ref.BF16)
        got = _flashinfer_call(case, moe_output=out, use_fused_finalize=False, **kw)
        assert got is out and not testing.poisoned_mask(out).any()
        ref_kw = {k: v for k, v in kw.items() if k.startswith("situ")}
        testing.assert_close(out, ref.fused_moe(**case, deterministic=True, **ref_kw), "w4a4")


def test_per_token_w4a4():
    case = testing.make_fused_moe_case("w4a4", 6, 256, 128, 8, 2, seed=4, per_token=True)
    testing.assert_close(_flashinfer_call(case, use_fused_finalize=False),
                         ref.fused_moe(**case, deterministic=True), "w4a4_per_token")


def test_wrapper_run_matches_functional():
    case = testing.make_fused_moe_case("w4a16", 4, 256, 128, 8, 2, seed=6)
    wrapper = flashinfer.CuteDslMoEWrapper(8, 2, 256, 128, quant_mode="w4a16", use_fused_finalize=False)
    assert wrapper.get_valid_tactics()
    got = wrapper.run(case["x"], None, case["topk_ids"], case["topk_weights"], case["w1"], _to_6d(case["w1_scale"]),
                      case["w1_alpha"], None, case["w2"], _to_6d(case["w2_scale"]), case["w2_alpha"])
    np.testing.assert_array_equal(got.view(np.uint16),
                                  _flashinfer_call(case, use_fused_finalize=False).view(np.uint16))
    with pytest.raises(ValueError, match="'w2_weight'"):
        flashinfer.CuteDslMoEWrapper(8, 2, 512, 128, quant_mode="w4a16").run(
            case["x"], None, case["topk_ids"], case["topk_weights"], case["w1"], case["w1_scale"], case["w1_alpha"],
            None, case["w2"], case["w2_scale"], case["w2_alpha"])


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(5, 8, 2, 512, 256), (16, 32, 8, 1024, 384)])
def test_sglang_moe_layer_call_sequence(tokens, experts, top_k, hidden, inter):
    """SGLang's cutlass_w4a8_moe forward, step by step, on qmoe's drop-in ops (CPU backend)."""
    case = testing.make_fused_moe_case("w4a8_int4", tokens, hidden, inter, experts, top_k, seed=tokens)
    ids, weights, x = case["topk_ids"], case["topk_weights"], case["x"]
    a1, a2 = case["x_scale"], case["fc2_input_scale"]
    slots = ids.size
    expert_offsets = np.empty(experts + 1, np.int32)
    ps1, ps2 = np.empty((experts, 3), np.int32), np.empty((experts, 3), np.int32)
    in_perm, out_perm = np.empty(slots, np.int32), np.empty(slots, np.int32)
    sgl_kernel.get_cutlass_w4a8_moe_mm_data(ids, expert_offsets, ps1, ps2, in_perm, out_perm, experts, inter, hidden)
    # SGLang builds src2dst with a stable sort of the flat ids; qmoe's output_permutation is that map.
    np.testing.assert_array_equal(out_perm, np.argsort(np.argsort(ids.reshape(-1), kind="stable"), kind="stable"))
    strides1 = np.full((experts, 3), hidden, np.int64)
    c_strides1 = np.full((experts, 3), 2 * inter, np.int64)
    strides2 = np.full((experts, 3), inter, np.int64)
    c_strides2 = np.full((experts, 3), hidden, np.int64)
    gateup_in = ref.quantize_fp8(x.astype(np.float32)[in_perm // top_k], a1)
    c1 = np.empty((slots, 2 * inter), ref.BF16)
    sgl_kernel.cutlass_w4a8_moe_mm(c1, gateup_in, case["w1"], a1, case["w1_scale"], expert_offsets[:-1], ps1,
                                   strides1, strides1, c_strides1, c_strides1, 128, top_k)
    h = c1.astype(np.float32)
    act = h[:, :inter] / (1 + np.exp(-h[:, :inter])) * h[:, inter:]
    inter_q = ref.quantize_fp8(act, a2)
    c2 = np.empty((slots, hidden), ref.BF16)
    sgl_kernel.cutlass_w4a8_moe_mm(c2, inter_q, case["w2"], a2, case["w2_scale"], expert_offsets[:-1], ps2,
                                   strides2, strides2, c_strides2, c_strides2, 128, top_k)
    rows = c2.astype(np.float32)[out_perm].reshape(tokens, top_k, hidden)
    out = (weights[:, :, None] * rows).sum(axis=1)
    # SGLang rounds GEMM1's output to bf16 before SiLU (qmoe's fused path does not): 3e-2 covers it.
    testing.assert_close(out, ref.fused_moe(**case, deterministic=True), "w4a8_int4", tol=3e-2)


def test_wrapper_graph_mode_needs_max_num_tokens():
    for bad in (None, 0):
        with pytest.raises(ValueError, match="max_num_tokens"):
            flashinfer.CuteDslMoEWrapper(8, 2, 256, 128, use_cuda_graph=True, max_num_tokens=bad, device="cuda")
    # CPU backend: nothing to pre-allocate, no error
    flashinfer.CuteDslMoEWrapper(8, 2, 256, 128, use_cuda_graph=True, device="cpu")


def test_workspace_is_refused_for_cpu_tensors():
    case = testing.make_fused_moe_case("w4a16", 3, 256, 128, 8, 2, seed=12)
    with pytest.raises(ValueError, match="'workspace'"):
        qmoe.fused_moe(**case, workspace=np.zeros(1 << 20, np.uint8))


def test_workspace_bound_binding():
    from qmoe import _C

    small = _C.fused_moe_workspace_bound("w4a4", 8, 4, 16, 1024, 512, True)
    large = _C.fused_moe_workspace_bound("w4a4", 256, 4, 16, 1024, 512, True)
    assert 0 < small < large
    assert _C.fused_moe_workspace_bound("w4a8_int4", 8, 4, 16, 1024, 512, False) > 0
    with pytest.raises(ValueError, match="'quant_mode'"):
        _C.fused_moe_workspace_bound("fp8", 8, 4, 16, 1024, 512, True)
    with pytest.raises(ValueError, match="'max_num_tokens'"):
        _C.fused_moe_workspace_bound("w4a4", -1, 4, 16, 1024, 512, True)
