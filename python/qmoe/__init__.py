"""qmoe: quantized Mixture-of-Experts kernels for NVIDIA Hopper, with a CPU reference backend."""
from . import _C

__version__ = _C.__version__
