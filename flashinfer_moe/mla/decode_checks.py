"""Argument checks of the paged MLA decode (``decode.py``): every bad argument gets a ``ValueError`` or
``TypeError`` naming it, the expectation and what it got. Dimension legend as in ``decode.py``."""

from __future__ import annotations

import torch

from flashinfer_moe import _checks
from flashinfer_moe import reference_mla as ref

FP8 = torch.float8_e4m3fn

Q_DTYPES = (torch.bfloat16, torch.float16)
PAGE_SIZES = (1, 16, 32, 64, 128)
MAX_S_Q = 8
D_LATENT, D_ROPE = ref.LATENT, ref.ROPE


def seq_lens_arg(seq_lens: object) -> torch.Tensor:
    seq_lens = _checks.tensor("seq_lens", seq_lens)
    _checks.ndim("seq_lens", seq_lens, 1, "[B]")
    _checks.dtype_in("seq_lens", seq_lens, (torch.int32,))
    if seq_lens.shape[0] == 0:
        raise ValueError("seq_lens must hold at least one sequence, got shape (0,)")
    return seq_lens.contiguous()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def queries(q_nope: object, q_pe: object) -> tuple[torch.Tensor, torch.Tensor]:
    q_nope = _checks.tensor("q_nope", q_nope)
    _checks.ndim("q_nope", q_nope, 4, "[B, s_q, Hq, 512]")
    _checks.dtype_in("q_nope", q_nope, Q_DTYPES)
    batch, s_q, heads, width = q_nope.shape
    if width != D_LATENT:
        raise ValueError(f"q_nope must have head dim 512 (the latent width), got shape {tuple(q_nope.shape)}")
    if not 1 <= s_q <= MAX_S_Q:
        raise ValueError(f"q_nope must have 1 <= s_q <= {MAX_S_Q} new tokens (dim 1), got shape {tuple(q_nope.shape)}")
    if batch == 0 or heads == 0:
        raise ValueError(f"q_nope must have at least one sequence and head, got shape {tuple(q_nope.shape)}")
    _checks.unit_last_stride("q_nope", q_nope)
    q_pe = _checks.tensor("q_pe", q_pe)
    _checks.ndim("q_pe", q_pe, 4, "[B, s_q, Hq, 64]")
    if tuple(q_pe.shape) != (batch, s_q, heads, D_ROPE):
        raise ValueError(f"q_pe must have shape {(batch, s_q, heads, D_ROPE)} (rope dim 64), got {tuple(q_pe.shape)}")
    if q_pe.dtype != q_nope.dtype:
        raise TypeError(f"q_pe must have the dtype of q_nope ({_name(q_nope.dtype)}), got {_name(q_pe.dtype)}")
    _checks.same_device("q_pe", q_pe, "q_nope", q_nope)
    _checks.unit_last_stride("q_pe", q_pe)
    return q_nope, q_pe


