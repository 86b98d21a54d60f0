"""FP8 block-scaled expert weights packed for the Hopper grouped GEMM's weight stream.

Decode-sized GEMMs are bound by how fast the weights stream in. Our wgmma kernel loads one `[256, 128]` piece
of W (256 weight rows, one 128-deep K block: 32 KB) per pipeline stage; from the plain `[E, N, K]` layout that
piece is 256 strided rows and takes the tensor TMA. Packed, the piece is 32 KB in a row, already in the
128-byte-swizzled order the stage's shared memory needs, and one bulk copy moves it: on an H200 that streamed
4-6% more weight bytes per second at 16 and 64 rows per expert, none at 128 (docs/perf-notes.md). Where several row
tiles read each piece (prefill, T = 4096) packed weights measured 2-4% slower than plain ones: pack for decode.
Packing is a one-time permutation of the bytes at load time; the scales are not touched.

Layout of ``PackedFp8BlockWeights.data``: `[E, N / 256, K / 128, 256, 128]` float8_e4m3fn. Piece ``(e, t, kb)``
holds weight rows ``256 t + r`` (``r`` < 256) and columns ``128 kb + [0, 128)``, with the 16-byte chunk ``c`` of
row ``r`` stored at chunk ``c ^ (r % 8)``. For GEMM1 with an activation (``gated``), the 256 rows of piece ``t``
are gate rows ``128 t + [0, 64)``, the same up rows (``N / 2`` on), then gate and up rows ``128 t + [64, 128)``:
the kernel's epilogue then holds each output column's gate and up values in one thread.

Dimension legend: ``E`` experts, ``N`` weight rows (``2 I`` for GEMM1), ``K`` reduction.
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks

__all__ = ["PackedFp8BlockWeights", "pack_fp8_block_weights"]

ROWS = 256  # weight rows per packed piece (the kernel's 256-column tiles)
DEPTH = 128  # K per piece (one scale block)
_CHUNK = 16  # bytes the 128-byte swizzle moves as one
_FP8 = torch.float8_e4m3fn


def packed_shape(e: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """The packed data's shape for weights `[E, N, K]` (``PackedFp8BlockWeights.shape`` is its inverse)."""
    return e, n // ROWS, k // DEPTH, ROWS, DEPTH


class PackedWeights:
    """Base of the packed weight classes: the permuted tensor ``data``, with its device and dtype."""

    __slots__ = ("data",)

    def __init__(self, data: torch.Tensor):
        self.data = data

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


