"""qmoe: quantized Mixture-of-Experts kernels for NVIDIA Hopper, with a CPU reference backend.

numpy arrays run the CPU reference; torch CUDA tensors run the sm_90a kernels.
"""
from . import _C
from .ops import fused_moe, select_tactic, valid_tactics

__version__ = _C.__version__
kernels_built = _C.kernels_built

__all__ = ["fused_moe", "select_tactic", "valid_tactics", "kernels_built", "__version__"]
