"""Merging two partial attentions by their LSEs (``merge_attn_states``): the attention over a prefix and over
the new tokens, or two split-KV halves, combined into the attention over both key sets."""

from __future__ import annotations

import torch

from flashinfer_moe import _checks
from flashinfer_moe import reference_mla as ref
from flashinfer_moe._ops import LIB, on_device

__all__ = ["merge_attn_states"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

LIB.define(
    "mla_merge_attn_states_(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, Tensor(a!) out, "
    "Tensor(b!) out_lse) -> ()"
)


def _merge_cpu(out_a, lse_a, out_b, lse_b, out, out_lse):
    o, l = ref.merge_attn_states(out_a, lse_a, out_b, lse_b, dtype=torch.float32)
    out.copy_(o)
    out_lse.copy_(l)


def _merge_cuda(out_a, lse_a, out_b, lse_b, out, out_lse):
    from . import prefill_kernel

    with on_device(out_a):
        prefill_kernel.launch_merge(out_a, lse_a, out_b, lse_b, out, out_lse)


LIB.impl("mla_merge_attn_states_", _merge_cpu, "CPU")
LIB.impl("mla_merge_attn_states_", _merge_cuda, "CUDA")
torch.library.register_fake("flashinfer_moe::mla_merge_attn_states_", lambda *args: None, lib=LIB)


def _state(name: str, out: object, lse_name: str, lse: object, like: torch.Tensor | None):
    out = _checks.tensor(name, out)
    lse = _checks.tensor(lse_name, lse)
    _checks.dtype_in(name, out, DTYPES)
    _checks.dtype_in(lse_name, lse, (torch.float32,))
    if out.dim() != 3:
        raise ValueError(f"{name} must have shape [T, H, D], got {tuple(out.shape)}")
    if tuple(lse.shape) != tuple(out.shape[:2]):
        raise ValueError(f"{lse_name} must have shape [T, H] = {tuple(out.shape[:2])}, got {tuple(lse.shape)}")
    if like is not None:
        if out.dtype != like.dtype:
            raise TypeError(f"{name} must have out_a's dtype ({like.dtype}), got {out.dtype}")
        if out.shape != like.shape:
            raise ValueError(f"{name} must have out_a's shape {tuple(like.shape)}, got {tuple(out.shape)}")
        _checks.same_device(name, out, "out_a", like)
    _checks.same_device(lse_name, lse, name, out)
    _checks.unit_last_stride(name, out)
    return out, lse


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two disjoint key sets from the attentions over each.

    With ``m = max(lse_a, lse_b)``, ``w_x = exp(lse_x - m)``: ``out = (w_a out_a + w_b out_b) / (w_a + w_b)``
    and ``lse = m + log(w_a + w_b)``, in fp32. A side whose LSE is -inf (no keys, e.g. an empty prefix) weighs
    nothing and its ``out`` rows are not read, so they may hold anything; both sides -inf give 0 and -inf. One
    Triton kernel, no allocation with ``out``/``out_lse`` given.

    Args:
        out_a: `[T, H, D]` float32/float16/bfloat16 (any ``D``; unit channel stride, any token/head strides).
        lse_a: `[T, H]` float32, natural log.
        out_b: `[T, H, D]`, ``out_a``'s dtype.
        lse_b: `[T, H]` float32.
        out: optional `[T, H, D]` buffer of ``out_a``'s dtype.
        out_lse: optional `[T, H]` float32 buffer.

    Returns:
        ``(out [T, H, D], lse [T, H] float32)``.
    """
    out_a, lse_a = _state("out_a", out_a, "lse_a", lse_a, None)
    out_b, lse_b = _state("out_b", out_b, "lse_b", lse_b, out_a)
    if out is None:
        out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    if out_lse is None:
        out_lse = torch.empty(lse_a.shape, dtype=torch.float32, device=out_a.device)
    out, out_lse = _state("out", out, "out_lse", out_lse, out_a)
    if out.numel() or out_lse.numel():
        torch.ops.flashinfer_moe.mla_merge_attn_states_(out_a, lse_a, out_b, lse_b, out, out_lse)
    return out, out_lse
