"""Drop-in for FlashInfer's CuTe-DSL fused MoE (`cute_dsl_fused_moe`, `CuteDslMoEWrapper`,
`autotune`, `ActivationType`), running on qmoe's engine (Hopper kernels or the CPU reference).

Conventions kept from FlashInfer: gated W1 is [up; gate] interleaved in 64-row groups; FP4 weight
scales are in the 128x4 swizzle (the 6-D MMA view FlashInfer passes is accepted as is);
activation scales are row-major; SiTU is Swiglu + situ_beta. qmoe adds quant_mode "w4a8_int4"
(SGLang int4-g128 weights x FP8 activations; x_sf carries a1, fc2_input_scale carries a2; W1 is
[gate; up] there, as in SGLang).
"""
from __future__ import annotations

import contextlib
import enum
import re
import warnings

import numpy as np

from .. import _C, ops, tune
from .._tensors import is_torch

FLT_MAX = float(np.finfo(np.float32).max)


class ActivationType(enum.IntEnum):
    """FlashInfer's tllm_enums.ActivationType values."""
    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    Situ = 10
    InvalidType = 11


_SUPPORTED_ACTIVATIONS = {ActivationType.Swiglu: "swiglu", ActivationType.GegluTanh: "geglu_tanh",
                          ActivationType.Relu2: "relu2"}


def _activation(activation_type, situ_beta, situ_linear_beta) -> str:
    try:
        act = ActivationType(int(activation_type))
    except ValueError:
        raise ValueError(f"qmoe: argument 'activation_type': expected an ActivationType, got {activation_type!r}")
    if act not in _SUPPORTED_ACTIVATIONS:
        raise ValueError("qmoe: argument 'activation_type': expected Swiglu, GegluTanh or Relu2 "
                         f"(SiTU is Swiglu with situ_beta), got {act.name}")
    if situ_linear_beta is not None and situ_beta is None:
        raise ValueError("qmoe: argument 'situ_linear_beta': expected situ_beta to be set too, got situ_beta=None")
    if situ_beta is not None:
        if act != ActivationType.Swiglu:
            raise ValueError(f"qmoe: argument 'situ_beta': expected activation_type Swiglu, got {act.name}")
        return "situ"
    return _SUPPORTED_ACTIVATIONS[act]


def _quant_mode(quant_mode: str) -> str:
    if quant_mode == "nvfp4":
        warnings.warn("quant_mode='nvfp4' is deprecated; use 'w4a4'", DeprecationWarning, stacklevel=3)
        return "w4a4"
    if quant_mode not in ("w4a4", "w4a8", "w4a16", "w4a8_int4"):
        raise ValueError(f"qmoe: argument 'quant_mode': expected 'w4a4', 'w4a8', 'w4a16' or 'w4a8_int4', "
                         f"got {quant_mode!r}")
    return quant_mode


def _weight_sf(sf, name):
    """FlashInfer's 6-D MMA view (32, 4, Mt, 4, Kt, E) -> qmoe's [E, Mt*128, Kt*4] swizzled bytes."""
    if sf is None or len(sf.shape) != 6:
        return sf
    s32, s4a, mt, s4b, kt, experts = sf.shape
    if (s32, s4a, s4b) != (32, 4, 4):
        raise ValueError(f"qmoe: argument '{name}': expected a 6-D MMA scale view of shape (32, 4, Mt, 4, Kt, E), "
                         f"got {tuple(sf.shape)}")
    if is_torch(sf):
        base = sf.permute(5, 2, 4, 0, 1, 3)
        if not base.is_contiguous():
            raise ValueError(f"qmoe: argument '{name}': expected the 6-D view of a contiguous swizzled buffer")
        return base.reshape(experts, mt * 128, kt * 4)
    base = np.ascontiguousarray(np.transpose(sf, (5, 2, 4, 0, 1, 3)))
    return base.reshape(experts, mt * 128, kt * 4)


