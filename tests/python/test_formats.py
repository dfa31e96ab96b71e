"""Bit-exact tests of qmoe.quant (and the scalar codecs of qmoe._C) against numpy + ml_dtypes.

Every expected value is computed here, independently of qmoe (including qmoe.reference): e4m3 and
bf16 through ml_dtypes (e4m3 clipped to +-448 first, since qmoe saturates where ml_dtypes gives
NaN), e2m1 through ml_dtypes.float4_e2m1fn, ue8m0 decoding through ml_dtypes.float8_e8m0fnu, the
128x4 swizzle from DESIGN.md 3.3's offset formula and the gate/up orders from array slicing.
Data is random with NaN, +-inf, huge, tiny / fp32-denormal values and all-zero blocks.
"""
import ml_dtypes
import numpy as np
import pytest

from qmoe import _C
from qmoe import quant as Q
from qmoe._tensors import arg

# NaN / inf arithmetic in the expected values is deliberate.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
BF16 = np.dtype(ml_dtypes.bfloat16)


# ------------------------------------------------------------------------------------------------
# Independent numpy codecs
# ------------------------------------------------------------------------------------------------
def np_e4m3(v):
    """RNE, saturating to +-448, NaN -> 0x7F | sign."""
    v = np.asarray(v, np.float32)
    nan = np.isnan(v)
    codes = np.clip(np.where(nan, 0, v), -448, 448).astype(E4M3).view(np.uint8)
    return np.where(nan, np.where(np.signbit(v), 0xFF, 0x7F), codes).astype(np.uint8)


def np_e2m1(v):
    """RNE, saturating to +-6, NaN -> 0x7. One code per byte."""
    v = np.asarray(v, np.float32)
    nan = np.isnan(v)
    codes = np.clip(np.where(nan, 0, v), -6, 6).astype(E2M1).view(np.uint8) & 0xF
    return np.where(nan, 7, codes).astype(np.uint8)


def np_ue8m0_ceil(v):
    """Smallest power of two >= |v| as a code clamped to [0, 254]; NaN -> 255."""
    v = np.abs(np.asarray(v, np.float64))  # float64: exact for every float32
    with np.errstate(divide="ignore", invalid="ignore"):
        mant, exp = np.frexp(v)  # v = mant * 2^exp, mant in [0.5, 1)
    p = np.where(mant == 0.5, exp - 1, exp)  # ceil(log2 v)
    code = np.clip(p.astype(np.int64) + 127, 0, 254)
    code = np.where(v == 0, 0, code)
    code = np.where(np.isinf(v), 254, code)
    return np.where(np.isnan(v), 255, code).astype(np.uint8)


def e4m3_value(codes):
    return np.asarray(codes, np.uint8).view(E4M3).astype(np.float32)


def ue8m0_value(codes):
    return np.asarray(codes, np.uint8).view(E8M0).astype(np.float32)


def e2m1_value(codes):
    return (np.asarray(codes, np.uint8) & 0xF).view(E2M1).astype(np.float32)


