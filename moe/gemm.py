"""Grouped expert GEMMs over the expert-major layouts: ``out[rows of e] = act(A[rows of e] @ W[e]^T)``.

Three operand types (bf16/fp16; FP8 with DeepSeek-V3 block scales; FP8 with per-tensor scales), two layouts
(contiguous `[R, K]` for prefill, masked `[E, C, K]` for decode), and GEMM1's epilogue fusions: the gated
activations (``"silu"``: ``silu(gate) * up``; ``"clamped_silu"``: gpt-oss's clamped form), optionally
re-quantized to FP8 per 128 columns for GEMM2. On a GPU a call launches the Triton kernel, or on Hopper
for the block-scaled type a grouped GEMM of ``gemm_sm90`` (see ``gemm_op``), with no host sync (CUDA-graph
capturable); on a CPU the reference runs.

Dimension legend: ``E`` experts, ``R`` rows of the contiguous layout, ``C`` masked capacity, ``K``
reduction, ``N`` weight rows (``2 I`` for GEMM1 with an activation, whose output has ``I`` columns).
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks
from flashinfer_moe.layout import ExpertLayout

from .gemm_op import (
    A_GROUP,
    A_NONE,
    A_ROW,
    A_TENSOR,
    ACT_CODES,
    BLOCK,
    NO_CAPACITY,
    W_BLOCK,
    W_EXPERT,
    W_NONE,
    W_PACKED,
    W_PACKED_GATED,
    W_PLAIN,
    run,
)
from .packed import PackedFp8BlockWeights
from .quant import FLOATS, FP8, check_out, out_buffers

__all__ = [
    "grouped_gemm_bf16_contiguous",
    "grouped_gemm_bf16_masked",
    "grouped_gemm_fp8_block_contiguous",
    "grouped_gemm_fp8_block_masked",
    "grouped_gemm_fp8_tensor_contiguous",
    "grouped_gemm_fp8_tensor_masked",
]

# ------------------------------------------------------------------------------------------- checking


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _operand(name: str, t: object, dims: int, shape_doc: str, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    t = _checks.tensor(name, t)
    _checks.ndim(name, t, dims, shape_doc)
    _checks.dtype_in(name, t, dtypes)
    _checks.unit_last_stride(name, t)
    return t


def _weights(w: object, a: torch.Tensor, dtypes) -> torch.Tensor:
    w = _operand("w", w, 3, "[E, N, K]", dtypes)
    _checks.same_device("w", w, "a", a)
    if w.shape[2] != a.shape[-1]:
        raise ValueError(f"w must have K = {a.shape[-1]} columns (as a), got shape {tuple(w.shape)}")
    if w.dtype != a.dtype:
        raise TypeError(f"w must have the dtype of a ({_name(a.dtype)}), got {_name(w.dtype)}")
    if 0 in w.shape:
        raise ValueError(f"w must have at least one expert, row and column, got shape {tuple(w.shape)}")
    return w


def _packed_weights(w: PackedFp8BlockWeights, a: torch.Tensor, block: bool, activation: object) -> int:
    """Checks packed weights against the call; returns their ``w_packed`` code."""
    if not block:
        raise TypeError(
            "w must be a tensor for the per-tensor GEMM (packed weights are block-scaled), got packed weights"
        )
    data = _checks.tensor("w.data", w.data)
    _checks.ndim("w.data", data, 5, "[E, N / 256, K / 128, 256, 128]")
    _checks.dtype_in("w.data", data, (FP8,))
    if tuple(data.shape[3:]) != (256, 128) or not data.is_contiguous():
        raise ValueError(f"w.data must be contiguous [E, N / 256, K / 128, 256, 128], got shape {tuple(data.shape)}")
    _checks.same_device("w", data, "a", a)
    if w.shape[2] != a.shape[-1]:
        raise ValueError(f"w must have K = {a.shape[-1]} columns (as a), got shape {w.shape}")
    if w.gated != (activation is not None):
        raise ValueError(
            f"w was packed with gated={w.gated}, which is for GEMM1 {'with' if w.gated else 'without'} an activation;"
            f" got activation={activation!r}"
        )
    return W_PACKED_GATED if w.gated else W_PACKED


def _activation(activation: object, w: torch.Tensor, alpha: object, limit: object) -> tuple[int, int, float, float]:
    if activation not in ACT_CODES:
        raise ValueError(f"activation must be one of None, 'silu', 'clamped_silu', got {activation!r}")
    nw = w.shape[1]
    if activation is not None and nw % 2:
        raise ValueError(f"w must have an even number of rows (gate then up) with activation={activation!r}, got {nw}")
    alpha, limit = _checks.finite_float("alpha", alpha), _checks.positive_float("limit", limit)
    return ACT_CODES[activation], nw // 2 if activation else nw, alpha, limit


def _rows_and_groups(a: torch.Tensor, layout: object, masked: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``(counts [E], offsets [E + 1] or None (masked), capacity)`` of the layout the rows of ``a`` are in."""
    if masked:
        counts = layout.tokens_per_expert if isinstance(layout, ExpertLayout) else layout
        counts = _checks.tensor("tokens_per_expert", counts)
        _checks.dtype_in("tokens_per_expert", counts, (torch.int32,))
        if tuple(counts.shape) != (a.shape[0],):
            raise ValueError(f"tokens_per_expert must have shape ({a.shape[0]},) (E of a), got {tuple(counts.shape)}")
        _checks.same_device("tokens_per_expert", counts, "a", a)
        return counts.contiguous(), None, a.shape[1]
    if not isinstance(layout, ExpertLayout) or layout.kind != "contiguous":
        got = layout.kind if isinstance(layout, ExpertLayout) else type(layout).__name__
        raise TypeError(f"layout must be a contiguous ExpertLayout (from moe_align_contiguous), got {got}")
    if layout.num_rows != a.shape[0]:
        raise ValueError(f"a must have the layout's R = {layout.num_rows} rows, got shape {tuple(a.shape)}")
    _checks.same_device("a", a, "layout", layout.row_of)
    return layout.tokens_per_expert, layout.expert_offsets, NO_CAPACITY


