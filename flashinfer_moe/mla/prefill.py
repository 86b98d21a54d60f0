"""MLA prefill over the new tokens (``mla_prefill``): causal attention of each sequence of a ragged batch over
itself in the non-absorbed form, q/k head dim 192 (128 nope + 64 rope), value head dim 128.

The cached prefix of a sequence (chunked prefill, prefix caching) is attended separately, in the absorbed
form over the paged latent cache, and merged by LSE (``merge_attn_states``); ``MLAAttention.prefill`` does
both. Dimension legend: ``T`` new tokens, ``B`` sequences, ``Hq`` heads.
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks
from flashinfer_moe import reference_mla as ref
from flashinfer_moe._ops import LIB, on_device

__all__ = ["mla_prefill"]

QK_DIM, V_DIM = ref.NOPE + ref.ROPE, ref.V_DIM
DTYPES = (torch.bfloat16, torch.float16)
MAX_BATCH = 65535  # the kernel's grid z dimension

LIB.define(
    "mla_prefill_(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor(a!) out, Tensor(b!) lse, float sm_scale, "
    "int max_seqlen, bool causal) -> ()"
)


def _prefill_cpu(q, k, v, cu_seqlens, out, lse, sm_scale, max_seqlen, causal):
    o, l = ref.prefill_attention(q, k, v, cu_seqlens, sm_scale, causal, dtype=torch.float32)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        covered[start:end] = True
    out[covered] = o[covered].to(out.dtype)
    lse[covered] = l[covered]


def _prefill_cuda(q, k, v, cu_seqlens, out, lse, sm_scale, max_seqlen, causal):
    from . import prefill_kernel

    with on_device(q):
        prefill_kernel.launch(q, k, v, cu_seqlens, out, lse, sm_scale, max_seqlen, causal)


LIB.impl("mla_prefill_", _prefill_cpu, "CPU")
LIB.impl("mla_prefill_", _prefill_cuda, "CUDA")
torch.library.register_fake("flashinfer_moe::mla_prefill_", lambda *args: None, lib=LIB)


def _heads(name: str, x: object, dim: int, like: torch.Tensor | None) -> torch.Tensor:
    x = _checks.tensor(name, x)
    _checks.dtype_in(name, x, DTYPES)
    if x.dim() != 3 or x.shape[2] != dim:
        raise ValueError(f"{name} must have shape [T, Hq, {dim}], got {tuple(x.shape)}")
    if like is not None:
        if x.dtype != like.dtype:
            raise TypeError(f"{name} must have q's dtype ({like.dtype}), got {x.dtype}")
        if x.shape[:2] != like.shape[:2]:
            raise ValueError(f"{name} must have q's [T, Hq] = {tuple(like.shape[:2])}, got {tuple(x.shape)}")
        _checks.same_device(name, x, "q", like)
    _checks.unit_last_stride(name, x)
    return x


def check_cu_seqlens(cu_seqlens: object, max_seqlen: object, tokens: int, like: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` `[B + 1]` int32 on ``like``'s device, and ``max_seqlen`` an int. On CPU tensors (no sync
    needed) also its values: starts at 0, non-decreasing, ends at ``T``, no sequence longer than
    ``max_seqlen``. On a GPU these are the caller's promise, as in flash-attn: a longer sequence leaves its
    rows past ``max_seqlen`` unwritten, and rows past ``cu_seqlens[-1]`` are never written."""
    cu_seqlens = _checks.tensor("cu_seqlens", cu_seqlens)
    _checks.dtype_in("cu_seqlens", cu_seqlens, (torch.int32,))
    if cu_seqlens.dim() != 1 or not 2 <= cu_seqlens.shape[0] <= MAX_BATCH + 1:
        raise ValueError(
            f"cu_seqlens must have shape [B + 1] with 1 <= B <= {MAX_BATCH}, got {tuple(cu_seqlens.shape)}"
        )
    _checks.same_device("cu_seqlens", cu_seqlens, "q", like)
    max_seqlen = _checks.integer("max_seqlen", max_seqlen, 0)
    if cu_seqlens.device.type == "cpu":
        lengths = cu_seqlens.diff()
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != tokens or bool((lengths < 0).any()):
            raise ValueError(
                f"cu_seqlens must rise from 0 to T = {tokens} without decreasing, got {cu_seqlens.tolist()}"
            )
        if int(lengths.max()) > max_seqlen:
            raise ValueError(f"max_seqlen must be >= the longest sequence ({int(lengths.max())}), got {max_seqlen}")
    return cu_seqlens.contiguous()


def _out_buffer(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor):
    t = _checks.tensor(name, t)
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    _checks.same_device(name, t, "q", like)
    _checks.unit_last_stride(name, t)
    return t


def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    sm_scale: float,
    *,
    causal: bool = True,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each sequence's new tokens over themselves (MLA non-absorbed form), ragged batch.

    Token ``i`` of a sequence sees tokens ``0..i`` of the same sequence (``causal``), or all of it. One Triton
    kernel; no host sync (``max_seqlen`` sizes the grid), no allocation with ``out`` and ``lse`` given.

    Args:
        q: `[T, Hq, 192]` bfloat16/float16, channels 0..127 the nope part, 128..191 the rope part.
        k: `[T, Hq, 192]`, ``q``'s dtype (keys; the shared rope part repeated per head).
        v: `[T, Hq, 128]`, ``q``'s dtype.
            Any token and head strides, unit channel stride (slices of a fused projection's output work).
        cu_seqlens: `[B + 1]` int32, sequence ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b + 1]``.
        max_seqlen: an int >= the longest sequence (unchecked on a GPU, where it would cost a sync).
        sm_scale: softmax scale (DeepSeek: ``192 ** -0.5`` times the YaRN ``mscale ** 2``).
        causal: causal mask within each sequence.
        out: optional `[T, Hq, 128]` buffer of ``q``'s dtype (unit channel stride).
        lse: optional `[T, Hq]` float32 buffer (unit head stride).

    Returns:
        ``(out [T, Hq, 128], lse [T, Hq] float32)``, the LSE of the scaled scores in natural log.
    """
    q = _heads("q", q, QK_DIM, None)
    k = _heads("k", k, QK_DIM, q)
    v = _heads("v", v, V_DIM, q)
    t, h = q.shape[:2]
    cu_seqlens = check_cu_seqlens(cu_seqlens, max_seqlen, t, q)
    sm_scale = _checks.positive_float("sm_scale", sm_scale)
    out = torch.empty(t, h, V_DIM, dtype=q.dtype, device=q.device) if out is None else out
    out = _out_buffer("out", out, (t, h, V_DIM), q.dtype, q)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device) if lse is None else lse
    lse = _out_buffer("lse", lse, (t, h), torch.float32, q)
    if t and h and max_seqlen:
        torch.ops.flashinfer_moe.mla_prefill_(q, k, v, cu_seqlens, out, lse, sm_scale, max_seqlen, bool(causal))
    return out, lse
