"""Weight and activation preparation: quantize / dequantize / pack / layout helpers (DESIGN.md 3).

numpy arrays (or CPU torch tensors) in, numpy arrays out (outputs allocated here with numpy /
ml_dtypes); the work runs in the C++ reference (qmoe._C, src/reference/formats.cpp), whose rounding
rules are written in include/qmoe/formats.h: e4m3 RNE saturating to +-448 (NaN -> 0x7F|sign), e2m1
RNE saturating to +-6 (NaN -> 0x7), bf16 RNE, MX scales = smallest power of two >= amax / max_code.

torch CUDA tensors in, torch CUDA tensors out: the same functions run the GPU kernels
(src/cuda/quant/) on torch's current stream of that device, asynchronously, with outputs allocated
by torch on the input's device; the codes are bit-identical to the CPU's. Every tensor argument of
a call must then be on that device (a float / numpy scale is moved there; a tensor is not).
pack_int4 / unpack_int4 have no GPU version and refuse CUDA tensors.

Real inputs may be float32 or bfloat16 (used as they are) or any other real dtype (converted to
float32 first). Returned dtypes (numpy / torch):
  int4   : int8 [..., K/2] (two values per byte, even K index in the low nibble; SGLang's dtype)
  fp4    : uint8 [..., K/2] (two e2m1 codes per byte, even K index in the low nibble)
  e4m3   : ml_dtypes.float8_e4m3fn / torch.float8_e4m3fn
  ue8m0  : uint8 codes (value 2^(code - 127), 255 = NaN)
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from . import _C
from ._tensors import arg, current_stream, is_torch

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)

__all__ = [
    "quantize_int4_g128", "dequantize_int4_g128", "pack_int4", "unpack_int4", "int4_scale_layout_shape",
    "interleave_int4_scales", "deinterleave_int4_scales", "quantize_fp8", "fp8_dynamic_scale",
    "dequantize_fp8", "nvfp4_global_scale", "quantize_nvfp4", "dequantize_nvfp4", "quantize_mxfp4",
    "dequantize_mxfp4", "quantize_mxfp8", "dequantize_mxfp8", "swizzle_scales_128x4",
    "unswizzle_scales_128x4", "gate_up_sglang_to_flashinfer", "gate_up_flashinfer_to_sglang",
]


# ------------------------------------------------------------------------------------------------
# Input handling
# ------------------------------------------------------------------------------------------------
def _host(t, name: str) -> np.ndarray:
    """A C-contiguous numpy array for the CPU reference. A CUDA tensor reaching here is refused
    (never copied to the host behind the caller's back): the call's main tensor was on the CPU, or
    the function has no GPU version."""
    if is_torch(t):
        if t.is_cuda:
            raise ValueError(f"qmoe: argument '{name}': expected a CPU tensor or numpy array (the other "
                             "tensors of this call are on the CPU, or this function has no GPU version), "
                             "got a CUDA tensor")
        import torch

        t = t.detach()
        t = t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()
    if not isinstance(t, np.ndarray):
        t = np.asarray(t)
    return np.ascontiguousarray(t)


def _real(x, name: str) -> np.ndarray:
    """float32 or bfloat16 as given; any other real dtype converted to float32."""
    x = _host(x, name)
    if x.dtype not in (np.float32, BF16):
        if x.dtype.kind not in "fiu" and x.dtype != E4M3:
            raise TypeError(f"qmoe.quant: argument '{name}': expected a real array, got dtype {x.dtype}")
        x = x.astype(np.float32)
    return x


def _last_axis(x: np.ndarray, name: str, multiple: int) -> int:
    if x.ndim < 1 or x.shape[-1] % multiple:
        raise ValueError(f"qmoe: argument '{name}': expected a last axis divisible by {multiple}, "
                         f"got shape {list(x.shape)}")
    return x.shape[-1]


_CODE_DTYPES = ("int8", "uint8", "float8_e4m3fn", "float8_e8m0fnu")


def _codes_u8(t, name: str) -> np.ndarray:
    """1-byte code arrays (int8, uint8, float8_e4m3fn, float8_e8m0fnu) passed through as stored. Other
    1-byte dtypes (bool, float8_e5m2, ...) are refused: their bytes are not these codes."""
    t = _host(t, name)
    if t.dtype.name not in _CODE_DTYPES:
        raise TypeError(f"qmoe.quant: argument '{name}': expected codes of dtype int8, uint8, float8_e4m3fn or "
                        f"float8_e8m0fnu, got dtype {t.dtype}")
    return t


# ------------------------------------------------------------------------------------------------
# GPU path: torch CUDA tensors stay on their device; outputs are allocated there by torch.
# ------------------------------------------------------------------------------------------------
def _on_gpu(t) -> bool:
    return is_torch(t) and t.is_cuda


def _g_real(x, name: str):
    """float32 / bfloat16 as given, any other real dtype converted to float32; contiguous."""
    import torch

    if x.dtype not in (torch.float32, torch.bfloat16):
        if x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"qmoe.quant: argument '{name}': expected a real tensor, got dtype {x.dtype}")
        x = x.float()
    return x.contiguous()


def _g_codes(t, name: str, like):
    """A 1-byte code tensor on the device of `like`, contiguous, as stored."""
    if not is_torch(t):
        raise TypeError(f"qmoe.quant: argument '{name}': expected a torch tensor on {like.device} "
                        f"(the device of the other tensors), got {type(t).__name__}")
    if t.element_size() != 1:
        raise TypeError(f"qmoe.quant: argument '{name}': expected a 1-byte dtype, got dtype {t.dtype}")
    return t.contiguous()


def _g_scale(scale, like, name: str = "scale"):
    """A float32 scale tensor on like's device: floats / numpy arrays are moved there, a torch
    tensor is taken as it is (a CPU tensor is then refused by the C++ device check)."""
    import torch

    if is_torch(scale):
        s = scale.float().contiguous()
    else:
        s = torch.as_tensor(np.asarray(scale, np.float32), device=like.device)
    return s.reshape(1) if s.ndim == 0 else s


def _g_empty(like, shape, dtype):
    import torch

    return torch.empty(tuple(shape), dtype=dtype, device=like.device)


def _torch():
    import torch

    return torch


# ------------------------------------------------------------------------------------------------
# int4-g128 (SGLang W4A8 weights)
# ------------------------------------------------------------------------------------------------
def quantize_int4_g128(w):
    """w real [..., K] (K % 128 == 0) -> (q int8 [..., K/2], scales float32 [..., K/128]).

    s = amax / 7 per group of 128 along K (1 for an all-zero group), q = clamp(rne(w / s), -8, 7).
    """
    if _on_gpu(w):
        torch = _torch()
        w = _g_real(w, "w")
        k = _last_axis(w, "w", 128)
        q = _g_empty(w, w.shape[:-1] + (k // 2,), torch.int8)
        scales = _g_empty(w, w.shape[:-1] + (k // 128,), torch.float32)
        _C.quantize_int4_g128(arg(w, "w"), arg(q, "q"), arg(scales, "scales"), stream=current_stream(w))
        return q, scales
    w = _real(w, "w")
    k = _last_axis(w, "w", 128)
    q = np.empty(w.shape[:-1] + (k // 2,), np.int8)
    scales = np.empty(w.shape[:-1] + (k // 128,), np.float32)
    _C.quantize_int4_g128(arg(w, "w"), arg(q, "q"), arg(scales, "scales"))
    return q, scales


def dequantize_int4_g128(q, scales):
    """q int4 [..., K/2] (int8/uint8), logical scales float32/bfloat16 [..., K/128] -> float32 [..., K]."""
    if _on_gpu(q):
        torch = _torch()
        q = _g_codes(q, "q", q)
        scales = _g_real(scales, "scales") if is_torch(scales) else _g_scale(scales, q, "scales")
        out = _g_empty(q, q.shape[:-1] + (q.shape[-1] * 2,), torch.float32)
        _C.dequantize_int4_g128(arg(q, "q"), arg(scales, "scales"), arg(out, "out"), stream=current_stream(q))
        return out
    q = _codes_u8(q, "q")
    scales = _real(scales, "scales")
    out = np.empty(q.shape[:-1] + (q.shape[-1] * 2,), np.float32)
    _C.dequantize_int4_g128(arg(q, "q"), arg(scales, "scales"), arg(out, "out"))
    return out


def _pack_int4_torch(v):
    """pack_int4 with torch ops on v's device (bit-identical to the C++ packer: two's complement
    nibbles, even K index low)."""
    import torch

    if v.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        raise TypeError(f"qmoe.quant: argument 'values': expected an integer tensor, got dtype {v.dtype}")
    if v.dim() < 1 or v.shape[-1] % 2:
        raise ValueError(f"qmoe: argument 'values': expected a last dimension that is a multiple of 2, "
                         f"got shape {tuple(v.shape)}")
    if v.dtype != torch.int8 and v.numel() and bool(((v < -8) | (v > 7)).any()):  # one host sync
        raise ValueError("qmoe: argument 'values': expected int4 values in [-8, 7], "
                         f"got range [{int(v.min())}, {int(v.max())}]")
    w = v.to(torch.int16)
    byte = (w[..., 0::2] & 0xF) | ((w[..., 1::2] & 0xF) << 4)
    return byte.to(torch.uint8).view(torch.int8).contiguous()


def _unpack_int4_torch(p):
    """unpack_int4 with torch ops on p's device: int8 values in [-8, 7], [..., 2 * K/2]."""
    import torch

    if p.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"qmoe.quant: argument 'packed': expected int8 or uint8, got dtype {p.dtype}")
    b = p.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    pair = torch.stack(((lo ^ 8) - 8, (hi ^ 8) - 8), dim=-1)  # sign-extend the nibbles
    return pair.reshape(*p.shape[:-1], p.shape[-1] * 2).to(torch.int8)


