"""The attention of one sequence piece of the paged MLA decode (``decode_kernel.py``) with TMA tile loads, for
pools whose pages are token-major and contiguous (page stride = page * token stride; ``mla.decode.tma_layout``).

Viewed as `[P * page, W]`, a tile of ``BLOCK_N`` tokens that one page holds is the ``BLOCK_N`` rows from
``page_id * page + offset``: tensor-descriptor loads, which (unlike the gathered pointer loads) the compiler
software-pipelines through ``num_stages`` shared-memory buffers, and which the tensor cores read where they land
(no register staging). The page id of the next tile is read one iteration ahead and carried, so that the loads'
coordinates do not hang on a load of the same iteration (which costs the pipeliner a stage: one buffer fewer).
The latent is handled as two 256-column halves (the widest TMA box). ``SWAP`` (row blocks of 16 or 32) computes
the transposed products, so that the 64-token tile is the 64-wide M side of the Hopper tensor-core instruction
and the few query rows its N side. The masked tiles (tail, causal diagonal) use gathered masked loads: they
give zeros past the sequence directly (a TMA tile would need masking in registers; that variant also faulted on
an H200, not root-caused).

Imported only where a kernel is launched (never on the CPU path).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .decode_tile import D_LATENT, D_ROPE, softmax_step

HALF = D_LATENT // 2
_HALF = tl.constexpr(HALF)
_DR = tl.constexpr(D_ROPE)


@triton.jit
def _page_row(bt_row, t, tok_hi, PAGE: tl.constexpr):
    """Row of token ``t`` in the `[P * page, W]` view (0 past ``tok_hi``: the table row may end there)."""
    return tl.load(bt_row + t // PAGE, mask=t < tok_hi, other=0) * PAGE + t % PAGE


@triton.jit
def _fold_tiles(
    acc_a,
    acc_b,
    m_i,
    l_i,
    qa,
    qb,
    qp,
    ka,
    kb,
    kp,
    t,
    tok_hi,
    row_vis,
    nope_scale,
    pe_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    MIXED: tl.constexpr,
    UPCAST: tl.constexpr,
    SWAP: tl.constexpr,
):
    """The tile of tokens ``t ..`` (latent halves ``ka``, ``kb`` `[BLOCK_N, 256]`, rope ``kp`` `[BLOCK_N, 64]`, as
    stored) folded into the running ``(acc_a, acc_b, m_i, l_i)``."""
    ka = ka.to(qa.dtype)
    kb = kb.to(qa.dtype)
    kp = kp.to(qp.dtype)
    if SWAP:
        acc_a, acc_b, m_i, l_i = _fold_swapped(
            acc_a, acc_b, m_i, l_i, qa, qb, qp, ka, kb, kp, t, tok_hi, row_vis, nope_scale, pe_scale, BLOCK_N,
            MASKED, MIXED, UPCAST,
        )  # fmt: skip
    else:
        acc_a, acc_b, m_i, l_i = _fold_plain(
            acc_a, acc_b, m_i, l_i, qa, qb, qp, ka, kb, kp, t, tok_hi, row_vis, nope_scale, pe_scale, BLOCK_N,
            MASKED, MIXED, UPCAST,
        )  # fmt: skip
    return acc_a, acc_b, m_i, l_i


@triton.jit
def _fold_plain(
    acc_a,
    acc_b,
    m_i,
    l_i,
    qa,
    qb,
    qp,
    ka,
    kb,
    kp,
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
    """Scores `[BLOCK_M, BLOCK_N]`, accumulators `[BLOCK_M, 256]` (queries `[BLOCK_M, 256]`, `[BLOCK_M, 64]`)."""
    if MIXED:  # FP8 latent with a bf16/fp16 rope: the two parts have different scales
        s = (tl.dot(qa, tl.trans(ka)) + tl.dot(qb, tl.trans(kb))) * nope_scale + tl.dot(qp, tl.trans(kp)) * pe_scale
    else:
        s = tl.dot(qp, tl.trans(kp), acc=tl.dot(qb, tl.trans(kb), acc=tl.dot(qa, tl.trans(ka)))) * nope_scale
    p, alpha, m_new, l_i = softmax_step(s, m_i, l_i, t, tok_hi, row_vis, BLOCK_N, MASKED, 1)
    if UPCAST:
        acc_a = acc_a * alpha[:, None] + tl.dot(p, ka, input_precision="ieee")
        acc_b = acc_b * alpha[:, None] + tl.dot(p, kb, input_precision="ieee")
    else:
        acc_a = acc_a * alpha[:, None] + tl.dot(p.to(ka.dtype), ka)
        acc_b = acc_b * alpha[:, None] + tl.dot(p.to(kb.dtype), kb)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _fold_swapped(
    acc_a,
    acc_b,
    m_i,
    l_i,
    qa,
    qb,
    qp,
    ka,
    kb,
    kp,
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
    """``_fold_plain`` transposed, for few query rows: scores `[BLOCK_N, BLOCK_M]` and accumulators `[256,
    BLOCK_M]` (queries ``qa``, ``qb`` `[256, BLOCK_M]`, ``qp`` `[64, BLOCK_M]`), so the tile is the tensor cores'
    M side of both products and is read from shared memory as it landed, the rows being the narrow N side."""
    if MIXED:
        s = (tl.dot(ka, qa) + tl.dot(kb, qb)) * nope_scale + tl.dot(kp, qp) * pe_scale
    else:
        s = tl.dot(kp, qp, acc=tl.dot(kb, qb, acc=tl.dot(ka, qa))) * nope_scale
    p, alpha, m_new, l_i = softmax_step(s, m_i, l_i, t, tok_hi, row_vis, BLOCK_N, MASKED, 0)
    if UPCAST:
        acc_a = acc_a * alpha[None, :] + tl.dot(tl.trans(ka), p, input_precision="ieee")
        acc_b = acc_b * alpha[None, :] + tl.dot(tl.trans(kb), p, input_precision="ieee")
    else:
        acc_a = acc_a * alpha[None, :] + tl.dot(tl.trans(ka), p.to(ka.dtype))
        acc_b = acc_b * alpha[None, :] + tl.dot(tl.trans(kb), p.to(kb.dtype))
    return acc_a, acc_b, m_new, l_i


@triton.jit
def attend_tma(
    qn_rows,
    qp_rows,
    row_ok,
    ckv_desc,
    kpe_desc,
    ckv_ptr,
    kpe_ptr,
    stride_ckv_t,
    stride_kpe_t,
    bt_row,
    tok_lo,
    safe,
    tok_hi,
    row_vis,
    nope_scale,
    pe_scale,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIXED: tl.constexpr,
    UPCAST: tl.constexpr,
    SWAP: tl.constexpr,
):
    """``(acc [BLOCK_M, 512], m_i, l_i)`` over tokens ``tok_lo .. tok_hi`` (unmasked up to ``safe``) for the rows
    whose query pointers are ``qn_rows`` / ``qp_rows`` `[BLOCK_M]`; ``SWAP``: the transposed products."""
    dh = tl.arange(0, _HALF)
    dr = tl.arange(0, _DR)
    if SWAP:
        qa = tl.load(qn_rows[None, :] + dh[:, None], mask=row_ok[None, :], other=0.0)
        qb = tl.load(qn_rows[None, :] + _HALF + dh[:, None], mask=row_ok[None, :], other=0.0)
        qp = tl.load(qp_rows[None, :] + dr[:, None], mask=row_ok[None, :], other=0.0)
        acc_a = tl.zeros([_HALF, BLOCK_M], dtype=tl.float32)
    else:
        qa = tl.load(qn_rows[:, None] + dh[None, :], mask=row_ok[:, None], other=0.0)
        qb = tl.load(qn_rows[:, None] + _HALF + dh[None, :], mask=row_ok[:, None], other=0.0)
        qp = tl.load(qp_rows[:, None] + dr[None, :], mask=row_ok[:, None], other=0.0)
        acc_a = tl.zeros([BLOCK_M, _HALF], dtype=tl.float32)
    if UPCAST:
        qa, qb, qp = qa.to(tl.float32), qb.to(tl.float32), qp.to(tl.float32)
    acc_b = tl.zeros_like(acc_a)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    row = _page_row(bt_row, tok_lo, tok_hi, PAGE)
    for t in range(tok_lo, safe, BLOCK_N):
        row_next = _page_row(bt_row, t + BLOCK_N, tok_hi, PAGE)
        ka = ckv_desc.load([row, 0])
        kb = ckv_desc.load([row, _HALF])
        kp = kpe_desc.load([row, 0])
        acc_a, acc_b, m_i, l_i = _fold_tiles(
            acc_a, acc_b, m_i, l_i, qa, qb, qp, ka, kb, kp, t, tok_hi, row_vis, nope_scale, pe_scale, BLOCK_N, False,
            MIXED, UPCAST, SWAP,
        )  # fmt: skip
        row = row_next
    # The tail and the causal diagonal (a tile or two): masked pointer loads, zeros past the sequence, whose
    # slots in the page may hold anything (NaN) that a zero probability must not meet.
    for t in range(safe, tok_hi, BLOCK_N):
        n = t + tl.arange(0, BLOCK_N)
        ok = (n < tok_hi)[:, None]
        rows = tl.load(bt_row + t // PAGE).to(tl.int64) * PAGE + n % PAGE
        ka = tl.load(ckv_ptr + rows[:, None] * stride_ckv_t + dh[None, :], mask=ok, other=0.0)
        kb = tl.load(ckv_ptr + rows[:, None] * stride_ckv_t + _HALF + dh[None, :], mask=ok, other=0.0)
        kp = tl.load(kpe_ptr + rows[:, None] * stride_kpe_t + dr[None, :], mask=ok, other=0.0)
        acc_a, acc_b, m_i, l_i = _fold_tiles(
            acc_a, acc_b, m_i, l_i, qa, qb, qp, ka, kb, kp, t, tok_hi, row_vis, nope_scale, pe_scale, BLOCK_N, True,
            MIXED, UPCAST, SWAP,
        )  # fmt: skip
    if SWAP:
        acc = tl.reshape(tl.permute(tl.join(acc_a, acc_b), (1, 2, 0)), (BLOCK_M, 2 * _HALF))
    else:
        acc = tl.reshape(tl.permute(tl.join(acc_a, acc_b), (0, 2, 1)), (BLOCK_M, 2 * _HALF))
    return acc, m_i, l_i


def descriptors(ckv, kpe, block_n: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Descriptors of the latent `[P * page, 512]` (256-column boxes) and rope `[P * page, 64]` rows."""
    rows = ckv.shape[0] * ckv.shape[1]
    return (
        TensorDescriptor(ckv, [rows, D_LATENT], [ckv.stride(1), 1], [block_n, HALF]),
        TensorDescriptor(kpe, [rows, D_ROPE], [kpe.stride(1), 1], [block_n, D_ROPE]),
    )
