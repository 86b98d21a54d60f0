"""The Hopper paged MLA decode written in CUDA, for bf16/fp16 or FP8 pages of any page size, tiles of 64 tokens
copied with cp.async one token row at a time (so page 1 loads like page 64; bf16/fp16 pages of ``TMA_MIN_PAGE``
tokens and more by TMA boxes instead, and below that tiles of consecutive pages, or in the narrow FP8 kernel
at pages of 16 and 32 tokens a copying warp's 16 rows: ``RUN_TILES``) and read by wgmma in shared memory (FP8
tiles widened to fp16 there first, the queries scaled into fp16; or, for FP8 pages under bf16 queries, multiplied
as they landed). Three kernels:

- ``csrc/mla/sm90_mla_decode.cu``: 64 (new token, head) rows per CTA, two warpgroups sharing the 512 output
  columns; bf16/fp16 pages, and FP8 pages of more than ``NARROW_MAX_ROWS`` rows (these with a third warpgroup that
  copies and widens the tiles, and bulk copies for the one-tensor cache from ``BULK_MIN_PAGE`` on).
- ``csrc/mla/sm90_mla_decode_narrow.cu``: FP8 pages of up to ``NARROW_MAX_ROWS`` rows (16 heads and one or two new
  tokens, say), the products transposed so that the rows are wgmma's N side (16 or 32) instead of 64 rows of
  which most would be padding.
- ``csrc/mla/sm90_mla_decode_narrow_rs.cu``: the same rows and products without fp16 images, for bf16 queries
  (``NARROW_RS``): the scores by FP8 wgmma on the tile as it landed (by TMA for the one-tensor cache from page 64
  on, else by cp.async token rows), the queries split exactly into two FP8 parts, and the values' operand widened
  in registers; at 32 rows the scores are not transposed: the two query parts are wgmma's 64 rows (in registers)
  and the tile its B operand.

All walk the same split-KV schedule as the Triton kernel (``plan_kernel.py``; a plan made for them has 64-row
blocks and one CTA per SM) and write split pieces to the same workspace, merged by the same combine kernel. FP8
latent pages beside bf16/fp16 rope pages, other GPUs and ``FLASHINFER_MOE_MLA_BACKEND=triton`` stay on the Triton
kernel (``decode_kernel.py``).
Dimension legend as in ``decode.py``.
"""

from __future__ import annotations

import ctypes

import torch

from flashinfer_moe import envs
from flashinfer_moe._ops import check_launch, is_sm90, kernel_library, stream_of
from flashinfer_moe.jit import KernelSpec, register

from .decode_checks import FP8

SPEC = register(
    KernelSpec(
        "mla_decode_sm90",
        (
            "mla/sm90_mla_decode.cu",
            "mla/sm90_mla_decode_narrow.cu",
            "mla/sm90_mla_decode_narrow_rs.cu",
            "gemm/sm90_common.cu",
        ),
        archs=("90a",),  # wgmma: sm_90a exactly
        min_arch="90a",
    )
)

BLOCK_M = 64  # rows per CTA of the 64-row kernel; the plan's row blocks for both
# FP8 pages of at most this many rows take the narrow kernel; 0 sends them to the 64-row one. On an H200 (page 64,
# docs/perf-notes.md) the narrow kernel is 1.21-1.32x faster there than the 64-row one (16 rows: than the Triton one).
NARROW_MAX_ROWS = 32
# The narrow kernel's fp16 stages (fp16 queries, or NARROW_RS off) where its tiles come by bulk copies (the one-tensor
# cache, pages of 64 tokens and up): 2 lets the widening of one tile overlap the products of the one before (raw
# buffers of half tiles beside them; 1.04-1.09x at 16 and 32 rows on an H200, docs/perf-notes.md), 1 alternates the
# two around one stage (raw buffers of whole tiles), as token-row copies always do (two stages measured 0.81-0.85x).
NARROW_STAGES = 2
# FP8 pages of up to NARROW_MAX_ROWS rows under bf16 queries: the narrow kernel without fp16 images
# (csrc/mla/sm90_mla_decode_narrow_rs.cu: the scores by FP8 wgmma on the tile as it landed, the queries split into
# two FP8 parts; the values from fragments widened in registers; 1.13-1.46x the fp16 stages on an H100,
# docs/perf-notes.md, before its lazy maxima and untransposed 32-row scores); False keeps the fp16 stages (as fp16
# queries do).
NARROW_RS = True
# The same kernel at 17-32 rows with P^T rounded to E4M3 and the values' product on the FP8 tensor cores (the tile's
# bytes as they lie, no widening, half the products): 1.01-1.16x on an H200, at 0.7-1.4% relative error against
# exact products (docs/perf.md); taken where FLASHINFER_MOE_MLA_FP8_PV allows it (the default). False keeps fp16.
NARROW_PV8 = True
CTAS_PER_SM = 1  # 227 KB of shared memory: Q and two 64-token stages
# Pages of at least this many tokens: the 64-row kernel's bf16/fp16 tiles by TMA (9 boxes a tile at page 64, issued
# by one warp) instead of cp.async token rows; 0 keeps cp.async. The 64-row kernel takes TMA tiles at any page
# size (a box per page and column block, so 576 a tile at page 1); on an H100 (docs/perf-notes.md) they were 1.04-1.15x
# faster at page 64 with 128 (new token, head) rows and more, no faster at page 16 and about 5x slower at page 1.
TMA_MIN_PAGE = 64
# FP8 pages of the one-tensor cache of at least this many tokens: tiles by bulk copies (one a tile from page 64 on,
# in both kernels; one a page below that, in the 64-row kernel only, the narrow one keeping cp.async there), else
# cp.async token rows; 0 keeps cp.async.
BULK_MIN_PAGE = 16
# Below those (token rows), a whole tile whose pages' block-table entries are consecutive (a run: the slots a pool
# hands out to one prompt's tokens) comes as at page 64, in the 64-row kernel: by TMA boxes of the tile's 64 rows
# (bf16/fp16 pages) or one bulk copy (FP8, the one-tensor cache with adjacent pages). The narrow kernel for bf16
# queries takes, at pages of 16 and 32 tokens (one-tensor cache), each copying warp's 16 rows, which lie in one page,
# by TMA boxes, on any pool. False keeps token rows for every tile.
RUN_TILES = True
LOG2E = 1.4426950408889634

