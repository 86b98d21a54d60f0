"""Plain-torch quantization formats: the oracle for the kernels, and the CPU path.

Every function runs on CPU and CUDA tensors alike and fixes, bit for bit, the conventions the kernels must
reproduce: FP8 (E4M3, saturating, round-to-nearest-even) with per-token-group, per-tensor and 128x128 block
scales; NVFP4 (E2M1 codes, two per byte, E4M3 block scales, fp32 global scale). Arguments are checked only
cheaply (dtype, shape, device); the public wrappers do the rest.

Dimension legend: ``N`` rows (tokens or weight rows), ``K`` the last (reduction) dimension.

Values are quantized as ``x * inv`` with ``inv = min(1 / scale, FLT_MAX)`` (each step rounded in fp32), not
as ``x / scale``: one multiply per element instead of a division, which is what makes the GPU kernels
memory-bound, and the two differ by at most one fp32 ulp before the much coarser FP8/FP4 rounding.

Zero scales: a scale computed from an amax is never below :data:`MIN_SCALE` (the smallest normal fp32,
``2**-126``). An all-zero group/block/tensor therefore gets scale ``2**-126`` (a power of two, so also a
valid UE8M0 scale), quantizes to zero codes and dequantizes to exact zeros, never NaN or inf; a group whose
amax is subnormal keeps every ``|x * inv| <= 448``. A given scale of 0 (or so small that its reciprocal
overflows) multiplies by ``FLT_MAX``: values saturate, zeros stay zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _checks

__all__ = [
    "E2M1_VALUES",
    "FP8_MAX",
    "MIN_SCALE",
    "dequantize_fp8_block",
    "dequantize_fp8_per_token_group",
    "dequantize_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "nvfp4_global_scaled",
    "pack_nibbles",
    "quantize_fp8_block_weights",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token_group",
    "quantize_nvfp4",
    "unpack_nibbles",
]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
E2M1_MAX = 6.0
MIN_SCALE = torch.finfo(torch.float32).tiny  # 2**-126
FLT_MAX = torch.finfo(torch.float32).max
# Magnitudes of the E2M1 codes 0..7; bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_IDS = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------------- helpers


def _float_input(name: str, x: object) -> torch.Tensor:
    x = _checks.tensor(name, x)
    _checks.dtype_in(name, x, _FLOATS)
    return x


def _saturate_fp8(v: torch.Tensor) -> torch.Tensor:
    # The cast alone rounds to nearest-even but turns out-of-range values into NaN: clamp first.
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _div(a: torch.Tensor, value: float) -> torch.Tensor:
    # A true IEEE division: on CUDA, dividing by a Python number multiplies by its rounded reciprocal,
    # which is 1 ulp off for some inputs (448 and 2688 have no exact reciprocal).
    return a / torch.full_like(a, value)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """``min(1 / scale, FLT_MAX)``, the division correctly rounded (as the kernels' __frcp_rn)."""
    return (torch.ones_like(scale) / scale).clamp(max=FLT_MAX)


def _amax(xf: torch.Tensor) -> torch.Tensor:
    return xf.abs().amax() if xf.numel() else xf.new_zeros(())


def _scale_from_amax(amax: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    scale = _div(amax, FP8_MAX).clamp(min=MIN_SCALE)
    if pow2:
        # frexp is exact where log2 is not (a float32 log2 of 2**e * (1 + 2**-23) rounds to e): scale = m * 2**e
        # with m in [0.5, 1), so 2**e is the smallest power of two >= scale unless m is exactly 0.5.
        mantissa, exponent = torch.frexp(scale)
        exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
        scale = torch.ldexp(torch.ones_like(scale), exponent)
    return scale


def _shape(name: str, t: torch.Tensor, expected: tuple[int, ...], context: str) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} ({context}), got {tuple(t.shape)}")


def _scale_arg(name: str, scale: object, like_name: str, like: torch.Tensor) -> torch.Tensor:
    """A caller-given scale (float or fp32 tensor of one element) as an fp32 0-d tensor on ``like``'s device."""
    if isinstance(scale, torch.Tensor):
        _checks.dtype_in(name, scale, (torch.float32,))
        _checks.same_device(name, scale, like_name, like)
        if scale.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {tuple(scale.shape)}")
        return scale.reshape(())
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float or a float32 tensor, got {type(scale).__name__}")
    return torch.tensor(float(scale), dtype=torch.float32, device=like.device)


def _block_arg(block: object) -> tuple[int, int]:
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise TypeError(f"block must be a pair (rows, cols), got {block!r}")
    return _checks.integer("block[0]", block[0], 1), _checks.integer("block[1]", block[1], 1)


def _expand_blocks(scales: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """`[..., ceil(N/bn), ceil(K/bk)]` -> `[..., N, K]`, each block's scale repeated over its elements."""
    return scales.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :n, :k]


# ------------------------------------------------------------------------------------------------- FP8


def quantize_fp8_per_token_group(
    x: torch.Tensor, group_size: int = 128, *, scale_pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one fp32 scale per ``group_size`` consecutive channels (DeepSeek-V3 activations).

    ``scale = max(amax / 448, 2**-126)`` computed in fp32; with ``scale_pow2`` it is rounded up to a power of
    two (UE8M0-compatible, still >= amax / 448). ``q = e4m3(clamp(x * (1 / scale), -448, 448))``, nearest-even.

    Args:
        x: `[..., H]` float, ``H`` a multiple of ``group_size``.
        group_size: channels per scale.
        scale_pow2: round each scale up to a power of two.

    Returns:
        ``(q [..., H] float8_e4m3fn, scales [..., H / group_size] float32)``.
    """
    x = _float_input("x", x)
    group_size = _checks.integer("group_size", group_size, 1)
    if x.dim() < 1 or x.shape[-1] % group_size:
        raise ValueError(
            f"x must have a last dimension that is a multiple of group_size ({group_size}), got shape {tuple(x.shape)}"
        )
    groups = x.float().unflatten(-1, (x.shape[-1] // group_size, group_size))  # [..., H/g, g]
    scales = _scale_from_amax(groups.abs().amax(dim=-1), scale_pow2)  # [..., H/g]
    q = _saturate_fp8(groups * _inverse(scales).unsqueeze(-1)).flatten(-2)
    return q, scales


def dequantize_fp8_per_token_group(q: torch.Tensor, scales: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_per_token_group`: ``q * scale`` in fp32.

    Args:
        q: `[..., H]` float8_e4m3fn.
        scales: `[..., H / group_size]` float32.
        group_size: channels per scale.

    Returns:
        `[..., H]` float32.
    """
    q, scales = _checks.tensor("q", q), _checks.tensor("scales", scales)
    _checks.dtype_in("q", q, (FP8,))
    _checks.dtype_in("scales", scales, (torch.float32,))
    _checks.same_device("scales", scales, "q", q)
    group_size = _checks.integer("group_size", group_size, 1)
    if q.dim() < 1 or q.shape[-1] % group_size:
        raise ValueError(
            f"q must have a last dimension that is a multiple of group_size ({group_size}), got {tuple(q.shape)}"
        )
    _shape("scales", scales, (*q.shape[:-1], q.shape[-1] // group_size), f"for q {tuple(q.shape)}")
    groups = q.float().unflatten(-1, (q.shape[-1] // group_size, group_size))
    return (groups * scales.unsqueeze(-1)).flatten(-2)


def quantize_fp8_per_tensor(
    x: torch.Tensor, scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one fp32 scale for the whole tensor.

    Args:
        x: any shape, float.
        scale: the dequantization scale to use; default ``max(amax / 448, 2**-126)``.

    Returns:
        ``(q float8_e4m3fn, same shape as x; scale float32 0-d)``; dequant is ``q.float() * scale``.
    """
    x = _float_input("x", x)
    xf = x.float()
    scale = _scale_from_amax(_amax(xf)) if scale is None else _scale_arg("scale", scale, "x", x)
    return _saturate_fp8(xf * _inverse(scale)), scale


def quantize_fp8_block_weights(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weights with one fp32 scale per ``block`` tile (DeepSeek-V3 ``weight_scale_inv``).

    Edge tiles may be partial; each tile's scale is ``max(tile amax / 448, 2**-126)``.

    Args:
        w: `[..., N, K]` float (e.g. `[E, N, K]`).
        block: tile shape ``(rows, cols)``.

    Returns:
        ``(q [..., N, K] float8_e4m3fn, weight_scale_inv [..., ceil(N / rows), ceil(K / cols)] float32)``.
    """
    w = _float_input("w", w)
    bn, bk = _block_arg(block)
    if w.dim() < 2:
        raise ValueError(f"w must be at least 2-D [..., N, K], got shape {tuple(w.shape)}")
    n, k = w.shape[-2:]
    nb, kb = -(-n // bn), -(-k // bk)
    wf = w.float()
    # Zero padding leaves every tile's amax unchanged.
    padded = F.pad(wf.abs(), (0, kb * bk - k, 0, nb * bn - n))
    amax = padded.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn)).amax(dim=(-3, -1))  # [..., nb, kb]
    scales = _scale_from_amax(amax)
    q = _saturate_fp8(wf * _expand_blocks(_inverse(scales), (bn, bk), n, k))
    return q, scales


def dequantize_fp8_block(
    q: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_block_weights`: ``q * scale`` of its tile, in fp32.

    Args:
        q: `[..., N, K]` float8_e4m3fn.
        weight_scale_inv: `[..., ceil(N / rows), ceil(K / cols)]` float32.
        block: tile shape ``(rows, cols)``.

    Returns:
        `[..., N, K]` float32.
    """
    q, s = _checks.tensor("q", q), _checks.tensor("weight_scale_inv", weight_scale_inv)
    _checks.dtype_in("q", q, (FP8,))
    _checks.dtype_in("weight_scale_inv", s, (torch.float32,))
    _checks.same_device("weight_scale_inv", s, "q", q)
    bn, bk = _block_arg(block)
    if q.dim() < 2:
        raise ValueError(f"q must be at least 2-D [..., N, K], got shape {tuple(q.shape)}")
    n, k = q.shape[-2:]
    _shape("weight_scale_inv", s, (*q.shape[:-2], -(-n // bn), -(-k // bk)), f"for q {tuple(q.shape)}")
    return q.float() * _expand_blocks(s, (bn, bk), n, k)


# ----------------------------------------------------------------------------------------------- NVFP4


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value, ties to even, saturating at +-6.

    Args:
        values: any shape, float (already scaled by the inverse block scale).

    Returns:
        uint8 codes, same shape: ``sign << 3 | i`` with ``i`` the index into :data:`E2M1_VALUES`.
    """
    a = _float_input("values", values).float().abs()
    # Ties go to the even index (even mantissa bit, as in IEEE round-to-nearest-even). At the midpoints
    # 0.25, 1.25, 2.5 and 5.0 the lower neighbour (index 0, 2, 4, 6) is even, so the threshold is strict
    # (>); at 0.75, 1.75 and 3.5 the upper neighbour (index 2, 4, 6) is even, so the threshold is >=.
    # Hence 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. Past 5 everything (inf too)
    # saturates to 6; NaN compares false everywhere and becomes a zero magnitude (E2M1 has no NaN).
    index = (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    # signbit keeps the sign of -0.0 and of negatives that round to zero (code 8).
    return index | (torch.signbit(values).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) to float32 values; code 8 is -0.0."""
    codes = _checks.tensor("codes", codes)
    _checks.dtype_in("codes", codes, (torch.uint8,))
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[(codes & 0xF).long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: element ``2i`` in the low nibble, ``2i + 1`` in the high nibble.

    Args:
        codes: `[..., K]` uint8 (values 0..15), ``K`` even.

    Returns:
        `[..., K / 2]` uint8.
    """
    codes = _checks.tensor("codes", codes)
    _checks.dtype_in("codes", codes, (torch.uint8,))
    if codes.dim() < 1 or codes.shape[-1] % 2:
        raise ValueError(f"codes must have an even last dimension, got shape {tuple(codes.shape)}")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: `[..., K / 2]` uint8 -> `[..., K]` uint8 codes."""
    packed = _checks.tensor("packed", packed)
    _checks.dtype_in("packed", packed, (torch.uint8,))
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4: E2M1 codes with one E4M3 scale per 16 elements along K and one fp32 global scale.

    ``global_scale`` is the dequantization factor (ModelOpt's ``weight_scale_2``), default
    ``max(amax / (6 * 448), 2**-126)``. Per block, ``s = e4m3(min(block amax / (6 * global_scale), 448))``
    (nearest-even) and the codes are ``e2m1_encode(x * min(1 / (float(s) * global_scale), FLT_MAX))``. A block
    whose ``s`` rounds to 0 (tiny values against the global scale) gets zero codes.

    Args:
        x: `[..., K]` float, ``K`` a multiple of 16.
        global_scale: the dequantization global scale to use (float or fp32 tensor of one element).

    Returns:
        ``(packed [..., K / 2] uint8, block_scales [..., K / 16] float8_e4m3fn, global_scale float32 0-d)``.
    """
    x = _float_input("x", x)
    if x.dim() < 1 or x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"x must have a last dimension K that is a multiple of 16, got shape {tuple(x.shape)}")
    xf = x.float()
    if global_scale is None:
        global_scale = _div(_amax(xf), E2M1_MAX * FP8_MAX).clamp(min=MIN_SCALE)
    else:
        global_scale = _scale_arg("global_scale", global_scale, "x", x)
    blocks = xf.unflatten(-1, (x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK))  # [..., K/16, 16]
    block_scales = _saturate_fp8(blocks.abs().amax(dim=-1) / (E2M1_MAX * global_scale))  # [..., K/16]
    denom = (block_scales.float() * global_scale).unsqueeze(-1)
    scaled = torch.where(denom > 0, blocks * _inverse(denom), torch.zeros_like(blocks))  # dead blocks: zeros
    return pack_nibbles(e2m1_encode(scaled).flatten(-2)), block_scales, global_scale


def dequantize_nvfp4(
    packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor | float
) -> torch.Tensor:
    """``e2m1(q) * float(block_scale) * global_scale`` in fp32 (loads ModelOpt ``weight`` / ``weight_scale`` /
    ``weight_scale_2`` as stored).

    Args:
        packed: `[..., K / 2]` uint8.
        block_scales: `[..., K / 16]` float8_e4m3fn.
        global_scale: float or fp32 tensor of one element.

    Returns:
        `[..., K]` float32.
    """
    packed, block_scales = _checks.tensor("packed", packed), _checks.tensor("block_scales", block_scales)
    _checks.dtype_in("packed", packed, (torch.uint8,))
    _checks.dtype_in("block_scales", block_scales, (FP8,))
    _checks.same_device("block_scales", block_scales, "packed", packed)
    if packed.dim() < 1 or packed.shape[-1] % (NVFP4_BLOCK // 2):
        raise ValueError(
            f"packed must have a last dimension K/2 that is a multiple of 8, got shape {tuple(packed.shape)}"
        )
    num_blocks = packed.shape[-1] * 2 // NVFP4_BLOCK
    _shape("block_scales", block_scales, (*packed.shape[:-1], num_blocks), f"for packed {tuple(packed.shape)}")
    global_scale = _scale_arg("global_scale", global_scale, "packed", packed)
    values = e2m1_decode(unpack_nibbles(packed)).unflatten(-1, (num_blocks, NVFP4_BLOCK))
    return (values * block_scales.float().unsqueeze(-1) * global_scale).flatten(-2)


def nvfp4_global_scaled(values: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Expert weights times their NVFP4 global scale, in ``values``' dtype and on its device.

    Args:
        values: `[E, NW, K]` dequantized weights (block scales applied).
        global_scale: `[E]`, or `[E, 2]` (gated weights: the first value for rows ``[0, NW/2)``, the second for
            the rest).

    Returns:
        `[E, NW, K]` in ``values``' dtype.
    """
    gs = global_scale.to(device=values.device, dtype=values.dtype)
    if gs.dim() == 2:
        half = values.shape[1] // 2
        return torch.cat((values[:, :half] * gs[:, :1, None], values[:, half:] * gs[:, 1:, None]), dim=1)
    return values * gs[:, None, None]