def _check_experts(w: torch.Tensor, counts: torch.Tensor, layout_name: str) -> None:
    if counts.shape[0] != w.shape[0]:
        raise ValueError(f"w must have E = {counts.shape[0]} experts (as the {layout_name}), got {w.shape[0]}")


def _outputs(out, a: torch.Tensor, n: int, out_dtype: object, quantize_output: bool):
    lead = tuple(a.shape[:-1])
    if quantize_output:
        if n % BLOCK:
            raise ValueError(f"quantize_output needs output columns that are a multiple of {BLOCK}, got {n}")
        shapes, dtypes = ((*lead, n), (*lead, n // BLOCK)), (FP8, torch.float32)
        return out_buffers(out, ("q", "scales"), shapes, dtypes, a)
    if out_dtype not in FLOATS:
        raise TypeError(f"out_dtype must be one of float32, float16, bfloat16, got {out_dtype}")
    if out is None:
        return (torch.empty((*lead, n), dtype=out_dtype, device=a.device),)
    return (check_out("out", out, (*lead, n), out_dtype, a),)


def _scale(name: str, s: object, shapes: tuple[tuple[int, ...], ...], doc: str, like: torch.Tensor) -> torch.Tensor:
    s = _checks.tensor(name, s)
    _checks.dtype_in(name, s, (torch.float32,))
    _checks.same_device(name, s, "a", like)
    if tuple(s.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))} ({doc}), got {tuple(s.shape)}")
    return s.contiguous()


