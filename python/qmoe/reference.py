"""numpy twin of every qmoe op (DESIGN.md sections 1, 3, 3b, 4, 5.1, 5.2): the executable semantics
the C++ reference and the GPU kernels are checked against. Only numpy and ml_dtypes; never imports
qmoe._C, so it can be loaded by file path before the extension is built.

Formats (DESIGN 3): 4-bit values are packed two per byte, even K index in the low nibble.
  int4-g128  signed [-8, 7]; logical scales S[e, n, g] (dequant w = q * S, g = K-group of 128);
             SGLang stored layout [E, K/512, 4N] (entry [e, kb, 4n+j] = S[e, n, 4kb+j]) when
             K % 512 == 0, else [E, K/128, N].
  e4m3fn     RNE, saturating to +-448 (ml_dtypes alone would turn overflow into NaN), NaN kept.
  e2m1       RNE on {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating to +-6; own implementation.
  ue8m0      2^(code-127), 0xFF = NaN; qmoe's MX scale = smallest power of two >= amax / max_code.
  NVFP4      per 16: sf = e4m3(gs * amax / 6), q = e2m1(x * gs / sf) (q = 0 when sf == 0).
  MXFP4/8    per 32: sf = ue8m0_ceil(amax / 6 | 448), q = e2m1 | e4m3 (x * 2^(127 - sf)).
  128x4      weight-scale swizzle, byte offset of (g, r, c):
             ((g*Mt + r//128)*Kt + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + (c%4).
Arithmetic: every fp32 operation of the contract is done in float32 numpy arrays (so it rounds
like the C++ code); dot products run in float64 from exactly dequantized operands (exact for the
int4 x e4m3 groups, closer than fp32 otherwise). Activations are evaluated in float64 and rounded
once to fp32. The int4 group promotion acc = fma(S, P, acc) is emulated in float64 (a double
rounding may differ from a true fma by 1 ulp of fp32 in rare cases).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_VALUES = np.concatenate([E2M1_GRID, -E2M1_GRID]).astype(np.float32)  # code -> value (8 = -0)
QUANT_MODES = ("w4a8_int4", "w4a16_int4", "w4a4", "w4a8", "w4a16")
ACTIVATIONS = ("swiglu", "geglu_tanh", "relu2", "situ")
GATE_UP_LAYOUTS = ("gate_up", "up_gate_interleaved64")
OUTPUT_DTYPES = {"bfloat16": BF16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


# ------------------------------------------------------------------------------------------------
# Scalar formats
# ------------------------------------------------------------------------------------------------
def to_f32(a) -> np.ndarray:
    """Any real array (f32/f64/f16/bf16/e4m3, or e4m3 bytes given as uint8) -> float32 values."""
    a = np.asarray(a)
    return a.astype(np.float32)


def as_e4m3(a) -> np.ndarray:
    """e4m3 array given as float8_e4m3fn or as its uint8/int8 bytes -> float8_e4m3fn view."""
    a = np.asarray(a)
    if a.dtype == E4M3:
        return a
    if a.dtype in (np.uint8, np.int8):
        return a.view(E4M3)
    raise TypeError(f"expected float8_e4m3fn or uint8 bytes, got {a.dtype}")


def e4m3_to_f32(a) -> np.ndarray:
    return as_e4m3(a).astype(np.float32)


def round_e4m3(x) -> np.ndarray:
    """fp32 -> e4m3fn, RNE, saturating to +-448 (no inf in the format), NaN stays NaN."""
    x = np.asarray(x, np.float32)
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def round_bf16(x) -> np.ndarray:
    """fp32 -> bf16, RNE (always from float32, so no double rounding from float64)."""
    return np.asarray(x, np.float32).astype(BF16)


def round_to(x, dtype_name: str) -> np.ndarray:
    """fp32 values -> "bfloat16" / "float16" / "float32" array, one rounding from fp32."""
    return np.asarray(x, np.float32).astype(OUTPUT_DTYPES[dtype_name])


def e2m1_encode(x) -> np.ndarray:
    """fp32 -> e2m1 codes (uint8, sign in bit 3). RNE on the grid, |x| > 6 saturates to 6.
    Ties go to the even code (0, 1.0, 2.0, 4.0); NaN -> code 0x7 (as qmoe's C++ codec; the block
    scale carries the NaN)."""
    x = np.asarray(x, np.float32)
    mag = np.abs(x)
    # Midpoints between neighbouring grid values; at a tie the even code wins: ">" where the lower
    # neighbour has the even code, ">=" where the upper one has it.
    code = ((mag > 0.25).astype(np.uint8) + (mag >= 0.75) + (mag > 1.25) + (mag >= 1.75)
            + (mag > 2.5) + (mag >= 3.5) + (mag > 5.0)).astype(np.uint8)
    code = code | (np.signbit(x).astype(np.uint8) << 3)
    return np.where(np.isnan(x), 7, code).astype(np.uint8)


def e2m1_decode(codes) -> np.ndarray:
    return E2M1_VALUES[np.asarray(codes, np.uint8) & 0xF]


def ue8m0_codes(a) -> np.ndarray:
    """ue8m0 scales given as uint8 codes or as ml_dtypes float8_e8m0fnu -> uint8 codes (bit view)."""
    a = np.asarray(a)
    if a.dtype == np.uint8:
        return a
    if a.dtype.itemsize == 1 and a.dtype.kind == "V" or a.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        return a.view(np.uint8)
    return a.astype(np.uint8)  # plain integer codes


def ue8m0_to_f32(codes) -> np.ndarray:
    c = ue8m0_codes(codes).astype(np.int32)
    v = np.ldexp(np.float64(1.0), np.minimum(c, 254) - 127).astype(np.float32)  # 0 -> 2^-127 (subnormal)
    return np.where(c == 255, np.float32(np.nan), v).astype(np.float32)


def ue8m0_ceil(v) -> np.ndarray:
    """Smallest power of two >= v (v >= 0) as a ue8m0 code, clamped to [0, 254]; NaN -> 255, 0 -> 0."""
    v = np.asarray(v, np.float32).astype(np.float64)
    m, e = np.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    exp = np.where(m == 0.5, e - 1, e)  # exact powers of two keep their exponent
    code = np.clip(exp + 127, 0, 254)
    code = np.where(v == 0, 0, code)
    code = np.where(np.isinf(v), 254, code)
    return np.where(np.isnan(v), 255, code).astype(np.uint8)


# ------------------------------------------------------------------------------------------------
# Packing
# ------------------------------------------------------------------------------------------------
def pack_nibbles(codes) -> np.ndarray:
    """uint8 nibbles [..., K] -> uint8 [..., K/2]; element 2j in the low nibble of byte j."""
    c = np.asarray(codes).astype(np.uint8) & 0xF
    if c.shape[-1] % 2:
        raise ValueError(f"pack: last dimension must be even, got {c.shape[-1]}")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed) -> np.ndarray:
    """uint8/int8 [..., K/2] -> uint8 nibbles [..., K] (low nibble first)."""
    p = np.asarray(packed).view(np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def pack_int4(values) -> np.ndarray:
    """int values in [-8, 7] [..., K] -> int8 [..., K/2] (two's complement nibbles)."""
    v = np.asarray(values)
    if v.size and (v.min() < -8 or v.max() > 7):
        raise ValueError("pack_int4: values must lie in [-8, 7]")
    return pack_nibbles(v.astype(np.int8).view(np.uint8)).view(np.int8)


def unpack_int4(packed) -> np.ndarray:
    """int8/uint8 [..., K/2] -> int8 values in [-8, 7] [..., K]."""
    n = unpack_nibbles(packed).astype(np.int8)
    return np.where(n >= 8, n - 16, n).astype(np.int8)


# byte -> (low, high) value tables: one np.take on a 1-D table whose entries hold both values
# (complex128 = two float64, uint64 = two float32) dequantizes a whole packed matrix quickly.
_BYTES = np.arange(256, dtype=np.uint8)[:, None]
_INT4_PAIR = np.ascontiguousarray(unpack_int4(_BYTES).astype(np.float64)).view(np.complex128).reshape(256)
_E2M1_PAIR = np.ascontiguousarray(E2M1_VALUES[unpack_nibbles(_BYTES)]).view(np.uint64).reshape(256)


def _int4_values_f64(packed) -> np.ndarray:
    p = np.asarray(packed).view(np.uint8)
    return np.take(_INT4_PAIR, p.astype(np.intp)).view(np.float64).reshape(p.shape[:-1] + (p.shape[-1] * 2,))


def _e2m1_values_f32(packed) -> np.ndarray:
    p = np.asarray(packed).view(np.uint8)
    return np.take(_E2M1_PAIR, p.astype(np.intp)).view(np.float32).reshape(p.shape[:-1] + (p.shape[-1] * 2,))


# ------------------------------------------------------------------------------------------------
# int4-g128 (SGLang)
# ------------------------------------------------------------------------------------------------
def int4_scale_layout_shape(e: int, n: int, k: int) -> tuple:
    if k % 128:
        raise ValueError(f"int4-g128: K must be a multiple of 128, got {k}")
    return (e, k // 512, 4 * n) if k % 512 == 0 else (e, k // 128, n)


def interleave_int4_scales(scales) -> np.ndarray:
    """Logical S [E, N, G] -> SGLang stored layout ([E, G/4, 4N] if G % 4 == 0 else [E, G, N])."""
    s = np.asarray(scales)
    e, n, g = s.shape
    if g % 4 == 0:
        return np.ascontiguousarray(s.reshape(e, n, g // 4, 4).transpose(0, 2, 1, 3).reshape(e, g // 4, 4 * n))
    return np.ascontiguousarray(s.transpose(0, 2, 1))


def deinterleave_int4_scales(stored, k: int) -> np.ndarray:
    """SGLang stored scales for reduction size k -> logical S [E, N, K/128]."""
    s = np.asarray(stored)
    e = s.shape[0]
    g = k // 128
    if k % 512 == 0:
        if s.shape[1] != g // 4 or s.shape[2] % 4:
            raise ValueError(f"stored scales: expected [E, {g // 4}, 4N] for K={k}, got {list(s.shape)}")
        n = s.shape[2] // 4
        return np.ascontiguousarray(s.reshape(e, g // 4, n, 4).transpose(0, 2, 1, 3).reshape(e, n, g))
    if k % 128 or s.shape[1] != g:
        raise ValueError(f"stored scales: expected [E, {g}, N] for K={k}, got {list(s.shape)}")
    return np.ascontiguousarray(s.transpose(0, 2, 1))


def quantize_int4_g128(w):
    """Symmetric int4-g128 of real w [E, N, K]: s = amax/7 per group (1 for an all-zero group),
    q = clamp(rne(w/s), -8, 7). Returns (packed int8 [E, N, K/2], scales float32 [E, N, K/128])."""
    w = to_f32(w)
    e, n, k = w.shape
    g = w.reshape(e, n, k // 128, 128)
    s = (np.max(np.abs(g), axis=-1) / np.float32(7)).astype(np.float32)
    s = np.where(s == 0, np.float32(1), s).astype(np.float32)
    q = np.clip(np.rint(g / s[..., None]), -8, 7).astype(np.int8).reshape(e, n, k)
    return pack_int4(q), s


def dequantize_int4_g128(packed, scales) -> np.ndarray:
    """packed int8 [E, N, K/2], logical scales [E, N, K/128] -> float32 [E, N, K] = q * S."""
    q = _int4_values_f64(packed).astype(np.float32)
    s = to_f32(scales)
    return (q.reshape(s.shape + (128,)) * s[..., None]).reshape(q.shape)


# ------------------------------------------------------------------------------------------------
# FP8 / NVFP4 / MXFP4 / MXFP8
# ------------------------------------------------------------------------------------------------
def quantize_fp8(x, scale) -> np.ndarray:
    """q = e4m3(x / scale); scale fp32 scalar, [1] (per tensor) or [R] (per row)."""
    x = to_f32(x)
    s = np.asarray(scale, np.float32).reshape(-1)
    s = s[0] if s.size == 1 else s.reshape((-1,) + (1,) * (x.ndim - 1))
    return round_e4m3(x / s)


def fp8_dynamic_scale(x, per_row: bool = False) -> np.ndarray:
    """amax / 448 over the tensor ([1]) or each row ([R]); an all-zero tensor / row gets 1."""
    a = np.abs(to_f32(x))
    amax = a.max(axis=tuple(range(1, a.ndim)), initial=0.0) if per_row else np.array([a.max(initial=0.0)])
    s = (amax.astype(np.float32) / np.float32(E4M3_MAX)).astype(np.float32)
    return np.where(s == 0, np.float32(1), s).astype(np.float32)


def _blocks(x, block):
    x = to_f32(x)
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block size {block}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _flat_blocks(shape):
    """[..., blocks, block] -> [..., blocks * block], spelled out so that zero rows reshape too."""
    return tuple(shape[:-2]) + (shape[-2] * shape[-1],)


def quantize_nvfp4(x, global_scale=1.0):
    """x real [..., K] -> (q uint8 [..., K/2], sf e4m3 [..., K/16]). global_scale: scalar or
    per-row array broadcastable to x[..., :1]. sf = e4m3(gs*amax/6); q = e2m1(x*gs/sf), 0 if sf==0."""
    b = _blocks(x, 16)
    gs = np.asarray(global_scale, np.float32)
    gs_b = gs.reshape(gs.shape + (1,)) if gs.ndim else gs  # [..., 1] -> [..., 1, 1]
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    sf = round_e4m3((gs_b * amax).astype(np.float32) / np.float32(6))
    sf32 = sf.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = ((b * gs_b).astype(np.float32) / sf32).astype(np.float32)
    v = np.where(sf32 == 0, np.float32(0), v)
    v = np.where(np.isnan(sf32), np.float32(np.nan), v)  # a NaN block: every element gets the NaN code
    q = pack_nibbles(e2m1_encode(v).reshape(_flat_blocks(b.shape)))
    return q, sf[..., 0]


def dequantize_nvfp4(q, sf, global_scale=1.0) -> np.ndarray:
    """float32 [..., K] = e2m1(q) * e4m3(sf) / gs."""
    v = _e2m1_values_f32(q)
    s = e4m3_to_f32(sf)
    out = (v.reshape(s.shape + (16,)) * s[..., None]).reshape(v.shape)
    gs = np.asarray(global_scale, np.float32)
    return (out / (gs[..., None] if gs.ndim else gs)).astype(np.float32)


def _quantize_mx(x, max_code):
    b = _blocks(x, 32)
    amax = np.max(np.abs(b), axis=-1)
    sf = ue8m0_ceil((amax / np.float32(max_code)).astype(np.float32))
    # 2^(127 - sf) is an exact power of two; every element of a NaN block (code 255) becomes NaN.
    exp = np.where(sf == 255, 0, 127 - sf.astype(np.int32))
    v = np.ldexp(b, exp[..., None]).astype(np.float32)
    return np.where((sf == 255)[..., None], np.float32(np.nan), v), sf


def quantize_mxfp8(x):
    """x real [..., K] -> (q e4m3 [..., K], sf uint8 ue8m0 [..., K/32])."""
    v, sf = _quantize_mx(x, E4M3_MAX)
    return round_e4m3(v.reshape(_flat_blocks(v.shape))), sf


def quantize_mxfp4(x):
    """x real [..., K] -> (q uint8 [..., K/2], sf uint8 ue8m0 [..., K/32])."""
    v, sf = _quantize_mx(x, E2M1_MAX)
    return pack_nibbles(e2m1_encode(v.reshape(_flat_blocks(v.shape)))), sf


def dequantize_mxfp8(q, sf) -> np.ndarray:
    v = e4m3_to_f32(q)
    s = ue8m0_to_f32(sf)
    return (v.reshape(s.shape + (32,)) * s[..., None]).reshape(v.shape).astype(np.float32)


def dequantize_mxfp4(q, sf) -> np.ndarray:
    v = _e2m1_values_f32(q)
    s = ue8m0_to_f32(sf)
    return (v.reshape(s.shape + (32,)) * s[..., None]).reshape(v.shape).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# 128x4 swizzle and gate/up layouts
# ------------------------------------------------------------------------------------------------
def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def swizzled_offsets(experts: int, rows: int, cols: int) -> np.ndarray:
    """int64 [E, rows, cols]: byte offset of each (g, r, c) in the 128x4 swizzled buffer."""
    mt, kt = _round_up(rows, 128) // 128, _round_up(cols, 4) // 4
    g = np.arange(experts, dtype=np.int64)[:, None, None]
    r = np.arange(rows, dtype=np.int64)[None, :, None]
    c = np.arange(cols, dtype=np.int64)[None, None, :]
    return ((g * mt + r // 128) * kt + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


def swizzle_128x4(sf) -> np.ndarray:
    """Row-major scales [E, rows, cols] (1-byte dtype) -> [E, rows_pad128, cols_pad4] whose flat
    bytes are in swizzled order; padding bytes are 0. Same dtype as the input."""
    sf = np.asarray(sf)
    if sf.ndim == 2:
        sf = sf[None]
    e, rows, cols = sf.shape
    out = np.zeros((e, _round_up(rows, 128), _round_up(cols, 4)), np.uint8)
    out.reshape(-1)[swizzled_offsets(e, rows, cols)] = sf.view(np.uint8)
    return out.view(sf.dtype)


def unswizzle_128x4(swizzled, rows: int, cols: int) -> np.ndarray:
    """Inverse of swizzle_128x4: [E, rows_pad128, cols_pad4] -> row-major [E, rows, cols]."""
    s = np.asarray(swizzled)
    e = s.shape[0]
    need = e * _round_up(rows, 128) * _round_up(cols, 4)
    if s.size != need:
        raise ValueError(f"swizzled scales: expected {need} bytes for [{e}, {rows}, {cols}], got {s.size}")
    return s.reshape(-1)[swizzled_offsets(e, rows, cols)]


def gate_up_to_interleaved64(w) -> np.ndarray:
    """SGLang [E, 2I, ...] rows [gate; up] -> FlashInfer [up 0:64, gate 0:64, up 64:128, ...]."""
    w = np.asarray(w)
    e, two_i = w.shape[:2]
    i = two_i // 2
    if two_i % 2 or i % 64:
        raise ValueError(f"gate/up reorder needs I % 64 == 0, got 2I = {two_i}")
    rest = w.shape[2:]
    gate = w[:, :i].reshape((e, i // 64, 1, 64) + rest)
    up = w[:, i:].reshape((e, i // 64, 1, 64) + rest)
    return np.concatenate([up, gate], axis=2).reshape(w.shape)


def interleaved64_to_gate_up(w) -> np.ndarray:
    """FlashInfer 64-row interleaved [up; gate] -> SGLang [gate; up]."""
    w = np.asarray(w)
    e, two_i = w.shape[:2]
    i = two_i // 2
    if two_i % 2 or i % 64:
        raise ValueError(f"gate/up reorder needs I % 64 == 0, got 2I = {two_i}")
    rest = w.shape[2:]
    v = w.reshape((e, i // 64, 2, 64) + rest)
    up, gate = v[:, :, 0].reshape((e, i) + rest), v[:, :, 1].reshape((e, i) + rest)
    return np.concatenate([gate, up], axis=1)


def split_gate_up(h, layout: str):
    """GEMM1 output columns [M, 2I] in the stored W13 row order -> (gate, up), each [M, I]."""
    m, two_i = h.shape
    i = two_i // 2
    if layout == "gate_up":
        return h[:, :i], h[:, i:]
    if layout == "up_gate_interleaved64":
        v = h.reshape(m, i // 64, 2, 64)
        return v[:, :, 1].reshape(m, i), v[:, :, 0].reshape(m, i)
    raise ValueError(f"gate_up_layout: expected one of {GATE_UP_LAYOUTS}, got {layout!r}")


# ------------------------------------------------------------------------------------------------
# Routing metadata (SGLang get_cutlass_w4a8_moe_mm_data, with permutations)
# ------------------------------------------------------------------------------------------------
def moe_mm_data(topk_ids, num_experts: int, n: int, k: int) -> dict:
    """Counts valid ids (in [0, E)) per expert. All outputs int32:
    expert_offsets [E+1] exclusive prefix sum; problem_sizes1 [E,3] = (2n, cnt, k);
    problem_sizes2 [E,3] = (k, cnt, n); input_permutation [numel]: sorted row -> flat slot
    (stable by slot; -1 past offsets[E]); output_permutation [numel]: slot -> row (-1 if dropped)."""
    ids = np.asarray(topk_ids).reshape(-1).astype(np.int64)
    numel = ids.size
    valid = (ids >= 0) & (ids < num_experts)
    cnt = np.bincount(ids[valid], minlength=num_experts).astype(np.int64)
    offsets = np.zeros(num_experts + 1, np.int64)
    np.cumsum(cnt, out=offsets[1:])
    key = np.where(valid, ids, num_experts)
    order = np.argsort(key, kind="stable")
    nvalid = int(valid.sum())
    inp = np.full(numel, -1, np.int64)
    inp[:nvalid] = order[:nvalid]
    out = np.full(numel, -1, np.int64)
    out[order[:nvalid]] = np.arange(nvalid)
    ps1 = np.stack([np.full(num_experts, 2 * n), cnt, np.full(num_experts, k)], 1)
    ps2 = np.stack([np.full(num_experts, k), cnt, np.full(num_experts, n)], 1)
    return dict(expert_offsets=offsets.astype(np.int32), problem_sizes1=ps1.astype(np.int32),
                problem_sizes2=ps2.astype(np.int32), input_permutation=inp.astype(np.int32),
                output_permutation=out.astype(np.int32))


# ------------------------------------------------------------------------------------------------
# int4-g128 group GEMM core and the SGLang grouped GEMM
# ------------------------------------------------------------------------------------------------
def int4_group_dot(a, packed, scales) -> np.ndarray:
    """acc[m, n] = sum_g S[n, g] * P[m, n, g], P = sum_{k in group g} a[m, k] * q[n, k].
    a real [M, K]; packed int8 [N, K/2]; scales logical [N, G]. P in float64 (exact for e4m3 a:
    products are multiples of 2^-9 below 2^19); the g loop is fp32 fma (emulated, g increasing)."""
    a64 = to_f32(a).astype(np.float64)
    m, kdim = a64.shape
    q = _int4_values_f64(packed)
    n = q.shape[0]
    g = kdim // 128
    s = to_f32(scales).astype(np.float64)
    acc = np.zeros((m, n), np.float32)
    if m == 0:
        return acc
    p = np.matmul(a64.reshape(m, g, 128).transpose(1, 0, 2), q.reshape(n, g, 128).transpose(1, 2, 0))
    p = p.astype(np.float32).astype(np.float64)  # fp32 group accumulator
    for gi in range(g):
        acc = (acc.astype(np.float64) + s[None, :, gi] * p[gi]).astype(np.float32)
    return acc


def w4a8_moe_mm(a, b, a_scales, b_scales, expert_offsets, problem_sizes, out=None) -> np.ndarray:
    """SGLang cutlass_w4a8_moe_mm (DESIGN 3.1 / 5.1). a e4m3 [R, K]; b int8 [E, N, K/2]; a_scales
    fp32 [1] or [R]; b_scales bf16 stored layout; expert_offsets int [E] start rows; problem_sizes
    [E, 3] = (N, M_e, K). Returns bf16 [R, N]: D = bf16(a_scale * sum_g S * P) for rows of each
    group; other rows keep `out`'s values (zeros when out is None)."""
    a = as_e4m3(a)
    r, k = a.shape
    b = np.asarray(b)
    e, n, half_k = b.shape
    if 2 * half_k != k:
        raise ValueError(f"b: expected [E, N, {k // 2}] for K={k}, got {list(b.shape)}")
    s = deinterleave_int4_scales(b_scales, k)
    if s.shape != (e, n, k // 128):
        raise ValueError(f"b_scales: logical shape {list(s.shape)} != [{e}, {n}, {k // 128}]")
    a_s = np.asarray(a_scales, np.float32).reshape(-1)
    if a_s.size not in (1, r):
        raise ValueError(f"a_scales: expected [1] or [{r}], got {a_s.size} elements")
    starts = np.asarray(expert_offsets).reshape(-1)
    ps = np.asarray(problem_sizes).reshape(e, 3)
    d = np.zeros((r, n), BF16) if out is None else out
    for ei in range(e):
        m_e, st = int(ps[ei, 1]), int(starts[ei])
        if m_e == 0:
            continue
        acc = int4_group_dot(a[st:st + m_e], b[ei], s[ei])
        sc = a_s[0] if a_s.size == 1 else a_s[st:st + m_e, None]
        d[st:st + m_e] = round_bf16(sc * acc)
    return d


# ------------------------------------------------------------------------------------------------
# Activations (DESIGN 4), evaluated in float64, rounded once to fp32
# ------------------------------------------------------------------------------------------------
def _sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def activation(h, name: str, layout: str = "gate_up", *, swiglu_alpha=1.0, swiglu_beta=0.0,
               swiglu_limit=float("inf"), situ_beta=1.0, situ_linear_beta=None) -> np.ndarray:
    """GEMM1 output h fp32 [M, 2I] (stored row order; [M, I] for relu2) -> fp32 [M, I]."""
    h = to_f32(h).astype(np.float64)
    if name == "relu2":
        return np.square(np.maximum(h, 0.0)).astype(np.float32)
    g, u = split_gate_up(h, layout)
    if name == "swiglu":
        lim = float(swiglu_limit)
        gp = np.minimum(g, lim)
        up = np.clip(u, -lim, lim)
        out = gp * _sigmoid(float(swiglu_alpha) * gp) * (up + float(swiglu_beta))
    elif name == "geglu_tanh":
        out = 0.5 * g * (1.0 + np.tanh(0.7978845608 * (g + 0.044715 * g ** 3))) * u
    elif name == "situ":
        b = float(situ_beta)
        up = u if situ_linear_beta is None else float(situ_linear_beta) * np.tanh(u / float(situ_linear_beta))
        out = b * np.tanh(g / b) * _sigmoid(g) * up
    else:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {name!r}")
    return out.astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Fused MoE
# ------------------------------------------------------------------------------------------------
def _vec(v, n, name):
    """None / scalar / [n] -> fp32 [n] (None -> ones)."""
    if v is None:
        return np.ones(n, np.float32)
    a = np.asarray(v, np.float32).reshape(-1)
    if a.size == 1:
        return np.full(n, a[0], np.float32)
    if a.size != n:
        raise ValueError(f"{name}: expected 1 or {n} elements, got {a.size}")
    return a


def _weights_fp4(w, sf_swizzled, rows, k, block, mx):
    """Dequantize one expert's FP4 weights [rows, K/2] with its swizzled scales -> fp32 [rows, K]."""
    sf = unswizzle_128x4(sf_swizzled[None], rows, k // block)[0]
    v = _e2m1_values_f32(w)
    s = ue8m0_to_f32(sf) if mx else e4m3_to_f32(sf)
    return (v.reshape(rows, k // block, block) * s[..., None]).reshape(rows, k)


def _dot64(a, w):
    """fp32 [M, K] x fp32 [N, K] -> fp32 [M, N], accumulated in float64."""
    return (a.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)


def fused_moe(x, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, *, quant_mode, num_experts,
              x_scale=None, w1_alpha=None, w2_alpha=None, fc2_input_scale=None, per_token_scale=None,
              num_local_experts=None, local_expert_offset=0, activation="swiglu", swiglu_alpha=1.0,
              swiglu_beta=0.0, swiglu_limit=float("inf"), situ_beta=1.0, situ_linear_beta=None,
              gate_up_layout="gate_up", deterministic=False, routed_scaling_factor=1.0,
              output_dtype="bfloat16") -> np.ndarray:
    """out[t] = rsf * sum_{local slots j} w[t,j] * alpha2 * W2 . requant(act(alpha1 * W13 . x[t])).

    quant_mode / operands (E_l local experts, I intermediate, rows1 = 2I or I for relu2):
      w4a8_int4   x bf16 [T,H] (q = e4m3(x / a1)) or e4m3 [T,H]; x_scale = a1 fp32 [1] | [T] | None
                  (dynamic amax(x)/448 over all T tokens; required for e4m3 x); w1 int8 [E_l,rows1,H/2],
                  w1_scale bf16 SGLang stored layout, w2 int8 [E_l,H,I/2], w2_scale likewise;
                  fc2_input_scale = a2 fp32 [1] | None (dynamic: amax over all valid intermediate
                  rows / 448); intermediate e4m3(act / a2) from fp32. w1_alpha/w2_alpha optional.
      w4a16_int4  x bf16; int4 weights as above; bf16 intermediate.
      w4a4        x uint8 [T,H/2] NVFP4, x_scale e4m3 [T,H/16] row-major; weights uint8 FP4 with
                  e4m3 swizzled scales [E_l, pad128(rows), pad4(K/16)]; w1_alpha, w2_alpha [E_l];
                  fc2_input_scale [1] required. Intermediate NVFP4 (gs = fc2_input_scale) from fp32.
                  per_token_scale [T]: GEMM1 scale w1_alpha*pts[t], bf16 intermediate,
                  row_scale = rowamax * fc2_input_scale, encode 1/row_scale, GEMM2 w2_alpha*row_scale.
      w4a8        x e4m3 [T,H], x_scale ue8m0 uint8 [T,H/32]; MXFP4 weights with ue8m0 swizzled
                  scales; intermediate MXFP8 from fp32; alphas optional (default 1).
      w4a16       x bf16; NVFP4 weights; w1_alpha/w2_alpha (default 1); bf16 intermediate.
    Finalize: deterministic=True: row_j = bf16(alpha2 * gemm2) per slot, acc = fp32 sum over slots in
    order of f32(w * row_j) (mul then add, each rounded to fp32), out = round(rsf * acc).
    deterministic=False (fused finalize emulated in slot order): out = 0 in the output dtype;
    out = round_out(out + bf16(f32(rsf * w) * (alpha2 * gemm2))), round_out = rounding to the output
    dtype. Slots whose id is < 0, >= num_experts or non-local are skipped (a token without any gets 0).
    """
    if quant_mode not in QUANT_MODES:
        raise ValueError(f"quant_mode: expected one of {QUANT_MODES}, got {quant_mode!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout: expected one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype: expected one of {tuple(OUTPUT_DTYPES)}, got {output_dtype!r}")
    ids = np.asarray(topk_ids).astype(np.int64)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids: expected [T, k], got shape {list(ids.shape)}")
    t_count, top_k = ids.shape
    wts = np.asarray(topk_weights, np.float32)
    if wts.shape != ids.shape:
        raise ValueError(f"topk_weights: expected {list(ids.shape)}, got {list(wts.shape)}")
    e_l = num_experts if num_local_experts is None else int(num_local_experts)
    w1 = np.asarray(w1)
    w2 = np.asarray(w2)
    if w1.shape[0] != e_l or w2.shape[0] != e_l:
        raise ValueError(f"w1/w2: expected {e_l} local experts, got {w1.shape[0]} / {w2.shape[0]}")
    gated = activation != "relu2"
    hidden = w2.shape[1]
    inter = w2.shape[2] * 2
    rows1 = 2 * inter if gated else inter
    if w1.shape[1] != rows1 or w1.shape[2] * 2 != hidden:
        raise ValueError(f"w1: expected [{e_l}, {rows1}, {hidden // 2}], got {list(w1.shape)}")
    alpha1 = _vec(w1_alpha, e_l, "w1_alpha")
    alpha2 = _vec(w2_alpha, e_l, "w2_alpha")
    out_dt = OUTPUT_DTYPES[output_dtype]
    act_kw = dict(swiglu_alpha=swiglu_alpha, swiglu_beta=swiglu_beta, swiglu_limit=swiglu_limit,
                  situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
    per_token = per_token_scale is not None
    if per_token and quant_mode != "w4a4":
        raise ValueError("per_token_scale: only supported with quant_mode 'w4a4'")
    # Arguments a mode has no use for are errors, never silently ignored.
    if x_scale is not None and quant_mode in ("w4a16", "w4a16_int4"):
        raise ValueError(f"x_scale: must be None for quant_mode {quant_mode!r} (bf16 x)")
    if fc2_input_scale is not None and quant_mode in ("w4a8", "w4a16", "w4a16_int4"):
        raise ValueError(f"fc2_input_scale: must be None for quant_mode {quant_mode!r}")
    if fc2_input_scale is not None and np.size(fc2_input_scale) != 1:
        raise ValueError(f"fc2_input_scale: expected one fp32 value, got {np.size(fc2_input_scale)}")
    int4 = quant_mode in ("w4a8_int4", "w4a16_int4")
    block = 32 if quant_mode == "w4a8" else 16
    for name, sc, rows, k in (("w1_scale", w1_scale, rows1, hidden), ("w2_scale", w2_scale, hidden, inter)):
        if k % (128 if int4 else block):
            raise ValueError(f"{name}: reduction size {k} must be a multiple of {128 if int4 else block}")
        want = int4_scale_layout_shape(e_l, rows, k) if int4 else \
            (e_l, _round_up(rows, 128), _round_up(k // block, 4))
        if np.shape(sc) != want:
            raise ValueError(f"{name}: expected shape {list(want)}, got {list(np.shape(sc))}")
    if quant_mode in ("w4a4", "w4a8"):
        want = (t_count, hidden // (16 if quant_mode == "w4a4" else 32))
        if x_scale is None or np.size(x_scale) != want[0] * want[1]:
            raise ValueError(f"x_scale: expected {list(want)} block scales, got "
                             f"{None if x_scale is None else list(np.shape(x_scale))}")

    # ---- activations into fp32 rows, plus the per-token GEMM1 scale ------------------------------
    row_scale1 = np.ones(t_count, np.float32)  # per-token multiplier of GEMM1 (a1 or pts)
    if quant_mode == "w4a8_int4":
        x = np.asarray(x)
        if x.dtype == E4M3:
            if x_scale is None:
                raise ValueError("x_scale: required (a1) when x is already e4m3")
            xq = x
            a1 = _vec(x_scale, t_count, "x_scale")
        else:
            a1 = fp8_dynamic_scale(x) if x_scale is None else np.asarray(x_scale, np.float32).reshape(-1)
            if a1.size not in (1, t_count):
                raise ValueError(f"x_scale: expected [1] or [{t_count}], got {a1.size} elements")
            xq = quantize_fp8(x, a1)
            a1 = _vec(a1, t_count, "x_scale")
        x_rows = e4m3_to_f32(xq)
        row_scale1 = a1
    elif quant_mode in ("w4a16_int4", "w4a16"):
        x_rows = to_f32(x)
    elif quant_mode == "w4a4":
        x_rows = dequantize_nvfp4(x, np.asarray(x_scale).reshape(t_count, -1))
        if fc2_input_scale is None:
            raise ValueError("fc2_input_scale: required for quant_mode 'w4a4'")
        if per_token:
            row_scale1 = _vec(per_token_scale, t_count, "per_token_scale")
    else:  # w4a8 (MXFP8 x MXFP4)
        x_rows = dequantize_mxfp8(x, np.asarray(x_scale).reshape(t_count, -1))
    if x_rows.shape != (t_count, hidden):
        raise ValueError(f"x: expected {t_count} rows of hidden size {hidden}, got {list(x_rows.shape)}")

    # ---- routing: local slots grouped by expert, slot order within an expert --------------------
    local = ids - int(local_expert_offset)
    valid = (ids >= 0) & (ids < num_experts) & (local >= 0) & (local < e_l)
    slots = np.flatnonzero(valid.reshape(-1))
    slot_expert = local.reshape(-1)[slots]
    order = np.argsort(slot_expert, kind="stable")
    slots, slot_expert = slots[order], slot_expert[order]
    slot_token = slots // top_k
    bounds = np.searchsorted(slot_expert, np.arange(e_l + 1))

    # ---- GEMM1 + activation per expert -----------------------------------------------------------
    if int4:
        s1_all = deinterleave_int4_scales(w1_scale, hidden)
        s2_all = deinterleave_int4_scales(w2_scale, inter)
    act_rows = np.zeros((slots.size, inter), np.float32)
    for le in range(e_l):
        lo, hi = bounds[le], bounds[le + 1]
        if lo == hi:
            continue
        tok = slot_token[lo:hi]
        # h = alpha1(row) * dot, alpha1 = (a1[t] | per_token_scale[t] | 1) * w1_alpha[e] in fp32
        scale = (row_scale1[tok] * alpha1[le]).astype(np.float32)
        if int4:  # SGLang group semantics: sum_g S * P
            acc = int4_group_dot(x_rows[tok], w1[le], s1_all[le])
        else:  # block-scaled product from exactly dequantized operands
            acc = _dot64(x_rows[tok], _weights_fp4(w1[le], np.asarray(w1_scale)[le], rows1, hidden, block,
                                                   quant_mode == "w4a8"))
        acc = (scale[:, None] * acc).astype(np.float32)
        act_rows[lo:hi] = activation_fn(acc, activation, gate_up_layout, **act_kw)

    # ---- requantize the intermediate; GEMM2 row scale -------------------------------------------
    row_scale2 = np.ones(slots.size, np.float32)
    if quant_mode == "w4a8_int4":
        if fc2_input_scale is None:
            amax = np.float32(np.max(np.abs(act_rows), initial=0.0))
            # NaN amax gives a NaN a2 (NaN is never hidden); only an all-zero intermediate gets 1.
            a2 = np.float32(amax / np.float32(E4M3_MAX)) if amax != 0 else np.float32(1)
        else:
            a2 = np.asarray(fc2_input_scale, np.float32).reshape(-1)[0]
        inter_rows = e4m3_to_f32(round_e4m3(act_rows / a2))
        row_scale2[:] = a2
    elif quant_mode in ("w4a16_int4", "w4a16"):
        inter_rows = to_f32(round_bf16(act_rows))
    elif quant_mode == "w4a4" and not per_token:
        gs = np.float32(np.asarray(fc2_input_scale, np.float32).reshape(-1)[0])
        inter_rows = dequantize_nvfp4(*quantize_nvfp4(act_rows, gs))  # gs folded into w2_alpha
    elif quant_mode == "w4a4":
        b16 = to_f32(round_bf16(act_rows))
        fc2 = np.float32(np.asarray(fc2_input_scale, np.float32).reshape(-1)[0])
        rs = (np.max(np.abs(b16), axis=1, initial=0.0) * fc2).astype(np.float32)
        with np.errstate(divide="ignore"):
            enc = np.where(rs > 0, np.float32(1) / rs, np.float32(0)).astype(np.float32)
        inter_rows = dequantize_nvfp4(*quantize_nvfp4(b16, enc[:, None]))
        inter_rows[rs == 0] = 0  # a zero row contributes 0
        row_scale2 = rs
    else:  # w4a8: MXFP8 intermediate
        inter_rows = dequantize_mxfp8(*quantize_mxfp8(act_rows))

    # ---- GEMM2 per expert: v = alpha2 * row_scale * W2 . inter ------------------------------------
    v_rows = np.zeros((slots.size, hidden), np.float32)
    for le in range(e_l):
        lo, hi = bounds[le], bounds[le + 1]
        if lo == hi:
            continue
        if int4:
            acc = int4_group_dot(inter_rows[lo:hi], w2[le], s2_all[le])
        else:
            acc = _dot64(inter_rows[lo:hi], _weights_fp4(w2[le], np.asarray(w2_scale)[le], hidden, inter, block,
                                                          quant_mode == "w4a8"))
        # y = alpha2(row) * dot, alpha2 = (a2 | row_scale | 1) * w2_alpha[e] in fp32
        v_rows[lo:hi] = ((row_scale2[lo:hi] * alpha2[le]).astype(np.float32)[:, None] * acc).astype(np.float32)

    # ---- finalize ------------------------------------------------------------------------------
    rsf = np.float32(routed_scaling_factor)
    slot_w = wts.reshape(-1)[slots]
    slot_j = slots % top_k
    out = np.zeros((t_count, hidden), np.float32)
    if deterministic:
        rows_b = to_f32(round_bf16(v_rows))
        for j in range(top_k):  # slot order; each token has at most one slot j
            sel = slot_j == j
            out[slot_token[sel]] = (out[slot_token[sel]] + (slot_w[sel, None] * rows_b[sel]).astype(np.float32))
        return round_to((rsf * out).astype(np.float32), output_dtype)
    acc = np.zeros((t_count, hidden), out_dt)
    for j in range(top_k):
        sel = slot_j == j
        # GEMM2's epilogue emits bf16 rows whatever the output dtype; the adds round to the output dtype.
        contrib = round_bf16(((rsf * slot_w[sel]).astype(np.float32)[:, None] * v_rows[sel]).astype(np.float32))
        acc[slot_token[sel]] = round_to(to_f32(acc[slot_token[sel]]) + to_f32(contrib), output_dtype)
    return acc


activation_fn = activation  # fused_moe's `activation` keyword shadows the function name inside it
