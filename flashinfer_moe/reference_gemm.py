"""Plain-torch grouped GEMMs, the gated activations, and the whole single-GPU MoE: the oracle for the
Triton kernels and the CPU path.

Everything is computed on dequantized inputs in ``compute_dtype`` (float64 for tests, float32 for the CPU
path) and rounded once at the end, so the only error a kernel may add is its own accumulation order.

Dimension legend: ``T`` tokens, ``k`` top-k, ``E`` experts, ``H`` hidden, ``I`` intermediate, ``N`` output
columns, ``K`` reduction, ``R`` rows of a layout, ``C`` masked capacity.
"""

from __future__ import annotations

import torch

from .reference_layout import combine_rows, moe_align_contiguous, permute
from .reference_quant import (
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token_group,
)

__all__ = [
    "ACTIVATIONS",
    "activation",
    "dequantize_activations",
    "dequantize_weights",
    "fused_moe",
    "grouped_gemm",
]

ACTIVATIONS = (None, "silu", "clamped_silu")


def activation(gate_up: torch.Tensor, kind: str | None, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The gated activation on `[..., 2N]` (gate columns first): ``silu(gate) * up``, or gpt-oss's clamped
    form ``g * sigmoid(alpha * g) * (u + 1)`` with ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``.
    ``None`` returns the input."""
    if kind is None:
        return gate_up
    gate, up = gate_up.chunk(2, dim=-1)
    if kind == "silu":
        return gate * torch.sigmoid(gate) * up
    if kind == "clamped_silu":
        g = gate.clamp(max=limit)
        return g * torch.sigmoid(alpha * g) * (up.clamp(-limit, limit) + 1)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {kind!r}")


def dequantize_activations(a: torch.Tensor, a_scale: torch.Tensor | None, dtype=torch.float64) -> torch.Tensor:
    """``a`` `[..., K]` in ``dtype``, times its scale: none, one value, one per row `[...]`, or one per row
    and 128 channels `[..., K / 128]`."""
    if a_scale is None:
        return a.to(dtype)
    if a_scale.numel() == 1:
        return a.to(dtype) * a_scale.reshape(()).to(dtype)
    if a_scale.dim() == a.dim():
        return dequantize_fp8_per_token_group(a, a_scale.float(), a.shape[-1] // a_scale.shape[-1]).to(dtype)
    return a.to(dtype) * a_scale.to(dtype).unsqueeze(-1)


def dequantize_weights(w: torch.Tensor, w_scale: torch.Tensor | None, dtype=torch.float64) -> torch.Tensor:
    """``w`` `[E, N, K]` in ``dtype``, times its scale: none, one per expert `[E]`, or one per 128 x 128 block
    `[E, ceil(N / 128), ceil(K / 128)]`."""
    if w_scale is None:
        return w.to(dtype)
    if w_scale.dim() == 1:
        return w.to(dtype) * w_scale.to(dtype)[:, None, None]
    return dequantize_fp8_block(w, w_scale.float()).to(dtype)


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    activation_kind: str | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``y[rows of e] = act(A[rows of e] @ W[e]^T)`` for each expert ``e``, the rows of ``e`` being
    ``expert_offsets[e] .. expert_offsets[e] + tokens_per_expert[e] - 1``.

    Args:
        a: `[R, K]` (a masked `[E, C, K]` is passed flattened to `[E * C, K]`).
        w: `[E, N, K]` (with an activation `[E, 2N, K]`, gate rows first).
        tokens_per_expert: `[E]` rows each expert owns.
        expert_offsets: `[E]` (or `[E + 1]`) first row of each expert.
        a_scale, w_scale: as :func:`dequantize_activations` / :func:`dequantize_weights` take them.
        activation_kind: ``None``, ``"silu"`` or ``"clamped_silu"``.
        compute_dtype: the arithmetic type.

    Returns:
        `[R, N]` in ``compute_dtype``; rows no expert owns are zero.
    """
    af = dequantize_activations(a, a_scale, compute_dtype)  # [R, K]
    wf = dequantize_weights(w, w_scale, compute_dtype)  # [E, NW, K]
    n = wf.shape[1] // 2 if activation_kind is not None else wf.shape[1]
    out = torch.zeros(a.shape[0], n, dtype=compute_dtype, device=a.device)
    counts = tokens_per_expert.tolist()
    starts = expert_offsets.tolist()
    for e, count in enumerate(counts):
        if count:
            rows = slice(starts[e], starts[e] + count)
            out[rows] = activation(af[rows] @ wf[e].T, activation_kind, alpha, limit)
    return out


def grouped_gemm_into(
    out: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    expert_offsets: torch.Tensor | None,
    capacity: int,
    *,
    activation_kind: str | None,
    alpha: float,
    limit: float,
) -> None:
    """:func:`grouped_gemm` in fp32 written into the rows of ``out`` that each expert owns (the others are left as
    they are): counts clamped to ``capacity``, and ``expert_offsets`` None for the masked layout (expert ``e``'s
    rows from ``e * capacity``). The CPU implementation of the grouped GEMM ops that dequantize their weights first.

    Args:
        out: `[R, N]` (or `[R, N / 2]` with an activation), written in place.
        a: `[R, K]`, already dequantized.
        w: `[E, N, K]`, already dequantized.
    """
    counts = tokens_per_expert.clamp(max=capacity)
    if expert_offsets is None:
        expert_offsets = torch.arange(counts.shape[0], dtype=torch.int32, device=a.device) * capacity
    y = grouped_gemm(
        a,
        w,
        counts,
        expert_offsets,
        activation_kind=activation_kind,
        alpha=alpha,
        limit=limit,
        compute_dtype=torch.float32,
    )
    for start, count in zip(expert_offsets.tolist(), counts.tolist(), strict=False):
        out[start : start + count] = y[start : start + count].to(out.dtype)


def _per_tensor(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_per_tensor(x, scale)


def _per_group(x: torch.Tensor, scale: None) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_per_token_group(x)


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    quant: str | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    a13_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    activation_kind: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    routed_scaling_factor: float | None = None,
    out_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The single-GPU MoE layer as the kernels compute it: permute, GEMM1 + activation, GEMM2, combine.

    With ``quant`` the activations are quantized exactly where the fused pipeline quantizes them (the input,
    and GEMM1's activated output): per token and 128 channels for ``"fp8_block"``, per tensor (``a13_scale``,
    ``a2_scale``, or the dynamic amax scale) for ``"fp8_tensor"``. So the reference is fed the same FP8 values
    as the kernels, up to the accumulation order before the second quantization. The weights are used as
    given, dequantized with their scales.

    Returns:
        `[T, H]` in ``out_dtype`` (default: the dtype of ``hidden_states``).
    """
    num_experts = w13.shape[0]
    layout = moe_align_contiguous(topk_ids, num_experts, 1)
    counts, offsets = layout.tokens_per_expert, layout.expert_offsets[:-1]
    quantize = _per_group if quant == "fp8_block" else _per_tensor
    if quant is None:
        a, a_scale = permute(hidden_states, layout), None
    else:
        if quant == "fp8_tensor" and a13_scale is None:  # the dynamic scale covers every token
            a13_scale = quantize_fp8_per_tensor(hidden_states)[1]
        a, a_scale = quantize(permute(hidden_states, layout), a13_scale)
    h1 = grouped_gemm(
        a,
        w13,
        counts,
        offsets,
        a_scale=a_scale,
        w_scale=w13_scale,
        activation_kind=activation_kind,
        alpha=alpha,
        limit=limit,
        compute_dtype=compute_dtype,
    )  # [R, I]
    if quant is None:
        a2, a2_scale = h1, None
    else:
        # The per-tensor path rounds GEMM1's output to bf16 before quantizing it, as the kernels do.
        a2, a2_scale = quantize(h1.float() if quant == "fp8_block" else h1.to(torch.bfloat16), a2_scale)
    y = grouped_gemm(a2, w2, counts, offsets, a_scale=a2_scale, w_scale=w2_scale, compute_dtype=compute_dtype)
    out_dtype = hidden_states.dtype if out_dtype is None else out_dtype
    return combine_rows(y, topk_weights, layout.row_of, routed_scaling_factor, None, out_dtype)
