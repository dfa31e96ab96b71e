"""Shared test utilities (DESIGN.md section 7): the one tolerance policy, error metrics, seeded
generators of routing / weights / activations for every quant mode, model shapes, poison helpers.
numpy + ml_dtypes only (imports qmoe.reference, never qmoe._C), so the numpy-twin tests, the C++
reference comparisons and the GPU comparisons all draw the same data.

Tolerance policy: relative RMS error vs the reference on the same quantized operands <= 1e-2, and
<= 2e-2 for the fused modes that requantize the intermediate to 4 bits (w4a4), where a rounding
flip near a code boundary is legitimate. max_rel is reported beside it, not gated.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import NamedTuple

import numpy as np

try:  # inside the package
    from . import reference as ref
except ImportError:  # loaded by file path (tests before the extension exists)
    _name = "qmoe_reference_standalone"
    ref = sys.modules.get(_name)
    if ref is None:
        _spec = importlib.util.spec_from_file_location(_name, os.path.join(os.path.dirname(__file__), "reference.py"))
        ref = importlib.util.module_from_spec(_spec)
        sys.modules[_name] = ref
        _spec.loader.exec_module(ref)

# ------------------------------------------------------------------------------------------------
# Tolerances and metrics
# ------------------------------------------------------------------------------------------------
TOLERANCES = {
    "w4a8_int4": 1e-2,       # FP8 intermediate
    "w4a16_int4": 1e-2,      # bf16 intermediate
    "w4a8": 1e-2,            # MXFP8 intermediate
    "w4a16": 1e-2,           # bf16 intermediate
    "w4a4": 2e-2,            # NVFP4 intermediate (4-bit requant)
    "w4a4_per_token": 2e-2,  # bf16 intermediate, then per-row NVFP4
    "grouped_gemm": 1e-2,    # w4a8_moe_mm: no requantization at all
}

# w4a8_int4 through the W4A8 GEMM's WGMMA tiles with a handful of tokens (fewer than 64 slots). Those tiles sum each
# 128-K group in the tensor cores' order, so GEMM1's fp32 sums sit a few ulps off the CPU's and now and then round to
# the other e4m3 code in the requantized intermediate (one step: up to 12.5% of that element). Over a few hundred
# outputs rel_rms is then the spread of a few such flips, not a bound on the arithmetic: 12 seeds at T = 1, top-1, I =
# 128 (H200, session 36, every WGMMA tile): mean 4.9e-3, max 4.5e-2; T = 13, top-4: max 1.1e-2 (the 32-token tile on
# biased codes: 1.5e-2). The mma.sync tiles match the CPU engine to ~1e-5 at those sizes and keep the mode's tolerance.
FEW_TOKENS_WGMMA_TOLERANCE = 5e-2

# DESIGN 7: (num_experts, top_k, hidden H, intermediate I). TP shards divide I.
MODEL_SHAPES = {
    "deepseek_v3": (256, 8, 7168, 2048),
    "qwen3_235b_a22b": (128, 8, 4096, 1536),
    "qwen3_30b_a3b": (128, 8, 2048, 768),
    "gpt_oss_120b": (128, 4, 2880, 2880),
    "mixtral_8x7b": (8, 2, 4096, 14336),
    "kimi_k2": (384, 8, 7168, 2048),
    "glm_4_5": (160, 8, 5120, 1536),
}
TOPK_VALUES = (1, 2, 4, 6, 8)


def tolerance(mode: str, per_token: bool = False) -> float:
    return TOLERANCES["w4a4_per_token" if (per_token and mode == "w4a4") else mode]


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float32).astype(np.float64)


def rel_rms(out, expected) -> float:
    """sqrt(mean((out - ref)^2)) / sqrt(mean(ref^2)); NaN anywhere in out -> nan (fails any
    `<=` check); an all-zero reference gives the absolute RMS of out."""
    o, r = _f64(out), _f64(expected)
    if o.shape != r.shape:
        raise ValueError(f"rel_rms: shapes differ {o.shape} vs {r.shape}")
    if o.size == 0:
        return 0.0
    err = np.sqrt(np.mean((o - r) ** 2))
    den = np.sqrt(np.mean(r ** 2))
    return float(err / den) if den > 0 else float(err)


def max_rel(out, expected) -> float:
    """max |out - ref| / max |ref|: the worst element error relative to the reference's scale
    (element-wise |d|/|ref| is meaningless near zeros). nan when out holds NaN."""
    o, r = _f64(out), _f64(expected)
    if o.size == 0:
        return 0.0
    err = np.max(np.abs(o - r))
    den = np.max(np.abs(r))
    return float(err / den) if den > 0 else float(err)


def assert_close(out, expected, mode: str = "grouped_gemm", *, tol: float | None = None, what: str = "output"):
    """Raise AssertionError (with rel_rms and max_rel) unless out is finite where the reference is
    and rel_rms(out, ref) <= tol (default: TOLERANCES[mode])."""
    tol = TOLERANCES[mode] if tol is None else tol
    o, r = _f64(out), _f64(expected)
    bad = np.isfinite(r) & ~np.isfinite(o)
    if bad.any():
        idx = tuple(int(v) for v in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} non-finite values where the reference is finite, first at {idx}")
    e, m = rel_rms(o, r), max_rel(o, r)
    if not e <= tol:
        raise AssertionError(f"{what}: rel_rms {e:.3e} > tol {tol:.1e} (max_rel {m:.3e}, mode {mode})")
    return e, m


# ------------------------------------------------------------------------------------------------
# Poison
# ------------------------------------------------------------------------------------------------
POISON_BYTE = 0xAA


def poison(shape, dtype) -> np.ndarray:
    """Array of `dtype` filled with a value a kernel never writes: NaN for float types (bf16, f16,
    f32, e4m3), 0xAA bytes for integer and other 1-byte types (uint8 / ue8m0 / packed fp4)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or dtype in (ref.BF16, ref.E4M3):
        return np.full(shape, np.nan, np.float32).astype(dtype)
    out = np.empty(shape, dtype)
    out.view(np.uint8).fill(POISON_BYTE)
    return out


