"""The gathered-load path's pieces of the paged MLA decode (``decode_kernel.py``): one tile of cached tokens
loaded through the block table (any page size), and one loaded tile folded into the running online-softmax state.

Imported only where a kernel is launched (never on the CPU path), like ``decode_kernel.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

D_LATENT = 512
D_ROPE = 64
_DL = tl.constexpr(D_LATENT)
_DR = tl.constexpr(D_ROPE)


@triton.jit
def load_tile(
    ckv_ptr,
    kpe_ptr,
    bt_row,
    t,
    tok_hi,
    stride_ckv_p,
    stride_ckv_t,
    stride_kpe_p,
    stride_kpe_t,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The cached tokens ``t .. t + BLOCK_N`` as stored: latent `[512, BLOCK_N]` and rope `[64, BLOCK_N]`
    (transposed: the scores' B operand as it is; the values are its transpose)."""
    n = t + tl.arange(0, BLOCK_N)
    dl = tl.arange(0, _DL)
    dr = tl.arange(0, _DR)
    in_range = n < tok_hi
    if PAGE >= BLOCK_N:  # one page holds the tile
        page = tl.load(bt_row + t // PAGE).to(tl.int64)
        slot = (n % PAGE).to(tl.int64)
        ckv_rows = page * stride_ckv_p + slot * stride_ckv_t
        kpe_rows = page * stride_kpe_p + slot * stride_kpe_t
    else:
        if MASKED:
            pages = tl.load(bt_row + n // PAGE, mask=in_range, other=0).to(tl.int64)
        else:
            pages = tl.load(bt_row + n // PAGE).to(tl.int64)
        slot = (n % PAGE).to(tl.int64)
        ckv_rows = pages * stride_ckv_p + slot * stride_ckv_t
        kpe_rows = pages * stride_kpe_p + slot * stride_kpe_t
    if MASKED:
        ckv_t = tl.load(ckv_ptr + ckv_rows[None, :] + dl[:, None], mask=in_range[None, :], other=0.0)
        kpe_t = tl.load(kpe_ptr + kpe_rows[None, :] + dr[:, None], mask=in_range[None, :], other=0.0)
    else:
        ckv_t = tl.load(ckv_ptr + ckv_rows[None, :] + dl[:, None])
        kpe_t = tl.load(kpe_ptr + kpe_rows[None, :] + dr[:, None])
    return ckv_t, kpe_t


@triton.jit
def softmax_step(s, m_i, l_i, t, tok_hi, row_vis, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, AXIS: tl.constexpr):
    """One tile's scores ``s`` (the tokens along ``AXIS``: `[BLOCK_M, BLOCK_N]` with 1, `[BLOCK_N, BLOCK_M]` with
    0), masked past each row's visible tokens where ``MASKED``, folded into the online softmax in base 2:
    ``(p, alpha, m_new, l_new)``. A row that has seen nothing yet keeps its maximum at 0."""
    if MASKED:
        n = t + tl.arange(0, BLOCK_N)
        vis = tl.minimum(row_vis, tok_hi)
        if AXIS == 1:
            s = tl.where(n[None, :] < vis[:, None], s, float("-inf"))
        else:
            s = tl.where(n[:, None] < vis[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - tl.expand_dims(m_use, AXIS))
    return p, alpha, m_new, l_i * alpha + tl.sum(p, AXIS)


@triton.jit
def fold(
    acc,
    m_i,
    l_i,
    qn,
    qp,
    ckv_t,
    kpe_t,
    t,
    tok_hi,
    row_vis,
    nope_scale,
    pe_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    MIXED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One loaded tile folded into the running ``(acc, m_i, l_i)``."""
    ckv_t = ckv_t.to(qn.dtype)
    kpe_t = kpe_t.to(qp.dtype)
    if MIXED:  # FP8 latent with a bf16/fp16 rope: the two parts have different scales
        s = tl.dot(qn, ckv_t) * nope_scale + tl.dot(qp, kpe_t) * pe_scale
    else:
        s = tl.dot(qp, kpe_t, acc=tl.dot(qn, ckv_t)) * nope_scale
    p, alpha, m_new, l_i = softmax_step(s, m_i, l_i, t, tok_hi, row_vis, BLOCK_N, MASKED, 1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, tl.trans(ckv_t), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(ckv_t.dtype), tl.trans(ckv_t))
    return acc, m_new, l_i
