"""Tile configurations of the grouped GEMM, chosen per shape from a fixed table (measured offline with
``launch/tune_gemm.py`` on an H200) and memoised: nothing is tuned on the hot path.

The choice depends only on static facts (dtypes, scale kinds, fusions, the layout's row count, E, N, K), never
on the routing, so a captured CUDA graph replays the kernel it was captured with.
"""

from __future__ import annotations

import functools

import torch

_FP8 = torch.float8_e4m3fn

# Rows per expert (expected) at or below which the decode configs apply.
_SMALL_M = 64


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int = 8) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "GROUP_M": group_m}


@functools.lru_cache(maxsize=1024)
def pick(
    dtype: torch.dtype,
    a_mode: int,
    w_mode: int,
    act: int,
    quant_out: bool,
    rows: int,
    num_experts: int,
    capacity: int,
    n: int,
    k: int,
) -> dict:
    """The tile config for one grouped-GEMM shape.

    Args:
        dtype: the operands' dtype.
        a_mode, w_mode: scale kinds (codes of ``moe/gemm.py``); group/block scales force ``BLOCK_K = 128``.
        act: fused activation code (two accumulators when non-zero).
        quant_out: FP8 output with 128-column scales (``BLOCK_N`` a multiple of 128).
        rows: rows of the layout (``R``, or ``E * C``).
        num_experts: ``E``.
        capacity: ``C`` for the masked layout, else a huge number.
        n, k: output columns and reduction length.

    Returns:
        ``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP_M"}``.
    """
    fp8 = dtype == _FP8
    bk = 128 if fp8 else 64
    scaled_in_loop = fp8 and (a_mode == 3 or w_mode == 2)
    # Measured on an H200 (docs/perf-notes.md, "Triton kernel and its tile configs"): with scales applied inside the K loop, and with two
    # accumulators (fused activation), 64-row tiles win at every size; 128-row tiles spill or stall there.
    if act:
        cfg = _cfg(64, 128, bk, 8 if fp8 else 4, 4, 1)
    elif scaled_in_loop:
        cfg = _cfg(64, 128, bk, 4, 4, 8)
    elif min(capacity, -(-rows // max(num_experts, 1))) <= _SMALL_M:
        # Few rows per expert: weight-bandwidth bound, many CTAs streaming weights, the smallest wgmma M.
        cfg = _cfg(64, 128, bk, 4, 4, 8)
    else:
        cfg = _cfg(128, 256, bk, 8, 4 if fp8 else 3, 8)
    if quant_out and cfg["BLOCK_N"] % 128:
        cfg["BLOCK_N"] = 128
    return cfg