def poisoned_mask(a) -> np.ndarray:
    """Boolean mask of elements still holding the poison value (per element)."""
    a = np.asarray(a)
    if a.dtype.kind == "f" or a.dtype in (ref.BF16, ref.E4M3):
        return np.isnan(a.astype(np.float32))
    b = a.view(np.uint8).reshape(a.shape + (a.dtype.itemsize,))
    return np.all(b == POISON_BYTE, axis=-1)


# ------------------------------------------------------------------------------------------------
# Routing
# ------------------------------------------------------------------------------------------------
def make_routing(num_tokens, top_k, num_experts, seed=0, *, empty_expert=None, hot_expert=None,
                 out_of_range=0, minus_one=0, distinct=True, expert_range=None):
    """(topk_ids int32 [T, k], topk_weights fp32 [T, k]) with positive weights summing to 1 per
    token. distinct: no expert twice in a token (needs k <= number of candidate experts).
    empty_expert: never chosen. hot_expert: every token has it in a random slot (all tokens hit it).
    out_of_range / minus_one: that many random slots replaced by ids >= num_experts / by -1.
    expert_range: (lo, hi) to draw ids from (e.g. mostly local experts in an EP test)."""
    rng = np.random.default_rng(seed)
    lo, hi = expert_range if expert_range is not None else (0, num_experts)
    cand = np.array([e for e in range(lo, hi) if e != empty_expert and e != hot_expert], np.int64)
    ids = np.empty((num_tokens, top_k), np.int64)
    for t in range(num_tokens):
        if distinct:
            need = top_k - (hot_expert is not None)
            if need > cand.size:
                raise ValueError(f"make_routing: {top_k} distinct experts requested from {cand.size} candidates")
            row = list(rng.choice(cand, size=need, replace=False))
        else:
            row = list(rng.choice(cand, size=top_k - (hot_expert is not None)))
        if hot_expert is not None:
            row.insert(int(rng.integers(0, top_k)), hot_expert)
        ids[t] = row
    flat = ids.reshape(-1)
    picks = rng.permutation(flat.size)
    n_oor = min(out_of_range, flat.size)
    n_m1 = min(minus_one, flat.size - n_oor)
    flat[picks[:n_oor]] = rng.integers(num_experts, num_experts + 7, size=n_oor)
    flat[picks[n_oor:n_oor + n_m1]] = -1
    logits = rng.standard_normal((num_tokens, top_k))
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
    return ids.astype(np.int32), w


# ------------------------------------------------------------------------------------------------
# Weights (random codes drawn directly: fast for model-sized expert sets)
# ------------------------------------------------------------------------------------------------
class Int4Weights(NamedTuple):
    q: np.ndarray              # int8 [E, N, K/2] packed int4 (even K index in the low nibble)
    scale: np.ndarray          # bf16 SGLang stored layout
    logical_scale: np.ndarray  # float32 [E, N, K/128] (the bf16 values)


class Fp4Weights(NamedTuple):
    q: np.ndarray             # uint8 [E, rows, K/2] e2m1 pairs
    scale: np.ndarray         # [E, pad128(rows), pad4(K/block)] 128x4 swizzled: float8_e4m3fn (NVFP4)
                              # or uint8 ue8m0 codes (MXFP4)
    global_scale: np.ndarray  # float32 [E]: encode scale (NVFP4); ones for MXFP4


