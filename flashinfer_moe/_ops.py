"""The `flashinfer_moe` torch.library namespace and the glue from custom ops to compiled kernels.

Every kernel is a custom op so that CUDA graphs and torch.compile see it as one opaque call; its CPU
implementation is the reference in :mod:`flashinfer_moe.reference`.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from .errors import KernelLaunchError

LIB = torch.library.Library("flashinfer_moe", "DEF")  # noqa: TOR901 - the library lives for the process

# Element type codes shared with csrc/common/dtype.cuh.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_loaded: dict[str, ctypes.CDLL] = {}
_load_lock = threading.Lock()


def kernel_library(name: str, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    """Build (first use) and load the kernel family ``name``, with ctypes signatures set once.

    Args:
        name: a name registered in :data:`flashinfer_moe.jit.REGISTRY`.
        signatures: exported function -> (argtypes, restype).

    Returns:
        The loaded library.
    """
    lib = _loaded.get(name)
    if lib is not None:
        return lib
    with _load_lock:
        lib = _loaded.get(name)
        if lib is None:
            from .jit import REGISTRY, load

            lib = load(REGISTRY[name])
            for fn_name, (argtypes, restype) in signatures.items():
                fn = getattr(lib, fn_name)
                fn.argtypes = argtypes
                fn.restype = restype
            lib.fim_error_string.argtypes = [ctypes.c_int]
            lib.fim_error_string.restype = ctypes.c_char_p
            _loaded[name] = lib
    return lib


@functools.cache
def is_sm90(index: int | None) -> bool:
    """Whether GPU ``index`` is sm_90 exactly (what the wgmma kernels are built for); cached per device."""
    return torch.cuda.get_device_capability(index) == (9, 0)


def check_launch(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        message = lib.fim_error_string(status).decode(errors="replace")
        raise KernelLaunchError(f"{what}: CUDA error {status} ({message})")


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def stream_of(t: torch.Tensor) -> int:
    """The raw handle of the current CUDA stream on ``t``'s device (what graph capture records into)."""
    if _raw_stream is not None:  # skips building a torch.cuda.Stream object on every launch
        return _raw_stream(t.device.index)
    return torch.cuda.current_stream(t.device).cuda_stream


class on_device:
    """Makes ``t``'s GPU current for the duration, only when it is not already (the common case)."""

    __slots__ = ("index", "previous")

    def __init__(self, t: torch.Tensor):
        self.index = t.device.index
        self.previous: int | None = None

    def __enter__(self):
        current = _get_device()
        if self.index is not None and current != self.index:
            self.previous = current
            torch.cuda.set_device(self.index)

    def __exit__(self, *exc):
        if self.previous is not None:
            torch.cuda.set_device(self.previous)
