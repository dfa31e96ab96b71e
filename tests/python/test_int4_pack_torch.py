"""qmoe.quant.pack_int4 / unpack_int4 on torch tensors (the path CUDA tensors take) against the C++
packer on numpy: bit for bit, every int4 value, odd leading shapes; the range and shape errors.
Runs wherever torch is installed (CPU tensors exercise the same torch code); the CUDA variant is
in test_gpu_quant.py's style below and skips without a GPU."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qmoe import quant  # noqa: E402


def _values(shape, seed):
    return np.random.default_rng(seed).integers(-8, 8, size=shape, dtype=np.int8)


@pytest.mark.parametrize("shape", [(2,), (3, 10), (2, 5, 64), (1, 1, 2)])
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64])
def test_torch_pack_matches_cpp(shape, dtype):
    v = _values(shape, sum(shape))
    want = quant.pack_int4(v)
    got = quant._pack_int4_torch(torch.from_numpy(v).to(dtype))
    assert got.dtype == torch.int8 and tuple(got.shape) == want.shape
    assert np.array_equal(got.numpy(), want)
    back = quant._unpack_int4_torch(got)
    assert np.array_equal(back.numpy(), v)
    assert np.array_equal(quant._unpack_int4_torch(got.view(torch.uint8)).numpy(), v)


def test_torch_pack_covers_every_pair():
    a, b = np.meshgrid(np.arange(-8, 8, dtype=np.int8), np.arange(-8, 8, dtype=np.int8))
    v = np.stack([a.reshape(-1), b.reshape(-1)], axis=-1)  # all 256 (even, odd) pairs
    got = quant._pack_int4_torch(torch.from_numpy(v))
    assert np.array_equal(got.numpy(), quant.pack_int4(v))
    assert np.array_equal(quant._unpack_int4_torch(got).numpy(), v)


def test_torch_pack_errors_name_the_argument():
    with pytest.raises(ValueError, match="'values'.*\\[-8, 7\\]"):
        quant._pack_int4_torch(torch.tensor([[0, 8]], dtype=torch.int32))
    with pytest.raises(ValueError, match="'values'.*multiple of 2"):
        quant._pack_int4_torch(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(TypeError, match="'values'"):
        quant._pack_int4_torch(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(TypeError, match="'packed'"):
        quant._unpack_int4_torch(torch.zeros(4, dtype=torch.int32))


@pytest.mark.gpu
def test_cuda_pack_unpack_stay_on_device():
    if not torch.cuda.is_available():  # pragma: no cover - CPU machines
        pytest.skip("no CUDA device")
    v = _values((4, 7, 128), 3)
    got = quant.pack_int4(torch.from_numpy(v).cuda())
    assert got.is_cuda and np.array_equal(got.cpu().numpy(), quant.pack_int4(v))
    back = quant.unpack_int4(got)
    assert back.is_cuda and np.array_equal(back.cpu().numpy(), v)
