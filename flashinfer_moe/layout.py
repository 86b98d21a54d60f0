"""The expert-major layouts that permute writes, the grouped GEMMs read, and combine reads back.

Two layouts hold the ``T * k`` (token, expert) pairs of a batch, expert by expert:

- **contiguous** (prefill): expert ``e`` owns rows ``expert_offsets[e]`` to ``expert_offsets[e] +
  tokens_per_expert[e]`` of one `[R, H]` tensor, and each expert's share is padded up to a multiple of
  ``block_rows`` (a GEMM tile), so every expert starts on a tile boundary.
- **masked** (decode): a `[E, C, H]` tensor, expert ``e`` filling slots ``0 .. tokens_per_expert[e] - 1``;
  pairs past the capacity ``C`` are dropped and counted in ``overflow``.

Within an expert, rows follow ascending ``t * k + j``, so the layout is deterministic. Sizes are static (they
depend on ``T``, ``k``, ``E`` and the alignment, never on the ids), so building a layout needs no host sync and
can be captured in a CUDA graph. Rows that hold no pair (padding, the tail past the last expert, unused
masked slots) have ``source_of == -1`` and their contents are unspecified: nothing reads them back.

Dimension legend: ``T`` tokens, ``k`` top-k, ``E`` experts, ``R`` rows of the contiguous layout, ``C``
capacity of the masked layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExpertLayout", "contiguous_rows"]


def contiguous_rows(num_tokens: int, top_k: int, num_experts: int, block_rows: int) -> int:
    """The static row count ``R`` of a contiguous layout: room for every pair plus the worst-case padding.

    At most ``min(E, T * k)`` experts receive a pair, and each pads by at most ``block_rows - 1`` rows.

    Args:
        num_tokens: ``T``.
        top_k: ``k``.
        num_experts: ``E``.
        block_rows: the per-expert row alignment.

    Returns:
        ``T * k + min(E, T * k) * (block_rows - 1)``.
    """
    pairs = num_tokens * top_k
    return pairs + min(num_experts, pairs) * (block_rows - 1)


@dataclass(frozen=True, eq=False)
class ExpertLayout:
    """Where every (token, expert) pair lives in an expert-major layout; made by ``moe_align_contiguous``
    or ``moe_align_masked``.

    Attributes:
        kind: ``"contiguous"`` or ``"masked"``.
        num_experts: ``E``.
        block_rows: row alignment of each expert (contiguous); 1 for masked.
        capacity: ``C`` slots per expert (masked); 0 for contiguous.
        tokens_per_expert: `[E]` int32, pairs each expert holds (masked: at most ``C``).
        expert_offsets: `[E + 1]` int32, first row of each expert (masked: ``e * C``); the last entry is where
            the last expert's rows end (contiguous: the rows in use, padding included).
        row_of: `[T, k]` int32, the row of pair ``(t, j)``; -1 where the id was -1 or the pair overflowed.
        source_of: `[R]` (masked: `[E * C]`) int32, the pair ``t * k + j`` a row holds, -1 for none.
        status: `[2]` int32 on the device: ``[overflow, invalid]``, the pairs dropped for capacity (masked)
            and the ids outside ``[-1, E)`` (dropped too; the public wrappers raise on them).
    """

    kind: str
    num_experts: int
    block_rows: int
    capacity: int
    tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    row_of: torch.Tensor
    source_of: torch.Tensor
    status: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.row_of.shape[0]

    @property
    def top_k(self) -> int:
        return self.row_of.shape[1]

    @property
    def num_rows(self) -> int:
        """Rows of the permuted tensor: ``R`` (contiguous) or ``E * C`` (masked)."""
        return self.source_of.shape[0]

    @property
    def rows_shape(self) -> tuple[int, ...]:
        """Leading shape of a permuted tensor: ``(R,)`` or ``(E, C)``."""
        if self.kind == "masked":
            return (self.num_experts, self.capacity)
        return (self.num_rows,)

    @property
    def overflow(self) -> torch.Tensor:
        """0-d int32 device tensor: pairs dropped because their expert was full (masked layout)."""
        return self.status[0]

    @property
    def device(self) -> torch.device:
        return self.row_of.device

    def __repr__(self) -> str:
        # Shapes only: printing the tensors would copy them to the host (a sync) and fill the screen.
        size = f"capacity={self.capacity}" if self.kind == "masked" else f"block_rows={self.block_rows}"
        return (
            f"ExpertLayout(kind={self.kind!r}, E={self.num_experts}, T={self.num_tokens}, k={self.top_k}, "
            f"rows={self.num_rows}, {size}, device={self.device})"
        )