def caches(kv_cache: object, kpe_cache: object, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ckv, kpe)``: the latent pages (whose first 512 columns the kernel reads) and the rope pages (a view
    of ``kv_cache``'s last 64 columns for the one-tensor layout)."""
    kv_cache = _checks.tensor("kv_cache", kv_cache)
    _checks.ndim("kv_cache", kv_cache, 3, "[P, page, 576] or [P, page, 512]")
    _checks.dtype_in("kv_cache", kv_cache, (q.dtype, FP8))
    _checks.same_device("kv_cache", kv_cache, "q_nope", q)
    num_pages, page, width = kv_cache.shape
    if page not in PAGE_SIZES:
        raise ValueError(f"kv_cache must have a page size (dim 1) in {PAGE_SIZES}, got shape {tuple(kv_cache.shape)}")
    if num_pages == 0:
        raise ValueError(f"kv_cache must hold at least one page, got shape {tuple(kv_cache.shape)}")
    want = D_LATENT + D_ROPE if kpe_cache is None else D_LATENT
    if width != want:
        layout = "[P, page, 576] (no kpe_cache)" if kpe_cache is None else "[P, page, 512] (with kpe_cache)"
        raise ValueError(f"kv_cache must be {layout}, got shape {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be contiguous in its last dimension, got strides {tuple(kv_cache.stride())}")
    if kpe_cache is None:
        return kv_cache, kv_cache[..., D_LATENT:]
    kpe_cache = _checks.tensor("kpe_cache", kpe_cache)
    _checks.ndim("kpe_cache", kpe_cache, 3, "[P, page, 64]")
    if tuple(kpe_cache.shape) != (num_pages, page, D_ROPE):
        raise ValueError(f"kpe_cache must have shape {(num_pages, page, D_ROPE)}, got {tuple(kpe_cache.shape)}")
    allowed = (kv_cache.dtype, q.dtype) if kv_cache.dtype == FP8 else (kv_cache.dtype,)
    _checks.dtype_in("kpe_cache", kpe_cache, allowed)
    _checks.same_device("kpe_cache", kpe_cache, "q_nope", q)
    if kpe_cache.stride(-1) != 1:
        raise ValueError(f"kpe_cache must be contiguous in its last dimension, got strides {tuple(kpe_cache.stride())}")
    return kv_cache, kpe_cache


def table(block_table: object, seq_lens: object, q: torch.Tensor, page: int, validate: bool):
    block_table = _checks.tensor("block_table", block_table)
    _checks.ndim("block_table", block_table, 2, "[B, max_pages]")
    _checks.dtype_in("block_table", block_table, (torch.int32,))
    _checks.same_device("block_table", block_table, "q_nope", q)
    batch = q.shape[0]
    if block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(f"block_table must have shape ({batch}, max_pages >= 1), got {tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table must be contiguous in its last dimension, got {tuple(block_table.stride())}")
    seq_lens = seq_lens_arg(seq_lens)
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have shape ({batch},) (B of q_nope), got {tuple(seq_lens.shape)}")
    _checks.same_device("seq_lens", seq_lens, "q_nope", q)
    # Reading values costs a host sync on a GPU: there, only on request.
    if validate or not seq_lens.is_cuda:
        capacity = block_table.shape[1] * page
        longest = int(seq_lens.max())
        if longest > capacity:
            raise ValueError(
                f"seq_lens must fit the block table ({block_table.shape[1]} pages of {page} = {capacity} tokens), "
                f"got a sequence of {longest}"
            )
    return block_table, seq_lens


def scale(kv_scale: object, fp8: bool, q: torch.Tensor) -> tuple[torch.Tensor | None, float]:
    if not fp8:
        return None, 1.0  # bf16/fp16 pages have no scale; a caller's 1.0 (or any value) is not applied
    if kv_scale is None:
        raise ValueError(
            "kv_scale must be given for an FP8 kv_cache (real = stored * kv_scale; 1.0 for none), got None"
        )
    if isinstance(kv_scale, torch.Tensor):
        _checks.dtype_in("kv_scale", kv_scale, (torch.float32,))
        _checks.same_device("kv_scale", kv_scale, "q_nope", q)
        if kv_scale.numel() != 1:
            raise ValueError(f"kv_scale must hold one value, got shape {tuple(kv_scale.shape)}")
        return kv_scale.reshape(1), 1.0
    return None, _checks.positive_float("kv_scale", kv_scale, "a float or a float32 tensor")


def outputs(out: object, lse: object, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    batch, s_q, heads, _ = q.shape
    if out is None:
        out = torch.empty(batch, s_q, heads, D_LATENT, dtype=q.dtype, device=q.device)
    else:
        out = _checks.tensor("out", out)
        if tuple(out.shape) != (batch, s_q, heads, D_LATENT) or out.dtype != q.dtype:
            raise ValueError(
                f"out must be {_name(q.dtype)} of shape {(batch, s_q, heads, D_LATENT)}, "
                f"got {_name(out.dtype)} {tuple(out.shape)}"
            )
        _checks.same_device("out", out, "q_nope", q)
        _checks.unit_last_stride("out", out)
    if lse is not None:
        lse = _checks.tensor("lse", lse)
        if tuple(lse.shape) != (batch, s_q, heads) or lse.dtype != torch.float32:
            raise ValueError(
                f"lse must be float32 of shape {(batch, s_q, heads)}, got {_name(lse.dtype)} {tuple(lse.shape)}"
            )
        _checks.same_device("lse", lse, "q_nope", q)
    return out, lse
