"""flashinfer-moe: Mixture-of-Experts kernels and expert-parallel communication for NVIDIA GPUs.

Dimension legend used across the API: ``T`` tokens, ``E`` experts, ``H`` hidden size, ``I`` expert
intermediate size, ``k`` experts per token.
"""

from ._version import __version__
from .errors import FlashInferMoEError, JitError, KernelLaunchError
from .moe.routing import route

__all__ = [
    "__version__",
    "FlashInferMoEError",
    "JitError",
    "KernelLaunchError",
    "route",
]