_vp, _int, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "fim_sm90_mla_decode": (
        [_vp] * 12 + [_int] * 6 + [_float, _int, _int, _vp, _float, _int, ctypes.c_int64, _int, _int, _vp],
        _int,
    )
}


def planned_for(device: torch.device, rows: int, kv_dtype: torch.dtype | None) -> bool:
    """Whether a plan made on ``device`` for ``rows`` (new token, head) rows of ``kv_dtype`` pages (None: not FP8)
    schedules for these kernels: a Hopper GPU with the backend not turned off (any rows, any of the dtypes)."""
    return device.type == "cuda" and envs.mla_backend() != "triton" and is_sm90(device.index or 0)


def usable(q_nope: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, block_m: int) -> bool:
    """Whether the kernel takes the call: a plan of 64-row blocks on sm_90; latent and rope pages both in the
    queries' dtype or both FP8; 16-byte aligned rows (base, page and token strides)."""
    rows = q_nope.shape[1] * q_nope.shape[2]
    if block_m != BLOCK_M or not planned_for(q_nope.device, rows, ckv.dtype):
        return False
    if ckv.dtype != kpe.dtype or ckv.dtype not in (q_nope.dtype, FP8):
        return False
    for t in (ckv, kpe):
        elem = t.element_size()
        if t.data_ptr() % 16 or (t.stride(0) * elem) % 16 or (t.stride(1) * elem) % 16:
            return False
    return True


def launch(q_nope, q_pe, ckv, kpe, block_table, seq_lens, sched, part_out, part_lse, out, lse, sm_scale, causal,
           num_programs, kv_scale=None) -> None:  # fmt: skip
    """Attention (this kernel) then the combine of split pieces (the Triton one). Shapes, dtypes and ``usable``
    arrive checked; ``lse`` may be None; ``kv_scale`` (FP8 pages) a float or a 1-element fp32 tensor on the
    device."""
    from .decode_kernel import launch_combine

    lib = kernel_library(SPEC.name, _SIGNATURES)
    batch, s_q, heads, _ = q_nope.shape
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    strides = (ctypes.c_int64 * 17)(
        *q_nope.stride()[:3], *q_pe.stride()[:3], *ckv.stride()[:2], *kpe.stride()[:2], block_table.stride(0),
        *out.stride()[:3], *lse_strides,
    )  # fmt: skip
    page = ckv.shape[1]
    status = lib.fim_sm90_mla_decode(
        q_nope.data_ptr(),
        q_pe.data_ptr(),
        ckv.data_ptr(),
        kpe.data_ptr(),
        block_table.data_ptr(),
        seq_lens.data_ptr(),
        sched.data_ptr(),
        part_out.data_ptr(),
        part_lse.data_ptr(),
        out.data_ptr(),
        None if lse is None else lse.data_ptr(),
        ctypes.cast(strides, ctypes.c_void_p),
        batch,
        s_q,
        heads,
        page.bit_length() - 1,
        block_table.shape[1] * page,
        int(causal),
        float(sm_scale) * LOG2E,
        int(q_nope.dtype == torch.float16),
        int(ckv.dtype == FP8),
        kv_scale.data_ptr() if isinstance(kv_scale, torch.Tensor) else None,
        1.0 if kv_scale is None or isinstance(kv_scale, torch.Tensor) else float(kv_scale),
        (3 if NARROW_RS else NARROW_STAGES) if ckv.dtype == FP8 and s_q * heads <= NARROW_MAX_ROWS else 0,
        ckv.shape[0],
        int(0 < (BULK_MIN_PAGE if ckv.dtype == FP8 else TMA_MIN_PAGE) <= page)
        | (2 if RUN_TILES else 0)
        | (4 if ckv.dtype == FP8 and NARROW_PV8 and envs.mla_fp8_pv() else 0),
        num_programs,
        stream_of(q_nope),
    )
    check_launch(lib, status, "mla_decode (sm90)")
    launch_combine(sched, part_out, part_lse, out, lse, BLOCK_M)
