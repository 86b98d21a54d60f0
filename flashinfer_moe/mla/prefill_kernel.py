"""The Triton kernels of the MLA prefill: the flash-attention forward behind ``mla_prefill`` (the non-absorbed
form: q/k head dim 192 = 128 nope + 64 rope, two ``tl.dot`` of power-of-two widths; value head dim 128; ragged
batch; causal) and the LSE merge behind ``merge_attn_states``.

Each program owns one `[BLOCK_M, 128]` output tile of one (sequence, head). The grid is the static bound
``(cdiv(max_seqlen, BLOCK_M), Hq, B)``, so no host sync finds the tiles; a program past its sequence's end
returns at once. Programs are issued longest-first (the last row block of a causal sequence has the most
keys), which keeps the tail of the grid short. The key loop runs unmasked over the blocks wholly below the
tile's diagonal and stops after the diagonal block (causal), masked only there and at the sequence end.
Softmax online, in base 2 (``exp2`` of ``s * sm_scale * log2 e``).

Imported only where a kernel is launched (never on the CPU path), so that ``TRITON_INTERPRET=1`` can be
set before the first import to run the kernel on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NOPE, ROPE, V_DIM = 128, 64, 128
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape and pipeline of the kernel; ``BLOCK_N`` divides ``BLOCK_M`` (the diagonal block starts on a
    key-block boundary)."""

    BLOCK_M: int = 128
    BLOCK_N: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.BLOCK_M % self.BLOCK_N or self.BLOCK_N < 16 or self.BLOCK_M & (self.BLOCK_M - 1):
            raise ValueError(f"PrefillConfig needs power-of-two BLOCK_M, BLOCK_N >= 16 dividing it, got {self}")


# Candidates of launch/bench_mla_prefill.py --sweep. Each fits Hopper's 227 KiB of shared memory (the q tile
# BLOCK_M x 192 plus num_stages k/v tiles of BLOCK_N x (192 + 128), bf16: 208 KiB for 128/128/2 and 128/64/4)
# and compiles for sm_90a without register spills (ptxas -v) but 128/32 with 4 warps (136 bytes).
CONFIGS = (
    PrefillConfig(128, 64, 8, 3),
    PrefillConfig(128, 64, 8, 2),
    PrefillConfig(128, 64, 8, 4),
    PrefillConfig(128, 128, 8, 2),
    PrefillConfig(128, 32, 4, 3),
    PrefillConfig(64, 64, 4, 3),
    PrefillConfig(64, 32, 4, 2),
)
DEFAULT = CONFIGS[0]
# The interpreter's cost is per program and per block: small tiles keep the CPU tier fast.
INTERPRETED = PrefillConfig(16, 16, 4, 1)


