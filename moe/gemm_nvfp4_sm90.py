"""The Hopper NVFP4 (W4A16) grouped GEMM written in CUDA (``csrc/gemm/sm90_nvfp4_w4a16_grouped.cu``), for
K-permuted weights, over the masked and the contiguous layouts: decode tiles of 8-64 tokens and prefill tiles of
128 and 256, with tail launches of a smaller tile for each group's few rows past its last whole tile
(``tail_tiles_for``).

Its weights are wgmma's register operand, expanded by the thread whose registers wgmma reads them from, so no
expanded weight passes through shared memory, and double-buffered, so that a span's expansion runs while the
previous span's products are in flight (which the Triton kernel cannot do, ``moe/gemm_nvfp4_kernel.py``,
``_retired``). ``usable`` sends it every call it can take (it measured faster at every group size); every other
call, and every other GPU, stays on the Triton kernel.
``FLASHINFER_MOE_GEMM_BACKEND=triton`` turns it off. Dimension legend as in ``moe/gemm_nvfp4.py``.
"""

from __future__ import annotations

import ctypes

import torch

from flashinfer_moe import envs
from flashinfer_moe._ops import check_launch, is_sm90, kernel_library, on_device, stream_of
from flashinfer_moe.jit import KernelSpec, register

from .gemm_op import ACT_CODES
from .gemm_sm90 import _rows_per_expert, _sm_count

SPEC = register(
    KernelSpec(
        "gemm_nvfp4_sm90",
        ("gemm/sm90_nvfp4_w4a16_grouped.cu", "gemm/sm90_common.cu"),
        archs=("90a",),  # wgmma: sm_90a exactly
        min_arch="90a",
    )
)

TILES = (8, 16, 32, 64, 128, 256)  # tokens per CTA tile (wgmma's N); 128 and 256: the prefill tiles
# It takes every group size: on an H100 (2026-11-28) it led the Triton kernel (which waits for each K step's
# products before expanding the next, moe/gemm_nvfp4_kernel.py, _retired) at every size measured, 8 to 4096 rows
# per expert (split bits, same run): 1.45-1.75x at 8-64 rows (masked), 1.04-1.1x at 128 (the 128-token tile),
# 1.3-1.45x at 160-256, 1.0-1.4x at 384 and 1.27-1.44x at 512-4096 (contiguous); on an H200 the same day 1.45-1.8x
# at 8-64 rows, 1.03-1.11x at 128 and 1.34-1.51x at prefill (docs/perf.md). A group larger than a tile runs as
# several tiles, side by side where the groups' mean size fills them (else one CTA after the other), each reading
# the CTA's weight rows again (from L2).
MAX_EXPERTS = 65535  # one grid index (z) per expert
W4A8_MAX_TILE = 128  # W4A8's largest tile (256 tokens' accumulators beside its tables spill)

_vp, _int, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "fim_sm90_nvfp4_w4a16_grouped": (
        [_vp, _vp, _vp, _vp, _int, _vp, _vp, _vp] + [_int] * 7 + [_float, _float] + [_int] * 7 + [_vp, _int, _vp],
        _int,
    )
}


# Contiguous groups of at most this mean size take the tile of twice their mean. Routed groups are uneven (top-8 of
# 256 experts: the largest 1.6-2.1x the mean at means 8-16), and a group past its tile takes a second one that
# expands its weights again: on H200s (2026-11-28, fused_moe of DeepSeek-V3, launch/bench_nvfp4_tiles.py) the doubled
# tile was 1.06-1.31x faster at a mean of 8 rows, 1.26-1.33x at 16, 0.99x at 24 and 1.15-1.23x at 32 (there beside
# the tail launch below, which takes the groups of up to 32 rows), and slower from 48 on (0.73x), while equal groups
# lose by it (12 rows: 0.87-0.92x; 24: 0.97-0.98x), docs/perf.md.
CONTIGUOUS_DOUBLED_MAX_ROWS = 32


def tile_for(group_rows: int) -> int:
    """Tokens per tile for groups of about ``group_rows``: the smallest tile holding them, else the largest."""
    return next((t for t in TILES if t >= group_rows), TILES[-1])


def tile_for_layout(rows: int, num_experts: int, capacity: int | None) -> int:
    """The tile of a launch: the masked capacity's (``capacity``), or the contiguous layout's for its mean group,
    doubled up to ``CONTIGUOUS_DOUBLED_MAX_ROWS``."""
    group_rows = _rows_per_expert(rows, num_experts, capacity)
    if capacity is None and group_rows <= CONTIGUOUS_DOUBLED_MAX_ROWS:
        group_rows *= 2
    return tile_for(group_rows)


