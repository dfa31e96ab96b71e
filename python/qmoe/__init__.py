"""qmoe: quantized Mixture-of-Experts kernels for NVIDIA Hopper, with a CPU reference backend.

numpy arrays run the CPU reference; torch CUDA tensors run the sm_90a kernels.
"""
from . import _C
from . import quant  # weight and activation preparation (qmoe.quant.pack_fp4_weights, ...)
from .ops import fused_moe, select_tactic, valid_tactics
from .sm_limit import limit_sms, set_sm_limit, sm_limit

__version__ = _C.__version__
kernels_built = _C.kernels_built

try:  # torch.library custom ops, when torch is there (qmoe itself never needs torch)
    import torch as _torch  # noqa: F401
except ImportError:
    _torch = None
if _torch is not None and hasattr(_torch.library, "custom_op"):  # torch >= 2.4
    from . import torch_ops  # noqa: F401

__all__ = ["quant", "fused_moe", "select_tactic", "valid_tactics", "limit_sms", "set_sm_limit", "sm_limit", "kernels_built",
           "__version__"]