@triton.jit
def _block(
    acc,
    m_i,
    l_i,
    q_nope,
    q_rope,
    k_base,
    v_base,
    n0,
    offs_m,
    seqlen,
    stride_kt,
    stride_vt,
    qk_scale,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key block: scores, online-softmax update of (acc, m_i, l_i)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    dn = tl.arange(0, 128)
    dr = tl.arange(0, 64)
    k_rows = k_base + offs_n[None, :].to(tl.int64) * stride_kt
    v_rows = v_base + offs_n[:, None].to(tl.int64) * stride_vt
    if MASK:
        in_seq = offs_n < seqlen
        k_nope = tl.load(k_rows + dn[:, None], mask=in_seq[None, :], other=0.0)  # [128, BLOCK_N]
        k_rope = tl.load(k_rows + 128 + dr[:, None], mask=in_seq[None, :], other=0.0)  # [64, BLOCK_N]
        v = tl.load(v_rows + dn[None, :], mask=in_seq[:, None], other=0.0)  # [BLOCK_N, 128]
    else:
        k_nope = tl.load(k_rows + dn[:, None])
        k_rope = tl.load(k_rows + 128 + dr[:, None])
        v = tl.load(v_rows + dn[None, :])
    s = tl.dot(q_rope, k_rope, tl.dot(q_nope, k_nope)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if MASK:
        visible = in_seq[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def prefill_kernel(
    q_ptr,  # [T, Hq, 192]
    k_ptr,  # [T, Hq, 192]
    v_ptr,  # [T, Hq, 128]
    out_ptr,  # [T, Hq, 128]
    lse_ptr,  # [T, Hq] fp32
    cu_ptr,  # [B + 1] int32
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    qk_scale,  # sm_scale * log2(e)
    num_m_blocks,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    m_block = num_m_blocks - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    seqlen = tl.load(cu_ptr + seq + 1) - start
    m0 = m_block * BLOCK_M
    if m0 >= seqlen:
        return
    start = start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen
    dn = tl.arange(0, 128)
    dr = tl.arange(0, 64)
    q_rows = q_ptr + (start + offs_m[:, None]) * stride_qt + head * stride_qh
    q_nope = tl.load(q_rows + dn[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, 128]
    q_rope = tl.load(q_rows + 128 + dr[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, 64]
    k_base = k_ptr + start * stride_kt + head * stride_kh
    v_base = v_ptr + start * stride_vt + head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, 128], tl.float32)
    if CAUSAL:
        unmasked_end = m0  # key blocks wholly below this tile's diagonal
        end = tl.minimum(m0 + BLOCK_M, seqlen)
    else:
        unmasked_end = seqlen // BLOCK_N * BLOCK_N
        end = seqlen
    for n0 in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _block(
            acc, m_i, l_i, q_nope, q_rope, k_base, v_base, n0, offs_m, seqlen, stride_kt, stride_vt, qk_scale,
            False, CAUSAL, BLOCK_N,
        )  # fmt: skip
    # Every row sees key n0 == unmasked_end (its own position or earlier), so no row's maximum stays -inf.
    for n0 in range(unmasked_end, end, BLOCK_N):
        acc, m_i, l_i = _block(
            acc, m_i, l_i, q_nope, q_rope, k_base, v_base, n0, offs_m, seqlen, stride_kt, stride_vt, qk_scale,
            True, CAUSAL, BLOCK_N,
        )  # fmt: skip

    out = acc / l_i[:, None]
    out_rows = out_ptr + (start + offs_m[:, None]) * stride_ot + head * stride_oh
    tl.store(out_rows + dn[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural log
    tl.store(lse_ptr + (start + offs_m) * stride_lt + head * stride_lh, lse, mask=row_ok)


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    max_seqlen: int,
    causal: bool = True,
    config: PrefillConfig | None = None,
) -> None:
    """Runs the kernel on checked arguments (shapes as ``mla_prefill``'s; unit stride in the last dims)."""
    if config is None:
        config = INTERPRETED if q.device.type == "cpu" else DEFAULT
    batch = cu_seqlens.shape[0] - 1
    if batch <= 0 or max_seqlen <= 0 or q.shape[0] == 0:
        return
    num_m_blocks = triton.cdiv(max_seqlen, config.BLOCK_M)
    grid = (num_m_blocks, q.shape[1], batch)
    prefill_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        lse.stride(1),
        sm_scale * LOG2E,
        num_m_blocks,
        CAUSAL=causal,
        BLOCK_M=config.BLOCK_M,
        BLOCK_N=config.BLOCK_N,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def causal_flops(seqlens: list[int], heads: int, causal: bool = True) -> float:
    """Multiply-adds x 2 of QK^T (192) and PV (128) over the visible (query, key) pairs."""
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in seqlens)
    return 2.0 * pairs * heads * (NOPE + ROPE + V_DIM)


@triton.jit
def merge_kernel(
    oa_ptr,  # [T, H, D]
    la_ptr,  # [T, H]
    ob_ptr,
    lb_ptr,
    o_ptr,
    lo_ptr,
    H,
    rows,  # T * H
    D,
    s_oat,
    s_oah,
    s_obt,
    s_obh,
    s_ot,
    s_oh,
    s_lat,
    s_lah,
    s_lbt,
    s_lbh,
    s_lot,
    s_loh,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < rows
    t = (r // H).to(tl.int64)
    h = r % H
    la = tl.load(la_ptr + t * s_lat + h * s_lah, mask=ok, other=float("-inf"))
    lb = tl.load(lb_ptr + t * s_lbt + h * s_lbh, mask=ok, other=float("-inf"))
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)  # both sides empty: weights 0, LSE -inf, out 0
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    # One side's weight is exactly 1 unless both are empty, so a non-zero total is >= 1.
    total = tl.maximum(wa + wb, 1.0)
    present = (wa + wb) > 0
    d = tl.arange(0, BLOCK_D)
    cols = (d < D)[None, :]
    # An empty side's rows are not read at all: they may hold anything.
    a = tl.load(oa_ptr + (t * s_oat + h * s_oah)[:, None] + d[None, :], mask=cols & (wa > 0)[:, None], other=0.0)
    b = tl.load(ob_ptr + (t * s_obt + h * s_obh)[:, None] + d[None, :], mask=cols & (wb > 0)[:, None], other=0.0)
    out = (a.to(tl.float32) * wa[:, None] + b.to(tl.float32) * wb[:, None]) / total[:, None]
    tl.store(
        o_ptr + (t * s_ot + h * s_oh)[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=cols & ok[:, None]
    )
    tl.store(lo_ptr + t * s_lot + h * s_loh, tl.where(present, m + tl.log(total), float("-inf")), mask=ok)


def launch_merge(out_a, lse_a, out_b, lse_b, out, out_lse) -> None:
    """Runs the merge kernel on checked `[T, H, D]` / `[T, H]` arguments (unit stride along D)."""
    t, h, d = out_a.shape
    rows = t * h
    if rows == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_rows = max(1, min(64, 4096 // block_d))
    merge_kernel[(triton.cdiv(rows, block_rows),)](
        out_a,
        lse_a,
        out_b,
        lse_b,
        out,
        out_lse,
        h,
        rows,
        d,
        out_a.stride(0),
        out_a.stride(1),
        out_b.stride(0),
        out_b.stride(1),
        out.stride(0),
        out.stride(1),
        lse_a.stride(0),
        lse_a.stride(1),
        lse_b.stride(0),
        lse_b.stride(1),
        out_lse.stride(0),
        out_lse.stride(1),
        ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=4,
    )
