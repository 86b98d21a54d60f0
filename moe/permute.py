"""Permute (tokens into an expert-major layout, optionally quantized on the way) and combine (back to tokens).

Permute reads each token once, quantizes it once and writes it to every row its pairs own; combine reads
each pair's row once and writes each token once. On a GPU both are one kernel launch, memory-bound and
host-sync free; on a CPU the reference runs. Rows that hold no pair are left unwritten.

Dimension legend: ``T`` tokens, ``k`` top-k, ``H`` hidden size, ``E`` experts, ``R`` rows of a layout.
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks
from flashinfer_moe import reference_layout as ref_layout
from flashinfer_moe import reference_quant as ref_quant
from flashinfer_moe._ops import DTYPE_CODES, LIB, check_launch, on_device, stream_of
from flashinfer_moe.layout import ExpertLayout

from . import _kernels as K
from .quant import FLOATS, FP8, check_out, group_size_arg, out_buffers, tensor_scale

__all__ = ["combine", "permute", "permute_fp8_per_tensor", "permute_fp8_per_token_group", "permute_nvfp4"]

LIB.define(
    "permute_(Tensor hidden, Tensor? row_of, Tensor(a!) out, Tensor(b!)? scales, Tensor? scale, int kind, "
    "int group_size, bool scale_pow2) -> ()"
)
LIB.define(
    "combine_(Tensor y, Tensor topk_weights, Tensor row_of, Tensor? residual, Tensor(a!) out, float scale, "
    "bool has_scale) -> ()"
)


def _permute_cpu(hidden, row_of, out, scales, scale, kind, group_size, scale_pow2):
    if kind == K.COPY:
        rows, row_scales = hidden, None
    elif kind == K.FP8_GROUP:
        rows, row_scales = ref_quant.quantize_fp8_per_token_group(hidden, group_size, scale_pow2=scale_pow2)
    elif kind == K.FP8_TENSOR:
        rows, row_scales = ref_quant.quantize_fp8_per_tensor(hidden, scale)[0], None
    else:
        rows, row_scales, _ = ref_quant.quantize_nvfp4(hidden, scale)
    ref_layout.put_rows(out, rows, row_of)
    if scales is not None:
        ref_layout.put_rows(scales, row_scales, row_of)


def _permute_cuda(hidden, row_of, out, scales, scale, kind, group_size, scale_pow2):
    lib = K.permute_lib()
    # 8-element vectors for a plain copy, 16 (one NVFP4 block, 16 FP8 bytes) for the quantizing kinds.
    vec = K.vector_rows(hidden, 8 if kind == K.COPY else 16) and K.vector_rows(out.view(-1, out.shape[-1]), 1)
    if not vec and kind in (K.FP8_GROUP, K.NVFP4):  # these read and write whole 16-element vectors
        hidden = K.aligned_copy(hidden)
        vec = K.vector_rows(hidden, 16)
        for name, t in (("out", out), ("scales", scales)):
            if t.data_ptr() % 16:
                raise ValueError(f"{name} must be 16-byte aligned, got address {t.data_ptr():#x}")
    with on_device(hidden):
        status = lib.fim_permute(
            hidden.data_ptr(),
            DTYPE_CODES[hidden.dtype],
            hidden.stride(0),
            K.ptr(row_of),
            1 if row_of is None else row_of.shape[1],
            hidden.shape[0],
            hidden.shape[1],
            kind,
            int(vec),
            out.data_ptr(),
            K.ptr(scales),
            K.ptr(scale),
            group_size,
            int(scale_pow2),
            stream_of(hidden),
        )
    check_launch(lib, status, "permute")


def _combine_cpu(y, topk_weights, row_of, residual, out, scale, has_scale):
    rsf = scale if has_scale else None
    out.copy_(ref_layout.combine_rows(y, topk_weights, row_of, rsf, residual, out.dtype))


def _combine_cuda(y, topk_weights, row_of, residual, out, scale, has_scale):
    lib = K.permute_lib()
    vec = all(K.vector_rows(t, 8) for t in (y, out) + ((residual,) if residual is not None else ()))
    with on_device(y):
        status = lib.fim_combine(
            y.data_ptr(),
            DTYPE_CODES[y.dtype],
            topk_weights.data_ptr(),
            row_of.data_ptr(),
            K.ptr(residual),
            out.data_ptr(),
            DTYPE_CODES[out.dtype],
            out.shape[0],
            row_of.shape[1],
            out.shape[1],
            scale,
            int(has_scale),
            int(vec),
            stream_of(y),
        )
    check_launch(lib, status, "combine")


LIB.impl("permute_", _permute_cpu, "CPU")
LIB.impl("permute_", _permute_cuda, "CUDA")
torch.library.register_fake("flashinfer_moe::permute_", lambda *args: None, lib=LIB)
LIB.impl("combine_", _combine_cpu, "CPU")
LIB.impl("combine_", _combine_cuda, "CUDA")
torch.library.register_fake("flashinfer_moe::combine_", lambda *args: None, lib=LIB)


# ---------------------------------------------------------------------------------------------- public


def _hidden_and_layout(hidden: object, layout: object) -> tuple[torch.Tensor, ExpertLayout]:
    hidden = _checks.tensor("hidden", hidden)
    _checks.ndim("hidden", hidden, 2, "[num_tokens, hidden_size]")
    _checks.dtype_in("hidden", hidden, FLOATS)
    if not isinstance(layout, ExpertLayout):
        raise TypeError(
            f"layout must be an ExpertLayout (from moe_align_contiguous/masked), got {type(layout).__name__}"
        )
    if hidden.shape[0] != layout.num_tokens:
        raise ValueError(
            f"hidden must have T = {layout.num_tokens} rows (as the layout's topk_ids), got {hidden.shape[0]}"
        )
    _checks.same_device("hidden", hidden, "layout", layout.row_of)
    if hidden.shape[1] > 1 and hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    return hidden, layout


def _launch(hidden, layout, out, scales, scale, kind, group_size=0, scale_pow2=False) -> None:
    if hidden.numel():
        torch.ops.flashinfer_moe.permute_(hidden, layout.row_of, out, scales, scale, kind, group_size, scale_pow2)


def permute(hidden: torch.Tensor, layout: ExpertLayout, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather tokens into an expert-major layout: row ``layout.row_of[t, j]`` gets ``hidden[t]``.

    Args:
        hidden: `[T, H]` float32/float16/bfloat16.
        layout: from :func:`moe_align_contiguous` or :func:`moe_align_masked`.
        out: optional `[*layout.rows_shape, H]` buffer (`[R, H]` or `[E, C, H]`), dtype of ``hidden``.

    Returns:
        `[*layout.rows_shape, H]`; rows that hold no pair are not written.
    """
    hidden, layout = _hidden_and_layout(hidden, layout)
    shape = (*layout.rows_shape, hidden.shape[1])
    out = (
        torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
        if out is None
        else check_out("out", out, shape, hidden.dtype, hidden)
    )
    _launch(hidden, layout, out, None, None, K.COPY)
    return out