# The tail launches beside each tile: a group's rows past its last whole tile, when no more than the largest tail,
# run on the smallest tail that holds them instead of on a whole tile more (whose products, not its weight stream,
# are what a few rows past a large tile cost). Tiles below 32 cannot split. Each launch more costs a few
# microseconds and a wave's rounding, so tails are few. On H200s (2026-11-28, launch/bench_nvfp4_tiles.py, docs/perf.md):
# contiguous (fused_moe of DeepSeek-V3, tables `tails`, three runs), a tail of 32 against none: E = 256, 1.07-1.15x at
# T = 2048 (tile 64), 1.11-1.18x at 4096 (128), 1.22-1.30x at 8192 (256); E = 64, 1.12-1.25x at T = 1024 .. 4096;
# 64 or 128 alone gained less, 32 and 64 together 0.99-1.02x of 32 alone. Masked (the capacity's tile, which an
# expert-parallel decode fills far less: capacity W x max tokens a rank; 32 experts, table `masked_fill`): groups of
# a mean of 8 rows took 1.79-2.09x less time below a capacity of 128 and 2.71-3.0x below 512; of 30, 1.39-1.40x below
# 128 and, with 32 and 64 (the 256-token tile), 2.09-2.18x below 512; of about 95, 0.97-1.07x below 128 and, with 32,
# 64 and 128, 1.30x and 1.37x below 512 (1.04-1.08x at 160); full groups 0.95-1.0x (32 and 64 beside 128 cost them
# 2-5%, so that tile keeps one).
TAIL_TILES = {64: (32,), 128: (32,), 256: (32,)}
MASKED_TAIL_TILES = {64: (32,), 128: (32,), 256: (32, 64, 128)}


def tail_tiles_for(tile: int, capacity: int | None) -> tuple[int, ...]:
    """The tail launches' tiles, ascending, beside a launch of ``tile`` tokens on the contiguous (``capacity``
    None) or the masked layout; () for none."""
    return (TAIL_TILES if capacity is None else MASKED_TAIL_TILES).get(tile, ())


# The gated 128-token tile (W4A16) on four warpgroups instead of two: 128 output columns a CTA instead of 64, and
# each activation stage read for 256 weight rows. Where both grids fill the GPU in as many waves that is faster (on
# an H200, 2026-11-28, masked groups of 65-128 rows: 1.07-1.20x at 1024-2048 output columns of 8-128 experts and
# 1.07-1.18x at 768 columns of 64-128 experts; fused_moe of DeepSeek-V3 1.04-1.07x, docs/perf.md), but its CTAs take
# twice as long, so where they fill fewer whole waves two warpgroups win: 768 columns of 32 experts (192 CTAs
# against 384, on 132 SMs) 0.91x, of 8 experts (48 against 96) 0.65x. Four where their waves, each counted
# 1 / WIDE_T128_GAIN as long as two of the two-warpgroup grid's, take no longer (it orders all ten shapes measured).
WIDE_T128_GAIN = 1.09


