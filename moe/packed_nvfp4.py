"""NVFP4 expert weights K-permuted for the Hopper W4A16 kernel's expansion.

wgmma's register operand gives each thread, per 16 K (8 bytes of packed E2M1 codes), bytes ``q`` and ``q + 4``
(``q`` its lane modulo 4) of every weight row it holds: never two adjacent bytes, so from the plain ModelOpt
layout the kernel moves its bytes out of shared memory one at a time (``LDS.U8``) and packs them with integer
instructions, in a kernel that is bound by instruction issue. Permuted once at load time within every 32 bytes
(64 K), a thread's bytes of four such groups lie together and one ``LDS.64`` moves them: on an H200 the masked
decode GEMM measured 13-15% faster with them (docs/perf-notes.md). Only the order of the bytes within each row
changes; the block scales and global scales are not touched.

Layout of ``PackedNvfp4Weights.data``: `[E, N, K / 2]` uint8 like the plain weights; in each 32-byte span of a
row, stored byte ``8 q + 2 c + h`` (``q``, ``c`` < 4, ``h`` < 2) is plain byte ``8 c + 4 h + q``. K must be a
multiple of 64 (whole spans).

Split bits (``split_bits=True``, the default of ``pack_nvfp4_weights``): on top of the byte order, the 32 bits
of each 4-byte word (little endian) are moved so that the kernels' expansion needs about half the integer instructions of the byte-table
lookup. Byte ``j`` of a K-permuted word becomes the bf16 pair ``j`` (its low nibble the low half): with
``PAIR_MASK`` = 0x81C081C0 (per half: the sign at bit 15, the 3-bit magnitude at bits 8..6),

    pair0 = y & PAIR_MASK                pair1 = (y << 4) & PAIR_MASK
    pair2 = rotl(y, 10) & PAIR_MASK      pair3 = ((y << 6) & 0x80C080C0) | (rotl(y, 14) & 0x01000100)

and each half read as a bf16 is the E2M1 value times 2**-126 (code 1, 0.5, a bf16 subnormal). Times the block
scale times 2**118 (at most 448 * 2**118, inside bf16's range), exact in bf16, it is the weight times 2**-8; the
2**8 goes back with the global scale in fp32. No four shift-and-mask words can tile a 32-bit word (checked
exhaustively), so the last pair takes two pieces: 5 masks and 2 rotations per 8 weights, plus two left shifts
that ptxas can issue as multiplies, against the lookup's 10 ``prmt`` and 5 logic and shift instructions.

W4A8 words (``w4a8=True``): for the Hopper kernel with FP8 activations, whose wgmma steps are 32 deep and take
each thread's weights as four e4m3 of one row and block (``k`` = 4 ``q`` .. 4 ``q`` + 3) and four of the next
block (16 further). In span ``d`` of a row, the 4-byte word at byte 8 ``q`` + 4 ``c`` (``c`` < 2: the 32-deep
step) holds the weights ``k`` = 64 ``d`` + 32 ``c`` + 4 ``q`` + ``i`` (a, ``i`` < 4) and those 16 further (b):
the 3-bit magnitude of a's weight ``i`` at bits 4 ``i`` .. 4 ``i`` + 2, its sign at bit 8 ``i`` + 7; b's magnitude
at bits 16 + 4 ``i`` .., its sign at bit 8 ``i`` + 3. So a's signs already sit at its four output bytes' top bits,
and b's reach them by one shift: a byte-permute lookup of each magnitude in its block's 8-entry e4m3 table and
one or per four weights expand them (``sm90_nvfp4_w4a16_grouped.cu``, ``expand8_e4m3``).

Dimension legend: ``E`` experts, ``N`` weight rows, ``K`` reduction.
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks

from .packed import PackedWeights

__all__ = ["PackedNvfp4Weights", "pack_nvfp4_weights"]

K_MULTIPLE = 64  # K elements per permuted span (32 bytes)
_SPAN = K_MULTIPLE // 2
# The weight layouts the kernels read (the GEMM op's ``wlayout``): plain ModelOpt bytes, K-permuted, K-permuted
# with split bits; and W4A8 words, the only layout of the W4A8 op.
PLAIN, KPERM, SPLIT_BITS, W4A8 = 0, 1, 2, 3
PAIR_MASK = 0x81C081C0
SPLIT_BITS_SCALE = 2.0**118  # the block scale's factor with split bits (exact in bf16 up to E4M3's 448)
SPLIT_BITS_UNSCALE = 2.0**8  # what the accumulators are multiplied by besides the global scale


def _split_sources() -> tuple[int, ...]:
    """``src[b]``: the bit of a split-bits word holding bit ``b`` of the K-permuted word, from the four pair
    formulas in the module docstring (the kernels hard-code the same shifts and masks)."""
    src = []
    for b in range(32):
        j, half, bit = b // 8, (b // 4) % 2, b % 4
        t = 16 * half + (6 + bit if bit < 3 else 15)  # the bf16 bit this nibble bit must reach in pair j
        if j == 0:
            src.append(t)
        elif j == 1:
            src.append(t - 4)
        elif j == 2:
            src.append((t - 10) % 32)
        else:
            src.append(t - 6 if (0x80C080C0 >> t) & 1 else (t - 14) % 32)
    assert sorted(src) == list(range(32)), src
    return tuple(src)


_SPLIT_SOURCES = _split_sources()
_WORDS_PER_STEP = 1 << 22  # words converted at a time (int64 temporaries of 32 MB)


class PackedNvfp4Weights(PackedWeights):
    """NVFP4 expert weights `[E, N, K / 2]` K-permuted by :func:`pack_nvfp4_weights`; the NVFP4 grouped GEMMs,
    :func:`fused_moe` and the layers take them in place of ``w``, with the unchanged block and global scales (W4A8
    words: the NVFP4 grouped GEMMs with FP8 activations only).

    Attributes:
        data: `[E, N, K / 2]` uint8 in the permuted byte order.
        split_bits: whether each 4-byte word's bits are split as well (see the module docstring).
        w4a8: whether the bytes are W4A8 words instead (module docstring), for FP8 activations only.
    """

    __slots__ = ("split_bits", "w4a8")

    def __init__(self, data: torch.Tensor, split_bits: bool = False, w4a8: bool = False):
        super().__init__(data)
        self.split_bits = bool(split_bits)
        self.w4a8 = bool(w4a8)
        if self.split_bits and self.w4a8:
            raise ValueError("PackedNvfp4Weights holds split bits or W4A8 words, not both")

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, N, K / 2)``, the plain weights' shape."""
        return tuple(self.data.shape)

    @property
    def layout(self) -> int:
        """The kernels' code for this layout: ``KPERM``, ``SPLIT_BITS`` or ``W4A8``."""
        return W4A8 if self.w4a8 else (SPLIT_BITS if self.split_bits else KPERM)

    def unpack(self) -> torch.Tensor:
        """The plain `[E, N, K / 2]` weights these were permuted from."""
        if self.w4a8:
            return w4a8_words(self.data, forward=False)
        data = _split_bits(self.data, forward=False) if self.split_bits else self.data
        return _permute(data, pack=False)

    def __repr__(self) -> str:
        extra = ", split_bits=True" if self.split_bits else (", w4a8=True" if self.w4a8 else "")
        return f"PackedNvfp4Weights(shape={self.shape}{extra}, device={self.device})"


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