def permute_fp8_per_token_group(
    hidden: torch.Tensor,
    layout: ExpertLayout,
    *,
    group_size: int = 128,
    scale_pow2: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`permute` fused with :func:`quantize_fp8_per_token_group`: each token is quantized once and its
    FP8 row and scales are written to each of its rows.

    Args:
        hidden: `[T, H]` float32/float16/bfloat16, ``H`` a multiple of ``group_size``.
        layout: the expert-major layout.
        group_size: channels per scale, a power of two in [16, 256].
        scale_pow2: round each scale up to a power of two (UE8M0-compatible).
        out: optional ``(q [*rows_shape, H] float8_e4m3fn, scales [*rows_shape, H / group_size] float32)``.

    Returns:
        ``(q, scales)`` as in ``out``.
    """
    hidden, layout = _hidden_and_layout(hidden, layout)
    group_size = group_size_arg(group_size)
    h = hidden.shape[1]
    if h % group_size:
        raise ValueError(f"hidden must have a hidden size that is a multiple of group_size ({group_size}), got {h}")
    shapes = ((*layout.rows_shape, h), (*layout.rows_shape, h // group_size))
    q, scales = out_buffers(out, ("q", "scales"), shapes, (FP8, torch.float32), hidden)
    _launch(hidden, layout, q, scales, None, K.FP8_GROUP, group_size, bool(scale_pow2))
    return q, scales


def permute_fp8_per_tensor(
    hidden: torch.Tensor, layout: ExpertLayout, scale=None, *, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`permute` fused with FP8 per-tensor quantization, ``q = e4m3(hidden / scale)``.

    Args:
        hidden: `[T, H]` float32/float16/bfloat16.
        layout: the expert-major layout.
        scale: the dequantization scale (positive finite float, or one-element float32 tensor: needed for CUDA
            graphs); default ``max(amax(hidden) / 448, 2**-126)``, computed on the device.
        out: optional `[*rows_shape, H]` float8_e4m3fn buffer.

    Returns:
        ``(q [*rows_shape, H] float8_e4m3fn, scale float32 0-d)``.
    """
    hidden, layout = _hidden_and_layout(hidden, layout)
    scale = tensor_scale(hidden, "hidden", scale, "scale", ref_quant.FP8_MAX)
    shape = (*layout.rows_shape, hidden.shape[1])
    q = (
        torch.empty(shape, dtype=FP8, device=hidden.device)
        if out is None
        else check_out("out", out, shape, FP8, hidden)
    )
    _launch(hidden, layout, q, None, scale, K.FP8_TENSOR)
    return q, scale


def permute_nvfp4(
    hidden: torch.Tensor,
    layout: ExpertLayout,
    global_scale=None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`permute` fused with :func:`quantize_nvfp4`.

    Args:
        hidden: `[T, H]` float32/float16/bfloat16, ``H`` a multiple of 16.
        layout: the expert-major layout.
        global_scale: the dequantization global scale (e.g. a checkpoint's ``input_scale``), positive finite
            float or one-element float32 tensor; default ``max(amax(hidden) / (6 * 448), 2**-126)`` on the device.
        out: optional ``(packed [*rows_shape, H / 2] uint8, block_scales [*rows_shape, H / 16] float8_e4m3fn)``.

    Returns:
        ``(packed, block_scales, global_scale float32 0-d)``.
    """
    hidden, layout = _hidden_and_layout(hidden, layout)
    h = hidden.shape[1]
    if h % 16:
        raise ValueError(f"hidden must have a hidden size that is a multiple of 16 (NVFP4 blocks), got {h}")
    global_scale = tensor_scale(hidden, "hidden", global_scale, "global_scale", ref_quant.E2M1_MAX * ref_quant.FP8_MAX)
    shapes = ((*layout.rows_shape, h // 2), (*layout.rows_shape, h // 16))
    packed, block_scales = out_buffers(out, ("packed", "block_scales"), shapes, (torch.uint8, FP8), hidden)
    _launch(hidden, layout, packed, block_scales, global_scale, K.NVFP4)
    return packed, block_scales, global_scale


def combine(
    y: torch.Tensor,
    topk_weights: torch.Tensor,
    layout: ExpertLayout,
    *,
    routed_scaling_factor: float | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum each token's expert outputs back: ``out[t] = (sum_j w[t, j] * y[row_of[t, j]]) * rsf + residual[t]``.

    fp32 accumulation over ``j`` ascending; pairs without a row (id -1, or dropped for capacity) are skipped.

    Args:
        y: `[*layout.rows_shape, H]` float32/float16/bfloat16 expert outputs (`[R, H]` or `[E, C, H]`).
        topk_weights: `[T, k]` routing weights (float32; other float dtypes are converted).
        layout: the layout ``y`` is in.
        routed_scaling_factor: optional factor applied to the sum, a positive finite float.
        residual: optional `[T, H]` added last (e.g. the shared expert's output), in the output dtype.
        out_dtype: float32, float16 or bfloat16; default ``y.dtype``.
        out: optional `[T, H]` buffer of ``out_dtype``.

    Returns:
        `[T, H]`.
    """
    y = _checks.tensor("y", y)
    _checks.dtype_in("y", y, FLOATS)
    if not isinstance(layout, ExpertLayout):
        raise TypeError(
            f"layout must be an ExpertLayout (from moe_align_contiguous/masked), got {type(layout).__name__}"
        )
    if y.dim() != len(layout.rows_shape) + 1 or tuple(y.shape[:-1]) != layout.rows_shape:
        raise ValueError(f"y must have shape ({', '.join(map(str, layout.rows_shape))}, H), got {tuple(y.shape)}")
    _checks.same_device("y", y, "layout", layout.row_of)
    weights = _checks.tensor("topk_weights", topk_weights)
    _checks.dtype_in("topk_weights", weights, (*FLOATS, torch.float64))
    if tuple(weights.shape) != tuple(layout.row_of.shape):
        raise ValueError(
            f"topk_weights must have shape {tuple(layout.row_of.shape)} ([T, k]), got {tuple(weights.shape)}"
        )
    _checks.same_device("topk_weights", weights, "layout", layout.row_of)
    out_dtype = y.dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOATS:
        raise TypeError(f"out_dtype must be one of float32, float16, bfloat16, got {out_dtype}")
    shape = (layout.num_tokens, y.shape[-1])
    if residual is not None:
        residual = _checks.tensor("residual", residual)
        if residual.dtype != out_dtype:
            raise TypeError(f"residual must have the output dtype {out_dtype}, got {residual.dtype}")
        if tuple(residual.shape) != shape:
            raise ValueError(f"residual must have shape {shape} ([T, H]), got {tuple(residual.shape)}")
        _checks.same_device("residual", residual, "y", y)
        residual = residual.contiguous()
    scale = 1.0
    if routed_scaling_factor is not None:
        scale = _checks.positive_float("routed_scaling_factor", routed_scaling_factor)
    out = (
        torch.empty(shape, dtype=out_dtype, device=y.device)
        if out is None
        else check_out("out", out, shape, out_dtype, y)
    )
    rows = y.reshape(-1, y.shape[-1]) if y.is_contiguous() else y.contiguous().view(-1, y.shape[-1])
    if out.numel():
        torch.ops.flashinfer_moe.combine_(
            rows,
            weights.to(torch.float32).contiguous(),
            layout.row_of,
            residual,
            out,
            scale,
            routed_scaling_factor is not None,
        )
    return out
