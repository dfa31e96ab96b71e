"""qmoe's native Python API. Tensors: numpy arrays run the CPU reference backend; torch CUDA
tensors run the Hopper kernels on torch's current stream. Outputs are allocated with the caller's
framework when not given."""
from __future__ import annotations

import math

import numpy as np

from . import _C
from ._tensors import arg, as_int, current_stream, is_torch

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

QUANT_MODES = ("w4a4", "w4a8", "w4a16", "w4a8_int4", "w4a16_int4")
ACTIVATIONS = ("swiglu", "geglu_tanh", "relu2", "situ")
GATE_UP_LAYOUTS = ("gate_up", "up_gate_interleaved64")
OUTPUT_DTYPES = ("bfloat16", "float16", "float32")


def empty_like_framework(like, shape, dtype_name: str):
    """Allocate an uninitialised tensor with like's framework and device."""
    if is_torch(like):
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype_name), device=like.device)
    if dtype_name == "bfloat16":
        return np.empty(shape, dtype=ml_dtypes.bfloat16)
    return np.empty(shape, dtype=np.dtype(dtype_name))


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in OUTPUT_DTYPES:
        raise ValueError(f"qmoe: argument 'output_dtype': expected one of {OUTPUT_DTYPES}, got {name}")
    return name


def _run_with_tactic(call, tactic, workspace, x):
    """One run of the layer with a given tactic (the autotuner times these)."""
    call.tactic = tactic
    _C.fused_moe(call, arg(workspace, "workspace"), current_stream(x))


def _layer_call(quant_mode, x, x_scale, topk_ids, topk_weights, w1, w1_scale, w1_alpha, fc2_input_scale, w2,
                w2_scale, w2_alpha, per_token_scale, output, num_experts, num_local_experts, local_expert_offset,
                activation, swiglu_alpha, swiglu_beta, swiglu_limit, situ_beta, situ_linear_beta, gate_up_layout,
                deterministic, routed_scaling_factor, tactic):
    """The _C.LayerCall of one fused-MoE call (output = (tensor, name)), validated on use."""
    return _C.LayerCall(
        quant_mode, arg(x, "x"), arg(x_scale, "x_scale"), arg(topk_ids, "topk_ids"),
        arg(topk_weights, "topk_weights"), arg(w1, "w1"), arg(w1_scale, "w1_scale"), arg(w1_alpha, "w1_alpha"),
        arg(fc2_input_scale, "fc2_input_scale"), arg(w2, "w2"), arg(w2_scale, "w2_scale"),
        arg(w2_alpha, "w2_alpha"), arg(per_token_scale, "per_token_scale"), arg(output[0], output[1], output=True),
        as_int(num_experts, "num_experts"),
        as_int(num_experts if num_local_experts is None else num_local_experts, "num_local_experts"),
        as_int(local_expert_offset, "local_expert_offset"),
        activation, float(swiglu_alpha), float(swiglu_beta), float(min(swiglu_limit, np.finfo(np.float32).max)),
        float(situ_beta), None if situ_linear_beta is None else float(situ_linear_beta), gate_up_layout,
        bool(deterministic), float(routed_scaling_factor), tactic or "")


def _describe(t) -> str:
    if not is_torch(t):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')} {tuple(t.shape)} on {t.device}" + ("" if t.is_contiguous() else " (non-contiguous)")


