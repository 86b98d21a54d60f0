"""The single-GPU MoE pipeline: align -> permute (+ quantize) -> GEMM1 + activation -> GEMM2 -> combine.

Six kernel launches on a GPU with no host sync (seven to nine with per-tensor FP8, which computes dynamic
activation scales on the device), so a whole layer captures in a CUDA graph; the same ops run the reference
on a CPU.

Dimension legend: ``T`` tokens, ``k`` top-k, ``E`` experts, ``H`` hidden, ``I`` intermediate.
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks

from . import gemm, gemm_nvfp4
from .layout import moe_align_contiguous
from .packed import PackedFp8BlockWeights, PackedWeights
from .permute import combine, permute, permute_fp8_per_tensor, permute_fp8_per_token_group
from .quant import FLOATS, FP8, quantize_fp8_per_tensor

__all__ = ["fused_moe"]

QUANTS = (None, "fp8_block", "fp8_tensor", "nvfp4")


def _weight(name: str, w: object, doc: str, quant: str | None, gated: bool) -> tuple[tuple[int, ...], torch.dtype]:
    """``(shape, dtype)`` of a weight given plain or packed (:func:`pack_fp8_block_weights`), checked for
    ``quant``'s dtypes."""
    wanted = (torch.bfloat16, torch.float16) if quant is None else (FP8,)
    if isinstance(w, PackedFp8BlockWeights):
        if quant != "fp8_block":
            raise ValueError(
                f"{name} must be a tensor with quant={quant!r} (packed weights are FP8 block-scaled), got packed"
            )
        if w.gated != gated:
            raise ValueError(f"{name} must be packed with gated={gated} ({doc}), got gated={w.gated}")
        _checks.dtype_in(name, w.data, wanted)
        return w.shape, w.dtype
    w = _checks.tensor(name, w)
    _checks.ndim(name, w, 3, doc)
    _checks.dtype_in(name, w, wanted)
    return tuple(w.shape), w.dtype


