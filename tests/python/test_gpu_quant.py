"""GPU quantizers and layout helpers (src/cuda/quant/) against the CPU functions, bit for bit.

Every GPU function of include/qmoe/formats.h is called through qmoe._C on torch CUDA tensors and on
numpy copies of the same data (the CPU reference, src/reference/formats.cpp), with every output
poisoned first (0xAA bytes), then compared:
  codes (e4m3 / e2m1 / ue8m0 / int4 bytes, swizzled and reordered bytes): byte-identical;
  float outputs: identical bits, NaN at the same places; the quantizers' float scales (fp8 dynamic
  scale, int4 scales) also with identical NaN bits. Dequantizers' NaN payloads are not compared
  (the CPU's NaN bits depend on the host compiler's operand order of a multiplication).
Data: random with NaN (both signs), +-inf, +-1e30, fp32-denormal / tiny values, -0, all-zero 32-
and 128-blocks and all-zero rows, block magnitudes over 40 binades; float32 and bfloat16; K in
{32, 64, 128, 4096, 7168} where the format allows; 1, odd and > 65536 rows; a tensor larger than one
grid-stride pass (> 2^24 elements); user scales of 0 (0 / 0), negative, NaN (both signs) and inf.
Also: the public qmoe.quant functions on CUDA tensors (dtype, device, and the same values as on
numpy), a non-default stream, CUDA-graph capture of the dynamic fp8 quantizer and of NVFP4
(replayed with new data), and the device checks (mixed devices are refused before anything runs).
NOTE: the CPU's NaN for 0/0 and inf/inf is x86's (sign set, e4m3 code 0xFF); the kernels copy it
(quant_common.cuh: div_as_host), so these tests assume an x86-64 host.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

from gpu_common import require_hopper, to_dev  # noqa: E402

torch = require_hopper()

from qmoe import _C  # noqa: E402
from qmoe import quant as Q  # noqa: E402
from qmoe._tensors import arg  # noqa: E402

DEV = torch.device("cuda")
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
POISON_U32 = 0xAAAAAAAA  # as float32: -3.03e-13, never a scale and (in practice) never a result


# ------------------------------------------------------------------------------------------------
# data and plumbing
# ------------------------------------------------------------------------------------------------
def to_np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    if t.dtype in (torch.float8_e4m3fn, getattr(torch, "float8_e8m0fnu", None)):
        return t.view(torch.uint8).numpy()
    return t.numpy()


def make_x(shape, dtype=np.float32, seed=0, special=True) -> np.ndarray:
    """Random real data; with special=True it holds every hostile value the formats care about."""
    rng = np.random.default_rng(seed)
    shape = tuple(shape)
    k = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32)
    # Block magnitudes over 40 binades (per 16 along K), so scales vary block to block.
    mag = np.exp2(rng.integers(-20, 20, size=shape[:-1] + ((k + 15) // 16,))).astype(np.float32)
    x *= np.repeat(mag, 16, axis=-1)[..., :k]
    flat = x.reshape(-1)
    n = flat.size
    if special and n:
        def put(frac, value):  # value with a random sign (copysign: NaN of both signs too)
            idx = rng.integers(0, n, size=max(1, int(n * frac)))
            flat[idx] = np.copysign(np.float32(value), np.where(rng.random(idx.size) < 0.5, -1, 1)).astype(np.float32)

        put(0.0005, np.nan)
        put(0.0005, np.inf)
        put(0.001, 1e30)
        put(0.002, 1e-40)  # fp32 denormal
        put(0.002, 1e-45)  # smallest fp32 denormal
        put(0.002, 3e-39)
        flat[rng.integers(0, n, size=max(1, n // 1000))] = -0.0
        if k % 32 == 0:  # all-zero 32-blocks (so also 16-blocks)
            blocks = x.reshape(-1, 32)
            blocks[rng.random(blocks.shape[0]) < 0.05] = 0.0
        if k % 128 == 0 and n >= 128:
            x.reshape(-1, 128)[rng.integers(0, n // 128)] = 0.0
        rows = x.reshape(-1, k)
        if rows.shape[0] > 2:
            rows[1] = 0.0
    return x.astype(dtype)


def poison_np(shape, kind):
    if kind == "f32":
        return np.full(shape, POISON_U32, np.uint32).view(np.float32)
    return np.full(shape, 0xAA, np.uint8)


def poison_dev(shape, kind):
    if kind == "f32":
        return torch.full(tuple(shape), POISON_U32 - (1 << 32), dtype=torch.int32, device=DEV).view(torch.float32)
    return torch.full(tuple(shape), 0xAA, dtype=torch.uint8, device=DEV)


def stream_id() -> int:
    return torch.cuda.current_stream().cuda_stream


def run_both(fn, inputs, outputs):
    """fn(*args, stream=s) with args = inputs then outputs (each an _C.Arg). inputs: numpy arrays;
    outputs: (shape, 'u8' | 'f32'). Returns (cpu outputs, gpu outputs), both numpy."""
    cpu_out = [poison_np(s, kind) for s, kind in outputs]
    fn(*[arg(a) for a in list(inputs) + cpu_out], stream=0)
    dev_in = [to_dev(a) for a in inputs]
    dev_out = [poison_dev(s, kind) for s, kind in outputs]
    fn(*[arg(t) for t in dev_in + dev_out], stream=stream_id())
    torch.cuda.synchronize()
    return cpu_out, [to_np(t) for t in dev_out]


def assert_bytes(gpu: np.ndarray, cpu: np.ndarray, what: str):
    g = np.ascontiguousarray(gpu).view(np.uint8).reshape(-1)
    c = np.ascontiguousarray(cpu).view(np.uint8).reshape(-1)
    assert g.shape == c.shape, what
    bad = np.flatnonzero(g != c)
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{what}: {bad.size} of {c.size} bytes differ, first at {i}: gpu {g[i]:#04x} cpu {c[i]:#04x}")


def assert_floats(gpu: np.ndarray, cpu: np.ndarray, what: str, nan_bits=False):
    g = np.ascontiguousarray(gpu, np.float32).reshape(-1)
    c = np.ascontiguousarray(cpu, np.float32).reshape(-1)
    assert g.shape == c.shape, what
    gn, cn = np.isnan(g), np.isnan(c)
    bad = np.flatnonzero(gn != cn)
    if bad.size:
        raise AssertionError(f"{what}: NaN at different places, first at {bad[0]}: gpu {g[bad[0]]} cpu {c[bad[0]]}")
    gb, cb = g.view(np.uint32), c.view(np.uint32)
    check = np.ones_like(gn) if nan_bits else ~cn
    bad = np.flatnonzero((gb != cb) & check)
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{what}: {bad.size} values differ, first at {i}: gpu {g[i]!r} ({gb[i]:#010x}) "
                             f"cpu {c[i]!r} ({cb[i]:#010x})")
    assert not np.any(gb == POISON_U32) or np.any(cb == POISON_U32), f"{what}: poison left in the GPU output"


def test_kernels_built():
    assert _C.kernels_built(), "the qmoe extension under test was built without the sm_90a kernels"


# (rows, K) of a 2-D x, or a full shape. K = 32 / 64 are legal for fp8, NVFP4 and MX only.
SHAPES = [(1, 32), (3, 64), (7, 128), (1, 4096), (5, 7168), (33, 4096), (129, 7168), (2, 3, 256)]
INT4_SHAPES = [s for s in SHAPES if s[-1] % 128 == 0]
DTYPES = [np.float32, BF16]
DTYPE_IDS = ["f32", "bf16"]


def rows_of(shape):
    return int(np.prod(shape[:-1]))


# ------------------------------------------------------------------------------------------------
# FP8 e4m3
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("special", [True, False], ids=["hostile", "clean"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES + [(70001, 32), (2400, 7168)], ids=str)
def test_fp8_dynamic_scale(shape, dtype, special):
    """Per tensor (multi-CTA atomicMax) and per row (one CTA per row, > 65536 rows included)."""
    x = make_x(shape, dtype, seed=sum(shape), special=special)
    for scale_shape in [(1,), shape[:-1]]:
        cpu, gpu = run_both(_C.fp8_dynamic_scale, [x], [(scale_shape, "f32")])
        assert_floats(gpu[0], cpu[0], f"scale {scale_shape}", nan_bits=True)


@pytest.mark.parametrize("case", ["zeros", "last_nan", "last_max", "first_inf", "empty"])
@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_dynamic_scale_edges(case, per_row):
    """The reduction must see every element: the deciding value at the first / last position."""
    x = np.random.default_rng(5).uniform(-1, 1, size=(5, 4096 * 3 + 32)).astype(np.float32)
    if case == "zeros":
        x[:] = 0.0
        x[2, 7] = -0.0
    elif case == "last_nan":
        x[-1, -1] = np.nan
    elif case == "last_max":
        x[:, -1] = 1e6 * np.arange(1, 6, dtype=np.float32)
    elif case == "first_inf":
        x[:, 0] = -np.inf
    else:
        x = np.zeros((0, 64), np.float32)
    scale_shape = x.shape[:-1] if per_row else (1,)
    cpu, gpu = run_both(_C.fp8_dynamic_scale, [x], [(scale_shape, "f32")])
    assert_floats(gpu[0], cpu[0], case, nan_bits=True)


def fp8_scales(x: np.ndarray, per_row: bool, rng) -> np.ndarray:
    """Dynamic scales, then a few user-style ones: 0 (0/0 and x/0), negative, NaN of both signs, inf."""
    scale = np.empty(x.shape[:-1] if per_row else (1,), np.float32)
    _C.fp8_dynamic_scale(arg(x), arg(scale))
    flat = scale.reshape(-1)
    if per_row and flat.size >= 6:
        flat[:6] = np.array([0.0, -0.02, np.nan, -np.nan, np.inf, 1e-30], np.float32)
        rng.shuffle(flat)
    return scale


@pytest.mark.parametrize("special", [True, False], ids=["hostile", "clean"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES + [(70001, 32), (2400, 7168)], ids=str)
@pytest.mark.parametrize("per_row", [False, True], ids=["tensor", "row"])
def test_quantize_fp8(shape, dtype, special, per_row):
    x = make_x(shape, dtype, seed=3 * sum(shape), special=special)
    scale = fp8_scales(x, per_row, np.random.default_rng(1))
    cpu, gpu = run_both(_C.quantize_fp8, [x, scale], [(shape, "u8")])
    assert_bytes(gpu[0], cpu[0], "q")


@pytest.mark.parametrize("value", [0.0, -0.0, -3.5, np.nan, -np.nan, np.inf, 1e-38, 7.0e-46])
def test_quantize_fp8_user_scalar_scale(value):
    """A zero scale gives 0/0 = NaN for zero inputs (code 0xFF, as the x86 CPU) and saturation else."""
    x = make_x((9, 128), np.float32, seed=11)
    scale = np.array([value], np.float32)
    cpu, gpu = run_both(_C.quantize_fp8, [x, scale], [((9, 128), "u8")])
    assert_bytes(gpu[0], cpu[0], f"q at scale {value}")


@pytest.mark.parametrize("per_row", [False, True], ids=["tensor", "row"])
@pytest.mark.parametrize("shape", [(1, 32), (7, 4096), (2, 3, 256), (129, 7168)], ids=str)
def test_dequantize_fp8(shape, per_row):
    rng = np.random.default_rng(sum(shape))
    q = rng.integers(0, 256, size=shape, dtype=np.uint8)  # every code, NaN codes included
    scale = fp8_scales(make_x(shape, seed=2), per_row, rng)
    cpu, gpu = run_both(_C.dequantize_fp8, [q, scale], [(shape, "f32")])
    assert_floats(gpu[0], cpu[0], "out")


# ------------------------------------------------------------------------------------------------
# NVFP4 / MXFP4 / MXFP8
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gs_kind", ["one", "tensor", "huge", "tiny"])
@pytest.mark.parametrize("special", [True, False], ids=["hostile", "clean"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_nvfp4(shape, dtype, special, gs_kind):
    x = make_x(shape, dtype, seed=7 * sum(shape), special=special)
    finite = np.abs(x.astype(np.float32))
    finite = finite[np.isfinite(finite)]
    gs = {"one": 1.0, "huge": 1e30, "tiny": 1e-30,
          "tensor": Q.nvfp4_global_scale(finite.max() if finite.size else 0.0)}[gs_kind]
    k = shape[-1]
    fn = lambda x_, q_, sf_, stream: _C.quantize_nvfp4(x_, gs, q_, sf_, stream=stream)  # noqa: E731
    cpu, gpu = run_both(fn, [x], [(shape[:-1] + (k // 2,), "u8"), (shape[:-1] + (k // 16,), "u8")])
    assert_bytes(gpu[1], cpu[1], "sf")
    assert_bytes(gpu[0], cpu[0], "q")


@pytest.mark.parametrize("gs", [1.0, 2688.0, 3.0e-3])
@pytest.mark.parametrize("shape", [(1, 32), (5, 7168), (2, 3, 256)], ids=str)
def test_dequantize_nvfp4(shape, gs):
    rng = np.random.default_rng(sum(shape))
    k = shape[-1]
    q = rng.integers(0, 256, size=shape[:-1] + (k // 2,), dtype=np.uint8)
    sf = rng.integers(0, 256, size=shape[:-1] + (k // 16,), dtype=np.uint8).view(E4M3)
    fn = lambda q_, sf_, out_, stream: _C.dequantize_nvfp4(q_, sf_, gs, out_, stream=stream)  # noqa: E731
    cpu, gpu = run_both(fn, [q, sf], [(shape, "f32")])
    assert_floats(gpu[0], cpu[0], "out")


@pytest.mark.parametrize("fp4", [True, False], ids=["mxfp4", "mxfp8"])
@pytest.mark.parametrize("special", [True, False], ids=["hostile", "clean"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_mx(shape, dtype, special, fp4):
    x = make_x(shape, dtype, seed=13 * sum(shape), special=special)
    k = shape[-1]
    fn = _C.quantize_mxfp4 if fp4 else _C.quantize_mxfp8
    cpu, gpu = run_both(fn, [x], [(shape[:-1] + (k // 2 if fp4 else k,), "u8"), (shape[:-1] + (k // 32,), "u8")])
    assert_bytes(gpu[1], cpu[1], "sf")
    assert_bytes(gpu[0], cpu[0], "q")


@pytest.mark.parametrize("fp4", [True, False], ids=["mxfp4", "mxfp8"])
@pytest.mark.parametrize("shape", [(1, 32), (5, 7168), (2, 3, 256)], ids=str)
def test_dequantize_mx(shape, fp4):
    rng = np.random.default_rng(sum(shape) + fp4)
    k = shape[-1]
    q = rng.integers(0, 256, size=shape[:-1] + (k // 2 if fp4 else k,), dtype=np.uint8)
    sf = rng.integers(0, 256, size=shape[:-1] + (k // 32,), dtype=np.uint8)  # 0, 254 and 255 included
    special = np.array([0, 254, 255], np.uint8)[: sf.size]  # a (1, 32) row has a single block
    sf.reshape(-1)[: special.size] = special
    fn = _C.dequantize_mxfp4 if fp4 else _C.dequantize_mxfp8
    cpu, gpu = run_both(fn, [q, sf], [(shape, "f32")])
    assert_floats(gpu[0], cpu[0], "out")


# ------------------------------------------------------------------------------------------------
# int4-g128
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("special", [True, False], ids=["hostile", "clean"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=str)
def test_quantize_int4_g128(shape, dtype, special):
    w = make_x(shape, dtype, seed=17 * sum(shape), special=special)
    k = shape[-1]
    cpu, gpu = run_both(_C.quantize_int4_g128, [w], [(shape[:-1] + (k // 2,), "u8"), (shape[:-1] + (k // 128,), "f32")])
    assert_floats(gpu[1], cpu[1], "scales", nan_bits=True)
    assert_bytes(gpu[0], cpu[0], "q")


@pytest.mark.parametrize("scale_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 128), (5, 7168), (2, 3, 256)], ids=str)
def test_dequantize_int4_g128(shape, scale_dtype):
    rng = np.random.default_rng(sum(shape))
    k = shape[-1]
    q = rng.integers(0, 256, size=shape[:-1] + (k // 2,), dtype=np.uint8)
    scales = make_x(shape[:-1] + (k // 128,), scale_dtype, seed=4)
    cpu, gpu = run_both(_C.dequantize_int4_g128, [q, scales], [(shape, "f32")])
    assert_floats(gpu[0], cpu[0], "out")


# ------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (128, 4), (129, 5), (300, 448), (3, 130, 7), (2, 128, 8)], ids=str)
def test_swizzle_unswizzle(shape):
    rng = np.random.default_rng(sum(shape))
    sf = rng.integers(1, 256, size=shape, dtype=np.uint8)  # no zero: padding must come out 0
    rp, cp = (shape[-2] + 127) // 128 * 128, (shape[-1] + 3) // 4 * 4
    out_shape = shape[:-2] + (rp, cp)
    cpu, gpu = run_both(_C.swizzle_scales_128x4, [sf], [(out_shape, "u8")])
    assert_bytes(gpu[0], cpu[0], "swizzled")
    cpu2, gpu2 = run_both(_C.unswizzle_scales_128x4, [cpu[0]], [(shape, "u8")])
    assert_bytes(gpu2[0], cpu2[0], "unswizzled")
    assert_bytes(gpu2[0], sf, "round trip")


def poisoned_like_dtype(shape, dtype, on_device: bool):
    """0xAA bytes viewed as float32 or bfloat16 (numpy or torch)."""
    size = np.dtype(dtype).itemsize
    raw = tuple(shape[:-1]) + (shape[-1] * size,)
    if on_device:
        return poison_dev(raw, "u8").view(torch.float32 if size == 4 else torch.bfloat16)
    return poison_np(raw, "u8").view(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("eng", [(1, 1, 1), (2, 5, 4), (3, 7, 56), (2, 4, 3), (1, 256, 57)], ids=str)
def test_interleave_int4_scales(eng, dtype):
    """G % 4 == 0 ([E, G/4, 4N]) and not ([E, G, N]); both directions."""
    e, n, g = eng
    s = make_x(eng, dtype, seed=e + n + g, special=False)
    out_shape = (e, g // 4, 4 * n) if g % 4 == 0 else (e, g, n)
    cpu_out = poisoned_like_dtype(out_shape, dtype, False)
    _C.interleave_int4_scales(arg(s), arg(cpu_out))
    dev_out = poisoned_like_dtype(out_shape, dtype, True)
    _C.interleave_int4_scales(arg(to_dev(s)), arg(dev_out), stream=stream_id())
    back = poisoned_like_dtype(eng, dtype, True)
    _C.deinterleave_int4_scales(arg(dev_out), arg(back), stream=stream_id())
    torch.cuda.synchronize()
    assert_bytes(to_np(dev_out), cpu_out, "stored")
    assert_bytes(to_np(back), s, "logical")


TORCH_OF = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float16): torch.float16, np.dtype(np.int32): torch.int32}


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.int32], ids=["u8", "f16", "i32"])
@pytest.mark.parametrize("shape", [(128, 1), (1, 128, 3), (3, 256, 40), (2, 512, 7)], ids=str)
def test_gate_up_reorders(shape, dtype):
    """Both directions on the GPU == CPU (16-byte path: torch allocations are aligned)."""
    rng = np.random.default_rng(sum(shape))
    size = np.dtype(dtype).itemsize
    raw = shape[:-1] + (shape[-1] * size,)
    w = rng.integers(0, 256, size=raw, dtype=np.uint8).view(dtype)
    for fn in (_C.gate_up_sglang_to_flashinfer, _C.gate_up_flashinfer_to_sglang):
        cpu_out = poison_np(raw, "u8").view(dtype)
        fn(arg(w), arg(cpu_out))
        out_dev = poison_dev(raw, "u8").view(TORCH_OF[np.dtype(dtype)])
        fn(arg(to_dev(w)), arg(out_dev), stream=stream_id())
        torch.cuda.synchronize()
        assert_bytes(to_np(out_dev), cpu_out, fn.__name__)


@pytest.mark.parametrize("shape", [(128, 1), (2, 256, 5), (1, 512, 33)], ids=str)
def test_gate_up_reorders_misaligned(shape):
    """Views 1 byte into their buffers take the per-byte path."""
    w = np.random.default_rng(7).integers(0, 256, size=shape, dtype=np.uint8)
    numel = w.size
    for fn in (_C.gate_up_sglang_to_flashinfer, _C.gate_up_flashinfer_to_sglang):
        cpu_out = poison_np(shape, "u8")
        fn(arg(w), arg(cpu_out))
        buf = torch.full((numel + 1,), 0xAA, dtype=torch.uint8, device=DEV)
        buf[1:].copy_(torch.from_numpy(w.reshape(-1)).to(DEV))
        obuf = torch.full((numel + 2,), 0xAA, dtype=torch.uint8, device=DEV)
        w_dev, out_dev = buf[1:].view(shape), obuf[1:numel + 1].view(shape)
        assert w_dev.data_ptr() % 16 != 0 and out_dev.data_ptr() % 16 != 0
        fn(arg(w_dev), arg(out_dev), stream=stream_id())
        torch.cuda.synchronize()
        assert_bytes(to_np(out_dev), cpu_out, fn.__name__)
        assert int(obuf[0]) == 0xAA and int(obuf[-1]) == 0xAA, "wrote outside the output"


# ------------------------------------------------------------------------------------------------
# the public qmoe.quant functions on CUDA tensors
# ------------------------------------------------------------------------------------------------
def check_same(gpu, cpu, what):
    """gpu torch (on DEV) vs cpu numpy result of the same public function."""
    assert isinstance(gpu, torch.Tensor) and gpu.device.type == "cuda", what
    g = to_np(gpu)
    if g.dtype == np.float32:
        assert_floats(g, cpu, what)
    else:
        assert_bytes(g, cpu, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_public_api_dispatch(dtype):
    x_np = make_x((37, 4096), dtype, seed=23)
    x = to_dev(x_np)
    for per_token in (False, True):
        (qg, sg), (qc, sc) = Q.quantize_fp8(x, per_token=per_token), Q.quantize_fp8(x_np, per_token=per_token)
        assert qg.dtype == torch.float8_e4m3fn and sg.dtype == torch.float32
        check_same(qg, qc, "quantize_fp8 q")
        check_same(sg, sc, "quantize_fp8 scale")
        check_same(Q.dequantize_fp8(qg, sg), Q.dequantize_fp8(qc, sc), "dequantize_fp8")
    check_same(Q.quantize_fp8(x, scale=0.01)[0], Q.quantize_fp8(x_np, scale=0.01)[0], "quantize_fp8 float scale")
    check_same(Q.fp8_dynamic_scale(x), Q.fp8_dynamic_scale(x_np), "fp8_dynamic_scale")
    for swizzle in (False, True):
        (qg, sfg), (qc, sfc) = Q.quantize_nvfp4(x, 300.0, swizzle=swizzle), Q.quantize_nvfp4(x_np, 300.0, swizzle=swizzle)
        assert qg.dtype == torch.uint8 and sfg.dtype == torch.float8_e4m3fn
        check_same(qg, qc, "nvfp4 q")
        check_same(sfg, sfc, f"nvfp4 sf swizzle={swizzle}")
        if not swizzle:
            check_same(Q.dequantize_nvfp4(qg, sfg, 300.0), Q.dequantize_nvfp4(qc, sfc, 300.0), "dequantize_nvfp4")
    for qf, dqf in ((Q.quantize_mxfp4, Q.dequantize_mxfp4), (Q.quantize_mxfp8, Q.dequantize_mxfp8)):
        (qg, sfg), (qc, sfc) = qf(x), qf(x_np)
        check_same(qg, qc, qf.__name__ + " q")
        check_same(sfg, sfc, qf.__name__ + " sf")
        check_same(dqf(qg, sfg), dqf(qc, sfc), dqf.__name__)
    (qg, sg), (qc, sc) = Q.quantize_int4_g128(x), Q.quantize_int4_g128(x_np)
    assert qg.dtype == torch.int8
    check_same(qg, qc, "int4 q")
    check_same(sg, sc, "int4 scales")
    check_same(Q.dequantize_int4_g128(qg, sg), Q.dequantize_int4_g128(qc, sc), "dequantize_int4_g128")
    s3 = make_x((2, 64, 32), dtype, seed=3, special=False)
    st_g, st_c = Q.interleave_int4_scales(to_dev(s3)), Q.interleave_int4_scales(s3)
    check_same(st_g, st_c, "interleave_int4_scales")
    check_same(Q.deinterleave_int4_scales(st_g, 32 * 128), Q.deinterleave_int4_scales(st_c, 32 * 128), "deinterleave")
    sf3 = np.random.default_rng(1).integers(0, 256, size=(3, 200, 9), dtype=np.uint8)
    sw_g, sw_c = Q.swizzle_scales_128x4(to_dev(sf3)), Q.swizzle_scales_128x4(sf3)
    check_same(sw_g, sw_c, "swizzle")
    check_same(Q.unswizzle_scales_128x4(sw_g, 200, 9), sf3, "unswizzle")
    w13 = make_x((2, 256, 64), dtype, seed=9)
    fi_g, fi_c = Q.gate_up_sglang_to_flashinfer(to_dev(w13)), Q.gate_up_sglang_to_flashinfer(w13)
    check_same(fi_g, fi_c, "gate_up_sglang_to_flashinfer")
    check_same(Q.gate_up_flashinfer_to_sglang(fi_g), w13, "gate_up_flashinfer_to_sglang")


def test_side_stream():
    """Work is enqueued on torch's current stream: a side stream gives the same result."""
    x_np = make_x((513, 7168), np.float32, seed=31)
    side = torch.cuda.Stream()
    x = to_dev(x_np)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        qg, sfg = Q.quantize_mxfp8(x)
        sg = Q.fp8_dynamic_scale(x, per_token=True)
    side.synchronize()
    qc, sfc = Q.quantize_mxfp8(x_np)
    check_same(qg, qc, "q")
    check_same(sfg, sfc, "sf")
    check_same(sg, Q.fp8_dynamic_scale(x_np, per_token=True), "scale")


