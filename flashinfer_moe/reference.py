"""Plain-torch versions of every op: the oracle the kernels are tested against, and the CPU path.

They favour clarity over speed, and fix the conventions the kernels must reproduce exactly (selection
order, tie-breaking, rounding). Routing lives here; quantization formats in ``reference_quant``, the
expert-major layouts, permute and combine in ``reference_layout``, and the grouped GEMMs and the whole MoE in
``reference_gemm``, all re-exported here so that this one
module is the oracle. Inputs are assumed validated by the public wrappers.

Dimension legend: ``T`` tokens, ``E`` experts, ``G`` expert groups, ``k`` top-k.
"""

from __future__ import annotations

import torch

from .reference_gemm import activation, dequantize_activations, dequantize_weights, fused_moe, grouped_gemm
from .reference_layout import (
    combine,
    moe_align_contiguous,
    moe_align_masked,
    permute,
    permute_fp8_per_tensor,
    permute_fp8_per_token_group,
    permute_nvfp4,
)
from .reference_quant import (
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    pack_nibbles,
    quantize_fp8_block_weights,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token_group,
    quantize_nvfp4,
    unpack_nibbles,
)

__all__ = [
    "activation",
    "combine",
    "dequantize_activations",
    "dequantize_weights",
    "fused_moe",
    "grouped_gemm",
    "dequantize_fp8_block",
    "dequantize_fp8_per_token_group",
    "dequantize_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "moe_align_contiguous",
    "moe_align_masked",
    "pack_nibbles",
    "permute",
    "permute_fp8_per_tensor",
    "permute_fp8_per_token_group",
    "permute_nvfp4",
    "quantize_fp8_block_weights",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token_group",
    "quantize_nvfp4",
    "route",
    "stable_topk_indices",
    "unpack_nibbles",
]


def stable_topk_indices(values: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ``k`` largest entries along the last dimension, largest first, ties to the lower index.

    Args:
        values: `[..., N]` float.
        k: how many to keep.
        allowed: optional `[..., N]` bool; entries that are not allowed are ranked after every allowed one.

    Returns:
        `[..., k]` int64 indices.
    """
    # +0.0 folds -0.0 into +0.0 so that the two tie, as they do in the kernels' integer ordering.
    order = torch.sort(values + 0.0, dim=-1, descending=True, stable=True).indices
    if allowed is not None:
        allowed_in_order = allowed.gather(-1, order).to(torch.int8)
        regroup = torch.sort(allowed_in_order, dim=-1, descending=True, stable=True).indices
        order = order.gather(-1, regroup)
    return order[..., :k]


def route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference top-k routing; see :func:`flashinfer_moe.route` for the semantics.

    Returns:
        ``(topk_weights [T, k] float32, topk_ids [T, k] int32)``.
    """
    logits = router_logits.float()  # [T, E]
    num_tokens, num_experts = logits.shape
    if scoring_func == "softmax":
        shifted = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        scores = shifted / shifted.sum(dim=-1, keepdim=True)
    elif scoring_func == "sigmoid":
        # (x >= 0 ? 1 : e) / (1 + e) with e = exp(-|x|): for x < 0 it is exp(x) / (1 + exp(x)), which does not
        # underflow to 0 before exp(x) does (x < -103), where 1 / (1 + exp(-x)) is 0 below -88.7. Spelled out
        # (not torch.sigmoid) so that on a GPU the bits equal the kernel's same expression.
        e = torch.exp(-logits.abs())
        scores = torch.where(logits >= 0, torch.ones_like(e), e) / (1.0 + e)
    else:
        raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")

    # Without a bias the scores are monotone in the logits: select on the logits (no rounding ties).
    keys = logits if correction_bias is None else scores + correction_bias.float()  # [T, E]

    allowed = None
    if num_expert_group is not None and num_expert_group > 1:
        groups = num_expert_group
        group_size = num_experts // groups
        grouped = keys.view(num_tokens, groups, group_size)  # [T, G, E/G]
        if correction_bias is None or group_size < 2:
            group_scores = grouped.amax(dim=-1)
        else:
            best_two = grouped.gather(-1, stable_topk_indices(grouped, 2))
            group_scores = best_two[..., 0] + best_two[..., 1]
        kept = stable_topk_indices(group_scores, topk_group)  # [T, topk_group]
        group_allowed = torch.zeros(num_tokens, groups, dtype=torch.bool, device=logits.device)
        group_allowed.scatter_(1, kept, True)
        allowed = group_allowed.repeat_interleave(group_size, dim=1)  # [T, E]

    ids = stable_topk_indices(keys, top_k, allowed)  # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)  # [T, 1]
        if scoring_func == "sigmoid":
            # w / (sum + 1e-20), as DeepSeek-V3 and SGLang: k scores that all underflow give 0, not 0 / 0.
            total = total + 1e-20
        weights = weights / total
    if routed_scaling_factor is not None:
        weights = weights * routed_scaling_factor
    return weights.float(), ids.to(torch.int32)