def pack_nibbles(codes):
    c = np.asarray(codes).astype(np.uint8) & 0xF
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed):
    p = np.asarray(packed).view(np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def encode(x, codec):
    x = np.ascontiguousarray(x, np.float32)
    codes = np.empty(x.shape, BF16 if codec == "bf16" else np.uint8)
    _C.encode_elementwise(arg(x), codec, arg(codes))
    return codes.view(np.uint16) if codec == "bf16" else codes


def decode(codes, codec):
    codes = np.ascontiguousarray(codes)
    out = np.empty(codes.shape, np.float32)
    _C.decode_elementwise(arg(codes.view(BF16) if codec == "bf16" else codes.view(np.uint8)), codec, arg(out))
    return out


def adversarial(shape, block, seed):
    """Random values whose magnitude changes per block (2^-30 .. 2^30), with an all-zero block, a
    NaN block, a -inf block, a huge value, fp32 denormals, a block of denormals and a -0.0."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1, block)
    flat *= np.exp2(rng.integers(-30, 30, size=(flat.shape[0], 1))).astype(np.float32)
    assert flat.shape[0] >= 8
    flat[1] = 0.0
    flat[2, 3] = np.nan
    flat[3, 0] = -np.inf
    flat[4, 5] = 3e38
    flat[5, 1:4] = [1e-40, -3e-42, 1e-45]
    flat[6] = rng.standard_normal(block).astype(np.float32) * np.float32(1e-39)
    flat[7, 2] = -0.0
    flat[7, 3] = -np.nan
    return x


# ------------------------------------------------------------------------------------------------
# Scalar codecs
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def float_patterns():
    """Random fp32 bit patterns (every class: NaN, inf, normal, denormal) plus all e4m3 / e2m1 /
    bf16 midpoints, where round-to-nearest-even decides."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    small = rng.standard_normal(100_000).astype(np.float32) * np.exp2(rng.integers(-12, 10, 100_000)).astype(np.float32)
    e4 = np.sort(e4m3_value(np.arange(0, 0x7F)))
    e2 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    mids = np.concatenate([(e4[1:] + e4[:-1]) / 2, (e2[1:] + e2[:-1]) / 2]).astype(np.float32)
    mids = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9))])
    bf_mid = (np.arange(0x3F80, 0x3FFF, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    special = np.array([0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448, 464, 465, 6, 7, 1e-45, 2.0**-127], np.float32)
    return np.concatenate([bits, small, mids, -mids, bf_mid, special]).astype(np.float32)


def test_e4m3_encode_matches_ml_dtypes(float_patterns):
    np.testing.assert_array_equal(encode(float_patterns, "e4m3"), np_e4m3(float_patterns))


def test_e4m3_decode_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    got, want = decode(codes, "e4m3"), e4m3_value(codes)
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want).sum() == 2
    np.testing.assert_array_equal(encode(got, "e4m3"), codes)  # exhaustive round trip, NaNs included


def test_e2m1_encode_and_decode(float_patterns):
    np.testing.assert_array_equal(encode(float_patterns, "e2m1"), np_e2m1(float_patterns))
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(decode(codes, "e2m1"), e2m1_value(codes))
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    np.testing.assert_array_equal(encode(ties, "e2m1"), [0, 2, 2, 4, 4, 6, 6])
    assert encode(np.array([np.nan, -np.nan], np.float32), "e2m1").tolist() == [7, 7]


def test_bf16_encode_matches_ml_dtypes(float_patterns):
    np.testing.assert_array_equal(encode(float_patterns, "bf16"), float_patterns.astype(BF16).view(np.uint16))


def test_ue8m0_ceil(float_patterns):
    np.testing.assert_array_equal(encode(float_patterns, "ue8m0_ceil"), np_ue8m0_ceil(float_patterns))
    finite = float_patterns[np.isfinite(float_patterns) & (np.abs(float_patterns) > 2.0**-127)
                            & (np.abs(float_patterns) <= 2.0**127)]
    value = ue8m0_value(encode(finite, "ue8m0_ceil"))
    assert np.all(value >= np.abs(finite)) and np.all(value / 2 < np.abs(finite))
    codes = np.arange(256, dtype=np.uint8)
    got, want = decode(codes, "ue8m0_ceil"), ue8m0_value(codes)
    np.testing.assert_array_equal(got[:255], want[:255])
    assert np.isnan(got[255])


# ------------------------------------------------------------------------------------------------
# int4-g128
# ------------------------------------------------------------------------------------------------
def np_quantize_int4(w):
    w = np.asarray(w).astype(np.float32)
    g = w.reshape(w.shape[:-1] + (-1, 128))
    amax = np.max(np.abs(g), axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = np.where(amax == 0, np.float32(1), amax / np.float32(7)).astype(np.float32)
        ok = np.isfinite(s) & (s > 0)
        q = np.where(ok[..., None], np.clip(np.rint(g / s[..., None]), -8, 7), 0).astype(np.int8)
    return pack_nibbles(q.reshape(w.shape)).view(np.int8), s


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_quantize_int4_g128(dtype):
    w = adversarial((2, 3, 1024), 128, 1).astype(dtype)
    q, s = Q.quantize_int4_g128(w)
    wq, ws = np_quantize_int4(w)
    assert q.dtype == np.int8 and q.shape == (2, 3, 512) and s.shape == (2, 3, 8)
    np.testing.assert_array_equal(q, wq)
    np.testing.assert_array_equal(s.view(np.uint32), ws.view(np.uint32))  # NaN payloads too
    out = Q.dequantize_int4_g128(q, s)
    values = unpack_nibbles(q).astype(np.int8)
    values = np.where(values >= 8, values - 16, values).astype(np.float32)
    want = (values.reshape(s.shape + (128,)) * s[..., None]).reshape(out.shape)
    np.testing.assert_array_equal(out, want)
    finite = np.isfinite(np.repeat(s, 128, axis=-1)) & (np.repeat(s, 128, axis=-1) > 0)
    err = np.abs(out - w.astype(np.float32))[finite]
    assert np.all(err <= np.repeat(s, 128, axis=-1)[finite] * 0.5001)


def test_dequantize_int4_bf16_scales():
    rng = np.random.default_rng(2)
    q = rng.integers(-128, 128, size=(3, 4, 64), dtype=np.int8)
    s = (rng.random((3, 4, 1)) + 0.1).astype(BF16)
    out = Q.dequantize_int4_g128(q, s)
    values = unpack_nibbles(q).astype(np.int8)
    values = np.where(values >= 8, values - 16, values).astype(np.float32)
    np.testing.assert_array_equal(out, values * s.astype(np.float32))


def test_pack_unpack_int4():
    rng = np.random.default_rng(3)
    v = rng.integers(-8, 8, size=(5, 6, 34), dtype=np.int8)
    p = Q.pack_int4(v)
    np.testing.assert_array_equal(p.view(np.uint8), pack_nibbles(v))
    np.testing.assert_array_equal(Q.unpack_int4(p), v)
    assert Q.pack_int4(np.array([-8, 7], np.int8)).view(np.uint8).tolist() == [0x78]  # even index low
    with pytest.raises(ValueError, match="'values'"):
        Q.pack_int4(np.array([1, 8], np.int8))


@pytest.mark.parametrize("k", [1024, 384, 512, 128])
@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_int4_scale_interleave_both_layouts(k, dtype):
    e, n, g = 3, 5, k // 128
    rng = np.random.default_rng(k)
    s = (rng.random((e, n, g)) + 0.01).astype(dtype)
    stored = Q.interleave_int4_scales(s)
    assert stored.dtype == s.dtype
    want_shape = (e, k // 512, 4 * n) if k % 512 == 0 else (e, g, n)
    assert stored.shape == want_shape == Q.int4_scale_layout_shape(e, n, k)
    for a in range(e):
        for i in range(n):
            for j in range(g):
                got = stored[a, j // 4, 4 * i + j % 4] if k % 512 == 0 else stored[a, j, i]
                assert got == s[a, i, j]
    np.testing.assert_array_equal(Q.deinterleave_int4_scales(stored, k), s)


# ------------------------------------------------------------------------------------------------
# FP8 e4m3
# ------------------------------------------------------------------------------------------------
def assert_e4m3_codes(got, want, nan_sign_free):
    """Exact, except that a NaN made by x / NaN-scale may carry either sign."""
    got = np.asarray(got).view(np.uint8)
    np.testing.assert_array_equal(np.where(nan_sign_free, got & 0x7F, got), np.where(nan_sign_free, want & 0x7F, want))


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_quantize_fp8_per_tensor_dynamic(dtype):
    x = np.random.default_rng(4).standard_normal((4, 96)).astype(np.float32) * 3
    x[0, :8] = [0.0, -0.0, 1e-40, -1e-45, 1e-6, -1e-5, 2e-3, 1e-38]  # zeros, denormals, tiny
    x = x.astype(dtype)
    q, scale = Q.quantize_fp8(x)
    xf = x.astype(np.float32)
    amax = np.max(np.abs(xf))
    assert q.dtype == E4M3 and scale.shape == (1,) and scale[0] == np.float32(amax) / np.float32(448)
    np.testing.assert_array_equal(q.view(np.uint8), np_e4m3(xf / scale[0]))
    assert np.count_nonzero(q.view(np.uint8) == 0x7E) + np.count_nonzero(q.view(np.uint8) == 0xFE) == 1  # amax
    assert np.count_nonzero(q.view(np.uint8) & 0x7F) > 300  # most elements are not flushed to zero
    np.testing.assert_array_equal(Q.dequantize_fp8(q, scale), e4m3_value(q.view(np.uint8)) * scale[0])


def test_quantize_fp8_given_scale_saturates_and_keeps_nan():
    x = adversarial((8, 64), 64, 5)
    q, scale = Q.quantize_fp8(x, scale=0.5)
    assert scale.tolist() == [0.5]
    np.testing.assert_array_equal(q.view(np.uint8), np_e4m3(x / np.float32(0.5)))
    assert q.view(np.uint8)[4, 5] == 0x7E and q.view(np.uint8)[3, 0] == 0xFE and q.view(np.uint8)[7, 3] == 0xFF


def test_quantize_fp8_per_token():
    x = adversarial((2, 6, 64), 64, 6)  # rows: 12
    q, scale = Q.quantize_fp8(x, per_token=True)
    assert scale.shape == (2, 6)
    rows = x.reshape(12, 64)
    amax = np.max(np.abs(rows), axis=1)
    want_scale = np.where(amax == 0, np.float32(1), amax / np.float32(448)).astype(np.float32)
    np.testing.assert_array_equal(scale.reshape(-1).view(np.uint32), want_scale.view(np.uint32))
    with np.errstate(invalid="ignore"):
        v = rows / want_scale[:, None]
    assert_e4m3_codes(q.reshape(12, 64), np_e4m3(v), np.isnan(v) & ~np.isnan(rows))
    assert np.all(q.view(np.uint8)[0, 1] == 0)  # the all-zero row gets scale 1 and zeros
    out = Q.dequantize_fp8(q, scale)
    np.testing.assert_array_equal(out.reshape(12, 64), e4m3_value(q.view(np.uint8).reshape(12, 64)) * want_scale[:, None])


# ------------------------------------------------------------------------------------------------
# NVFP4 / MXFP4 / MXFP8
# ------------------------------------------------------------------------------------------------
def np_quantize_nvfp4(x, gs):
    gs = np.float32(gs)
    b = np.asarray(x).astype(np.float32).reshape(x.shape[:-1] + (-1, 16))
    amax = np.max(np.abs(b), axis=-1)
    nan = np.isnan(amax)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        sf = np.where(nan, 0x7F, np_e4m3((gs * amax) / np.float32(6))).astype(np.uint8)
        sfv = e4m3_value(sf)[..., None]
        codes = np.where(sfv == 0, 0, np_e2m1((b * gs) / sfv))
    codes = np.where(nan[..., None], 7, codes).astype(np.uint8).reshape(x.shape)
    return pack_nibbles(codes), sf


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("gs", [1.0, 448 * 6 / 3.0, 1e-3])
def test_quantize_nvfp4(dtype, gs):
    x = adversarial((3, 128), 16, 7).astype(dtype)
    q, sf = Q.quantize_nvfp4(x, gs)
    wq, wsf = np_quantize_nvfp4(x, gs)
    assert q.dtype == np.uint8 and q.shape == (3, 64) and sf.dtype == E4M3 and sf.shape == (3, 8)
    np.testing.assert_array_equal(sf.view(np.uint8), wsf)
    np.testing.assert_array_equal(q, wq)
    assert sf.view(np.uint8).reshape(-1)[2] == 0x7F and sf.view(np.uint8).reshape(-1)[1] == 0
    out = Q.dequantize_nvfp4(q, sf, gs)
    want = (e2m1_value(unpack_nibbles(q)).reshape(3, 8, 16) * e4m3_value(wsf)[..., None]) / np.float32(gs)
    np.testing.assert_array_equal(out, want.reshape(3, 128))


def np_quantize_mx(x, max_code, fp4):
    b = np.asarray(x).astype(np.float32).reshape(x.shape[:-1] + (-1, 32))
    amax = np.max(np.abs(b), axis=-1)
    nan = np.isnan(amax)
    with np.errstate(over="ignore", invalid="ignore"):
        sf = np_ue8m0_ceil(amax / np.float32(max_code))
        v = b / np.where(nan, np.float32(1), ue8m0_value(np.where(nan, 127, sf)))[..., None]
    codes = np.where(nan[..., None], 7 if fp4 else 0x7F, np_e2m1(v) if fp4 else np_e4m3(v)).astype(np.uint8)
    codes = codes.reshape(x.shape)
    return (pack_nibbles(codes) if fp4 else codes), sf


@pytest.mark.parametrize("fp4", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_quantize_mx(fp4, dtype):
    x = adversarial((2, 4, 128), 32, 8).astype(dtype)
    q, sf = Q.quantize_mxfp4(x) if fp4 else Q.quantize_mxfp8(x)
    wq, wsf = np_quantize_mx(x, 6.0 if fp4 else 448.0, fp4)
    assert sf.dtype == np.uint8 and sf.shape == (2, 4, 4)
    assert q.dtype == (np.uint8 if fp4 else E4M3) and q.shape == (2, 4, 64 if fp4 else 128)
    np.testing.assert_array_equal(sf, wsf)
    np.testing.assert_array_equal(q.view(np.uint8), wq)
    flat = sf.reshape(-1)
    assert flat[1] == 0 and flat[2] == 255 and flat[3] == 254  # zero, NaN, inf blocks
    out = Q.dequantize_mxfp4(q, sf) if fp4 else Q.dequantize_mxfp8(q, sf)
    elems = e2m1_value(unpack_nibbles(q)) if fp4 else e4m3_value(q.view(np.uint8))
    want = (elems.reshape(sf.shape + (32,)) * ue8m0_value(sf)[..., None]).reshape(out.shape)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_array_equal(out[~np.isnan(out)], want[~np.isnan(want)])


# ------------------------------------------------------------------------------------------------
# 128x4 swizzle and gate/up
# ------------------------------------------------------------------------------------------------
def np_swizzle(sf):
    """DESIGN.md 3.3, element by element."""
    e, rows, cols = sf.shape
    mt, kt = -(-rows // 128), -(-cols // 4)
    out = np.zeros(e * mt * kt * 512, np.uint8)
    for g in range(e):
        for r in range(rows):
            for c in range(cols):
                off = ((g * mt + r // 128) * kt + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
                out[off] = sf[g, r, c]
    return out.reshape(e, mt * 128, kt * 4)


@pytest.mark.parametrize("shape", [(2, 200, 6), (1, 128, 4), (3, 5, 1), (1, 300, 13)])
def test_swizzle_128x4(shape):
    rng = np.random.default_rng(9)
    sf = rng.integers(1, 256, size=shape, dtype=np.uint8)  # nonzero, so padding shows
    sw = Q.swizzle_scales_128x4(sf)
    np.testing.assert_array_equal(sw, np_swizzle(sf))
    np.testing.assert_array_equal(Q.unswizzle_scales_128x4(sw, shape[1], shape[2]), sf)
    sw2 = Q.swizzle_scales_128x4(sf[0].view(E4M3))  # 2-D form keeps the dtype
    assert sw2.dtype == E4M3
    np.testing.assert_array_equal(sw2.view(np.uint8), np_swizzle(sf[:1])[0])
    assert _C.swizzled_offset(1, 200, 9, 2, 3) == ((1 * 2 + 1) * 3 + 2) * 512 + 8 * 16 + 2 * 4 + 1


@pytest.mark.parametrize("dtype", [np.uint8, BF16, np.float32, E4M3])
def test_gate_up_reorder(dtype):
    e, inter, c = 2, 192, 5
    rng = np.random.default_rng(10)
    w = rng.integers(0, 255, size=(e, 2 * inter, c)).astype(np.uint8).astype(np.float32).astype(dtype)
    fi = Q.gate_up_sglang_to_flashinfer(w)
    gate, up = w[:, :inter], w[:, inter:]
    blocks = []
    for j in range(inter // 64):
        blocks += [up[:, 64 * j:64 * (j + 1)], gate[:, 64 * j:64 * (j + 1)]]
    want = np.concatenate(blocks, axis=1)
    assert fi.dtype == w.dtype
    np.testing.assert_array_equal(fi.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(Q.gate_up_flashinfer_to_sglang(fi).view(np.uint8), w.view(np.uint8))
    np.testing.assert_array_equal(Q.gate_up_sglang_to_flashinfer(w[0]).view(np.uint8), want[0].view(np.uint8))


# ------------------------------------------------------------------------------------------------
# Errors name the argument
# ------------------------------------------------------------------------------------------------
def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="'w'"):
        Q.quantize_int4_g128(np.ones((2, 100), np.float32))
    with pytest.raises(ValueError, match="'global_scale'"):
        Q.quantize_nvfp4(np.ones((2, 32), np.float32), 0.0)
    with pytest.raises(ValueError, match="'scale'"):
        Q.quantize_fp8(np.ones((4, 32), np.float32), scale=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="'w'"):
        Q.gate_up_sglang_to_flashinfer(np.ones((96, 4), np.float32))
    with pytest.raises(TypeError, match="'sf'"):
        Q.swizzle_scales_128x4(np.ones((4, 4), np.float32))
    with pytest.raises(ValueError, match="'x'"):
        Q.quantize_mxfp8(np.ones((2, 48), np.float32))
    q = np.zeros((2, 16), np.uint8)
    with pytest.raises(ValueError, match="'sf'"):  # C++ check: sf shape
        _C.dequantize_mxfp4(arg(q), arg(np.zeros((2, 2), np.uint8)), arg(np.zeros((2, 32), np.float32)))
    with pytest.raises(TypeError, match="'out'"):  # C++ check: out dtype
        _C.dequantize_mxfp4(arg(q), arg(np.zeros((2, 1), np.uint8)), arg(np.zeros((2, 32), np.int32)))
    with pytest.raises(ValueError, match="'codec'"):
        encode(np.ones(3, np.float32), "e5m2")
