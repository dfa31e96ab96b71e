"""Turn numpy arrays and torch tensors into qmoe._C.Arg (DLPack storage + logical dtype).

Frameworks cannot always export fp8 / e8m0 / bf16 through DLPack (numpy cannot at all for the
ml_dtypes types), so the storage goes across as a same-size integer view and the logical dtype
name travels beside it. The C++ side checks the pair; nothing is reinterpreted silently.
"""
from __future__ import annotations

import operator

import numpy as np

from . import _C

try:  # torch is optional
    import torch
except ImportError:  # pragma: no cover - exercised on machines without torch
    torch = None

_NUMPY_NAMES = {
    "float32": "float32", "float16": "float16", "int8": "int8", "uint8": "uint8",
    "int32": "int32", "int64": "int64", "bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn",
    "float8_e8m0fnu": "float8_e8m0fnu",
}
_VIEW_BY_SIZE_NP = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def is_torch(t) -> bool:
    return torch is not None and isinstance(t, torch.Tensor)


# dtype -> name caches: arg() runs for every tensor of every call, and numpy's dtype.name and
# str(torch.dtype) are slow Python paths (~1 us each).
_NP_NAME_CACHE: dict = {}
_TORCH_NAME_CACHE: dict = {}


def dtype_name(t) -> str:
    """qmoe's logical dtype name of a numpy array or torch tensor."""
    if is_torch(t):
        name = _TORCH_NAME_CACHE.get(t.dtype)
        if name is None:
            name = _TORCH_NAME_CACHE.setdefault(t.dtype, str(t.dtype).replace("torch.", ""))
        return name
    if isinstance(t, np.ndarray):
        name = _NP_NAME_CACHE.get(t.dtype)
        if name is None:
            name = _NP_NAME_CACHE.setdefault(t.dtype, t.dtype.name)
        return name
    raise TypeError(f"qmoe: expected a numpy array or a torch tensor, got {type(t).__name__}")


def as_int(value, name: str) -> int:
    """An integer argument as a Python int that fits int64; anything else is an error naming it
    (no silent truncation of 4.5 to 4)."""
    try:
        i = operator.index(value)
    except TypeError:
        raise TypeError(f"qmoe: argument '{name}': expected an integer, got {type(value).__name__} {value!r}") from None
    if not -(2**63) <= i < 2**63:
        raise ValueError(f"qmoe: argument '{name}': expected a value that fits int64, got {i}")
    return i


def arg(t, name: str = "tensor", output: bool = False):
    """Wrap t for the C++ side. Raises TypeError naming `name` for unsupported objects/dtypes, and
    ValueError for a read-only output or byte strides that are not multiples of the item size."""
    if t is None:
        return None
    if is_torch(t):
        logical = dtype_name(t)
        if logical in ("bfloat16", "float16", "float32", "int8", "uint8", "int32", "int64"):
            storage = t if logical != "bfloat16" else t.view(torch.int16)
        elif t.element_size() == 1:
            storage = t.view(torch.uint8)
        else:
            raise TypeError(f"qmoe: argument '{name}': unsupported dtype {t.dtype}")
        # DLPack needs a dense enough view; strides travel as they are and C++ checks them.
        return _C.Arg(storage.detach(), logical)
    if isinstance(t, np.ndarray):
        logical = _NUMPY_NAMES.get(dtype_name(t))
        if logical is None:
            raise TypeError(f"qmoe: argument '{name}': expected a supported dtype, got dtype {t.dtype.name}")
        if output and not t.flags.writeable:
            raise ValueError(f"qmoe: argument '{name}': expected a writable array (it is written), got a read-only one")
        if any(stride % t.itemsize for stride in t.strides):
            raise ValueError(f"qmoe: argument '{name}': expected byte strides that are multiples of the item size "
                             f"({t.itemsize}), got strides {t.strides}")
        storage = t if t.dtype.kind in "iuf" and logical != "bfloat16" else t.view(_VIEW_BY_SIZE_NP[t.itemsize])
        return _C.Arg(storage, logical)
    raise TypeError(f"qmoe: argument '{name}': expected a numpy array or a torch tensor, got {type(t).__name__}")


def device_of(t) -> str:
    if is_torch(t):
        return "cuda" if t.is_cuda else "cpu"
    return "cpu"


def current_stream(t) -> int:
    """The caller framework's current stream (raw cudaStream_t) for t's device; 0 on CPU."""
    if is_torch(t) and t.is_cuda:
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0