class PackedFp8BlockWeights(PackedWeights):
    """Expert weights `[E, N, K]` packed by :func:`pack_fp8_block_weights`; the block-scaled grouped GEMMs
    (and :func:`fused_moe`) take them in place of ``w``, with the unchanged ``w_scale``.

    Attributes:
        data: `[E, N / 256, K / 128, 256, 128]` float8_e4m3fn.
        gated: packed for GEMM1 with an activation (gate and up rows interleaved); such weights are only
            accepted with an activation, and plain ones only without.
    """

    __slots__ = ("gated",)

    def __init__(self, data: torch.Tensor, gated: bool):
        super().__init__(data)
        self.gated = bool(gated)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, N, K)`` of the weights before packing."""
        e, tiles, blocks, _, _ = self.data.shape
        return e, tiles * ROWS, blocks * DEPTH

    def unpack(self) -> torch.Tensor:
        """The `[E, N, K]` weights these were packed from."""
        return _unpack(self.data, self.gated)

    def __repr__(self) -> str:
        return f"PackedFp8BlockWeights(shape={self.shape}, gated={self.gated}, device={self.device})"


def _chunk_order(device) -> torch.Tensor:
    """Index of the source chunk of each stored chunk in a `[256 rows x 8 chunks]` piece (the swizzle is its own
    inverse, so this serves both directions)."""
    r = torch.arange(ROWS, device=device).view(-1, 1)
    c = torch.arange(DEPTH // _CHUNK, device=device).view(1, -1)
    return (r * (DEPTH // _CHUNK) + (c ^ (r % 8))).view(-1)


def _gate_up_rows(n: int, device) -> torch.Tensor:
    """Source row of each packed row for GEMM1: per 128 output columns, 64 gate, 64 up, 64 gate, 64 up."""
    i = n // 2
    t = torch.arange(i // 128, device=device).view(-1, 1, 1, 1)
    half = torch.arange(2, device=device).view(1, -1, 1, 1)
    up = torch.arange(2, device=device).view(1, 1, -1, 1)
    row = torch.arange(64, device=device).view(1, 1, 1, -1)
    return (up * i + t * 128 + half * 64 + row).reshape(-1)


def _swizzle(x: torch.Tensor) -> torch.Tensor:
    """`[e, N, K]` uint8 (rows already in packed order) -> `[e, N / 256, K / 128, 256, 128]`, chunks swizzled."""
    e, n, k = x.shape
    pieces = x.reshape(e, n // ROWS, ROWS, k // DEPTH, DEPTH).transpose(2, 3)
    chunks = pieces.reshape(e, n // ROWS, k // DEPTH, ROWS * DEPTH // _CHUNK, _CHUNK)
    out = chunks.index_select(3, _chunk_order(x.device))
    return out.reshape(e, n // ROWS, k // DEPTH, ROWS, DEPTH).view(_FP8)


def _unpack(data: torch.Tensor, gated: bool) -> torch.Tensor:
    e, tiles, blocks, _, _ = data.shape
    n, k = tiles * ROWS, blocks * DEPTH
    chunks = data.view(torch.uint8).reshape(e, tiles, blocks, ROWS * DEPTH // _CHUNK, _CHUNK)
    pieces = chunks.index_select(3, _chunk_order(data.device)).reshape(e, tiles, blocks, ROWS, DEPTH)
    w = pieces.transpose(2, 3).reshape(e, n, k)
    if gated:
        w = torch.empty_like(w).index_copy_(1, _gate_up_rows(n, data.device), w)
    return w.view(_FP8)


def pack_fp8_block_weights(w, *, gated: bool = False, chunk_experts: int = 16) -> PackedFp8BlockWeights:
    """Packs FP8 block-scaled expert weights for the Hopper grouped GEMM (once, at load time).

    Args:
        w: `[E, N, K]` float8_e4m3fn (``w13`` `[E, 2 I, H]` or ``w2`` `[E, H, I]`), N and K multiples of 256 and
            128 (with ``gated``, N = 2 I with I a multiple of 128).
        gated: pack for GEMM1 with an activation (gate rows ``[0, N / 2)`` then up rows, as ``w13``).
        chunk_experts: experts packed at a time (bounds the temporary memory).

    Returns:
        :class:`PackedFp8BlockWeights` on ``w``'s device, `[E, N / 256, K / 128, 256, 128]` bytes.
    """
    w = _checks.tensor("w", w)
    _checks.ndim("w", w, 3, "[E, N, K]")
    _checks.dtype_in("w", w, (_FP8,))
    if not isinstance(gated, bool):
        raise TypeError(f"gated must be a bool, got {type(gated).__name__} {gated!r}")
    chunk_experts = _checks.integer("chunk_experts", chunk_experts, low=1)
    e, n, k = w.shape
    if e == 0 or n % ROWS or k % DEPTH or k == 0 or n == 0:
        raise ValueError(f"w must have E >= 1, N a multiple of {ROWS} and K of {DEPTH}, got shape {tuple(w.shape)}")
    order = _gate_up_rows(n, w.device) if gated else None
    out = torch.empty(packed_shape(e, n, k), dtype=_FP8, device=w.device)
    for e0 in range(0, e, chunk_experts):
        part = w[e0 : e0 + chunk_experts].view(torch.uint8)  # index ops have no fp8 kernels
        if order is not None:
            part = part.index_select(1, order)
        out[e0 : e0 + chunk_experts] = _swizzle(part.contiguous())
    return PackedFp8BlockWeights(out, gated)


@torch.no_grad()
def repack_in_place(w: torch.Tensor, *, gated: bool, pack: bool, chunk_experts: int = 16) -> torch.Tensor:
    """Packs (``pack``) or unpacks contiguous expert weights over their own storage, ``chunk_experts`` experts
    at a time. Each expert's packed bytes fill exactly the byte range of its plain ones, so the temporary memory
    is one chunk's, not a second copy of the weights (a DeepSeek-V3 layer's ``w13`` is 7.5 GB).

    Args:
        w: `[E, N, K]` float8_e4m3fn to pack (checked as :func:`pack_fp8_block_weights` checks it), or
            `[E, N / 256, K / 128, 256, 128]` to unpack; contiguous.
        gated, chunk_experts: as :func:`pack_fp8_block_weights` takes them.
        pack: the direction.

    Returns:
        A view of ``w``'s storage in the other layout; ``w``'s bytes are overwritten.

    Raises:
        ValueError: ``w`` is not contiguous, or not a shape :func:`pack_fp8_block_weights` takes.
        Whatever a chunk raises (out of memory, say), once the chunks before it are converted back: ``w`` is
        then as it was. Should that fail too, a ``RuntimeError`` saying which experts are left converted.
    """
    if not w.is_contiguous():
        raise ValueError(f"w must be contiguous to be repacked in place, got strides {w.stride()}")
    e, done = w.shape[0], 0
    try:
        for e0 in range(0, max(e, 1), chunk_experts):  # E = 0 reaches pack_fp8_block_weights' check
            dst = w[e0 : e0 + chunk_experts]
            part = pack_fp8_block_weights(dst, gated=gated).data if pack else _unpack(dst, gated)
            dst.view(torch.uint8).copy_(part.view(torch.uint8).reshape(dst.shape))
            done = e0 + dst.shape[0]
    except BaseException as err:
        if done:
            try:
                repack_in_place(_converted(w, pack)[:done], gated=gated, pack=not pack, chunk_experts=chunk_experts)
            except BaseException as undo:
                state = "packed" if pack else "unpacked"
                raise RuntimeError(
                    f"repacking w failed ({err!r}), and so did restoring it: experts [0, {done}) are left {state}"
                ) from undo
        raise
    return _converted(w, pack)


def _converted(w: torch.Tensor, pack: bool) -> torch.Tensor:
    """``w``'s storage viewed in the layout ``repack_in_place(w, pack=pack)`` turns it into."""
    return w.view(packed_shape(*w.shape) if pack else PackedFp8BlockWeights(w, False).shape)