def _plain(a, w, layout, masked, activation, alpha, limit, out_dtype, out):
    a = _operand("a", a, 3 if masked else 2, "[E, C, K]" if masked else "[R, K]", (torch.bfloat16, torch.float16))
    w = _weights(w, a, (torch.bfloat16, torch.float16))
    counts, offsets, capacity = _rows_and_groups(a, layout, masked)
    _check_experts(w, counts, "tokens_per_expert" if masked else "layout")
    act, n, alpha, limit = _activation(activation, w, alpha, limit)
    outs = _outputs(out, a, n, a.dtype if out_dtype is None else out_dtype, False)
    return run(a, w, counts, offsets, capacity, None, None, outs, A_NONE, W_NONE, act, alpha, limit)


def _fp8(
    a,
    a_scale,
    w,
    w_scale,
    layout,
    masked,
    block,
    activation,
    alpha,
    limit,
    quantize_output,
    out_dtype,
    out,
    fast_accum=False,
):
    a = _operand("a", a, 3 if masked else 2, "[E, C, K]" if masked else "[R, K]", (FP8,))
    packed = isinstance(w, PackedFp8BlockWeights)
    w_packed = _packed_weights(w, a, block, activation) if packed else W_PLAIN
    if not packed:
        w = _weights(w, a, (FP8,))
    counts, offsets, capacity = _rows_and_groups(a, layout, masked)
    _check_experts(w, counts, "tokens_per_expert" if masked else "layout")
    act, n, alpha, limit = _activation(activation, w, alpha, limit)
    num_experts, nw, k = w.shape
    lead = tuple(a.shape[:-1])
    if block:
        if k % BLOCK:
            raise ValueError(f"a must have K a multiple of {BLOCK} for 128-wide scale blocks, got K = {k}")
        a_scale = _scale("a_scale", a_scale, ((*lead, k // BLOCK),), "one per row and 128 channels", a)
        w_scale = _scale("w_scale", w_scale, ((num_experts, -(-nw // BLOCK), k // BLOCK),), "128 x 128 blocks", a)
        a_mode, w_mode = A_GROUP, W_BLOCK
    else:
        shapes = ((), (1,), lead, (*lead, k // BLOCK)) if k % BLOCK == 0 else ((), (1,), lead)
        a_scale = _scale("a_scale", a_scale, shapes, "per tensor, per row, or per row and 128 channels", a)
        a_mode = {0: A_TENSOR, len(lead): A_ROW}.get(a_scale.dim(), A_GROUP) if a_scale.numel() != 1 else A_TENSOR
        w_scale = _scale("w_scale", w_scale, ((num_experts,),), "one per expert", a)
        w_mode = W_EXPERT
    # The kernel sees the rows flattened: [rows] per row, [rows, K / 128] per row and group.
    a_scale = a_scale.reshape(-1, k // BLOCK) if a_mode == A_GROUP else a_scale.reshape(-1)
    outs = _outputs(out, a, n, out_dtype, quantize_output)
    w = w.data if packed else w
    return run(
        a, w, counts, offsets, capacity, a_scale, w_scale, outs, a_mode, w_mode, act, alpha, limit, fast_accum, w_packed
    )


# ---------------------------------------------------------------------------------------------- public

_ACT_DOC = """activation: ``None``; ``"silu"`` (``silu(gate) * up``, gate rows ``[0, N/2)`` of ``w`` first);
            or ``"clamped_silu"`` (gpt-oss: ``g * sigmoid(alpha * g) * (u + 1)``, ``g = min(gate, limit)``,
            ``u = clamp(up, -limit, limit)``). With an activation the output has ``N / 2`` columns.
        alpha, limit: parameters of ``"clamped_silu"`` (``alpha`` finite, ``limit`` positive and finite)."""


def grouped_gemm_bf16_contiguous(
    a, w, layout, *, activation=None, alpha=1.702, limit=7.0, out_dtype=None, out=None
) -> torch.Tensor:
    """bf16/fp16 grouped GEMM over the contiguous layout: ``out[rows of e] = act(a[rows of e] @ w[e]^T)``,
    fp32 accumulation. Rows no expert owns (padding) are not written.

    Args:
        a: `[R, K]` bfloat16 or float16 (e.g. from :func:`permute`).
        w: `[E, N, K]`, the dtype of ``a``.
        layout: the contiguous :class:`ExpertLayout` ``a`` is in.
        {act}
        out_dtype: default the dtype of ``a``.
        out: optional `[R, N]` (or `[R, N / 2]`) buffer.

    Returns:
        `[R, N]` (or `[R, N / 2]`).
    """
    return _plain(a, w, layout, False, activation, alpha, limit, out_dtype, out)


def grouped_gemm_bf16_masked(
    a, w, tokens_per_expert, *, activation=None, alpha=1.702, limit=7.0, out_dtype=None, out=None
) -> torch.Tensor:
    """bf16/fp16 grouped GEMM over the masked layout: ``out[e, :m_e] = act(a[e, :m_e] @ w[e]^T)`` with
    ``m_e = min(tokens_per_expert[e], C)``; slots past ``m_e`` are not written. No host sync.

    Args:
        a: `[E, C, K]` bfloat16 or float16.
        w: `[E, N, K]`, the dtype of ``a``.
        tokens_per_expert: `[E]` int32 on the device (or the masked :class:`ExpertLayout`).
        {act}
        out_dtype: default the dtype of ``a``.
        out: optional `[E, C, N]` (or `[E, C, N / 2]`) buffer.

    Returns:
        `[E, C, N]` (or `[E, C, N / 2]`).
    """
    return _plain(a, w, tokens_per_expert, True, activation, alpha, limit, out_dtype, out)


def grouped_gemm_fp8_block_contiguous(
    a,
    a_scale,
    w,
    w_scale,
    layout,
    *,
    activation=None,
    alpha=1.702,
    limit=7.0,
    quantize_output=False,
    out_dtype=torch.bfloat16,
    out=None,
):
    """FP8 grouped GEMM with DeepSeek-V3 block scales over the contiguous layout: each 128-wide K block's
    product is scaled by ``a_scale[row, kb] * w_scale[e, n // 128, kb]`` and accumulated in fp32.

    Args:
        a: `[R, K]` float8_e4m3fn, ``K`` a multiple of 128 (e.g. from :func:`permute_fp8_per_token_group`).
        a_scale: `[R, K / 128]` float32.
        w: `[E, N, K]` float8_e4m3fn, or the same packed by :func:`pack_fp8_block_weights` (``gated=True``
            exactly when there is an activation): on Hopper it streams faster at decode sizes (not at prefill
            sizes); elsewhere it is unpacked per call.
        w_scale: `[E, ceil(N / 128), K / 128]` float32 (a checkpoint's ``weight_scale_inv``).
        layout: the contiguous :class:`ExpertLayout` ``a`` is in.
        {act}
        quantize_output: return the output re-quantized to FP8 with one scale per row and 128 columns
            (GEMM2's input), as :func:`quantize_fp8_per_token_group` does.
        out_dtype: bfloat16 (default), float16 or float32, without ``quantize_output``.
        out: optional `[R, N']` buffer, or ``(q [R, N'], scales [R, N' / 128])`` with ``quantize_output``.

    Returns:
        `[R, N']` (``N' = N`` or ``N / 2``), or ``(q, scales)``.
    """
    return _fp8(a, a_scale, w, w_scale, layout, False, True, activation, alpha, limit, quantize_output, out_dtype, out)


def grouped_gemm_fp8_block_masked(
    a,
    a_scale,
    w,
    w_scale,
    tokens_per_expert,
    *,
    activation=None,
    alpha=1.702,
    limit=7.0,
    quantize_output=False,
    out_dtype=torch.bfloat16,
    out=None,
):
    """:func:`grouped_gemm_fp8_block_contiguous` over the masked layout (decode; no host sync).

    Args:
        a: `[E, C, K]` float8_e4m3fn.
        a_scale: `[E, C, K / 128]` float32.
        w: `[E, N, K]` float8_e4m3fn, or packed (:func:`pack_fp8_block_weights`), as in the contiguous form.
        w_scale: `[E, ceil(N / 128), K / 128]` float32.
        tokens_per_expert: `[E]` int32 on the device (or the masked :class:`ExpertLayout`).
        {act}
        quantize_output: as in the contiguous form.
        out_dtype: bfloat16 (default), float16 or float32.
        out: optional `[E, C, N']` buffer, or ``(q, scales)``.

    Returns:
        `[E, C, N']`, or ``(q [E, C, N'], scales [E, C, N' / 128])``.
    """
    return _fp8(
        a, a_scale, w, w_scale, tokens_per_expert, True, True, activation, alpha, limit, quantize_output, out_dtype, out
    )


def grouped_gemm_fp8_tensor_contiguous(
    a,
    a_scale,
    w,
    w_scale,
    layout,
    *,
    activation=None,
    alpha=1.702,
    limit=7.0,
    quantize_output=False,
    out_dtype=torch.bfloat16,
    fast_accum=False,
    out=None,
):
    """FP8 grouped GEMM with one weight scale per expert over the contiguous layout. Scales that are constant
    along K (per tensor, per row) are applied once after the fp32 accumulation.

    Args:
        a: `[R, K]` float8_e4m3fn.
        a_scale: float32, one value (`[]` or `[1]`, per tensor), `[R]` (per token), or `[R, K / 128]`
            (per token and 128 channels).
        w: `[E, N, K]` float8_e4m3fn.
        w_scale: `[E]` float32.
        layout: the contiguous :class:`ExpertLayout` ``a`` is in.
        {act}
        quantize_output: as in :func:`grouped_gemm_fp8_block_contiguous`.
        out_dtype: bfloat16 (default), float16 or float32.
        fast_accum: keep the whole K in the tensor cores' reduced-precision FP8 accumulator (as
            ``torch._scaled_mm(use_fast_accum=True)``): faster, less accurate. By default the partial sums are
            promoted to fp32 every 128 along K.
        out: optional `[R, N']` buffer, or ``(q, scales)``.

    Returns:
        `[R, N']`, or ``(q, scales)``.
    """
    return _fp8(
        a,
        a_scale,
        w,
        w_scale,
        layout,
        False,
        False,
        activation,
        alpha,
        limit,
        quantize_output,
        out_dtype,
        out,
        fast_accum,
    )


def grouped_gemm_fp8_tensor_masked(
    a,
    a_scale,
    w,
    w_scale,
    tokens_per_expert,
    *,
    activation=None,
    alpha=1.702,
    limit=7.0,
    quantize_output=False,
    out_dtype=torch.bfloat16,
    fast_accum=False,
    out=None,
):
    """:func:`grouped_gemm_fp8_tensor_contiguous` over the masked layout (decode; no host sync).

    Args:
        a: `[E, C, K]` float8_e4m3fn.
        a_scale: float32, one value, `[E, C]` (per token) or `[E, C, K / 128]`.
        w: `[E, N, K]` float8_e4m3fn.
        w_scale: `[E]` float32.
        tokens_per_expert: `[E]` int32 on the device (or the masked :class:`ExpertLayout`).
        {act}
        quantize_output: as in :func:`grouped_gemm_fp8_block_contiguous`.
        out_dtype: bfloat16 (default), float16 or float32.
        fast_accum: as in :func:`grouped_gemm_fp8_tensor_contiguous`.
        out: optional `[E, C, N']` buffer, or ``(q, scales)``.

    Returns:
        `[E, C, N']`, or ``(q, scales)``.
    """
    return _fp8(
        a,
        a_scale,
        w,
        w_scale,
        tokens_per_expert,
        True,
        False,
        activation,
        alpha,
        limit,
        quantize_output,
        out_dtype,
        out,
        fast_accum,
    )


for _fn in (
    grouped_gemm_bf16_contiguous,
    grouped_gemm_bf16_masked,
    grouped_gemm_fp8_block_contiguous,
    grouped_gemm_fp8_block_masked,
    grouped_gemm_fp8_tensor_contiguous,
    grouped_gemm_fp8_tensor_masked,
):
    _fn.__doc__ = _fn.__doc__.replace("{act}", _ACT_DOC)
