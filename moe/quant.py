"""Public quantizers: FP8 (E4M3) per token group, per tensor and per 128x128 weight block, and NVFP4.

Formats are those of DeepSeek-V3 FP8 checkpoints (``weight``, ``weight_scale_inv``) and ModelOpt NVFP4
checkpoints (``weight``, ``weight_scale``, ``weight_scale_2``, ``input_scale``), which load as stored; the
bit-level definitions are in :mod:`flashinfer_moe.reference_quant`, which the GPU kernels match exactly and
which runs on a CPU. Scales are dequantization factors: ``x ~= q * scale``.

Dimension legend: ``N`` rows (tokens or weight rows), ``K`` the last (reduction) dimension.
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks
from flashinfer_moe import reference_quant as ref
from flashinfer_moe._ops import DTYPE_CODES, LIB, check_launch, on_device, stream_of

from . import _kernels as K

__all__ = [
    "dequantize_nvfp4",
    "quantize_fp8_block_weights",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token_group",
    "quantize_nvfp4",
]

FP8 = torch.float8_e4m3fn
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_FP32_MAX = torch.finfo(torch.float32).max

LIB.define("amax_scale_(Tensor x, Tensor(a!) scale, float divisor) -> ()")
LIB.define("quantize_fp8_block_(Tensor w, Tensor(a!) q, Tensor(b!) scales, int block_n, int block_k) -> ()")
LIB.define("dequantize_nvfp4_(Tensor packed, Tensor block_scales, Tensor global_scale, Tensor(a!) out) -> ()")


def _amax_scale_cpu(x, scale, divisor):
    scale.copy_(ref._div(ref._amax(x.float()), divisor).clamp(min=ref.MIN_SCALE))


def _amax_scale_cuda(x, scale, divisor):
    lib = K.quant_lib()
    vec = x.data_ptr() % 16 == 0 and x.numel() % 8 == 0 and x.is_contiguous()
    with on_device(x):
        status = lib.fim_amax_scale(
            x.data_ptr(), DTYPE_CODES[x.dtype], x.numel(), int(vec), scale.data_ptr(), divisor, stream_of(x)
        )
    check_launch(lib, status, "amax")


def _block_cpu(w, q, scales, block_n, block_k):
    q_ref, s_ref = ref.quantize_fp8_block_weights(w, (block_n, block_k))
    q.copy_(q_ref)
    scales.copy_(s_ref)


def _block_cuda(w, q, scales, block_n, block_k):
    lib = K.quant_lib()
    n, k = w.shape[-2:]
    with on_device(w):
        status = lib.fim_quantize_fp8_block(
            w.data_ptr(),
            DTYPE_CODES[w.dtype],
            w.numel() // max(n * k, 1),
            n,
            k,
            block_n,
            block_k,
            q.data_ptr(),
            scales.data_ptr(),
            stream_of(w),
        )
    check_launch(lib, status, "quantize_fp8_block_weights")


def _dequant_cpu(packed, block_scales, global_scale, out):
    out.copy_(ref.dequantize_nvfp4(packed, block_scales, global_scale))


def _dequant_cuda(packed, block_scales, global_scale, out):
    lib = K.quant_lib()
    packed = K.aligned_copy(packed)  # read as 32-bit words
    if out.data_ptr() % 16:
        raise ValueError(f"out must be 16-byte aligned, got address {out.data_ptr():#x}")
    with on_device(packed):
        status = lib.fim_dequantize_nvfp4(
            packed.data_ptr(),
            block_scales.data_ptr(),
            global_scale.data_ptr(),
            out.numel(),
            out.data_ptr(),
            stream_of(packed),
        )
    check_launch(lib, status, "dequantize_nvfp4")


for _name, _cpu, _cuda in (
    ("amax_scale_", _amax_scale_cpu, _amax_scale_cuda),
    ("quantize_fp8_block_", _block_cpu, _block_cuda),
    ("dequantize_nvfp4_", _dequant_cpu, _dequant_cuda),
):
    LIB.impl(_name, _cpu, "CPU")
    LIB.impl(_name, _cuda, "CUDA")
    torch.library.register_fake(f"flashinfer_moe::{_name}", lambda *args: None, lib=LIB)


# ------------------------------------------------------------------------------------ argument helpers


def float_input(name: str, x: object, min_dim: int = 1) -> torch.Tensor:
    x = _checks.tensor(name, x)
    _checks.dtype_in(name, x, FLOATS)
    if x.dim() < min_dim:
        raise ValueError(f"{name} must be at least {min_dim}-D, got shape {tuple(x.shape)}")
    return x


def group_size_arg(group_size: object) -> int:
    group_size = _checks.integer("group_size", group_size, 16, 256)
    if group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two in [16, 256], got {group_size}")
    return group_size


def scale_tensor(name: str, scale: object, like_name: str, like: torch.Tensor) -> torch.Tensor:
    """A given scale (float, or float32 tensor of one element on ``like``'s device) as a 0-d fp32 tensor.

    A Python number must be positive and finite, and a normal float32 (zero would saturate every value, a
    negative one flip the signs); a tensor's value is not checked, which would cost a host sync. A Python
    number is copied to the device on every call: pass a tensor to capture in a CUDA graph.
    """
    if isinstance(scale, torch.Tensor):
        _checks.dtype_in(name, scale, (torch.float32,))
        _checks.same_device(name, scale, like_name, like)
        if scale.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {tuple(scale.shape)}")
        return scale.reshape(()).contiguous()
    scale = _checks.positive_float(name, scale, "a float or a float32 tensor")
    if not ref.MIN_SCALE <= scale <= _FP32_MAX:  # would become 0, a subnormal or inf in float32
        raise ValueError(
            f"{name} must be a positive finite number in float32's normal range [2**-126, {_FP32_MAX:.6g}], got {scale}"
        )
    return torch.tensor(scale, dtype=torch.float32, device=like.device)


def tensor_scale(x: torch.Tensor, x_name: str, scale: object, name: str, divisor: float) -> torch.Tensor:
    """The given scale, or ``max(amax(x) / divisor, 2**-126)`` computed on the device (no host sync)."""
    if scale is not None:
        return scale_tensor(name, scale, x_name, x)
    out = torch.empty((), dtype=torch.float32, device=x.device)
    torch.ops.flashinfer_moe.amax_scale_(x.contiguous(), out, divisor)
    return out


def check_out(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """An ``out=`` buffer: right shape, dtype and device, and contiguous. (The kernels that store 16-byte
    vectors also need it 16-byte aligned, as every fresh torch allocation is; they check that themselves.)"""
    t = _checks.tensor(name, t)
    if t.dtype != dtype:
        raise TypeError(
            f"{name} must have dtype {str(dtype).replace('torch.', '')}, got {str(t.dtype).replace('torch.', '')}"
        )
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    _checks.same_device(name, t, "the input", like)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    return t


def out_buffers(out, names: tuple[str, ...], shapes, dtypes, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Fresh outputs, or the caller's ``out=`` tuple checked buffer by buffer (shape, dtype, device)."""
    if out is None:
        return tuple(torch.empty(s, dtype=d, device=like.device) for s, d in zip(shapes, dtypes, strict=True))
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise TypeError(f"out must be a ({', '.join(names)}) tuple of tensors, got {type(out).__name__}")
    return tuple(
        check_out(f"out[{i}] ({n})", t, s, d, like)
        for i, (t, n, s, d) in enumerate(zip(out, names, shapes, dtypes, strict=True))
    )


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` as `[N, K]` rows with unit stride along K (a copy only where needed)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] == 1 else x2.contiguous()


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor viewed as rows for an elementwise kernel: rows of whole 16-element vectors where
    the element count allows (the vector path), else the last dimension (the element path)."""
    x = x.contiguous()
    n = x.numel()
    for length in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16):
        if n % length == 0:
            return x.view(-1, length)
    return x.view(-1, x.shape[-1]) if x.dim() else x.view(1, 1)


# ---------------------------------------------------------------------------------------------- public


def quantize_fp8_per_token_group(
    x: torch.Tensor, group_size: int = 128, *, scale_pow2: bool = False, out=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one fp32 scale per ``group_size`` consecutive channels (DeepSeek-V3 activations, 1x128).

    ``scale = max(amax / 448, 2**-126)``; with ``scale_pow2`` rounded up to a power of two (UE8M0-compatible).
    ``q = e4m3(x * (1 / scale))``, round-to-nearest-even, saturating at +-448.

    Args:
        x: `[..., K]` float32/float16/bfloat16, ``K`` a multiple of ``group_size``.
        group_size: channels per scale, a power of two in [16, 256].
        scale_pow2: round each scale up to a power of two.
        out: optional ``(q, scales)`` buffers.

    Returns:
        ``(q [..., K] float8_e4m3fn, scales [..., K / group_size] float32)``.
    """
    x = float_input("x", x)
    group_size = group_size_arg(group_size)
    if x.shape[-1] % group_size:
        raise ValueError(
            f"x must have a last dimension that is a multiple of group_size ({group_size}), got {tuple(x.shape)}"
        )
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    shapes = ((*lead, k), (*lead, k // group_size))
    q, scales = out_buffers(out, ("q", "scales"), shapes, (FP8, torch.float32), x)
    if x.numel():
        torch.ops.flashinfer_moe.permute_(rows_2d(x), None, q, scales, None, K.FP8_GROUP, group_size, scale_pow2)
    return q, scales


def quantize_fp8_per_tensor(x: torch.Tensor, scale=None, *, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one fp32 scale for the whole tensor: ``q = e4m3(x * (1 / scale))``, saturating.

    Args:
        x: any shape, float32/float16/bfloat16 (last dimension a multiple of 8 for the fastest path).
        scale: the dequantization scale (positive finite float, or one-element float32 tensor); default
            ``max(amax / 448, 2**-126)`` computed on the device with no host sync.
        out: optional ``q`` buffer.

    Returns:
        ``(q float8_e4m3fn shaped like x, scale float32 0-d)``.
    """
    x = float_input("x", x, 0)
    scale = tensor_scale(x, "x", scale, "scale", ref.FP8_MAX)
    q = torch.empty(x.shape, dtype=FP8, device=x.device) if out is None else check_out("out", out, x.shape, FP8, x)
    if x.numel():
        torch.ops.flashinfer_moe.permute_(flat_rows(x), None, q, None, scale, K.FP8_TENSOR, 0, False)
    return q, scale


def quantize_fp8_block_weights(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weights with one fp32 scale per ``block`` tile (DeepSeek-V3 ``weight`` / ``weight_scale_inv``).

    Edge tiles may be partial; each tile's scale is ``max(tile amax / 448, 2**-126)``.

    Args:
        w: `[..., N, K]` float32/float16/bfloat16 (e.g. `[E, N, K]`).
        block: tile shape ``(rows, cols)``.

    Returns:
        ``(q [..., N, K] float8_e4m3fn, weight_scale_inv [..., ceil(N / rows), ceil(K / cols)] float32)``.
    """
    w = float_input("w", w, 2)
    bn, bk = ref._block_arg(block)
    n, k = w.shape[-2:]
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    scales = torch.empty(*w.shape[:-2], -(-n // bn), -(-k // bk), dtype=torch.float32, device=w.device)
    torch.ops.flashinfer_moe.quantize_fp8_block_(w.contiguous(), q, scales, bn, bk)
    return q, scales


def quantize_nvfp4(x: torch.Tensor, global_scale=None, *, out=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4: E2M1 codes (two per byte, element ``2i`` in the low nibble), one E4M3 scale per 16 elements
    along K, one fp32 global scale.

    ``global_scale`` is the dequantization factor (ModelOpt's ``weight_scale_2``), default
    ``max(amax / (6 * 448), 2**-126)``. Block scale ``s = e4m3(block amax / (6 * global_scale))``; values are
    multiplied by ``1 / (float(s) * global_scale)`` and rounded to nearest-even on the E2M1 grid, saturating at +-6.

    Args:
        x: `[..., K]` float32/float16/bfloat16, ``K`` a multiple of 16.
        global_scale: positive finite float or one-element float32 tensor; default from the amax, computed on
            the device.
        out: optional ``(packed, block_scales)`` buffers.

    Returns:
        ``(packed [..., K / 2] uint8, block_scales [..., K / 16] float8_e4m3fn, global_scale float32 0-d)``.
    """
    x = float_input("x", x)
    if x.shape[-1] % 16:
        raise ValueError(f"x must have a last dimension K that is a multiple of 16, got shape {tuple(x.shape)}")
    global_scale = tensor_scale(x, "x", global_scale, "global_scale", ref.E2M1_MAX * ref.FP8_MAX)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    shapes = ((*lead, k // 2), (*lead, k // 16))
    packed, block_scales = out_buffers(out, ("packed", "block_scales"), shapes, (torch.uint8, FP8), x)
    if x.numel():
        torch.ops.flashinfer_moe.permute_(rows_2d(x), None, packed, block_scales, global_scale, K.NVFP4, 0, False)
    return packed, block_scales, global_scale


def dequantize_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale, *, out=None) -> torch.Tensor:
    """``e2m1(code) * float(block_scale) * global_scale`` in fp32; loads ModelOpt ``weight`` /
    ``weight_scale`` / ``weight_scale_2`` as stored.

    Args:
        packed: `[..., K / 2]` uint8.
        block_scales: `[..., K / 16]` float8_e4m3fn.
        global_scale: positive finite float or one-element float32 tensor.
        out: optional `[..., K]` float32 buffer.

    Returns:
        `[..., K]` float32.
    """
    packed = _checks.tensor("packed", packed)
    block_scales = _checks.tensor("block_scales", block_scales)
    _checks.dtype_in("packed", packed, (torch.uint8,))
    _checks.dtype_in("block_scales", block_scales, (FP8,))
    _checks.same_device("block_scales", block_scales, "packed", packed)
    if packed.dim() < 1 or packed.shape[-1] % 8:
        raise ValueError(
            f"packed must have a last dimension K/2 that is a multiple of 8, got shape {tuple(packed.shape)}"
        )
    k = packed.shape[-1] * 2
    if tuple(block_scales.shape) != (*packed.shape[:-1], k // 16):
        raise ValueError(
            f"block_scales must have shape {(*packed.shape[:-1], k // 16)} for packed {tuple(packed.shape)}, "
            f"got {tuple(block_scales.shape)}"
        )
    global_scale = scale_tensor("global_scale", global_scale, "packed", packed)
    shape = (*packed.shape[:-1], k)
    result = torch.empty(shape, dtype=torch.float32, device=packed.device) if out is None else out
    if out is not None:
        result = check_out("out", out, shape, torch.float32, packed)
    if packed.numel():
        torch.ops.flashinfer_moe.dequantize_nvfp4_(
            rows_2d(packed), block_scales.reshape(-1, k // 16), global_scale, result.view(-1, k)
        )
    return result
