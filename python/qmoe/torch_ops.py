"""qmoe's ops as torch.library custom ops (registered when torch is importable), so torch.compile
graphs and engine CUDA graphs can hold them:

    torch.ops.qmoe.get_cutlass_w4a8_moe_mm_data(...)   # mutates its five outputs
    torch.ops.qmoe.cutlass_w4a8_moe_mm(...)            # mutates d
    torch.ops.qmoe.fused_moe(...)                      # returns a new [T, H] tensor

Each has a fake (meta) implementation, so shapes propagate without running anything. The plain
DLPack path (qmoe.fused_moe, qmoe.compat.*) keeps working without torch.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import ops
from .compat import sgl_kernel

_FLT_MAX = 3.4028234663852886e38  # swiglu_limit "none"; a finite default keeps the op schema simple
_MM_DATA_OUTPUTS = ("expert_offsets", "problem_sizes1", "problem_sizes2", "input_permutation", "output_permutation")


@torch.library.custom_op("qmoe::get_cutlass_w4a8_moe_mm_data", mutates_args=_MM_DATA_OUTPUTS)
def get_cutlass_w4a8_moe_mm_data(topk_ids: Tensor, expert_offsets: Tensor, problem_sizes1: Tensor,
                                 problem_sizes2: Tensor, input_permutation: Tensor, output_permutation: Tensor,
                                 num_experts: int, n: int, k: int) -> None:
    sgl_kernel.get_cutlass_w4a8_moe_mm_data(topk_ids, expert_offsets, problem_sizes1, problem_sizes2,
                                            input_permutation, output_permutation, num_experts, n, k)


@get_cutlass_w4a8_moe_mm_data.register_fake
def _(topk_ids, expert_offsets, problem_sizes1, problem_sizes2, input_permutation, output_permutation,
      num_experts, n, k) -> None:
    return None


@torch.library.custom_op("qmoe::cutlass_w4a8_moe_mm", mutates_args=("d",))
def cutlass_w4a8_moe_mm(d: Tensor, a: Tensor, b: Tensor, a_scales: Tensor, b_scales: Tensor,
                        experts_offsets: Tensor, problem_sizes: Tensor, a_strides: Tensor, b_strides: Tensor,
                        d_strides: Tensor, s_strides: Tensor, chunk_size: int = 128, topk: int = 8) -> None:
    sgl_kernel.cutlass_w4a8_moe_mm(d, a, b, a_scales, b_scales, experts_offsets, problem_sizes, a_strides,
                                   b_strides, d_strides, s_strides, chunk_size, topk)


@cutlass_w4a8_moe_mm.register_fake
def _(d, a, b, a_scales, b_scales, experts_offsets, problem_sizes, a_strides, b_strides, d_strides, s_strides,
      chunk_size=128, topk=8) -> None:
    return None


@torch.library.custom_op("qmoe::fused_moe", mutates_args=())
def fused_moe(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w1_scale: Tensor, w2: Tensor,
              w2_scale: Tensor, quant_mode: str, num_experts: int, x_scale: Optional[Tensor] = None,
              w1_alpha: Optional[Tensor] = None, w2_alpha: Optional[Tensor] = None,
              fc2_input_scale: Optional[Tensor] = None, per_token_scale: Optional[Tensor] = None,
              num_local_experts: Optional[int] = None, local_expert_offset: int = 0, activation: str = "swiglu",
              swiglu_alpha: float = 1.0, swiglu_beta: float = 0.0, swiglu_limit: float = _FLT_MAX,
              situ_beta: float = 1.0, situ_linear_beta: Optional[float] = None, gate_up_layout: str = "gate_up",
              deterministic: bool = False, routed_scaling_factor: float = 1.0,
              output_dtype: str = "bfloat16", fp4_weights_packed: bool = False) -> Tensor:
    return ops.fused_moe(x, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, quant_mode=quant_mode,
                         num_experts=num_experts, x_scale=x_scale, w1_alpha=w1_alpha, w2_alpha=w2_alpha,
                         fc2_input_scale=fc2_input_scale, per_token_scale=per_token_scale,
                         num_local_experts=num_local_experts, local_expert_offset=local_expert_offset,
                         activation=activation, swiglu_alpha=swiglu_alpha, swiglu_beta=swiglu_beta,
                         swiglu_limit=swiglu_limit, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                         gate_up_layout=gate_up_layout, deterministic=deterministic,
                         routed_scaling_factor=routed_scaling_factor, output_dtype=output_dtype,
                         fp4_weights_packed=fp4_weights_packed)


@fused_moe.register_fake
def _(x, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, quant_mode, num_experts, x_scale=None, w1_alpha=None,
      w2_alpha=None, fc2_input_scale=None, per_token_scale=None, num_local_experts=None, local_expert_offset=0,
      activation="swiglu", swiglu_alpha=1.0, swiglu_beta=0.0, swiglu_limit=_FLT_MAX, situ_beta=1.0,
      situ_linear_beta=None, gate_up_layout="gate_up", deterministic=False, routed_scaling_factor=1.0,
      output_dtype="bfloat16", fp4_weights_packed=False):
    return x.new_empty((topk_ids.shape[0], w2.shape[1]), dtype=getattr(torch, output_dtype))
