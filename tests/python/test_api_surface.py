"""The Python API surface: signatures identical to SGLang's and FlashInfer's, enums, and the
Python-level argument errors."""
import inspect

import numpy as np
import pytest

import qmoe
from qmoe.compat import flashinfer, sgl_kernel

SGL_MM_DATA = ["topk_ids", "expert_offsets", "problem_sizes1", "problem_sizes2", "input_permutation",
               "output_permutation", "num_experts", "n", "k"]
SGL_MM = ["d", "a", "b", "a_scales", "b_scales", "experts_offsets", "problem_sizes", "a_strides", "b_strides",
          "d_strides", "s_strides", "chunk_size", "topk"]
FI_FUSED = ["x", "x_sf", "token_selected_experts", "token_final_scales", "w1_weight", "w1_weight_sf", "w1_alpha",
            "fc2_input_scale", "w2_weight", "w2_weight_sf", "w2_alpha", "num_experts", "top_k",
            "num_local_experts", "local_expert_offset", "output_dtype", "use_fused_finalize", "moe_output",
            "aux_stream", "enable_pdl", "activation_type", "swiglu_alpha", "swiglu_beta", "swiglu_limit",
            "situ_beta", "situ_linear_beta", "quant_mode", "per_token_scale", "tactic",
            "workspace", "fp4_weights_packed"]  # tactic, workspace, fp4_weights_packed: qmoe extensions (keyword-only)
FI_WRAPPER_RUN = ["x", "x_sf", "token_selected_experts", "token_final_scales", "w1_weight", "w1_weight_sf",
                  "w1_alpha", "fc2_input_scale", "w2_weight", "w2_weight_sf", "w2_alpha", "tactic",
                  "per_token_scale"]


def _params(fn):
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def test_sgl_kernel_signatures_match_sglang():
    assert _params(sgl_kernel.get_cutlass_w4a8_moe_mm_data) == SGL_MM_DATA
    assert _params(sgl_kernel.cutlass_w4a8_moe_mm)[: len(SGL_MM)] == SGL_MM
    defaults = inspect.signature(sgl_kernel.cutlass_w4a8_moe_mm).parameters
    assert defaults["chunk_size"].default == 128 and defaults["topk"].default == 8


def test_pdl_is_on_by_default_as_in_flashinfer():
    for fn in (qmoe.fused_moe, flashinfer.cute_dsl_fused_moe, flashinfer.CuteDslMoEWrapper.__init__):
        assert inspect.signature(fn).parameters["enable_pdl"].default is True, fn


def test_flashinfer_signatures_match_seed():
    assert _params(flashinfer.cute_dsl_fused_moe) == FI_FUSED
    sig = inspect.signature(flashinfer.cute_dsl_fused_moe).parameters
    assert sig["quant_mode"].kind == inspect.Parameter.KEYWORD_ONLY and sig["quant_mode"].default == "w4a4"
    assert sig["use_fused_finalize"].default is True
    assert sig["activation_type"].default == flashinfer.ActivationType.Swiglu
    assert _params(flashinfer.CuteDslMoEWrapper.run)[: len(FI_WRAPPER_RUN)] == FI_WRAPPER_RUN


def test_activation_type_values_match_flashinfer():
    a = flashinfer.ActivationType
    assert (a.Gelu, a.Relu, a.Silu, a.Swiglu, a.Geglu, a.SwigluBias, a.Relu2, a.SwigluStep, a.GegluTanh,
            a.Identity, a.Situ, a.InvalidType) == tuple(range(12))


def test_non_tensor_argument_is_a_type_error_naming_it():
    ids = np.zeros((4, 2), dtype=np.int32)
    with pytest.raises(TypeError, match="'topk_ids'"):
        sgl_kernel.get_cutlass_w4a8_moe_mm_data([[0, 1]], ids, ids, ids, ids, ids, 4, 8, 128)


def test_unsupported_numpy_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="'topk_ids'.*complex128"):
        sgl_kernel.get_cutlass_w4a8_moe_mm_data(np.zeros(4, np.complex128), *(np.zeros(5, np.int32),) * 5, 4, 8, 128)


def test_fused_moe_rejects_unknown_quant_mode():
    with pytest.raises(ValueError, match="'quant_mode'"):
        qmoe.fused_moe(None, np.zeros((1, 1), np.int32), None, None, None, None, None, quant_mode="w8a8",
                       num_experts=1)


def test_flashinfer_activation_checks():
    with pytest.raises(ValueError, match="'activation_type'"):
        flashinfer._activation(flashinfer.ActivationType.Gelu, None, None)
    with pytest.raises(ValueError, match="'situ_linear_beta'"):
        flashinfer._activation(flashinfer.ActivationType.Swiglu, None, 1.5)
    with pytest.raises(ValueError, match="'situ_beta'"):
        flashinfer._activation(flashinfer.ActivationType.Relu2, 1.0, None)
    assert flashinfer._activation(flashinfer.ActivationType.Swiglu, 1.0, None) == "situ"
    assert flashinfer._activation(flashinfer.ActivationType.GegluTanh, None, None) == "geglu_tanh"


def test_nvfp4_alias_warns():
    with pytest.warns(DeprecationWarning):
        assert flashinfer._quant_mode("nvfp4") == "w4a4"
    with pytest.raises(ValueError, match="'quant_mode'"):
        flashinfer._quant_mode("fp8")


def test_localized_weights_raise_on_hopper():
    with pytest.raises(ValueError, match="'localized_weights'.*one die"):
        flashinfer.CuteDslMoEWrapper(8, 2, 256, 128, localized_weights=[object()])


def test_weight_sf_6d_view_round_trip():
    experts, mt, kt = 2, 1, 2
    flat = np.arange(experts * mt * kt * 512, dtype=np.uint8)
    view6 = np.transpose(flat.reshape(experts, mt, kt, 32, 4, 4), (3, 4, 1, 5, 2, 0))
    assert view6.shape == (32, 4, mt, 4, kt, experts)
    back = flashinfer._weight_sf(view6, "w1_weight_sf")
    assert back.shape == (experts, mt * 128, kt * 4)
    assert np.array_equal(back.reshape(-1), flat)
