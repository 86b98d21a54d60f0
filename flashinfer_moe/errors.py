"""Exceptions raised by flashinfer-moe."""

from __future__ import annotations


class FlashInferMoEError(RuntimeError):
    """Base class of the library's own runtime errors."""


class JitError(FlashInferMoEError):
    """A kernel could not be compiled or loaded (no nvcc, no GPU, compiler error, lock timeout)."""


class KernelLaunchError(FlashInferMoEError):
    """A CUDA launch or call reported an error."""
