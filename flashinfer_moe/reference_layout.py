"""Plain-torch expert-major layouts, permutation and combine: the oracle for the kernels, and the CPU path.

They fix the conventions the kernels reproduce exactly: rows within an expert in ascending ``t * k + j``,
padding to ``block_rows``, the masked capacity (pairs past it dropped and counted), and the combine's fp32
accumulation over ``j`` ascending. Rows that hold no pair are zero here; the kernels leave them unwritten.

Dimension legend: ``T`` tokens, ``k`` top-k, ``E`` experts, ``H`` hidden size, ``R`` rows of the contiguous
layout, ``C`` capacity of the masked layout.
"""

from __future__ import annotations

import torch

from . import _checks
from .layout import ExpertLayout, contiguous_rows
from .reference_quant import quantize_fp8_per_tensor, quantize_fp8_per_token_group, quantize_nvfp4

__all__ = [
    "combine",
    "moe_align_contiguous",
    "moe_align_masked",
    "permute",
    "permute_fp8_per_tensor",
    "permute_fp8_per_token_group",
    "permute_nvfp4",
]

_IDS = (torch.int32, torch.int64)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_ids(topk_ids: object, num_experts: object) -> tuple[torch.Tensor, int]:
    """Type, shape and range checks of ``topk_ids`` (the range check reads the ids on the host)."""
    ids = _checks.tensor("topk_ids", topk_ids)
    _checks.dtype_in("topk_ids", ids, _IDS)
    _checks.ndim("topk_ids", ids, 2, "[T, k]")
    num_experts = _checks.integer("num_experts", num_experts, 1)
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < -1 or high >= num_experts:
            raise ValueError(
                f"topk_ids must lie in [-1, num_experts) = [-1, {num_experts}), got values in [{low}, {high}]"
            )
    return ids, num_experts


