"""Shared by the GPU test modules: the skip rules (torch, a CUDA device, sm_90, a kernels build)
and numpy <-> torch conversions for qmoe's dtypes (bf16 and e4m3 travel as same-size integers)."""
import ml_dtypes
import numpy as np
import pytest


def require_hopper():
    """Skip the calling module unless it can run qmoe's sm_90a kernels; returns torch."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():  # pragma: no cover - CPU-only machines
        pytest.skip("no CUDA device", allow_module_level=True)
    if torch.cuda.get_device_capability() != (9, 0):  # pragma: no cover
        pytest.skip("qmoe's kernels are built for sm_90a (Hopper) only", allow_module_level=True)
    from qmoe import _C

    if not _C.kernels_built():  # pragma: no cover
        pytest.skip("the qmoe extension under test was built without the sm_90a kernels", allow_module_level=True)
    return torch


def to_np(t) -> np.ndarray:
    """A torch tensor as numpy (bf16 / e4m3 as the ml_dtypes types)."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def to_dev(a, device="cuda"):
    """A numpy array as a torch tensor on `device` (anything else passes through)."""
    from qmoe import testing

    return testing.to_torch(a, device)
