"""Top-k expert routing: softmax / sigmoid scoring, correction bias, group-limited selection.

Dimension legend: ``T`` tokens, ``E`` experts, ``G`` expert groups, ``k`` top-k.
"""

from __future__ import annotations

import ctypes

import torch

from flashinfer_moe import _checks, reference
from flashinfer_moe._ops import DTYPE_CODES, LIB, check_launch, kernel_library, on_device, stream_of
from flashinfer_moe.jit import KernelSpec, register

__all__ = ["route", "MAX_EXPERTS", "MAX_TOP_K", "MAX_EXPERT_GROUPS"]

# Limits of the fused kernel (csrc/routing/route.cu), applied on every device so that CPU and GPU accept
# the same inputs.
MAX_EXPERTS = 1024
MAX_TOP_K = 32
MAX_EXPERT_GROUPS = 32

# sm_80: the warp reductions (__reduce_max_sync, __reduce_min_sync: redux.sync).
SPEC = register(KernelSpec("routing", ("routing/route.cu",), min_arch="80"))

_vp, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "fim_route": (
        [_vp, _int, _i64, _vp, _vp, _vp, _int, _int, _int, _int, _int, _int, _int, _float, _vp],
        ctypes.c_int,
    )
}

LIB.define(
    "route_(Tensor router_logits, Tensor? correction_bias, Tensor(a!) topk_weights, Tensor(b!) topk_ids, "
    "int top_k, str scoring_func, bool renormalize, int num_expert_group, int topk_group, "
    "float routed_scaling_factor) -> ()"
)


def _route_cpu(logits, bias, weights_out, ids_out, top_k, scoring_func, renormalize, groups, topk_group, scale):
    weights, ids = reference.route(
        logits,
        top_k,
        scoring_func=scoring_func,
        renormalize=renormalize,
        num_expert_group=groups,
        topk_group=topk_group,
        correction_bias=bias,
        routed_scaling_factor=scale,
    )
    weights_out.copy_(weights)
    ids_out.copy_(ids)


def _route_cuda(logits, bias, weights_out, ids_out, top_k, scoring_func, renormalize, groups, topk_group, scale):
    lib = kernel_library("routing", _SIGNATURES)
    num_tokens, num_experts = logits.shape
    with on_device(logits):
        status = lib.fim_route(
            logits.data_ptr(),
            DTYPE_CODES[logits.dtype],
            logits.stride(0),
            bias.data_ptr() if bias is not None else None,
            weights_out.data_ptr(),
            ids_out.data_ptr(),
            num_tokens,
            num_experts,
            top_k,
            int(scoring_func == "sigmoid"),
            int(renormalize),
            groups,
            topk_group,
            scale,
            stream_of(logits),
        )
    check_launch(lib, status, "route")


def _route_fake(logits, bias, weights_out, ids_out, top_k, scoring_func, renormalize, groups, topk_group, scale):
    return None