def _ranks_in_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per flattened pair ``t * k + j``: its expert (``E`` for id -1) and its rank within the expert in ascending
    pair order (-1 for id -1); plus the pairs per expert.

    Returns:
        ``(expert [T*k] int64, rank [T*k] int64, counts [E] int64)``.
    """
    flat = ids.reshape(-1).long()
    expert = torch.where(flat >= 0, flat, num_experts)  # id -1 sorts after every real expert
    counts = torch.bincount(expert, minlength=num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    # A stable sort keeps ascending t*k+j within an expert, so the rank is exact and deterministic.
    order = torch.sort(expert, stable=True).indices
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[expert[order]]
    rank = torch.where(flat >= 0, rank, -1)
    return expert, rank, counts[:num_experts]


def _layout(kind, ids, num_experts, block_rows, capacity, counts, offsets, row, num_rows, overflow) -> ExpertLayout:
    valid = row >= 0
    pairs = torch.arange(row.numel(), device=ids.device)
    # Rows that hold no pair keep -1; the scatter sends invalid pairs to an extra slot, dropped after.
    source_of = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=ids.device)
    source_of[torch.where(valid, row, num_rows)] = torch.where(valid, pairs, -1)
    return ExpertLayout(
        kind=kind,
        num_experts=num_experts,
        block_rows=block_rows,
        capacity=capacity,
        tokens_per_expert=counts.to(torch.int32),
        expert_offsets=offsets.to(torch.int32),
        row_of=row.view(ids.shape).to(torch.int32),
        source_of=source_of[:num_rows].to(torch.int32),
        status=torch.tensor([overflow, 0], dtype=torch.int32, device=ids.device),
    )


def moe_align_contiguous(topk_ids: torch.Tensor, num_experts: int, block_rows: int = 1) -> ExpertLayout:
    """Contiguous layout: expert ``e`` owns rows from ``expert_offsets[e]``, its count padded to ``block_rows``.

    Args:
        topk_ids: `[T, k]` int32/int64, -1 for an expert not on this GPU (no row).
        num_experts: ``E``.
        block_rows: row alignment of each expert.

    Returns:
        The layout, with ``R = contiguous_rows(T, k, E, block_rows)`` rows.
    """
    ids, num_experts = check_ids(topk_ids, num_experts)
    block_rows = _checks.integer("block_rows", block_rows, 1)
    expert, rank, counts = _ranks_in_expert(ids, num_experts)
    padded = (counts + block_rows - 1) // block_rows * block_rows
    offsets = torch.cat((padded.new_zeros(1), torch.cumsum(padded, 0)))  # [E + 1]
    row = torch.where(rank >= 0, offsets[expert.clamp(max=num_experts - 1)] + rank, -1)  # [T * k]
    num_rows = contiguous_rows(ids.shape[0], ids.shape[1], num_experts, block_rows)
    return _layout("contiguous", ids, num_experts, block_rows, 0, counts, offsets, row, num_rows, 0)


def moe_align_masked(topk_ids: torch.Tensor, num_experts: int, capacity: int) -> ExpertLayout:
    """Masked layout: expert ``e`` fills slots ``0 .. tokens_per_expert[e] - 1`` of ``[E, C]``; pairs past the
    capacity are dropped (``row_of == -1``) and counted in ``status[0]``.

    Args:
        topk_ids: `[T, k]` int32/int64, -1 for an expert not on this GPU.
        num_experts: ``E``.
        capacity: ``C``, slots per expert.

    Returns:
        The layout, with ``E * C`` rows.
    """
    ids, num_experts = check_ids(topk_ids, num_experts)
    capacity = _checks.integer("capacity", capacity, 0)
    expert, rank, counts = _ranks_in_expert(ids, num_experts)
    kept = (rank >= 0) & (rank < capacity)
    row = torch.where(kept, expert * capacity + rank, -1)
    offsets = torch.arange(num_experts + 1, device=ids.device) * capacity
    overflow = int((counts - capacity).clamp(min=0).sum())
    filled = counts.clamp(max=capacity)
    return _layout("masked", ids, num_experts, 1, capacity, filled, offsets, row, num_experts * capacity, overflow)


def _check_layout(layout: object, num_tokens: int, name: str, device: torch.device) -> ExpertLayout:
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout must be an ExpertLayout (from moe_align_*), got {type(layout).__name__}")
    if layout.num_tokens != num_tokens:
        raise ValueError(f"{name} must have T = {layout.num_tokens} rows (as layout.row_of), got {num_tokens}")
    if layout.device != device:
        raise ValueError(f"{name} must be on the same device as layout ({layout.device}), got {device}")
    return layout


def put_rows(dst: torch.Tensor, rows: torch.Tensor, row_of: torch.Tensor | None) -> None:
    """``dst`` row ``row_of[t, j]`` = ``rows[t]`` for every pair with a row (``row_of is None``: row t = row t);
    rows holding no pair are left as they were.

    Args:
        dst: `[num_rows, ...]` (or any shape whose leading dimensions flatten to it).
        rows: `[T, ...]`, the dtype of ``dst``.
        row_of: `[T, k]` int32, or None.
    """
    dst = dst.view(-1, *rows.shape[1:])
    if rows.element_size() == 1:  # index_put has no float8 kernels: move the bytes
        dst, rows = dst.view(torch.uint8), rows.view(torch.uint8)
    if row_of is None:
        dst.copy_(rows)
        return
    row = row_of.reshape(-1).long()
    valid = row >= 0
    token = torch.arange(row.numel(), device=row.device) // max(row_of.shape[1], 1)
    dst[row[valid]] = rows[token[valid]]


def scatter_rows(rows: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Row ``t`` of ``rows`` copied to every row ``row_of[t, j] >= 0``; rows holding no pair are zero.

    Args:
        rows: `[T, ...]`, any dtype.
        layout: the layout.

    Returns:
        `[*layout.rows_shape, ...]`.
    """
    out = torch.zeros((*layout.rows_shape, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    put_rows(out, rows, layout.row_of)
    return out


def _hidden(hidden: object, layout: object) -> tuple[torch.Tensor, ExpertLayout]:
    hidden = _checks.tensor("hidden", hidden)
    _checks.ndim("hidden", hidden, 2, "[T, H]")
    return hidden, _check_layout(layout, hidden.shape[0], "hidden", hidden.device)


def permute(hidden: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Gather tokens into ``layout``: `[T, H]` -> `[*layout.rows_shape, H]`, dtype of ``hidden``."""
    hidden, layout = _hidden(hidden, layout)
    return scatter_rows(hidden, layout)


def permute_fp8_per_token_group(
    hidden: torch.Tensor, layout: ExpertLayout, group_size: int = 128, scale_pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`permute` fused with :func:`~flashinfer_moe.reference_quant.quantize_fp8_per_token_group`.

    Returns:
        ``(q [*rows_shape, H] float8_e4m3fn, scales [*rows_shape, H / group_size] float32)``.
    """
    hidden, layout = _hidden(hidden, layout)
    q, scales = quantize_fp8_per_token_group(hidden, group_size, scale_pow2=scale_pow2)
    return scatter_rows(q, layout), scatter_rows(scales, layout)


def permute_fp8_per_tensor(
    hidden: torch.Tensor, layout: ExpertLayout, scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`permute` fused with FP8 per-tensor quantization (``scale`` default: from ``hidden``'s amax).

    Returns:
        ``(q [*rows_shape, H] float8_e4m3fn, scale float32 0-d)``.
    """
    hidden, layout = _hidden(hidden, layout)
    q, scale = quantize_fp8_per_tensor(hidden, scale)
    return scatter_rows(q, layout), scale


def permute_nvfp4(
    hidden: torch.Tensor, layout: ExpertLayout, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`permute` fused with NVFP4 quantization (``global_scale`` default: from ``hidden``'s amax).

    Returns:
        ``(packed [*rows_shape, H / 2] uint8, block_scales [*rows_shape, H / 16] float8_e4m3fn,
        global_scale float32 0-d)``.
    """
    hidden, layout = _hidden(hidden, layout)
    packed, block_scales, global_scale = quantize_nvfp4(hidden, global_scale)
    return scatter_rows(packed, layout), scatter_rows(block_scales, layout), global_scale


def combine(
    y: torch.Tensor,
    topk_weights: torch.Tensor,
    layout: ExpertLayout,
    *,
    routed_scaling_factor: float | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Weighted sum back to token order: ``out[t] = (sum_j w[t, j] * y[row_of[t, j]]) * rsf + residual``.

    Accumulates in fp32 over ``j`` ascending (each product rounded, then added); pairs with ``row_of == -1``
    (id -1, or dropped for capacity) contribute nothing, even where their row or weight is not finite.

    Args:
        y: `[*layout.rows_shape, H]` expert outputs.
        topk_weights: `[T, k]` float.
        layout: the layout ``y`` is in.
        routed_scaling_factor: optional factor applied to the sum.
        residual: optional `[T, H]` added last.
        out_dtype: default ``y.dtype``.

    Returns:
        `[T, H]`.
    """
    y = _checks.tensor("y", y)
    topk_weights = _checks.tensor("topk_weights", topk_weights)
    _checks.ndim("topk_weights", topk_weights, 2, "[T, k]")
    layout = _check_layout(layout, topk_weights.shape[0], "topk_weights", topk_weights.device)
    if y.dim() != len(layout.rows_shape) + 1 or tuple(y.shape[:-1]) != layout.rows_shape:
        raise ValueError(f"y must have shape ({', '.join(map(str, layout.rows_shape))}, H), got {tuple(y.shape)}")
    _checks.same_device("y", y, "layout", layout.row_of)
    _checks.dtype_in("topk_weights", topk_weights, _FLOATS)
    if tuple(topk_weights.shape) != tuple(layout.row_of.shape):
        raise ValueError(f"topk_weights must have shape {tuple(layout.row_of.shape)}, got {tuple(topk_weights.shape)}")
    rows = y.reshape(-1, y.shape[-1])
    if residual is not None:
        _checks.tensor("residual", residual)
        _checks.same_device("residual", residual, "y", y)
        if tuple(residual.shape) != (layout.num_tokens, rows.shape[1]):
            raise ValueError(
                f"residual must have shape ({layout.num_tokens}, {rows.shape[1]}), got {tuple(residual.shape)}"
            )
    return combine_rows(rows, topk_weights, layout.row_of, routed_scaling_factor, residual, out_dtype or y.dtype)


def combine_rows(
    rows: torch.Tensor,
    topk_weights: torch.Tensor,
    row_of: torch.Tensor,
    routed_scaling_factor: float | None,
    residual: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The arithmetic of :func:`combine` on `[num_rows, H]` rows and a `[T, k]` ``row_of`` (inputs checked)."""
    acc = torch.zeros(row_of.shape[0], rows.shape[1], dtype=torch.float32, device=rows.device)
    weights = topk_weights.float()
    zero = acc.new_zeros(())
    for j in range(row_of.shape[1]):  # fixed order, so the fp32 rounding is reproducible
        index = row_of[:, j].long()
        picked = rows[index.clamp(min=0)].float() if rows.shape[0] else acc
        # where (not a zero weight): a skipped pair contributes nothing, even inf/NaN.
        acc = acc + torch.where((index >= 0).unsqueeze(-1), weights[:, j, None] * picked, zero)
    if routed_scaling_factor is not None:
        acc = acc * routed_scaling_factor
    if residual is not None:
        acc = acc + residual.float()
    return acc.to(out_dtype)