def cute_dsl_fused_moe(x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
                       fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, num_experts, top_k,
                       num_local_experts=None, local_expert_offset=0, output_dtype="bfloat16",
                       use_fused_finalize=True, moe_output=None, aux_stream=None, enable_pdl=True,
                       activation_type=ActivationType.Swiglu, swiglu_alpha=1.0, swiglu_beta=0.0,
                       swiglu_limit=FLT_MAX, situ_beta=None, situ_linear_beta=None, *, quant_mode="w4a4",
                       per_token_scale=None, tactic=None, workspace=None, fp4_weights_packed=False):
    """FlashInfer's seed signature. Returns the [num_tokens, hidden] output (moe_output if given).
    use_fused_finalize=True: output zeroed (on aux_stream when given: a torch.cuda.Stream or raw
    handle, forked from and joined back into the current stream), GEMM2 scatter-adds into it.
    workspace (qmoe extension): pre-allocated scratch (qmoe.fused_moe's `workspace`).
    fp4_weights_packed (qmoe extension): w1_weight / w2_weight prepared once by qmoe.quant.pack_fp4_weights
    (faster GPU GEMMs, same results)."""
    mode = _quant_mode(quant_mode)
    activation = _activation(activation_type, situ_beta, situ_linear_beta)
    if len(getattr(token_selected_experts, "shape", ())) != 2 or token_selected_experts.shape[1] != top_k:
        raise ValueError("qmoe: argument 'token_selected_experts': expected shape [num_tokens, top_k="
                         f"{top_k}], got {tuple(getattr(token_selected_experts, 'shape', ()))}")
    if mode == "w4a4" and x_sf is not None and len(x_sf.shape) == 3 and x_sf.shape[2] == 1:
        x_sf = x_sf.reshape(x_sf.shape[0], x_sf.shape[1])
    layout = "gate_up" if (mode == "w4a8_int4" or activation == "relu2") else "up_gate_interleaved64"
    with _flashinfer_argument_names():
        return ops.fused_moe(
            x, token_selected_experts, token_final_scales, w1_weight, _weight_sf(w1_weight_sf, "w1_weight_sf"),
            w2_weight, _weight_sf(w2_weight_sf, "w2_weight_sf"), quant_mode=mode, num_experts=num_experts,
            x_scale=x_sf, w1_alpha=w1_alpha, w2_alpha=w2_alpha, fc2_input_scale=fc2_input_scale,
            per_token_scale=per_token_scale, num_local_experts=num_local_experts,
            local_expert_offset=local_expert_offset, activation=activation,
            # FlashInfer ignores the swiglu parameters on the other activations; qmoe's native API
            # rejects them there, so they are passed only with SwiGLU.
            **(dict(swiglu_alpha=swiglu_alpha, swiglu_beta=swiglu_beta, swiglu_limit=swiglu_limit)
               if activation == "swiglu" else {}),
            situ_beta=1.0 if situ_beta is None else situ_beta, situ_linear_beta=situ_linear_beta,
            gate_up_layout=layout, deterministic=not use_fused_finalize, output_dtype=output_dtype, out=moe_output,
            tactic=None if tactic is None else str(tactic), workspace=workspace, enable_pdl=bool(enable_pdl),
            aux_stream=aux_stream if use_fused_finalize else None, fp4_weights_packed=bool(fp4_weights_packed))


# qmoe's native argument names -> FlashInfer's: errors raised under cute_dsl_fused_moe name each
# argument as its caller wrote it.
_FLASHINFER_NAMES = {"topk_ids": "token_selected_experts", "topk_weights": "token_final_scales", "x_scale": "x_sf",
                     "w1": "w1_weight", "w1_scale": "w1_weight_sf", "w2": "w2_weight", "w2_scale": "w2_weight_sf",
                     "out": "moe_output", "output": "moe_output"}


@contextlib.contextmanager
def _flashinfer_argument_names():
    """Re-raise a ValueError / TypeError of qmoe's native op with FlashInfer's argument names (same
    type, the message otherwise unchanged)."""
    try:
        yield
    except (ValueError, TypeError) as err:
        text = str(err)
        renamed = re.sub(r"argument '([^']+)'", lambda m: f"argument '{_FLASHINFER_NAMES.get(m[1], m[1])}'", text)
        if renamed == text:
            raise
        raise type(err)(renamed) from err


