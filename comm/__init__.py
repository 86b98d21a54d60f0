"""Expert-parallel communication (installed as ``flashinfer_moe.comm``).

:class:`MoEAllToAll` is the entry point: dispatch/combine over the one-shot P2P kernels or the collective
(NCCL / gloo) fallback, chosen collectively.
"""

from .alltoall import MoEAllToAll

__all__ = ["MoEAllToAll"]