def pack_int4(values):
    """int values in [-8, 7] [..., K] (K even) -> int8 [..., K/2], even K index in the low nibble.
    CUDA tensors are packed on their device (torch ops); everything else on the CPU."""
    if _on_gpu(values):
        return _pack_int4_torch(values)
    v = _host(values, "values")
    if v.dtype.kind not in "iu":
        raise TypeError(f"qmoe.quant: argument 'values': expected an integer array, got dtype {v.dtype}")
    if v.dtype != np.int8:
        if v.size and (v.min() < -8 or v.max() > 7):
            raise ValueError("qmoe: argument 'values': expected int4 values in [-8, 7], "
                             f"got range [{v.min()}, {v.max()}]")
        v = v.astype(np.int8)
    _last_axis(v, "values", 2)
    packed = np.empty(v.shape[:-1] + (v.shape[-1] // 2,), np.int8)
    _C.pack_int4(arg(v, "values"), arg(packed, "packed"))
    return packed


def unpack_int4(packed):
    """int4 [..., K/2] (int8/uint8) -> int8 values [..., K]. CUDA tensors stay on their device."""
    if _on_gpu(packed):
        return _unpack_int4_torch(packed)
    p = _codes_u8(packed, "packed")
    values = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), np.int8)
    _C.unpack_int4(arg(p, "packed"), arg(values, "values"))
    return values


