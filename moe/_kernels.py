"""The ``permute`` and ``quant`` kernel families: JIT specs, C signatures, and small launch helpers."""

from __future__ import annotations

import ctypes

import torch

from flashinfer_moe._ops import kernel_library
from flashinfer_moe.jit import KernelSpec, register

# sm_80: the warp reductions (__reduce_max_sync, __reduce_add_sync: redux.sync). The FP8 conversions of
# cuda_fp8.h are single instructions from sm_89 on and emulated below it.
PERMUTE_SPEC = register(
    KernelSpec("permute", ("permute/align.cu", "permute/scatter.cu", "permute/combine.cu"), min_arch="80")
)
QUANT_SPEC = register(KernelSpec("quant", ("quant/quant.cu",), min_arch="80"))

_vp, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_PERMUTE_SIGNATURES = {
    "fim_moe_align": ([_vp, _int, _i64, _int, _int, _int, _vp, _i64, _vp, _vp, _vp, _vp, _i64, _vp, _vp], _int),
    "fim_permute": (
        [_vp, _int, _i64, _vp, _int, _i64, _int, _int, _int, _vp, _vp, _vp, _int, _int, _vp],
        _int,
    ),
    "fim_combine": ([_vp, _int, _vp, _vp, _vp, _vp, _int, _i64, _int, _int, _float, _int, _int, _vp], _int),
}
_QUANT_SIGNATURES = {
    "fim_amax_scale": ([_vp, _int, _i64, _int, _vp, _float, _vp], _int),
    "fim_quantize_fp8_block": ([_vp, _int, _i64, _i64, _i64, _int, _int, _vp, _vp, _vp], _int),
    "fim_dequantize_nvfp4": ([_vp, _vp, _vp, _i64, _vp, _vp], _int),
}

# Modes of fim_permute, as in csrc/permute/scatter.cu.
COPY, FP8_GROUP, FP8_TENSOR, NVFP4 = 0, 1, 2, 3
# Limits of the kernels, applied on every device so that CPU and GPU accept the same inputs.
MAX_EXPERTS = 1024
MAX_TOP_K = 64
# Rows of per-chunk expert counts the layout kernel may use (csrc/permute/align.cu checks the size).
ALIGN_WORKSPACE_CHUNKS = 265


def permute_lib() -> ctypes.CDLL:
    return kernel_library("permute", _PERMUTE_SIGNATURES)


def quant_lib() -> ctypes.CDLL:
    return kernel_library("quant", _QUANT_SIGNATURES)


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def vector_rows(t: torch.Tensor, elements: int) -> bool:
    """Rows of ``t`` (2-D) start on 16-byte boundaries and hold a multiple of ``elements`` unit-stride elements,
    so kernels may move them in 16-byte vectors. Reads the address: call it inside an op, not while tracing."""
    row_bytes = t.stride(0) * t.element_size() if t.dim() > 1 and t.shape[0] > 1 else 0
    unit = t.stride(-1) == 1 or t.shape[-1] == 1
    return t.data_ptr() % 16 == 0 and row_bytes % 16 == 0 and t.shape[-1] % elements == 0 and unit


def aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if contiguous and 16-byte aligned, else an aligned contiguous copy."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)
