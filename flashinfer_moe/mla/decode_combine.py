"""The paged MLA decode's combine kernel: a sequence split across programs gets its output and LSE from the
pieces' partial outputs and LSEs (base 2), weighted by ``exp2(lse - max)``; sequences of one piece were written
directly by the attention kernel and are skipped. Launched by ``decode_kernel.py``."""

from __future__ import annotations

import triton
import triton.language as tl

_DL = tl.constexpr(512)  # the latent width
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def combine_kernel(
    sched_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    B,
    M,
    HQ,
    stride_o_b,
    stride_o_s,
    stride_o_h,
    stride_l_b,
    stride_l_s,
    stride_l_h,
    BLOCK_M: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    b = tl.program_id(0)
    mb = tl.program_id(1)
    splits = tl.load(sched_ptr + 2 + 2 * B + b)
    if splits > 1:
        first = tl.load(sched_ptr + 2 + 3 * B + b).to(tl.int64)
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        dl = tl.arange(0, _DL)
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for j in range(splits):
            m = tl.maximum(m, tl.load(part_lse_ptr + (first + j) * M + rows, mask=row_ok, other=float("-inf")))
        m_use = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, _DL], dtype=tl.float32)
        for j in range(splits):
            w = tl.exp2(tl.load(part_lse_ptr + (first + j) * M + rows, mask=row_ok, other=float("-inf")) - m_use)
            part = tl.load(part_out_ptr + ((first + j) * M + rows)[:, None] * _DL + dl[None, :], mask=row_ok[:, None])
            total += w
            acc += w[:, None] * part
        seen = total > 0.0
        o = acc / tl.where(seen, total, 1.0)[:, None]
        qi = rows // HQ
        qh = rows % HQ
        o_rows = b.to(tl.int64) * stride_o_b + qi.to(tl.int64) * stride_o_s + qh * stride_o_h
        tl.store(out_ptr + o_rows[:, None] + dl[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if HAS_LSE:
            lse = tl.where(seen, (m_use + tl.log2(tl.where(seen, total, 1.0))) * _LN2, float("-inf"))
            tl.store(lse_ptr + b * stride_l_b + qi * stride_l_s + qh * stride_l_h, lse, mask=row_ok)
