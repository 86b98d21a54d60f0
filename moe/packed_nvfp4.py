"""NVFP4 expert weights K-permuted for the Hopper W4A16 kernel's expansion.

wgmma's register operand gives each thread, per 16 K (8 bytes of packed E2M1 codes), bytes ``q`` and ``q + 4``
(``q`` its lane modulo 4) of every weight row it holds: never two adjacent bytes, so from the plain ModelOpt
layout the kernel moves its bytes out of shared memory one at a time (``LDS.U8``) and packs them with integer
instructions, in a kernel that is bound by instruction issue. Permuted once at load time within every 32 bytes
(64 K), a thread's bytes of four such groups lie together and one ``LDS.64`` moves them: on an H200 the masked
decode GEMM measured 13-15% faster with them (docs/perf.md). Only the order of the bytes within each row
changes; the block scales and global scales are not touched.

Layout of ``PackedNvfp4Weights.data``: `[E, N, K / 2]` uint8 like the plain weights; in each 32-byte span of a
row, stored byte ``8 q + 2 c + h`` (``q``, ``c`` < 4, ``h`` < 2) is plain byte ``8 c + 4 h + q``. K must be a
multiple of 64 (whole spans).

Dimension legend: ``E`` experts, ``N`` weight rows, ``K`` reduction.
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks

from .packed import PackedWeights

__all__ = ["PackedNvfp4Weights", "pack_nvfp4_weights"]

K_MULTIPLE = 64  # K elements per permuted span (32 bytes)
_SPAN = K_MULTIPLE // 2


class PackedNvfp4Weights(PackedWeights):
    """NVFP4 expert weights `[E, N, K / 2]` K-permuted by :func:`pack_nvfp4_weights`; the NVFP4 grouped GEMMs,
    :func:`fused_moe` and the layers take them in place of ``w``, with the unchanged block and global scales.

    Attributes:
        data: `[E, N, K / 2]` uint8 in the permuted byte order.
    """

    __slots__ = ()

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, N, K / 2)``, the plain weights' shape."""
        return tuple(self.data.shape)

    def unpack(self) -> torch.Tensor:
        """The plain `[E, N, K / 2]` weights these were permuted from."""
        return _permute(self.data, pack=False)

    def __repr__(self) -> str:
        return f"PackedNvfp4Weights(shape={self.shape}, device={self.device})"


def _permute(w: torch.Tensor, pack: bool) -> torch.Tensor:
    """`[..., K / 2]` bytes to the permuted order (``pack``) or back, as a new contiguous tensor."""
    *lead, half_k = w.shape
    if pack:  # plain byte 8 c + 4 h + q -> stored 8 q + 2 c + h
        x = w.reshape(*lead, half_k // _SPAN, 4, 2, 4)  # [..., span, c, h, q]
        x = x.permute(*range(len(lead) + 1), -1, -3, -2)
    else:
        x = w.reshape(*lead, half_k // _SPAN, 4, 4, 2)  # [..., span, q, c, h]
        x = x.permute(*range(len(lead) + 1), -2, -1, -3)
    return x.reshape(w.shape).contiguous()


def check_packable(name: str, w: object) -> torch.Tensor:
    """``w`` as a `[E, N, K / 2]` uint8 tensor whose K is a multiple of 64, else an error naming ``name``."""
    w = _checks.tensor(name, w)
    _checks.ndim(name, w, 3, "[E, N, K / 2]")
    _checks.dtype_in(name, w, (torch.uint8,))
    if w.shape[2] % _SPAN or 0 in w.shape:
        raise ValueError(
            f"{name} must have E, N >= 1 and K a multiple of {K_MULTIPLE} ({_SPAN} bytes per span) to be "
            f"K-permuted, got shape {tuple(w.shape)} (K = {2 * w.shape[2]})"
        )
    return w


def pack_nvfp4_weights(w) -> PackedNvfp4Weights:
    """K-permutes NVFP4 expert weights for the Hopper W4A16 kernel (once, at load time).

    Args:
        w: `[E, N, K / 2]` uint8 (ModelOpt ``weight``: two E2M1 codes per byte, element ``2i`` in the low
            nibble), ``K`` a multiple of 64.

    Returns:
        :class:`PackedNvfp4Weights` on ``w``'s device (a new tensor; ``w`` is not changed).
    """
    if isinstance(w, PackedNvfp4Weights):
        raise TypeError("w must be plain [E, N, K / 2] uint8 weights, got PackedNvfp4Weights (already packed)")
    w = check_packable("w", w)
    return PackedNvfp4Weights(_permute(w, pack=True))


@torch.no_grad()
def repack_nvfp4_in_place(w: torch.Tensor, *, pack: bool, chunk_experts: int = 16) -> None:
    """Permutes (``pack``) or restores contiguous NVFP4 weights `[E, N, K / 2]` over their own storage,
    ``chunk_experts`` experts at a time, so the temporary memory is one chunk's.

    Raises:
        ValueError: ``w`` is not contiguous, or not a shape :func:`pack_nvfp4_weights` takes.
        Whatever a chunk raises (out of memory, say), once the chunks before it are converted back: ``w`` is
        then as it was.
    """
    if not w.is_contiguous():
        raise ValueError(f"w must be contiguous to be permuted in place, got strides {w.stride()}")
    check_packable("w", w)
    done = 0
    try:
        for e0 in range(0, w.shape[0], chunk_experts):
            part = w[e0 : e0 + chunk_experts]
            part.copy_(_permute(part, pack=pack))  # a chunk is written only once its permuted copy exists
            done = e0 + part.shape[0]
    except BaseException:
        for e0 in range(0, done, chunk_experts):
            part = w[e0 : min(e0 + chunk_experts, done)]
            part.copy_(_permute(part, pack=not pack))
        raise


def repack_nvfp4_experts_in_place(w13: torch.Tensor, w2: torch.Tensor, *, pack: bool) -> None:
    """:func:`repack_nvfp4_in_place` on a layer's two weights; if ``w2`` fails, ``w13`` is put back, so the
    layer is never half converted."""
    repack_nvfp4_in_place(w13, pack=pack)
    try:
        repack_nvfp4_in_place(w2, pack=pack)
    except BaseException:
        repack_nvfp4_in_place(w13, pack=not pack)
        raise