def fused_moe(x, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, *, quant_mode, num_experts,
              x_scale=None, w1_alpha=None, w2_alpha=None, fc2_input_scale=None, per_token_scale=None,
              num_local_experts=None, local_expert_offset=0, activation="swiglu", swiglu_alpha=1.0,
              swiglu_beta=0.0, swiglu_limit=math.inf, situ_beta=1.0, situ_linear_beta=None,
              gate_up_layout="gate_up", deterministic=False, routed_scaling_factor=1.0,
              output_dtype="bfloat16", out=None, tactic=None, workspace=None, enable_pdl=True, aux_stream=None,
              fp4_weights_packed=False):
    """One MoE layer: out[t] = rsf * sum_j w[t,j] * alpha2 * W2 . requant(act(alpha1 * W13 . x[t])).

    See include/qmoe/fused_moe.h for the tensors of each quant_mode. `out` ([T, H]) is written,
    never accumulated into. Returns the output tensor. `workspace` (CUDA tensors only): a uint8
    CUDA tensor of at least _C.fused_moe_workspace_size bytes to use instead of allocating one
    (CuteDslMoEWrapper(use_cuda_graph=True) passes its pre-allocated buffer). `enable_pdl`: CUDA
    programmatic dependent launch between the pipeline's kernels (same results; no effect on the CPU;
    on by default, as FlashInfer's: 2-40 us less per layer measured on the H200).
    `deterministic=False` (the fused finalize): on the GPU the output is zeroed and GEMM2 adds each
    slot's bf16-rounded weighted row into its token's row atomically (summation order, hence the last
    bits, vary run to run); True: fixed-order fp32 sum, bitwise reproducible. `aux_stream` (CUDA, fused
    finalize only): a torch.cuda.Stream or raw cudaStream_t int on x's device that runs the output
    memset, forked from and joined back into the current stream, so it overlaps the earlier kernels
    (FlashInfer's aux_stream); None: the memset runs on the current stream.
    `fp4_weights_packed` (FP4 weight modes w4a4 / w4a8 / w4a16; a qmoe extension): w1 and w2 are in qmoe's
    packed word order (qmoe.quant.pack_fp4_weights, a one-time weight preparation): the same exact products
    (bit-identical on the CPU; on the GPU the fp32 summation order differs) and faster GPU GEMMs (their FP4
    decode takes fewer instructions).
    """
    if quant_mode not in QUANT_MODES:
        raise ValueError(f"qmoe: argument 'quant_mode': expected one of {QUANT_MODES}, got {quant_mode!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"qmoe: argument 'activation': expected one of {ACTIVATIONS}, got {activation!r}")
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(
            f"qmoe: argument 'gate_up_layout': expected one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
    if len(getattr(topk_ids, "shape", ())) != 2:
        raise ValueError("qmoe: argument 'topk_ids': expected a 2-D tensor [T, top_k], got "
                         f"shape {tuple(getattr(topk_ids, 'shape', ()))}")
    if len(getattr(w2, "shape", ())) != 3:
        raise ValueError("qmoe: argument 'w2': expected a 3-D tensor [E_local, H, I/2], got "
                         f"shape {tuple(getattr(w2, 'shape', ()))}")
    num_tokens, hidden = topk_ids.shape[0], w2.shape[1]
    if out is None:
        out = empty_like_framework(x, (num_tokens, hidden), _dtype_name(output_dtype))
    call = _layer_call(quant_mode, x, x_scale, topk_ids, topk_weights, w1, w1_scale, w1_alpha, fc2_input_scale,
                       w2, w2_scale, w2_alpha, per_token_scale, (out, "out"), num_experts, num_local_experts,
                       local_expert_offset, activation, swiglu_alpha, swiglu_beta, swiglu_limit, situ_beta,
                       situ_linear_beta, gate_up_layout, deterministic, routed_scaling_factor, tactic)
    call.enable_pdl = bool(enable_pdl)
    call.fp4_weights_packed = bool(fp4_weights_packed)
    if workspace is not None and not (is_torch(x) and x.is_cuda):
        raise ValueError("qmoe: argument 'workspace': expected None for CPU tensors (the CPU engine "
                         f"allocates its own scratch), got {_describe(workspace)}")
    if is_torch(x) and x.is_cuda:
        # Scratch of the GPU pipeline (exact size from C++; validates the call first). Allocated by
        # torch's caching allocator on x's device: cheap per call, and inside a CUDA-graph capture
        # it comes from the graph's private pool, so captured calls stay replayable.
        import torch

        nbytes = _C.fused_moe_workspace_size(call)
        if workspace is not None:
            if not (is_torch(workspace) and workspace.is_cuda and workspace.dtype == torch.uint8
                    and workspace.device == x.device and workspace.is_contiguous()
                    and workspace.numel() >= nbytes):
                raise ValueError(f"qmoe: argument 'workspace': expected a contiguous uint8 tensor on {x.device} "
                                 f"of at least {nbytes} bytes, got {_describe(workspace)}")
        elif nbytes > 0:
            workspace = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        if not tactic and _C.kernels_built():
            # No forced tactic: the autotuner's cached winner, or inside autotune() the fastest
            # tactic timed now on this call's own tensors (the W4A8 GEMM's tactics for w4a8_int4,
            # the bf16 x 4-bit GEMM's for the other modes); None keeps the C++ heuristic.
            from . import tune

            chosen = tune.fused_moe_tactic(
                num_tokens, quant_mode=quant_mode, hidden=hidden, inter=2 * w2.shape[2],
                gated=activation != "relu2", num_experts=int(num_experts),
                num_local_experts=int(num_local_experts or num_experts),
                topk=topk_ids.shape[1], activation=activation, gate_up_layout=gate_up_layout,
                deterministic=bool(deterministic), x_dtype=str(x.dtype).replace("torch.", ""),
                out_dtype=str(out.dtype).replace("torch.", ""), device=x.device,
                run=lambda name: _run_with_tactic(call, name, workspace, x),
                fp4_weights_packed=bool(fp4_weights_packed))
            call.tactic = chosen or ""
        # After tuning: the timed runs keep the memset inline (FlashInfer forces that too, PR #4192).
        call.aux_stream = _aux_stream_handle(aux_stream, x)
    _C.fused_moe(call, arg(workspace, "workspace"), current_stream(x))
    return out


def _aux_stream_handle(aux_stream, x) -> int:
    """fused_moe's aux_stream as a raw cudaStream_t (0: none): a torch.cuda.Stream on x's device, an
    int handle, or None."""
    if aux_stream is None:
        return 0
    if isinstance(aux_stream, bool):
        raise ValueError(f"qmoe: argument 'aux_stream': expected a torch.cuda.Stream, an int handle or None, "
                         f"got {aux_stream!r}")
    if isinstance(aux_stream, int):
        if aux_stream < 0:
            raise ValueError(f"qmoe: argument 'aux_stream': expected a non-negative stream handle, got {aux_stream}")
        return aux_stream
    import torch

    if isinstance(aux_stream, torch.cuda.Stream):
        if aux_stream.device != x.device:
            raise ValueError(f"qmoe: argument 'aux_stream': expected a stream on {x.device} (the device of 'x'), "
                             f"got one on {aux_stream.device}")
        return int(aux_stream.cuda_stream)
    raise ValueError(f"qmoe: argument 'aux_stream': expected a torch.cuda.Stream, an int handle or None, "
                     f"got {type(aux_stream).__name__}")


def moe_expert_rows(x, topk_ids, w1, w1_scale, w2, w2_scale, *, quant_mode, num_experts, x_scale=None,
                    w1_alpha=None, w2_alpha=None, fc2_input_scale=None, per_token_scale=None,
                    num_local_experts=None, local_expert_offset=0, activation="swiglu", swiglu_alpha=1.0,
                    swiglu_beta=0.0, swiglu_limit=math.inf, situ_beta=1.0, situ_linear_beta=None,
                    gate_up_layout="gate_up", rows=None, tactic=None, fp4_weights_packed=False):
    """Per-slot GEMM2 rows without the finalize: rows bf16 [T*k, H], rows[t*k + j] =
    bf16(alpha2 * W2 . requant(act(alpha1 * W13 . x[t]))) for every valid local slot (no routing
    weight); rows of other slots are left unwritten. moe_finalize(rows, ...) then equals
    fused_moe(..., deterministic=True) bit for bit (on the GPU: with the same GEMM tactics, which the
    heuristic picks from the problem size; pass tactic= to pin them). numpy arrays run the CPU
    reference; torch CUDA tensors the GPU pipeline on torch's current stream (no host sync)."""
    if len(getattr(topk_ids, "shape", ())) != 2:
        raise ValueError("qmoe: argument 'topk_ids': expected a 2-D tensor [T, top_k], got "
                         f"shape {tuple(getattr(topk_ids, 'shape', ()))}")
    if len(getattr(w2, "shape", ())) != 3:
        raise ValueError("qmoe: argument 'w2': expected a 3-D tensor [E_local, H, I/2], got "
                         f"shape {tuple(getattr(w2, 'shape', ()))}")
    num_tokens, top_k = topk_ids.shape
    if rows is None:
        rows = empty_like_framework(x, (num_tokens * top_k, w2.shape[1]), "bfloat16")
    # The routing weights are not applied here; the native call checks a [T, k] f32 tensor anyway.
    if is_torch(x):
        import torch

        ones = torch.ones((num_tokens, top_k), dtype=torch.float32, device=x.device)
    else:
        ones = np.ones((num_tokens, top_k), np.float32)
    call = _layer_call(
        quant_mode, x, x_scale, topk_ids, ones, w1, w1_scale, w1_alpha, fc2_input_scale, w2, w2_scale, w2_alpha,
        per_token_scale, (rows, "rows"), num_experts, num_local_experts, local_expert_offset, activation,
        swiglu_alpha, swiglu_beta, swiglu_limit, situ_beta, situ_linear_beta, gate_up_layout, True, 1.0, tactic)
    call.fp4_weights_packed = bool(fp4_weights_packed)
    workspace = None
    if is_torch(x) and x.is_cuda:
        # Exact scratch size from C++ (validates the call first); torch's caching allocator makes it
        # cheap per call and takes it from the graph's pool inside a CUDA-graph capture.
        import torch

        nbytes = _C.moe_expert_rows_workspace_size(call)
        if nbytes > 0:
            workspace = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    _C.moe_expert_rows(call, arg(workspace, "workspace"), current_stream(x))
    return rows


def moe_finalize(rows, topk_ids, topk_weights, *, num_experts, num_local_experts=None, local_expert_offset=0,
                 routed_scaling_factor=1.0, output_dtype="bfloat16", out=None, row_index=None):
    """Deterministic finalize of per-slot rows (bf16 [T*k, H], as moe_expert_rows writes them):
    out[t] = round_out(rsf * sum_j fp32(w[t, j] * rows[t*k + j])), fp32 in slot order, over the slots
    whose expert is valid and local; other rows are never read. row_index (int32 [T*k] or [T, k]):
    slot s reads rows[row_index[s]] instead, rows then [R, H] of any R; an index outside [0, R)
    (e.g. -1) drops the slot. The result equals moe_finalize(rows[row_index], ...) bit for bit
    without that gather. numpy arrays run the CPU reference; torch CUDA tensors a GPU kernel
    (bit-identical) on torch's current stream."""
    if len(getattr(topk_ids, "shape", ())) != 2 or len(getattr(rows, "shape", ())) != 2:
        raise ValueError("qmoe: argument 'rows': expected rows [T*k, H] and topk_ids [T, k], got shapes "
                         f"{tuple(getattr(rows, 'shape', ()))} and {tuple(getattr(topk_ids, 'shape', ()))}")
    if out is None:
        out = empty_like_framework(rows, (topk_ids.shape[0], rows.shape[1]), _dtype_name(output_dtype))
    _C.moe_finalize(arg(rows, "rows"), arg(topk_ids, "topk_ids"), arg(topk_weights, "topk_weights"),
                    arg(out, "out", output=True), as_int(num_experts, "num_experts"),
                    as_int(num_experts if num_local_experts is None else num_local_experts, "num_local_experts"),
                    as_int(local_expert_offset, "local_expert_offset"), float(routed_scaling_factor),
                    current_stream(rows), arg(row_index, "row_index"))
    return out


def select_tactic(n: int, k: int, total_rows: int, num_experts: int, topk: int = 8,
                  bf16_activations: bool = False, fp4_weights: bool = False, activation_slots: bool = False) -> str:
    """The grouped GEMM tactic the heuristic picks for this problem (pure function). bf16_activations:
    the bf16 x 4-bit GEMM of the fused w4a16 / w4a16_int4 / w4a4 / w4a8 modes instead of the W4A8 one;
    fp4_weights: its weights are FP4 (w4a16, w4a4, w4a8), not int4 (w4a16_int4); activation_slots: the W4A8 call
    has an a_slots scratch (the SGLang wrapper passes one where it pays), which can change the choice."""
    return _C.select_tactic(n, k, total_rows, num_experts, topk, bool(bf16_activations), bool(fp4_weights),
                            bool(activation_slots))


def w4a8_activation_slots(n: int, k: int, total_rows: int, num_experts: int, topk: int = 8, tactic=None) -> bool:
    """Whether cutlass_w4a8_moe_mm would use an a_slots scratch ([R, 2K + K/32] uint8: the activations once in the
    16-token decode tile's fp16 operand slots; same results, a faster tile) for this problem and tactic (None: the
    heuristic's choice with the scratch given). The SGLang wrapper allocates one exactly then."""
    return bool(_C.w4a8_activation_slots(n, k, total_rows, num_experts, topk, tactic))


def valid_tactics(n: int, k: int, total_rows: int, num_experts: int, topk: int = 8,
                  bf16_activations: bool = False) -> list:
    return list(_C.valid_tactics(n, k, total_rows, num_experts, topk, bool(bf16_activations)))