def pack_nvfp4_weights(w, *, split_bits: bool = True, w4a8: bool = False) -> PackedNvfp4Weights:
    """K-permutes NVFP4 expert weights for the Hopper W4A16 kernel (once, at load time), in split bits by default.

    Args:
        w: `[E, N, K / 2]` uint8 (ModelOpt ``weight``: two E2M1 codes per byte, element ``2i`` in the low
            nibble), ``K`` a multiple of 64.
        split_bits: also split each 4-byte word's bits for the shift-and-mask expansion (module docstring):
            faster everywhere but contiguous prefill at 8 x 4096 rows (docs/perf.md). ``False``: K-permuted bytes
            only.
        w4a8: W4A8 words instead (module docstring), for the Hopper kernel with FP8 activations, which takes
            these weights only (``split_bits`` is then ignored).

    Returns:
        :class:`PackedNvfp4Weights` on ``w``'s device (a new tensor; ``w`` is not changed).
    """
    if isinstance(w, PackedNvfp4Weights):
        raise TypeError("w must be plain [E, N, K / 2] uint8 weights, got PackedNvfp4Weights (already packed)")
    for name, flag in (("split_bits", split_bits), ("w4a8", w4a8)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    w = check_packable("w", w)
    if w4a8:
        return PackedNvfp4Weights(w4a8_words(w, forward=True), w4a8=True)
    data = _permute(w, pack=True)  # a new tensor, split in place
    return PackedNvfp4Weights(_split_bits(data, forward=True, in_place=True) if split_bits else data, split_bits)


def _split_bits(w: torch.Tensor, forward: bool, in_place: bool = False) -> torch.Tensor:
    """K-permuted bytes `[..., K / 2]` with each 4-byte word's bits split (``forward``) or joined back: a new
    contiguous tensor, or ``w`` itself with ``in_place`` (contiguous ``w``: no second copy of a layer's weights),
    in steps of ``_WORDS_PER_STEP`` words for the int64 temporaries."""
    words = w.contiguous().view(torch.int32).reshape(-1)
    out = words if in_place else torch.empty_like(words)
    moves: dict[int, int] = {}  # shift (destination - source bit) -> mask of the source bits it moves
    for b, dst in enumerate(_SPLIT_SOURCES):
        src, d = (b, dst - b) if forward else (dst, b - dst)
        moves[d] = moves.get(d, 0) | (1 << src)
    for i in range(0, words.numel(), _WORDS_PER_STEP):
        x = words[i : i + _WORDS_PER_STEP].to(torch.int64) & 0xFFFFFFFF
        y = torch.zeros_like(x)
        for d, mask in moves.items():
            y |= (x & mask) << d if d >= 0 else (x & mask) >> -d
        out[i : i + _WORDS_PER_STEP] = (y - ((y >> 31) << 32)).to(torch.int32)  # as signed 32-bit; read first
    return out.view(torch.uint8).reshape(w.shape)


def _convert(w: torch.Tensor, pack: bool, split_bits: bool) -> torch.Tensor:
    """Plain bytes to the packed layout (``pack``: K-permuted, with ``split_bits`` split too) or back."""
    if pack:
        permuted = _permute(w, pack=True)
        return _split_bits(permuted, forward=True, in_place=True) if split_bits else permuted
    return _permute(_split_bits(w, forward=False) if split_bits else w, pack=False)


@torch.no_grad()
def repack_nvfp4_in_place(w: torch.Tensor, *, pack: bool, split_bits: bool = False, chunk_experts: int = 16) -> None:
    """Permutes (``pack``; with ``split_bits`` into split bits) or restores contiguous NVFP4 weights
    `[E, N, K / 2]` over their own storage, ``chunk_experts`` experts at a time, so the temporary memory is one
    chunk's.

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
            part.copy_(_convert(part, pack, split_bits))  # a chunk is written only once its new copy exists
            done = e0 + part.shape[0]
    except BaseException:
        for e0 in range(0, done, chunk_experts):
            part = w[e0 : min(e0 + chunk_experts, done)]
            part.copy_(_convert(part, not pack, split_bits))
        raise


def repack_nvfp4_experts_in_place(w13: torch.Tensor, w2: torch.Tensor, *, pack: bool, split_bits: bool = False) -> None:
    """:func:`repack_nvfp4_in_place` on a layer's two weights; if ``w2`` fails, ``w13`` is put back, so the
    layer is never half converted."""
    repack_nvfp4_in_place(w13, pack=pack, split_bits=split_bits)
    try:
        repack_nvfp4_in_place(w2, pack=pack, split_bits=split_bits)
    except BaseException:
        repack_nvfp4_in_place(w13, pack=not pack, split_bits=split_bits)
        raise


_W4A8_ROWS_ELEMENTS = 1 << 22  # K elements converted at a time (int64 temporaries of 32 MB)


def w4a8_words(w: torch.Tensor, forward: bool) -> torch.Tensor:
    """Plain bytes `[..., K / 2]` to W4A8 words (``forward``, module docstring) or back, as a new tensor."""
    *lead, half_k = w.shape
    rows = w.reshape(-1, half_k)
    out = torch.empty_like(rows)
    step = max(1, _W4A8_ROWS_ELEMENTS // (2 * half_k))
    i = torch.arange(4, device=w.device, dtype=torch.int64)
    for r0 in range(0, rows.shape[0], step):
        x = rows[r0 : r0 + step]
        n, spans = x.shape[0], half_k // _SPAN
        if forward:
            codes = torch.stack((x & 0xF, x >> 4), dim=-1).to(torch.int64)  # [n, K / 2, 2]: element 2j, 2j + 1
            c = codes.reshape(n, spans, 2, 2, 4, 4)  # k = 64 d + 32 c + 16 h + 4 q + i: [n, d, c, h, q, i]
            mag, sign = c & 7, c >> 3
            word = (
                (mag[:, :, :, 0] << (4 * i))
                | (sign[:, :, :, 0] << (8 * i + 7))
                | (mag[:, :, :, 1] << (16 + 4 * i))
                | (sign[:, :, :, 1] << (8 * i + 3))
            ).sum(-1)  # disjoint bits: the sum is the or; [n, d, c, q]
            word = word.transpose(-1, -2)  # stored at byte 8 q + 4 c of the span
            out[r0 : r0 + n] = torch.stack([(word >> (8 * b)) & 0xFF for b in range(4)], -1).reshape(n, half_k)
        else:
            b = x.reshape(n, spans, 4, 2, 4).to(torch.int64)  # [n, d, q, c, byte]
            word = (b << (8 * i)).sum(-1).transpose(-1, -2)[..., None]  # [n, d, c, q, 1]
            code_a = ((word >> (4 * i)) & 7) | (((word >> (8 * i + 7)) & 1) << 3)
            code_b = ((word >> (16 + 4 * i)) & 7) | (((word >> (8 * i + 3)) & 1) << 3)
            codes = torch.stack((code_a, code_b), dim=3).reshape(n, half_k, 2)  # [n, d, c, h, q, i] -> pairs
            out[r0 : r0 + n] = codes[..., 0] | (codes[..., 1] << 4)
    return out.reshape(w.shape)