@pytest.mark.parametrize("per_token", [False, True], ids=["tensor", "row"])
def test_cuda_graph_capture(per_token):
    """Dynamic fp8 (memset + atomicMax + finalize, or one CTA per row) and NVFP4 captured in one
    graph, replayed on new data; every replay equals the CPU."""
    shape = (301, 4096)
    x = to_dev(make_x(shape, np.float32, seed=0))
    scale = torch.empty(shape[:-1] if per_token else (1,), dtype=torch.float32, device=DEV)
    q = torch.empty(shape, dtype=torch.uint8, device=DEV)
    q4 = torch.empty((shape[0], shape[1] // 2), dtype=torch.uint8, device=DEV)
    sf4 = torch.empty((shape[0], shape[1] // 16), dtype=torch.uint8, device=DEV)

    def body():
        s = stream_id()
        _C.fp8_dynamic_scale(arg(x), arg(scale), stream=s)
        _C.quantize_fp8(arg(x), arg(scale), arg(q), stream=s)
        _C.quantize_nvfp4(arg(x), 300.0, arg(q4), arg(sf4), stream=s)

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        body()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for seed in (1, 2, 3):
        x_np = make_x(shape, np.float32, seed=seed, special=seed != 2)
        x.copy_(to_dev(x_np))
        for t in (q, q4, sf4):
            t.fill_(0xAA)
        scale.fill_(-1.0)
        graph.replay()
        torch.cuda.synchronize()
        cs = np.empty(tuple(scale.shape), np.float32)
        _C.fp8_dynamic_scale(arg(x_np), arg(cs))
        cq = np.empty(shape, np.uint8)
        _C.quantize_fp8(arg(x_np), arg(cs), arg(cq))
        cq4, csf4 = np.empty(tuple(q4.shape), np.uint8), np.empty(tuple(sf4.shape), np.uint8)
        _C.quantize_nvfp4(arg(x_np), 300.0, arg(cq4), arg(csf4))
        assert_floats(to_np(scale), cs, f"scale replay {seed}", nan_bits=True)
        assert_bytes(to_np(q), cq, f"q replay {seed}")
        assert_bytes(to_np(q4), cq4, f"nvfp4 q replay {seed}")
        assert_bytes(to_np(sf4), csf4, f"nvfp4 sf replay {seed}")


# ------------------------------------------------------------------------------------------------
# device checks: nothing runs, nothing is written, the error names the argument
# ------------------------------------------------------------------------------------------------
def test_mixed_devices_are_refused():
    x = to_dev(make_x((4, 64), seed=1))
    scale_dev = torch.ones(1, device=DEV)
    q_np = np.full((4, 64), 0xAA, np.uint8)
    with pytest.raises(ValueError, match="'x'"):
        _C.quantize_fp8(arg(x), arg(scale_dev), arg(q_np))
    assert np.all(q_np == 0xAA)
    q_dev = poison_dev((4, 64), "u8")
    with pytest.raises(ValueError, match="'scale'"):
        _C.quantize_fp8(arg(x), arg(np.ones(1, np.float32)), arg(q_dev))
    with pytest.raises(ValueError, match="'scale'"):
        Q.quantize_fp8(x, scale=torch.ones(1))  # a CPU torch tensor is not moved behind the caller's back
    sf_np = np.full((4, 4), 0xAA, np.uint8)
    with pytest.raises(ValueError, match="'sf'"):
        _C.quantize_nvfp4(arg(x), 1.0, arg(poison_dev((4, 32), "u8")), arg(sf_np))
    with pytest.raises(ValueError, match="'w'"):
        _C.gate_up_sglang_to_flashinfer(arg(torch.zeros((128, 4), device=DEV)), arg(np.zeros((128, 4), np.float32)))
    torch.cuda.synchronize()
    assert torch.all(q_dev == 0xAA)
    assert np.all(sf_np == 0xAA)