class CuteDslMoEWrapper:
    """FlashInfer's wrapper: holds the layer configuration; run() executes one forward. On CUDA it
    keeps a private side stream for the fused finalize's output memset (created with the buffers
    when use_cuda_graph=True, else at the first run), as FlashInfer's wrapper does."""

    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False,
                 max_num_tokens=None, num_local_experts=None, local_expert_offset=0, tile_size=128,
                 sf_vec_size=16, output_dtype="bfloat16", device="cuda", enable_pdl=True,
                 activation_type=ActivationType.Swiglu, swiglu_alpha=1.0, swiglu_beta=0.0, swiglu_limit=FLT_MAX,
                 situ_beta=None, situ_linear_beta=None, use_fused_finalize=True, quant_mode="w4a4",
                 localized_weights=None, locality_streams=None, fp4_weights_packed=False):
        if localized_weights is not None or locality_streams is not None:
            raise ValueError("qmoe: argument 'localized_weights': expected None: locality domains exist only on "
                             "two-die GPUs (Rubin); Hopper is one die, so there is nothing to localize")
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        self.hidden_size, self.intermediate_size = int(hidden_size), int(intermediate_size)
        self.num_local_experts = self.num_experts if num_local_experts is None else int(num_local_experts)
        self.local_expert_offset = int(local_expert_offset)
        self.max_num_tokens = max_num_tokens
        self.use_cuda_graph = bool(use_cuda_graph)
        self.output_dtype, self.device, self.enable_pdl = output_dtype, device, enable_pdl
        self.quant_mode = _quant_mode(quant_mode)
        self.activation = _activation(activation_type, situ_beta, situ_linear_beta)
        # use_cuda_graph: scratch and output for max_num_tokens allocated once, here, so that run()
        # allocates nothing and graphs captured for several token counts share the same buffers
        # (replays see new routing and inputs written in place).
        self._workspace = self._output = self._aux_stream = None
        if self.use_cuda_graph and str(device).startswith("cuda"):
            if not max_num_tokens or int(max_num_tokens) < 1:
                raise ValueError("qmoe: argument 'max_num_tokens': expected a positive token count with "
                                 f"use_cuda_graph=True (buffers are sized for it), got {max_num_tokens!r}")
            import torch

            gated = self.activation != "relu2"
            nbytes = _C.fused_moe_workspace_bound(self.quant_mode, int(max_num_tokens), self.top_k,
                                                  self.num_local_experts, self.hidden_size, self.intermediate_size,
                                                  gated)
            self._workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
            out_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
                str(output_dtype).replace("torch.", ""), output_dtype)
            self._output = torch.empty((int(max_num_tokens), self.hidden_size), dtype=out_dtype, device=device)
            # As FlashInfer's wrapper: a private side stream for the fused finalize's output memset,
            # created here, outside any capture (the fork/join through events is captured with run()).
            self._aux_stream = torch.cuda.Stream(device=self._output.device)
        self._config = dict(activation_type=activation_type, swiglu_alpha=swiglu_alpha, swiglu_beta=swiglu_beta,
                            swiglu_limit=swiglu_limit, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                            use_fused_finalize=use_fused_finalize, fp4_weights_packed=bool(fp4_weights_packed))

    def get_valid_tactics(self):
        """Tactic names usable by run(): on a CUDA device, the GEMM tactics valid for both GEMMs of
        this layer (qmoe.valid_tactics; the W4A8 GEMM's for 'w4a8_int4', the bf16 x 4-bit GEMM's for
        the other modes); on the CPU backend the single 'reference', which forces nothing."""
        if str(self.device).startswith("cuda"):
            gated = self.activation != "relu2"
            return tune.fused_moe_candidates(self.max_num_tokens or 1, self.hidden_size, self.intermediate_size,
                                             gated, self.num_local_experts, self.top_k, self.quant_mode)
        return ["reference"]

    def run(self, x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
            fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic=None, *, per_token_scale=None,
            moe_output=None):
        if w2_weight.shape[1] != self.hidden_size:
            raise ValueError(f"qmoe: argument 'w2_weight': expected hidden size {self.hidden_size} in dim 1, "
                             f"got shape {tuple(w2_weight.shape)}")
        if self._output is not None:
            tokens = token_selected_experts.shape[0]
            if tokens > self._output.shape[0]:
                raise ValueError(f"qmoe: argument 'token_selected_experts': expected at most max_num_tokens="
                                 f"{self._output.shape[0]} tokens (use_cuda_graph=True), got {tokens}")
            if moe_output is None:
                moe_output = self._output[:tokens]
        if self._aux_stream is None and is_torch(x) and x.is_cuda:  # eager mode: created at the first run
            import torch

            self._aux_stream = torch.cuda.Stream(device=x.device)
        aux = self._aux_stream if is_torch(x) and x.is_cuda and self._aux_stream.device == x.device else None
        return cute_dsl_fused_moe(
            x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha, fc2_input_scale,
            w2_weight, w2_weight_sf, w2_alpha, self.num_experts, self.top_k,
            num_local_experts=self.num_local_experts, local_expert_offset=self.local_expert_offset,
            output_dtype=self.output_dtype, moe_output=moe_output, aux_stream=aux, enable_pdl=self.enable_pdl,
            quant_mode=self.quant_mode, per_token_scale=per_token_scale,
            tactic=None if tactic in (None, "reference") else tactic, workspace=self._workspace, **self._config)


# FlashInfer's `with autotune(True, cache=path): ...` is qmoe's autotuner itself (qmoe/tune.py):
# the same thread-local tuning flag, in-memory cache and JSON file with _metadata.
autotune = tune.autotune