def gated_t128_wide(n_out: int, ctas_per_column_block: int, sms: int) -> bool:
    """Whether the gated 128-token tile runs on four warpgroups: ``n_out`` output columns, ``ctas_per_column_block``
    CTAs along the groups and their tiles, ``sms`` SMs (one CTA an SM either way)."""

    def waves(cols: int) -> int:
        return -(-(-(-n_out // cols) * ctas_per_column_block) // sms)

    return waves(128) <= WIDE_T128_GAIN * waves(64) / 2


def usable(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, offsets, capacity: int, act: int, kperm: bool, a8: bool = False
) -> bool:
    """Whether the kernel takes the call: sm_90, K-permuted weights, bf16 activations (``a8``: W4A8 words and e4m3
    activations), weight rows (and GEMM1's output columns) a multiple of 64, dense operands with 16-byte aligned
    activations and outputs. (W4A8 has no other kernel: ``FLASHINFER_MOE_GEMM_BACKEND=triton`` leaves it on.)"""
    if (envs.gemm_backend() == "triton" and not a8) or not kperm:
        return False
    if a.dtype != (torch.float8_e4m3fn if a8 else torch.bfloat16) or out.dtype not in (torch.bfloat16, torch.float32):
        return False
    if not is_sm90(a.device.index):
        return False
    num_experts, nw = w.shape[:2]
    if nw % 64 or (act != ACT_CODES[None] and nw % 128) or num_experts > MAX_EXPERTS:
        return False
    if not (a.is_contiguous() and w.is_contiguous() and out.is_contiguous()):
        return False
    return a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0


def launch(
    a,
    w,
    w_block_scale,
    w_global_scale,
    out,
    counts,
    offsets,
    *,
    act,
    alpha,
    limit,
    capacity,
    split_bits=False,
    a_scale=None,
) -> None:
    """Launch on ``a`` `[R, K]` (masked: `[E * C, K]`), ``w`` `[E, NW, K / 2]` (K-permuted; with ``split_bits``
    in split bits too), ``w_block_scale`` `[E, NW, K / 16]`, ``w_global_scale`` `[E]` or `[E, 2]`, ``out``
    `[R, N]`, ``counts`` `[E]` int32, ``offsets`` `[E]` int32 group starts (contiguous) or None (masked); no
    host sync. W4A8: ``a`` e4m3, ``w`` in W4A8 words, ``a_scale`` fp32 `[R]` or `[1]`."""
    lib = kernel_library(SPEC.name, _SIGNATURES)
    num_experts, nw, half_k = w.shape
    scale = w_block_scale.contiguous()
    if scale.data_ptr() % 4:  # the kernel copies a row's scales 4 bytes at a time
        scale = scale.clone()
    gscale = w_global_scale.contiguous()
    layout_capacity = capacity if offsets is None else None
    tile = tile_for_layout(a.shape[0], num_experts, layout_capacity)
    if a_scale is not None:
        tile = min(tile, W4A8_MAX_TILE)
    # The kernel's weight modes: K-permuted bytes, split bits, W4A8 words.
    mode = 2 if a_scale is not None else int(split_bits)
    tails = tail_tiles_for(tile, layout_capacity)
    # The whole tiles (and rests past the largest tail), then each tail's rests: (lo, hi] rows past the whole tiles.
    launches = [(tile, 0, tails[-1] if tails else 0, 0)]
    launches += [(t, lo, t, 1) for lo, t in zip((0, *tails), tails, strict=False)]
    rows = a.shape[0]
    for run_tile, tail_lo, tail_hi, tail in launches:
        wide = False
        if run_tile == 128 and act != ACT_CODES[None] and a_scale is None:
            # The kernel's grid along a column block, as its entry point computes it (a twin of that code: the
            # rule needs the SM count, which the entry does not take): CTA rows (one per group, or per row where
            # contiguous rows are fewer than groups) times the tiles along a group its mean rows (masked: the
            # capacity) fill.
            grid_rows = rows if offsets is not None and rows < num_experts else num_experts
            bound = min(tail_hi if tail else (-(-rows // num_experts) if offsets is not None else capacity), capacity)
            grid_tiles = max(1, min(-(-bound // run_tile), 65535))
            wide = gated_t128_wide(nw // 2, grid_rows * grid_tiles, _sm_count(a.device.index))
        status = lib.fim_sm90_nvfp4_w4a16_grouped(
            a.data_ptr(),
            w.data_ptr(),
            scale.data_ptr(),
            gscale.data_ptr(),
            1 if gscale.dim() == 1 else gscale.shape[1],
            counts.data_ptr(),
            None if offsets is None else offsets.data_ptr(),
            out.data_ptr(),
            int(out.dtype == torch.float32),
            num_experts,
            rows,
            capacity,
            nw,
            2 * half_k,
            act,
            alpha,
            limit,
            run_tile,
            mode,
            tile if tails else 0,
            tail_lo,
            tail_hi,
            tail,
            int(wide),
            None if a_scale is None else a_scale.data_ptr(),
            0 if a_scale is None or a_scale.numel() == 1 else 1,
            stream_of(a),
        )
        check_launch(lib, status, "grouped_gemm_nvfp4 (sm90)")


def run_if_usable(a, w, w_block_scale, w_global_scale, out, counts, offsets, *, kperm: bool, **kw) -> bool:
    """:func:`launch` (its keyword arguments ``kw``) on ``a``'s device where :func:`usable` takes the call
    (``a_scale`` given: W4A8); whether it did."""
    if not usable(a, w, out, offsets, kw["capacity"], kw["act"], kperm, a8=kw.get("a_scale") is not None):
        return False
    with on_device(a):
        offsets = None if offsets is None else offsets.contiguous()
        launch(a, w, w_block_scale, w_global_scale, out, counts.contiguous(), offsets, **kw)
    return True
