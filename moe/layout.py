"""Building the expert-major layouts (``moe_align_contiguous``, ``moe_align_masked``) from ``topk_ids``.

See :mod:`flashinfer_moe.layout` for what a layout holds. On a GPU one fused kernel (three for large batches)
builds it with no host sync; on a CPU the reference does.

Dimension legend: ``T`` tokens, ``k`` top-k, ``E`` experts, ``R`` rows of the contiguous layout, ``C``
capacity of the masked layout.
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks
from flashinfer_moe import reference_layout as ref
from flashinfer_moe._ops import LIB, check_launch, on_device, stream_of
from flashinfer_moe.layout import ExpertLayout, contiguous_rows

from ._kernels import ALIGN_WORKSPACE_CHUNKS, MAX_EXPERTS, MAX_TOP_K, permute_lib

__all__ = ["moe_align_contiguous", "moe_align_masked"]

LIB.define(
    "moe_align_(Tensor topk_ids, Tensor(a!) workspace, Tensor(b!) tokens_per_expert, Tensor(c!) expert_offsets, "
    "Tensor(d!) row_of, Tensor(e!) source_of, Tensor(f!) status, int num_experts, int block_rows, int capacity) -> ()"
)


def _align_cpu(ids, workspace, tokens_per_expert, expert_offsets, row_of, source_of, status, num_experts, block_rows,
               capacity):  # fmt: skip
    if capacity < 0:
        layout = ref.moe_align_contiguous(ids, num_experts, block_rows)
    else:
        layout = ref.moe_align_masked(ids, num_experts, capacity)
    for out, value in (
        (tokens_per_expert, layout.tokens_per_expert),
        (expert_offsets, layout.expert_offsets),
        (row_of, layout.row_of),
        (source_of, layout.source_of),
        (status, layout.status),
    ):
        out.copy_(value)


def _align_cuda(ids, workspace, tokens_per_expert, expert_offsets, row_of, source_of, status, num_experts, block_rows,
                capacity):  # fmt: skip
    lib = permute_lib()
    with on_device(ids):
        status_code = lib.fim_moe_align(
            ids.data_ptr(),
            int(ids.dtype == torch.int64),
            ids.numel(),
            num_experts,
            block_rows,
            capacity,
            workspace.data_ptr(),
            workspace.numel(),
            tokens_per_expert.data_ptr(),
            expert_offsets.data_ptr(),
            row_of.data_ptr(),
            source_of.data_ptr(),
            source_of.numel(),
            status.data_ptr(),
            stream_of(ids),
        )
    check_launch(lib, status_code, "moe_align")


LIB.impl("moe_align_", _align_cpu, "CPU")
LIB.impl("moe_align_", _align_cuda, "CUDA")
torch.library.register_fake("flashinfer_moe::moe_align_", lambda *args: None, lib=LIB)


def _checked_ids(topk_ids: object, num_experts: object) -> tuple[torch.Tensor, int]:
    ids = _checks.tensor("topk_ids", topk_ids)
    _checks.dtype_in("topk_ids", ids, (torch.int32, torch.int64))
    _checks.ndim("topk_ids", ids, 2, "[num_tokens, top_k]")
    _checks.integer("topk_ids.shape[1] (top_k)", ids.shape[1], 0, MAX_TOP_K)
    num_experts = _checks.integer("num_experts", num_experts, 1, MAX_EXPERTS)
    # On a CPU the op itself (the reference) range-checks the ids; on a GPU the kernel counts bad ones.
    return ids.contiguous(), num_experts


def _checking() -> bool:
    # Compiling first: torch.compile's fullgraph mode cannot trace the capture query. That query raises on a
    # CPU build of torch, so it is asked only where CUDA exists.
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _build(ids: torch.Tensor, num_experts: int, block_rows: int, capacity: int, num_rows: int, validate: bool):
    device = ids.device
    i32 = dict(dtype=torch.int32, device=device)
    workspace_ints = ALIGN_WORKSPACE_CHUNKS * num_experts if device.type == "cuda" else 0
    layout = ExpertLayout(
        kind="contiguous" if capacity < 0 else "masked",
        num_experts=num_experts,
        block_rows=block_rows,
        capacity=max(capacity, 0),
        tokens_per_expert=torch.empty(num_experts, **i32),  # [E]
        expert_offsets=torch.empty(num_experts + 1, **i32),  # [E + 1]
        row_of=torch.empty(ids.shape, **i32),  # [T, k]
        source_of=torch.empty(num_rows, **i32),  # [R] or [E * C]
        status=torch.empty(2, **i32),
    )
    workspace = torch.empty(workspace_ints, **i32)
    torch.ops.flashinfer_moe.moe_align_(
        ids,
        workspace,
        layout.tokens_per_expert,
        layout.expert_offsets,
        layout.row_of,
        layout.source_of,
        layout.status,
        num_experts,
        block_rows,
        capacity,
    )
    if validate and device.type == "cuda" and _checking():  # not on meta tensors: they hold no values
        invalid = int(layout.status[1])  # one host sync; pass validate=False to skip it
        if invalid:
            raise ValueError(f"topk_ids must lie in [-1, num_experts) = [-1, {num_experts}), got {invalid} ids outside")
    return layout


def moe_align_contiguous(
    topk_ids: torch.Tensor, num_experts: int, block_rows: int = 128, *, validate: bool = True
) -> ExpertLayout:
    """Contiguous expert-major layout (prefill): expert ``e``'s pairs are rows ``expert_offsets[e]`` onward of
    one `[R, H]` tensor, its share padded to a multiple of ``block_rows`` (the grouped GEMM's row tile).

    ``R = T * k + min(E, T * k) * (block_rows - 1)`` is fixed by the shapes, so no host sync is needed; the
    rows in use end at ``expert_offsets[E]``. Within an expert, rows follow ascending ``t * k + j``.

    Args:
        topk_ids: `[T, k]` int32/int64 expert ids; -1 marks an expert not on this GPU (the pair gets no row).
        num_experts: ``E`` (at most 1024).
        block_rows: row alignment of each expert.
        validate: on a GPU, check after the kernel (one host sync) that every id was in ``[-1, E)``; skipped
            during CUDA-graph capture and torch.compile, where bad ids are dropped and counted in
            ``layout.status[1]``. On a CPU the ids are always checked.

    Returns:
        The :class:`~flashinfer_moe.ExpertLayout`.
    """
    ids, num_experts = _checked_ids(topk_ids, num_experts)
    block_rows = _checks.integer("block_rows", block_rows, 1, 1 << 16)
    num_rows = contiguous_rows(ids.shape[0], ids.shape[1], num_experts, block_rows)
    return _build(ids, num_experts, block_rows, -1, num_rows, validate)


def moe_align_masked(topk_ids: torch.Tensor, num_experts: int, capacity: int, *, validate: bool = True) -> ExpertLayout:
    """Masked expert-major layout (decode): `[E, C, H]`, expert ``e`` filling slots ``0 .. tokens_per_expert[e]``.

    Pairs past the capacity are dropped (``row_of == -1``, they get no slot and combine skips them) and
    counted in ``layout.overflow`` (a device tensor, read without a sync only when you ask for it). Nothing
    is ever written out of bounds.

    Args:
        topk_ids: `[T, k]` int32/int64 expert ids; -1 marks an expert not on this GPU.
        num_experts: ``E`` (at most 1024).
        capacity: ``C``, slots per expert.
        validate: as for :func:`moe_align_contiguous`.

    Returns:
        The :class:`~flashinfer_moe.ExpertLayout`.
    """
    ids, num_experts = _checked_ids(topk_ids, num_experts)
    capacity = _checks.integer("capacity", capacity, 0, (1 << 31) // num_experts - 1)
    return _build(ids, num_experts, 1, capacity, num_experts * capacity, validate)