def int4_scale_layout_shape(experts: int, n: int, k: int) -> tuple:
    """Shape of SGLang's stored scales: (E, K/512, 4N) when K % 512 == 0, else (E, K/128, N)."""
    return tuple(_C.int4_scale_layout_shape(experts, n, k))


def interleave_int4_scales(scales):
    """Logical scales S [E, N, G] (float32 or bfloat16) -> SGLang's stored layout, same dtype:
    [E, G/4, 4N] with out[e, kb, 4n + j] = S[e, n, 4kb + j] when G % 4 == 0 (K % 512 == 0),
    else [E, G, N] (transposed)."""
    if _on_gpu(scales):
        s = _g_real(scales, "scales")
        if s.ndim != 3:
            raise ValueError(f"qmoe: argument 'scales': expected [E, N, G], got shape {list(s.shape)}")
        e, n, g = s.shape
        out = _g_empty(s, (e, g // 4, 4 * n) if g % 4 == 0 else (e, g, n), s.dtype)
        _C.interleave_int4_scales(arg(s, "scales"), arg(out, "out"), stream=current_stream(s))
        return out
    s = _real(scales, "scales")
    if s.ndim != 3:
        raise ValueError(f"qmoe: argument 'scales': expected [E, N, G], got shape {list(s.shape)}")
    e, n, g = s.shape
    out = np.empty((e, g // 4, 4 * n) if g % 4 == 0 else (e, g, n), s.dtype)
    _C.interleave_int4_scales(arg(s, "scales"), arg(out, "out"))
    return out


def deinterleave_int4_scales(stored, k: int):
    """SGLang's stored scales for a weight of reduction size k -> logical S [E, N, K/128]."""
    gpu = _on_gpu(stored)
    st = _g_real(stored, "stored") if gpu else _real(stored, "stored")
    if st.ndim != 3 or k % 128:
        raise ValueError(f"qmoe: argument 'stored': expected [E, *, *] scales and k % 128 == 0, "
                         f"got shape {list(st.shape)} and k={k}")
    g = k // 128
    n = st.shape[2] // 4 if g % 4 == 0 else st.shape[2]
    if gpu:
        out = _g_empty(st, (st.shape[0], n, g), st.dtype)
        _C.deinterleave_int4_scales(arg(st, "stored"), arg(out, "scales"), stream=current_stream(st))
        return out
    out = np.empty((st.shape[0], n, g), st.dtype)
    _C.deinterleave_int4_scales(arg(st, "stored"), arg(out, "scales"))
    return out


# ------------------------------------------------------------------------------------------------
# FP8 e4m3 activations
# ------------------------------------------------------------------------------------------------
def fp8_dynamic_scale(x, per_token: bool = False):
    """amax / 448 over the tensor (shape [1]) or each row (shape x.shape[:-1]); an all-zero
    tensor / row gets 1; NaN or inf is kept (never hidden)."""
    if _on_gpu(x):
        x = _g_real(x, "x")
        scale = _g_empty(x, x.shape[:-1] if per_token and x.ndim > 1 else (1,), _torch().float32)
        _C.fp8_dynamic_scale(arg(x, "x"), arg(scale, "scale"), stream=current_stream(x))
        return scale
    x = _real(x, "x")
    scale = np.empty(x.shape[:-1] if per_token and x.ndim > 1 else (1,), np.float32)
    _C.fp8_dynamic_scale(arg(x, "x"), arg(scale, "scale"))
    return scale


def quantize_fp8(x, scale=None, per_token: bool = False):
    """q = e4m3(x / scale), RNE, saturating to +-448. Returns (q float8_e4m3fn [..., K], scale f32).

    scale None: dynamic, amax / 448 per tensor (or per row when per_token). Otherwise a float or an
    array with one element (per tensor) or one per row (per token)."""
    if _on_gpu(x):
        x = _g_real(x, "x")
        scale = fp8_dynamic_scale(x, per_token) if scale is None else _g_scale(scale, x)
        q = _g_empty(x, x.shape, _torch().float8_e4m3fn)
        _C.quantize_fp8(arg(x, "x"), arg(scale, "scale"), arg(q, "q"), stream=current_stream(x))
        return q, scale
    x = _real(x, "x")
    if scale is None:
        scale = fp8_dynamic_scale(x, per_token)
    else:
        scale = np.ascontiguousarray(np.asarray(_host(scale, "scale"), np.float32))
        if scale.ndim == 0:
            scale = scale.reshape(1)
    q = np.empty(x.shape, E4M3)
    _C.quantize_fp8(arg(x, "x"), arg(scale, "scale"), arg(q, "q"))
    return q, scale


def dequantize_fp8(q, scale):
    """float32 [..., K] = e4m3(q) * scale (one element, or one per row)."""
    if _on_gpu(q):
        q = _g_codes(q, "q", q)
        scale = _g_scale(scale, q)
        out = _g_empty(q, q.shape, _torch().float32)
        _C.dequantize_fp8(arg(q, "q"), arg(scale, "scale"), arg(out, "out"), stream=current_stream(q))
        return out
    q = _codes_u8(q, "q")
    if q.dtype == np.uint8:
        q = q.view(E4M3)
    scale = np.ascontiguousarray(np.asarray(_host(scale, "scale"), np.float32))
    if scale.ndim == 0:
        scale = scale.reshape(1)
    out = np.empty(q.shape, np.float32)
    _C.dequantize_fp8(arg(q, "q"), arg(scale, "scale"), arg(out, "out"))
    return out


# ------------------------------------------------------------------------------------------------
# NVFP4 / MXFP4 / MXFP8
# ------------------------------------------------------------------------------------------------
def nvfp4_global_scale(amax) -> float:
    """The usual NVFP4 encode scale 448 * 6 / amax (1 when amax is 0): the largest block of the
    tensor then gets the largest e4m3 block scale."""
    amax = float(np.float32(amax))
    return 1.0 if amax == 0.0 else float(np.float32(448.0 * 6.0) / np.float32(amax))


def quantize_nvfp4(x, global_scale: float, swizzle: bool = False):
    """x real [..., K] (K % 16 == 0) -> (q uint8 [..., K/2], sf float8_e4m3fn [..., K/16]).

    Per 16: sf = e4m3((gs * amax) / 6), q = e2m1((x * gs) / sf) (0 when sf is 0); NaN block -> sf 0x7F.
    swizzle=True returns sf in the 128x4 layout (swizzle_scales_128x4): per expert [E, Rp, Cp] for
    a 3-D x [E, rows, K] (weights), else [Rp, Cp] over the rows of x flattened (activations)."""
    if _on_gpu(x):
        x = _g_real(x, "x")
        k = _last_axis(x, "x", 16)
        q = _g_empty(x, x.shape[:-1] + (k // 2,), _torch().uint8)
        sf = _g_empty(x, x.shape[:-1] + (k // 16,), _torch().float8_e4m3fn)
        _C.quantize_nvfp4(arg(x, "x"), float(global_scale), arg(q, "q"), arg(sf, "sf"), stream=current_stream(x))
    else:
        x = _real(x, "x")
        k = _last_axis(x, "x", 16)
        q = np.empty(x.shape[:-1] + (k // 2,), np.uint8)
        sf = np.empty(x.shape[:-1] + (k // 16,), E4M3)
        _C.quantize_nvfp4(arg(x, "x"), float(global_scale), arg(q, "q"), arg(sf, "sf"))
    if swizzle:
        sf = swizzle_scales_128x4(sf if sf.ndim == 3 else sf.reshape(-1, k // 16))
    return q, sf


def dequantize_nvfp4(q, sf, global_scale: float):
    """float32 [..., K] = (e2m1(q) * e4m3(sf)) / gs."""
    if _on_gpu(q):
        torch = _torch()
        q = _g_codes(q, "q", q)
        sf = _g_codes(sf, "sf", q)
        out = _g_empty(q, q.shape[:-1] + (q.shape[-1] * 2,), torch.float32)
        _C.dequantize_nvfp4(arg(q.view(torch.uint8), "q"), arg(sf.view(torch.float8_e4m3fn), "sf"),
                            float(global_scale), arg(out, "out"), stream=current_stream(q))
        return out
    q = _codes_u8(q, "q")
    sf = _codes_u8(sf, "sf")
    if sf.dtype == np.uint8:
        sf = sf.view(E4M3)
    out = np.empty(q.shape[:-1] + (q.shape[-1] * 2,), np.float32)
    _C.dequantize_nvfp4(arg(q.view(np.uint8), "q"), arg(sf, "sf"), float(global_scale), arg(out, "out"))
    return out


def quantize_mxfp4(x):
    """x real [..., K] (K % 32 == 0) -> (q uint8 [..., K/2], sf uint8 ue8m0 [..., K/32])."""
    if _on_gpu(x):
        torch = _torch()
        x = _g_real(x, "x")
        k = _last_axis(x, "x", 32)
        q = _g_empty(x, x.shape[:-1] + (k // 2,), torch.uint8)
        sf = _g_empty(x, x.shape[:-1] + (k // 32,), torch.uint8)
        _C.quantize_mxfp4(arg(x, "x"), arg(q, "q"), arg(sf, "sf"), stream=current_stream(x))
        return q, sf
    x = _real(x, "x")
    k = _last_axis(x, "x", 32)
    q = np.empty(x.shape[:-1] + (k // 2,), np.uint8)
    sf = np.empty(x.shape[:-1] + (k // 32,), np.uint8)
    _C.quantize_mxfp4(arg(x, "x"), arg(q, "q"), arg(sf, "sf"))
    return q, sf


def quantize_mxfp8(x):
    """x real [..., K] (K % 32 == 0) -> (q float8_e4m3fn [..., K], sf uint8 ue8m0 [..., K/32])."""
    if _on_gpu(x):
        torch = _torch()
        x = _g_real(x, "x")
        k = _last_axis(x, "x", 32)
        q = _g_empty(x, x.shape, torch.float8_e4m3fn)
        sf = _g_empty(x, x.shape[:-1] + (k // 32,), torch.uint8)
        _C.quantize_mxfp8(arg(x, "x"), arg(q, "q"), arg(sf, "sf"), stream=current_stream(x))
        return q, sf
    x = _real(x, "x")
    k = _last_axis(x, "x", 32)
    q = np.empty(x.shape, E4M3)
    sf = np.empty(x.shape[:-1] + (k // 32,), np.uint8)
    _C.quantize_mxfp8(arg(x, "x"), arg(q, "q"), arg(sf, "sf"))
    return q, sf


def _ue8m0_codes(sf) -> np.ndarray:
    return _codes_u8(sf, "sf").view(np.uint8)


def dequantize_mxfp4(q, sf):
    """float32 [..., K] = e2m1(q) * 2^(sf - 127) (NaN for sf 255)."""
    if _on_gpu(q):
        torch = _torch()
        q = _g_codes(q, "q", q).view(torch.uint8)
        sf = _g_codes(sf, "sf", q).view(torch.uint8)
        out = _g_empty(q, q.shape[:-1] + (q.shape[-1] * 2,), torch.float32)
        _C.dequantize_mxfp4(arg(q, "q"), arg(sf, "sf"), arg(out, "out"), stream=current_stream(q))
        return out
    q = _codes_u8(q, "q").view(np.uint8)
    out = np.empty(q.shape[:-1] + (q.shape[-1] * 2,), np.float32)
    _C.dequantize_mxfp4(arg(q, "q"), arg(_ue8m0_codes(sf), "sf"), arg(out, "out"))
    return out


def dequantize_mxfp8(q, sf):
    """float32 [..., K] = e4m3(q) * 2^(sf - 127) (NaN for sf 255)."""
    if _on_gpu(q):
        torch = _torch()
        q = _g_codes(q, "q", q).view(torch.uint8)
        sf = _g_codes(sf, "sf", q).view(torch.uint8)
        out = _g_empty(q, q.shape, torch.float32)
        _C.dequantize_mxfp8(arg(q, "q"), arg(sf, "sf"), arg(out, "out"), stream=current_stream(q))
        return out
    q = _codes_u8(q, "q").view(np.uint8)
    out = np.empty(q.shape, np.float32)
    _C.dequantize_mxfp8(arg(q, "q"), arg(_ue8m0_codes(sf), "sf"), arg(out, "out"))
    return out


# ------------------------------------------------------------------------------------------------
# Weight-scale swizzle and gate/up row orders
# ------------------------------------------------------------------------------------------------
def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def swizzle_scales_128x4(sf):
    """Row-major 1-byte scales [E, rows, cols] or [rows, cols] -> the same dtype and ndim,
    [E, round_up(rows, 128), round_up(cols, 4)], bytes in FlashInfer's 128x4 order (DESIGN.md 3.3),
    padding 0."""
    if _on_gpu(sf):
        torch = _torch()
        sf = _g_codes(sf, "sf", sf)
        if sf.ndim not in (2, 3):
            raise ValueError(f"qmoe: argument 'sf': expected [E, rows, cols] or [rows, cols], got shape {list(sf.shape)}")
        out = _g_empty(sf, sf.shape[:-2] + (_round_up(sf.shape[-2], 128), _round_up(sf.shape[-1], 4)), sf.dtype)
        _C.swizzle_scales_128x4(arg(sf.view(torch.uint8), "sf"), arg(out.view(torch.uint8), "out"),
                                stream=current_stream(sf))
        return out
    sf = _codes_u8(sf, "sf")
    if sf.ndim not in (2, 3):
        raise ValueError(f"qmoe: argument 'sf': expected [E, rows, cols] or [rows, cols], got shape {list(sf.shape)}")
    out = np.empty(sf.shape[:-2] + (_round_up(sf.shape[-2], 128), _round_up(sf.shape[-1], 4)), sf.dtype)
    _C.swizzle_scales_128x4(arg(sf.view(np.uint8), "sf"), arg(out.view(np.uint8), "out"))
    return out


def _fp4_words(w, pack: bool):
    name = "w" if pack else "packed"
    fn = _C.pack_fp4_weights if pack else _C.unpack_fp4_weights
    if _on_gpu(w):
        torch = _torch()
        w = _g_codes(w, name, w)
        out = torch.empty_like(w)
        fn(arg(w.view(torch.uint8), name), arg(out.view(torch.uint8), "out"), stream=current_stream(w))
        return out
    w = _codes_u8(w, name)
    out = np.empty_like(w)
    fn(arg(w.view(np.uint8), name), arg(out.view(np.uint8), "out"))
    return out


def pack_fp4_weights(w):
    """FP4 weights (fp4x2 bytes [..., K/2], K % 8 == 0; a numpy uint8 array, or a torch CUDA tensor of a 1-byte
    dtype such as uint8 or float4_e2m1fn_x2) -> the same bytes with every 32-bit word's bits in qmoe's packed
    order (docs/design.md 3.4), for fused_moe(..., fp4_weights_packed=True): a one-time weight preparation
    that makes the GPU GEMMs' FP4 decode cheaper. Scales are not touched."""
    return _fp4_words(w, True)


def unpack_fp4_weights(packed):
    """Inverse of pack_fp4_weights."""
    return _fp4_words(packed, False)


def unswizzle_scales_128x4(swizzled, rows: int, cols: int):
    """Inverse of swizzle_scales_128x4: swizzled [E, Rp, Cp] or [Rp, Cp] -> [E, rows, cols] (same dtype)."""
    if _on_gpu(swizzled):
        torch = _torch()
        sw = _g_codes(swizzled, "swizzled", swizzled)
        if sw.ndim not in (2, 3):
            raise ValueError(f"qmoe: argument 'swizzled': expected a 2-D or 3-D tensor, got shape {list(sw.shape)}")
        out = _g_empty(sw, sw.shape[:-2] + (rows, cols), sw.dtype)
        _C.unswizzle_scales_128x4(arg(sw.view(torch.uint8), "swizzled"), arg(out.view(torch.uint8), "sf"),
                                  stream=current_stream(sw))
        return out
    sw = _codes_u8(swizzled, "swizzled")
    if sw.ndim not in (2, 3):
        raise ValueError(f"qmoe: argument 'swizzled': expected a 2-D or 3-D array, got shape {list(sw.shape)}")
    out = np.empty(sw.shape[:-2] + (rows, cols), sw.dtype)
    _C.unswizzle_scales_128x4(arg(sw.view(np.uint8), "swizzled"), arg(out.view(np.uint8), "sf"))
    return out


def _reorder(w, to_flashinfer: bool):
    fn = _C.gate_up_sglang_to_flashinfer if to_flashinfer else _C.gate_up_flashinfer_to_sglang
    if _on_gpu(w):
        torch = _torch()
        w = w.contiguous()
        out = torch.empty_like(w)
        # Rows move as raw bytes: any dtype goes across as a same-size integer (or float16) view.
        view = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}.get(w.element_size())
        if view is None or w.ndim < 1:
            raise TypeError(f"qmoe.quant: argument 'w': unsupported dtype {w.dtype}")
        fn(arg(w.view(view), "w"), arg(out.view(view), "out"), stream=current_stream(w))
        return out
    w = _host(w, "w")
    out = np.empty_like(w)
    # Rows are moved as raw bytes, so every dtype goes across as a same-size integer view.
    # (float16 for 2 bytes: qmoe has no int16 dtype; the C++ side only copies bytes.)
    view = {1: np.uint8, 2: np.float16, 4: np.int32, 8: np.int64}.get(w.itemsize)
    if view is None or w.ndim < 1:
        raise TypeError(f"qmoe.quant: argument 'w': unsupported dtype {w.dtype}")
    fn(arg(w.view(view), "w"), arg(out.view(view), "out"))
    return out


def gate_up_sglang_to_flashinfer(w):
    """W13 [E, 2I, C] or [2I, C] (any dtype, or per-row scales) from SGLang's [gate; up] to
    FlashInfer's [up 0:64, gate 0:64, up 64:128, gate 64:128, ...]. Needs I % 64 == 0."""
    return _reorder(w, True)


def gate_up_flashinfer_to_sglang(w):
    """Inverse of gate_up_sglang_to_flashinfer."""
    return _reorder(w, False)