def make_w4a8_int4_weights(experts, n, k, seed=0) -> Int4Weights:
    """Uniform int4 codes and bf16 group scales around 1/(4.6 sqrt(K)) so W . x stays O(|x|)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, size=(experts, n, k // 2), dtype=np.uint8).view(np.int8)
    base = 1.0 / (4.6 * np.sqrt(k))
    s = ref.round_bf16((base * rng.uniform(0.5, 1.5, size=(experts, n, k // 128))).astype(np.float32))
    return Int4Weights(q, ref.interleave_int4_scales(s), s.astype(np.float32))


def make_nvfp4_weights(experts, rows, k, seed=0) -> Fp4Weights:
    """Uniform e2m1 codes, e4m3 block scales in [32, 384) (normal range), encode scale gs chosen
    so the dequantized W = e2m1 * sf / gs has rms about 1/sqrt(K) per expert."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, size=(experts, rows, k // 2), dtype=np.uint8)
    sf = ref.round_e4m3(rng.uniform(32, 384, size=(experts, rows, k // 16)).astype(np.float32))
    rms_sf = np.sqrt(np.mean(np.square(sf.astype(np.float32)), axis=(1, 2)))
    gs = (2.93 * np.sqrt(k) * rms_sf * rng.uniform(0.8, 1.25, size=experts)).astype(np.float32)
    return Fp4Weights(q, ref.swizzle_128x4(sf), gs)


def make_mxfp4_weights(experts, rows, k, seed=0) -> Fp4Weights:
    """Uniform e2m1 codes, ue8m0 block scales around 1/(2.93 sqrt(K)) (+-1 binade)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, size=(experts, rows, k // 2), dtype=np.uint8)
    center = 127 + int(np.round(np.log2(1.0 / (2.93 * np.sqrt(k)))))
    sf = rng.integers(center - 1, center + 2, size=(experts, rows, k // 32)).astype(np.uint8)
    return Fp4Weights(q, ref.swizzle_128x4(sf), np.ones(experts, np.float32))


def fp4_logical_scales(w: Fp4Weights, k: int, block: int) -> np.ndarray:
    """Row-major scale bytes [E, rows, K/block] of generated FP4 weights (unswizzled)."""
    return ref.unswizzle_128x4(w.scale, w.q.shape[1], k // block)


# ------------------------------------------------------------------------------------------------
# Activations
# ------------------------------------------------------------------------------------------------
def make_bf16_activations(num_tokens, hidden, seed=0, scale=1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return ref.round_bf16((scale * rng.standard_normal((num_tokens, hidden))).astype(np.float32))


def make_nvfp4_activations(num_tokens, hidden, seed=0, *, per_token=False, base_inv=1.0 / (448 * 6)):
    """NVFP4 x from random normal rows. Per tensor: gs = 448*6/amax (returned as `global_scale`,
    so w1_alpha = 1/(gs_x * gs_w1)). Per token: per_token_scale[t] = rowamax * base_inv and each
    row is encoded with 1/per_token_scale[t] (FlashInfer's per-token convention).
    Returns dict(x uint8 [T,H/2], x_sf e4m3 [T,H/16], global_scale, per_token_scale, x_bf16)."""
    x = make_bf16_activations(num_tokens, hidden, seed)
    xf = x.astype(np.float32)
    if per_token:
        pts = (np.max(np.abs(xf), axis=1) * np.float32(base_inv)).astype(np.float32)
        pts = np.where(pts == 0, np.float32(1), pts).astype(np.float32)
        q, sf = ref.quantize_nvfp4(xf, (np.float32(1) / pts)[:, None])
        return dict(x=q, x_sf=sf, global_scale=np.float32(1), per_token_scale=pts, x_bf16=x)
    amax = np.float32(np.max(np.abs(xf)))
    gs = np.float32(448 * 6) / amax if amax > 0 else np.float32(1)
    q, sf = ref.quantize_nvfp4(xf, gs)
    return dict(x=q, x_sf=sf, global_scale=np.float32(gs), per_token_scale=None, x_bf16=x)


def make_mxfp8_activations(num_tokens, hidden, seed=0):
    """(x e4m3 [T, H], x_sf uint8 ue8m0 [T, H/32]) from random normal rows."""
    q, sf = ref.quantize_mxfp8(make_bf16_activations(num_tokens, hidden, seed).astype(np.float32))
    return q, sf


# ------------------------------------------------------------------------------------------------
# Whole fused-MoE problems
# ------------------------------------------------------------------------------------------------
def make_fused_moe_case(quant_mode, num_tokens, hidden, inter, num_experts, top_k, seed=0, *,
                        num_local_experts=None, local_expert_offset=0, activation="swiglu",
                        gate_up_layout=None, per_token=False, static_scales=True, routing=None,
                        **routing_options) -> dict:
    """Keyword arguments for reference.fused_moe (and the native/compat APIs mirroring it) with
    random data for one quant mode. routing: optional (ids, weights); else make_routing(...,
    **routing_options). static_scales (w4a8_int4): give a1/a2 (True) or leave them dynamic.
    gate_up_layout defaults to "gate_up" for the int4 modes and "up_gate_interleaved64" otherwise."""
    e_l = num_experts if num_local_experts is None else num_local_experts
    gated = activation != "relu2"
    rows1 = 2 * inter if gated else inter
    if gate_up_layout is None:
        gate_up_layout = "gate_up" if quant_mode.endswith("int4") else "up_gate_interleaved64"
    if routing is None:
        routing = make_routing(num_tokens, top_k, num_experts, seed + 1, **routing_options)
    ids, wts = routing
    rng = np.random.default_rng(seed + 2)
    kw = dict(topk_ids=ids, topk_weights=wts, quant_mode=quant_mode, num_experts=num_experts,
              num_local_experts=num_local_experts, local_expert_offset=local_expert_offset,
              activation=activation, gate_up_layout=gate_up_layout)
    if quant_mode in ("w4a8_int4", "w4a16_int4"):
        w1 = make_w4a8_int4_weights(e_l, rows1, hidden, seed + 3)
        w2 = make_w4a8_int4_weights(e_l, hidden, inter, seed + 4)
        x = make_bf16_activations(num_tokens, hidden, seed + 5)
        kw.update(x=x, w1=w1.q, w1_scale=w1.scale, w2=w2.q, w2_scale=w2.scale)
        if quant_mode == "w4a8_int4" and static_scales:
            a1 = np.float32(np.max(np.abs(x.astype(np.float32))) / 448)
            # a2 from a typical |act| bound: SwiGLU of O(1) inputs stays well below 8.
            kw.update(x_scale=np.array([a1], np.float32), fc2_input_scale=np.array([8.0 / 448], np.float32))
        return kw
    if quant_mode == "w4a8":
        w1 = make_mxfp4_weights(e_l, rows1, hidden, seed + 3)
        w2 = make_mxfp4_weights(e_l, hidden, inter, seed + 4)
        x, x_sf = make_mxfp8_activations(num_tokens, hidden, seed + 5)
        alpha1 = rng.uniform(0.75, 1.25, e_l).astype(np.float32)
        alpha2 = rng.uniform(0.75, 1.25, e_l).astype(np.float32)
        kw.update(x=x, x_scale=x_sf)
    else:
        w1 = make_nvfp4_weights(e_l, rows1, hidden, seed + 3)
        w2 = make_nvfp4_weights(e_l, hidden, inter, seed + 4)
        if quant_mode == "w4a16":
            kw.update(x=make_bf16_activations(num_tokens, hidden, seed + 5))
            alpha1 = (1.0 / w1.global_scale).astype(np.float32)
            alpha2 = (1.0 / w2.global_scale).astype(np.float32)
        else:
            act = make_nvfp4_activations(num_tokens, hidden, seed + 5, per_token=per_token)
            alpha1 = (1.0 / (act["global_scale"] * w1.global_scale)).astype(np.float32)
            if per_token:
                fc2 = np.float32(1.0 / (448 * 6))
                alpha2 = (1.0 / w2.global_scale).astype(np.float32)
                kw.update(per_token_scale=act["per_token_scale"])
            else:
                fc2 = np.float32(448 * 6 / 8.0)  # encode scale for |act| up to about 8
                alpha2 = (1.0 / (fc2 * w2.global_scale)).astype(np.float32)
            kw.update(x=act["x"], x_scale=act["x_sf"], fc2_input_scale=np.array([fc2], np.float32))
    kw.update(w1=w1.q, w1_scale=w1.scale, w2=w2.q, w2_scale=w2.scale, w1_alpha=alpha1, w2_alpha=alpha2)
    return kw


def to_torch(a, device="cuda"):
    """A numpy array as a torch tensor on `device` (bf16 and e4m3 cross as same-size integer views,
    the ml_dtypes types torch.from_numpy cannot read); a dict (e.g. a make_fused_moe_case) is
    converted value by value; anything else is returned as it is. Needs torch."""
    import torch

    if isinstance(a, dict):
        return {k: to_torch(v, device) for k, v in a.items()}
    if not isinstance(a, np.ndarray):
        return a
    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16)
    if a.dtype.name == "float8_e4m3fn":
        return torch.from_numpy(a.view(np.uint8)).to(device).view(torch.float8_e4m3fn)
    return torch.from_numpy(a).to(device)


def capture_graph(fn, warmup: int = 2):
    """A torch.cuda.CUDAGraph of fn() on the current device, after `warmup` eager runs on a side stream
    (NCCL peer connections, allocator pools and lazy setup happen outside the capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
