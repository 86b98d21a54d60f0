"""Exceptions raised by flashinfer-moe."""

from __future__ import annotations


class FlashInferMoEError(RuntimeError):
    """Base class of the library's own runtime errors."""


class JitError(FlashInferMoEError):
    """A kernel could not be compiled or loaded (no nvcc, no GPU, compiler error, lock timeout)."""


class KernelLaunchError(FlashInferMoEError):
    """A CUDA launch or call reported an error."""


class CommTimeoutError(FlashInferMoEError):
    """A communication step did not complete within its time budget.

    Attributes:
        phase: the step that timed out (e.g. ``"dispatch counts"``).
        rank: this process's rank in the group.
        peers: the ranks that did not arrive, where they are known; otherwise every other rank.
        epoch: the communicator's call counter when it happened.
    """

    def __init__(self, message: str, *, phase: str, rank: int, peers: tuple[int, ...], epoch: int):
        super().__init__(message)
        self.phase, self.rank, self.peers, self.epoch = phase, rank, peers, epoch