def _check_weights(quant, hidden, w13, w2, w13_scale, w2_scale) -> tuple[int, int]:
    w13_shape, w13_dtype = _weight("w13", w13, "[E, 2I, H]", quant, True)
    w2_shape, w2_dtype = _weight("w2", w2, "[E, H, I]", quant, False)
    num_experts, two_i, h = w13_shape
    if h != hidden.shape[1]:
        raise ValueError(f"w13 must have H = {hidden.shape[1]} columns (as hidden_states), got {w13_shape}")
    if two_i == 0 or two_i % 2:
        raise ValueError(f"w13 must have 2I rows (gate then up), an even number, got {w13_shape}")
    if w2_shape != (num_experts, h, two_i // 2):
        raise ValueError(f"w2 must have shape {(num_experts, h, two_i // 2)} ([E, H, I]), got {w2_shape}")
    if w2_dtype != w13_dtype:
        raise TypeError(f"w2 must have the dtype of w13 ({w13_dtype}), got {w2_dtype}")
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if quant is None and s is not None:
            raise ValueError(f"{name} must be None without quant, got a tensor of shape {tuple(s.shape)}")
        if quant is not None and s is None:
            raise ValueError(f"{name} must be given with quant={quant!r}, got None")
    return num_experts, two_i // 2


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
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    routed_scaling_factor: float | None = None,
    validate: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One MoE layer's experts on one GPU: ``out[t] = rsf * sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` with
    ``expert_e(x) = w2[e] @ act(w13[e] @ x)``.

    Args:
        hidden_states: `[T, H]` bfloat16/float16 (float32 is accepted and computed in bf16).
        w13: `[E, 2I, H]` gate rows then up rows: bf16/fp16 without ``quant``, float8_e4m3fn with it; with
            ``"fp8_block"`` also packed (``pack_fp8_block_weights(w13, gated=True)``: faster on Hopper).
        w2: `[E, H, I]`, the dtype of ``w13``; with ``"fp8_block"`` also packed (``gated=False``).
        topk_weights: `[T, k]` routing weights.
        topk_ids: `[T, k]` int32 expert ids in ``[0, E)``; -1 skips a slot.
        quant: ``None``; ``"fp8_block"`` (DeepSeek-V3: activations quantized per token and 128 channels,
            weights per 128 x 128 block, ``w13_scale [E, 2I/128, H/128]``, ``w2_scale [E, H/128, I/128]``);
            ``"fp8_tensor"`` (one scale per expert, ``w13_scale``/``w2_scale`` `[E]`; activations per
            tensor, from ``a13_scale``/``a2_scale`` where given, else computed on the device); or ``"nvfp4"``
            (W4A16: ModelOpt NVFP4 weights ``w13`` `[E, 2I, H / 2]` and ``w2`` `[E, H, I / 2]` uint8 with E4M3
            block scales ``w13_scale`` `[E, 2I, H / 16]`, ``w2_scale`` `[E, H, I / 16]` and fp32 global scales
            ``w13_global_scale`` `[E]` or `[E, 2]` (gate, up) and ``w2_global_scale`` `[E]`; activations stay
            bf16/fp16; ``H`` and ``I`` multiples of 32; ``w13``/``w2`` also K-permuted by
            ``pack_nvfp4_weights``, faster on Hopper, where ``H`` and ``I`` are multiples of 64).
        w13_scale, w2_scale: weight scales as ``quant`` needs (float32).
        a13_scale, a2_scale: static per-tensor activation scales for ``"fp8_tensor"`` (e.g. a checkpoint's
            ``input_scale``), float32 one-element tensors (or positive finite floats).
        w13_global_scale, w2_global_scale: the NVFP4 global scales (``weight_scale_2``), with ``"nvfp4"`` only;
            checked positive and finite when ``validate``.
        activation: ``"silu"`` or ``"clamped_silu"`` (gpt-oss, with ``alpha`` and ``limit``: ``alpha`` finite,
            ``limit`` positive and finite).
        routed_scaling_factor: optional factor applied to the weighted sum, a positive finite float.
        validate: raise on ids outside ``[-1, E)`` (one host sync on a GPU, skipped under graph capture and
            torch.compile); ``False`` drops them silently, as :func:`moe_align_contiguous` does.
        out: optional `[T, H]` buffer of the dtype of ``hidden_states``.

    Returns:
        `[T, H]` in the dtype of ``hidden_states``.
    """
    hidden = _checks.tensor("hidden_states", hidden_states)
    _checks.ndim("hidden_states", hidden, 2, "[T, H]")
    _checks.dtype_in("hidden_states", hidden, FLOATS)
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if activation not in ("silu", "clamped_silu"):
        raise ValueError(f"activation must be 'silu' or 'clamped_silu', got {activation!r}")
    if quant == "nvfp4":
        gs = (w13_global_scale, w2_global_scale)
        num_experts, nv13, nv2 = gemm_nvfp4.check_moe_weights(hidden, w13, w2, w13_scale, w2_scale, *gs)
    else:
        for name, s in (("w13_global_scale", w13_global_scale), ("w2_global_scale", w2_global_scale)):
            if s is not None:
                raise ValueError(f"{name} applies to quant='nvfp4' only, got a tensor with quant={quant!r}")
        num_experts, _ = _check_weights(quant, hidden, w13, w2, w13_scale, w2_scale)
    if quant != "fp8_tensor" and (a13_scale is not None or a2_scale is not None):
        raise ValueError(f"a13_scale and a2_scale apply to quant='fp8_tensor' only, got quant={quant!r}")
    # The Python numbers, before any launch (the GEMMs and combine check them again where they are used);
    # a scale given as a tensor is not read, which would cost a host sync.
    for name, s in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
        if s is not None and not isinstance(s, torch.Tensor):
            _checks.positive_float(name, s, "a float or a float32 tensor")
    _checks.finite_float("alpha", alpha)
    _checks.positive_float("limit", limit)
    if routed_scaling_factor is not None:
        _checks.positive_float("routed_scaling_factor", routed_scaling_factor)
    for name, t in (("w13", w13), ("w2", w2), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        t = t.data if isinstance(t, PackedWeights) else t
        _checks.same_device(name, _checks.tensor(name, t), "hidden_states", hidden)
    out_dtype = hidden.dtype
    act = dict(activation=activation, alpha=alpha, limit=limit)

    if quant == "nvfp4" and validate:
        gemm_nvfp4.check_global_scale_values(w13_global_scale=nv13[2], w2_global_scale=nv2[2])
    layout = moe_align_contiguous(topk_ids, num_experts, 1, validate=validate)  # R = T * k rows, no padding
    if quant is None:
        a = permute(hidden.to(w13.dtype), layout)  # [R, H]
        h1 = gemm.grouped_gemm_bf16_contiguous(a, w13, layout, **act)  # [R, I]
        y = gemm.grouped_gemm_bf16_contiguous(h1, w2, layout)  # [R, H]
    elif quant == "nvfp4":
        a = permute(hidden if hidden.dtype != torch.float32 else hidden.to(torch.bfloat16), layout)  # [R, H]
        h1 = gemm_nvfp4.grouped_gemm_nvfp4_contiguous(a, *nv13, layout, validate=False, **act)  # [R, I]
        y = gemm_nvfp4.grouped_gemm_nvfp4_contiguous(h1, *nv2, layout, validate=False)  # [R, H]
    elif quant == "fp8_block":
        a, a_scale = permute_fp8_per_token_group(hidden, layout)  # [R, H], [R, H/128]
        q1, s1 = gemm.grouped_gemm_fp8_block_contiguous(a, a_scale, w13, w13_scale, layout, quantize_output=True, **act)
        y = gemm.grouped_gemm_fp8_block_contiguous(q1, s1, w2, w2_scale, layout)  # [R, H] bf16
    else:
        a, a_scale = permute_fp8_per_tensor(hidden, layout, a13_scale)  # [R, H], one scale
        # Rows that hold no pair (ids of -1) are not written by GEMM1: zero them, or their garbage would
        # enter the dynamic scale of GEMM2's input.
        h1 = (
            torch.zeros(layout.num_rows, w2.shape[2], dtype=torch.bfloat16, device=hidden.device)
            if a2_scale is None
            else None
        )
        h1 = gemm.grouped_gemm_fp8_tensor_contiguous(a, a_scale, w13, w13_scale, layout, out=h1, **act)  # [R, I]
        q1, s1 = quantize_fp8_per_tensor(h1, a2_scale)
        y = gemm.grouped_gemm_fp8_tensor_contiguous(q1, s1, w2, w2_scale, layout)
    return combine(y, topk_weights, layout, routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype, out=out)