LIB.impl("route_", _route_cpu, "CPU")
LIB.impl("route_", _route_cuda, "CUDA")
torch.library.register_fake("flashinfer_moe::route_", _route_fake, lib=LIB)


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
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the top-k experts of every token and their weights, in one fused kernel on a GPU.

    Scores are ``softmax`` or ``sigmoid`` of the logits in fp32. Without ``correction_bias`` the k
    highest-scoring experts are chosen; with it, experts are chosen on ``score + bias`` but weighted by the
    unbiased score (DeepSeek-V3, Kimi-K2). With groups, each group is scored by its best score (no bias)
    or by the sum of its two best biased scores, only the ``topk_group`` best groups stay eligible, and the
    k experts are chosen among theirs. ``renormalize`` divides the k weights by their sum: sigmoid weights
    as ``w / (sum + 1e-20)`` (DeepSeek-V3's and SGLang's formula, so a token whose k scores all underflow to
    0 gets zero weights, not NaN), softmax weights as ``w / sum`` (SGLang's softmax top-k); then
    ``routed_scaling_factor`` multiplies them. The sigmoid is computed without premature underflow
    (``exp(x) / (1 + exp(x))`` for x < 0): finite or +-inf logits give finite sigmoid weights. Columns
    come in descending selection order; ties go to the lower expert (and group) index. Llama4 routing is
    ``scoring_func="sigmoid", renormalize=False``. NaN logits give unspecified ids.

    Args:
        router_logits: `[T, E]` float32, float16 or bfloat16; rows may be strided, columns must be dense.
        top_k: experts per token, 1 <= k <= min(E, 32).
        scoring_func: ``"softmax"`` or ``"sigmoid"``.
        renormalize: divide the k weights by their sum (sigmoid: by their sum + 1e-20).
        num_expert_group: ``G``, groups of E/G consecutive experts (1 <= G <= 32, E % G == 0); None: no groups.
        topk_group: groups kept, 1 <= topk_group <= G; required with ``num_expert_group``.
        correction_bias: `[E]` float tensor on the logits' device, added for selection only.
        routed_scaling_factor: multiplies the final weights; None means 1.
        out: optional preallocated ``(topk_weights [T, k] float32, topk_ids [T, k] int32)``.

    Returns:
        ``(topk_weights [T, k] float32, topk_ids [T, k] int32)``.
    """
    logits = _checks.tensor("router_logits", router_logits)
    _checks.ndim("router_logits", logits, 2, "[num_tokens, num_experts]")
    _checks.dtype_in("router_logits", logits, (torch.float32, torch.float16, torch.bfloat16))
    _checks.unit_last_stride("router_logits", logits)
    num_tokens, num_experts = logits.shape
    _checks.integer("router_logits.shape[1] (num_experts)", num_experts, 1, MAX_EXPERTS)
    _checks.integer("top_k", top_k, 1, min(num_experts, MAX_TOP_K))
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")

    groups, kept_groups = 1, 1
    if num_expert_group is None:
        if topk_group is not None:
            raise ValueError(f"topk_group must be None without num_expert_group, got {topk_group}")
    else:
        groups = _checks.integer("num_expert_group", num_expert_group, 1, MAX_EXPERT_GROUPS)
        if num_experts % groups != 0:
            raise ValueError(
                f"num_expert_group must divide the number of experts {num_experts}, got {num_expert_group}"
            )
        if topk_group is None:
            raise ValueError("topk_group must be given with num_expert_group, got None")
        kept_groups = _checks.integer("topk_group", topk_group, 1, groups)
        eligible = kept_groups * (num_experts // groups)
        if top_k > eligible:
            raise ValueError(f"top_k must be <= topk_group * experts per group = {eligible}, got {top_k}")

    bias = None
    if correction_bias is not None:
        bias = _checks.tensor("correction_bias", correction_bias)
        if bias.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"correction_bias must be a float tensor, got {bias.dtype}")
        if tuple(bias.shape) != (num_experts,):
            raise ValueError(f"correction_bias must have shape ({num_experts},), got {tuple(bias.shape)}")
        _checks.same_device("correction_bias", bias, "router_logits", logits)
        bias = bias.float().contiguous()

    scale = 1.0
    if routed_scaling_factor is not None:
        scale = _checks.positive_float("routed_scaling_factor", routed_scaling_factor)

    if out is None:
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)  # [T, k]
        ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)  # [T, k]
    else:
        weights, ids = _check_out(out, num_tokens, top_k, logits)

    torch.ops.flashinfer_moe.route_(
        logits, bias, weights, ids, top_k, scoring_func, renormalize, groups, kept_groups, scale
    )
    return weights, ids


def _check_out(out, num_tokens: int, top_k: int, logits: torch.Tensor):
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError("out must be a (topk_weights, topk_ids) pair of tensors")
    weights = _checks.tensor("out[0] (topk_weights)", out[0])
    ids = _checks.tensor("out[1] (topk_ids)", out[1])
    for name, t, dtype in (("out[0] (topk_weights)", weights, torch.float32), ("out[1] (topk_ids)", ids, torch.int32)):
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
        if tuple(t.shape) != (num_tokens, top_k):
            raise ValueError(f"{name} must have shape ({num_tokens}, {top_k}), got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        _checks.same_device(name, t, "router_logits", logits)
    return weights, ids
