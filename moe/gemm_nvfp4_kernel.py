"""The Triton grouped GEMM with NVFP4 weights and 16-bit activations (W4A16).

Each program owns one output tile of one expert, found as in ``gemm_kernel`` (a prefix sum over the `[E]`
counts, no host sync). Per K step it takes the packed weight bytes `[BLOCK_N, BLOCK_K / 2]` and the activations
from TMA loads that the compiler pipelines ``num_stages`` deep in shared memory (so the weight stream runs ahead
of the expansion), expands the bytes with their E4M3 block scales `[BLOCK_N, BLOCK_K / 16]` in registers to the
activations' dtype (bf16 on a GPU: a ``prmt`` table lookup in inline PTX, about 2 instructions per
weight), and feeds the tensor cores with ``tl.dot`` (wgmma on Hopper; with ``SWAP_AB`` each step's products
complete before the next step's expansion, see ``_retired``). The expansion is exact: an E2M1 value times an E4M3
scale has at most 6 significant bits (1.5 x 1.875 = 10.1101b) and lies in ``[2**-10, 2688]``, inside bf16 and fp16
alike. The fp32 global scale (one per expert, or one per gate/up half for GEMM1) multiplies the fp32 accumulator
once, in the epilogue.

With ``SWAP_AB`` the product is computed transposed, ``acc[n, m] = sum_k W[n, k] A[m, k]``: the expanded
weights are then the left operand, which wgmma reads from registers (no shared-memory round trip for them),
and the rows of the layout become wgmma's N, which may be as small as 8, so decode with a handful of rows
per expert wastes little of the tensor cores; without it wgmma's M (at least 64) is the layout's rows.

Imported only where a kernel is launched, so that ``TRITON_INTERPRET=1`` can be set before the first import.
Dimension legend: ``E`` experts, ``N`` output columns, ``NW`` weight rows (``2 N`` with an activation),
``K`` reduction, ``R`` rows of the layout.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .gemm_kernel import ACT_NONE, _tile_of, gated_activation

_ACT_NONE = tl.constexpr(ACT_NONE)
# Expansion variants (``EXPAND``): 0 builds fp16 bits and scales in fp32 (portable: the interpreter's, and fp16
# activations'); 2 is a PTX byte-permute lookup (``prmt``) with bf16x2 scaling, bf16 on a GPU only (measured
# 1.25x faster at decode on an H200; a bf16 bit construction with bf16 scaling, tried as 1, was 1.1x).
EXPAND_FP16, EXPAND_PRMT = 0, 2
# E2M1 magnitudes placed in an fp16's exponent/mantissa bits read as the value times 2**-14 (code 1, 0.5,
# is an fp16 subnormal, which converts to fp32 exactly); the block scale carries the 2**14 back.
_E2M1_FP16_BIAS = tl.constexpr(16384.0)

# Four packed bytes ($4) -> four bf16x2 (low nibble in the low half), each times its byte's scale pair ($5-$8).
# prmt with the 3-bit magnitude as selector reads the high and the low byte of the bf16 of each E2M1 magnitude
# from two 8-byte tables (bf16 of 0, .5, 1, 1.5, 2, 3, 4, 6: 0000 3F00 3F80 3FC0 4000 4040 4080 40C0); the
# sign bits are replicated to whole bytes by prmt's sign mode (from x and x << 4) and or-ed into the high bytes;
# two more prmt interleave low and high bytes into pairs. 15 integer instructions and 4 bf16x2 multiplies per
# 8 weights, all exact (the products have at most 6 significant bits, bf16 holds 8).
_PRMT_ASM = tl.constexpr("""
{
.reg .b32 xm, xh, xs, l01, h01, l23, h23, s01, s23, tl0, tl1, th0, th1;
mov.b32 tl0, 0xC0800000;
mov.b32 tl1, 0xC0804000;
mov.b32 th0, 0x3F3F3F00;
mov.b32 th1, 0x40404040;
and.b32 xm, $4, 0x77777777;
shr.u32 xh, xm, 16;
shl.b32 xs, $4, 4;
prmt.b32 l01, tl0, tl1, xm;
prmt.b32 h01, th0, th1, xm;
prmt.b32 l23, tl0, tl1, xh;
prmt.b32 h23, th0, th1, xh;
prmt.b32 s01, xs, $4, 0xD9C8;
prmt.b32 s23, xs, $4, 0xFBEA;
lop3.b32 h01, h01, s01, 0x80808080, 0xF8;
lop3.b32 h23, h23, s23, 0x80808080, 0xF8;
prmt.b32 $0, l01, h01, 0x5140;
prmt.b32 $1, l01, h01, 0x7362;
prmt.b32 $2, l23, h23, 0x5140;
prmt.b32 $3, l23, h23, 0x7362;
mul.rn.bf16x2 $0, $0, $5;
mul.rn.bf16x2 $1, $1, $6;
mul.rn.bf16x2 $2, $2, $7;
mul.rn.bf16x2 $3, $3, $8;
}
""")

# The same for one split-bits word ($4, ``moe.packed_nvfp4``): shifts, rotations and masks put its bits into four
# bf16 pairs reading as the values times 2**-126. Bytes 0-1 and 2-3 of a K-permuted word belong to two scale
# groups, whose pairs ($5, $6) carry the block scale times 2**118, so the results are the weights times 2**-8
# (the kernel multiplies the global scale by 2**8). 7 integer instructions (two more left shifts that may issue
# as multiplies) and 4 bf16x2 multiplies per 8 weights. Unlike the byte-wise lookup above, this mixes the bits of
# four bytes, so it takes whole 32-bit words (loaded as such) rather than four bytes Triton packs together,
# which need not be adjacent in memory.
_SPLIT_ASM = tl.constexpr("""
{
.reg .b32 p0, p1, p2, p3, r10, r14, t6;
and.b32 p0, $4, 0x81C081C0;
shl.b32 p1, $4, 4;
and.b32 p1, p1, 0x81C081C0;
shf.l.wrap.b32 r10, $4, $4, 10;
and.b32 p2, r10, 0x81C081C0;
shf.l.wrap.b32 r14, $4, $4, 14;
and.b32 r14, r14, 0x01000100;
shl.b32 t6, $4, 6;
and.b32 t6, t6, 0x80C080C0;
or.b32 p3, t6, r14;
mul.rn.bf16x2 $0, p0, $5;
mul.rn.bf16x2 $1, p1, $5;
mul.rn.bf16x2 $2, p2, $6;
mul.rn.bf16x2 $3, p3, $6;
}
""")
_SPLIT_SCALE = tl.constexpr(2.0**118)
_SPLIT_UNSCALE = tl.constexpr(256.0)  # 2**8, see _SPLIT_ASM


@triton.jit
def _rotl(y, r: tl.constexpr):
    return (y << r) | (y >> (32 - r))


@triton.jit
def _pair_codes(p):
    """The byte of two E2M1 codes a bf16 pair of split bits holds (low half: the low nibble)."""
    return ((p >> 6) & 0x7) | ((p >> 12) & 0x8) | ((p >> 18) & 0x70) | ((p >> 24) & 0x80)


@triton.jit
def _join_split_bits(words, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Split-bits words `[BLOCK_N, BLOCK_K / 8]` back to K-permuted bytes `[BLOCK_N, BLOCK_K / 2]`, by the four
    pair formulas the GPU expansion uses (``moe.packed_nvfp4``), reading each pair's sign and magnitude bits (the
    portable path)."""
    y = words.to(tl.uint32, bitcast=True)
    p0 = y & 0x81C081C0
    p1 = (y << 4) & 0x81C081C0
    p2 = _rotl(y, 10) & 0x81C081C0
    p3 = ((y << 6) & 0x80C080C0) | (_rotl(y, 14) & 0x01000100)
    x = _word_bytes(_pair_codes(p0), _pair_codes(p1), _pair_codes(p2), _pair_codes(p3), BLOCK_N, BLOCK_K)
    return x.to(tl.uint8)


@triton.jit
def _word_bytes(b0, b1, b2, b3, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Four `[BLOCK_N, BLOCK_K / 8]` tensors, one per byte of each 32-bit word, interleaved into memory order
    `[BLOCK_N, BLOCK_K / 2]` (byte ``j`` of word ``w`` at ``4 w + j``)."""
    # join(join(b0, b2), join(b1, b3))[..., a, m] is b_(2a + m)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _natural_bytes(x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-byte values `[BLOCK_N, BLOCK_K / 2]` of K-permuted weights (see ``moe.packed_nvfp4``) put back in
    natural byte order: stored byte ``8 q + 2 c + h`` of each 32-byte span is natural byte ``8 c + 4 h + q``."""
    x = tl.reshape(x, (BLOCK_N, BLOCK_K // 64, 4, 4, 2))  # [n, span, q, c, h]
    return tl.reshape(tl.permute(x, (0, 1, 3, 4, 2)), (BLOCK_N, BLOCK_K // 2))


@triton.jit
def expand_nvfp4(
    packed,
    scale,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr,
    EXPAND: tl.constexpr = 0,
    KPERM: tl.constexpr = False,
    SPLIT: tl.constexpr = False,
):
    """``packed`` `[BLOCK_N, BLOCK_K / 2]` uint8 (element 2i in the low nibble; with ``KPERM`` in the
    K-permuted byte order), or with ``SPLIT`` (and ``KPERM``) split-bits words `[BLOCK_N, BLOCK_K / 8]` int32,
    and ``scale`` `[BLOCK_N, BLOCK_K / 16]` (E4M3 block scales, any float type) -> `[BLOCK_N, BLOCK_K]` values
    in ``DTYPE`` (``EXPAND_PRMT`` needs a bf16 ``DTYPE`` and a GPU; with ``SPLIT`` it returns the values times
    2**-8)."""
    if EXPAND == 2:
        if SPLIT:
            scale = scale.to(tl.float32) * _SPLIT_SCALE
        sb = scale.to(tl.float32).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        pair = sb | (sb << 16)  # the scale in both halves of a bf16x2
        if SPLIT:
            # Word 2 q + c // 2 of a span holds the stored bytes of scale groups c = 2 (c // 2) + {0, 1}.
            pair = tl.reshape(pair, (BLOCK_N, BLOCK_K // 64, 1, 2, 2))  # [n, span, 1, c // 2, c % 2]
            pair_lo, pair_hi = tl.split(tl.broadcast_to(pair, (BLOCK_N, BLOCK_K // 64, 4, 2, 2)))
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                _SPLIT_ASM,
                "=r,=r,=r,=r,r,r,r",
                [
                    packed,
                    tl.reshape(pair_lo, (BLOCK_N, BLOCK_K // 8)),
                    tl.reshape(pair_hi, (BLOCK_N, BLOCK_K // 8)),
                ],
                dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                is_pure=True,
                pack=1,
            )
            o = _natural_bytes(_word_bytes(o0, o1, o2, o3, BLOCK_N, BLOCK_K), BLOCK_N, BLOCK_K)
        else:
            if KPERM:
                # Stored byte 8 q + 2 c + h of a span belongs to scale group c of that span.
                pair = tl.reshape(pair, (BLOCK_N, BLOCK_K // 64, 1, 4, 1))
                pair = tl.broadcast_to(pair, (BLOCK_N, BLOCK_K // 64, 4, 4, 2))
            else:
                pair = tl.broadcast_to(pair[:, :, None], (BLOCK_N, BLOCK_K // 16, 8))
            pair = tl.reshape(pair, (BLOCK_N, BLOCK_K // 2))
            o = tl.inline_asm_elementwise(
                _PRMT_ASM, "=r,=r,=r,=r,r,r,r,r,r", [packed, pair], dtype=tl.uint32, is_pure=True, pack=4
            )
            if KPERM:
                # After the expansion, so that the elementwise work keeps the load's layout and the permutation
                # is only a renaming of the registers the wgmma operand needs.
                o = _natural_bytes(o, BLOCK_N, BLOCK_K)
        lo = (o & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (o >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
    else:
        if SPLIT:
            packed = _join_split_bits(packed, BLOCK_N, BLOCK_K)
        if KPERM:
            packed = _natural_bytes(packed, BLOCK_N, BLOCK_K)
        x = packed.to(tl.uint16)
        lo = ((x & 0x8) << 12) | ((x & 0x7) << 9)  # sign to bit 15, exponent and mantissa to bits 11..9
        hi = ((x & 0x80) << 8) | ((x & 0x70) << 5)
        v = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)).to(tl.float16, bitcast=True).to(tl.float32)
        s = scale.to(tl.float32) * _E2M1_FP16_BIAS
        v = tl.reshape(tl.reshape(v, (BLOCK_N, BLOCK_K // 16, 16)) * s[:, :, None], (BLOCK_N, BLOCK_K))
        return v.to(DTYPE)


@triton.jit
def _load_scales(s_ptrs, offs_g, left):
    """Block scales `[BLOCK_N, BLOCK_K / 16]` of one K step with ``left`` columns still to go (K is a multiple
    of 32, so a partial step holds whole scale groups; nothing is loaded when ``left <= 0``)."""
    return tl.load(s_ptrs, mask=offs_g[None, :] < left // 16, other=0.0)


@triton.jit
def _retired(acc):
    """``acc`` once every wgmma that accumulates into it has completed, so that the next K step's expansion may
    write the registers they read. With ``SWAP_AB`` the expanded weights are wgmma's register operand; Triton 3.6
    leaves up to (products per step - 1) of them in flight into the next step, whose expansion then writes the
    same registers (undefined in PTX; triton-lang/triton#9433), and where ptxas did not serialize the wgmma in
    response, an H200 read the new values: 8 experts x 4096 rows came out at 1e34 and more. An opaque copy of the
    accumulators is a use that is not a product, before which Triton waits for all of them (ptxas folds the
    copy away); ``tests/triton_sm90.py`` checks the SASS of every config for writes to registers that an
    unfinished wgmma reads."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _product(a, wv, acc, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        acc = tl.dot(wv, tl.trans(a), acc)  # [BLOCK_N, BLOCK_M]
    else:
        acc = tl.dot(a, tl.trans(wv), acc)  # [BLOCK_M, BLOCK_N]
    return acc


@triton.jit
def grouped_gemm_nvfp4_kernel(
    a_desc,  # TMA descriptor of a [R, K] bf16 / fp16, block [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor of w [E * NW, K / 2] uint8, block [BLOCK_N, BLOCK_K / 2] (SPLIT: int32 words, / 8)
    ws_ptr,  # [E, NW, K / 16] float8_e4m3fn
    gs_ptr,  # [E] or [E, 2] fp32
    out_ptr,  # [R, N]
    counts_ptr,  # [E] int32
    offsets_ptr,  # [E] int32 first row of each expert (contiguous)
    E,
    N,
    NW,
    K,
    stride_se,
    stride_sn,
    stride_ge,  # global scale expert stride
    up_scale_offset,  # 1 when the global scale has a gate and an up value per expert, else 0
    stride_om,
    num_m_tiles,
    capacity,
    alpha,
    limit,
    MASKED: tl.constexpr,
    ACT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    EXPAND: tl.constexpr,
    KPERM: tl.constexpr,
    SPLIT: tl.constexpr,
    RETIRE: tl.constexpr,  # _retired each K step (not under the interpreter, which has no inline PTX and no wgmma)
):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    # As in gemm_kernel: GROUP_M row tiles in a row share a weight tile while it is in L2.
    per_group = GROUP_M * num_n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    # True of every call (the ops reject weights with no K). Without it the accumulators' zeros sit on a path
    # around the loop (K = 0), and for some tile configs and expert counts ptxas then serialized every wgmma of
    # the loop (C7515). That serialization also hid the register race that _retired now prevents.
    tl.assume(K > 0)
    expert, row0, rows = _tile_of(pid_m, counts_ptr, offsets_ptr, E, capacity, MASKED, BLOCK_M, BLOCK_E)
    if expert >= E:
        return

    GROUPS_K: tl.constexpr = BLOCK_K // 16
    K_PER_W: tl.constexpr = 8 if SPLIT else 2  # weights per element of w_desc
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUPS_K)
    # The TMA loads need no masks: rows past the expert's (another expert's, or zeros past the tensor) and
    # weight rows past N give output elements the store drops; columns past K arrive as zeros. The scale
    # loads clamp their rows instead.
    w_row = expert * NW + pid_n * BLOCK_N
    s_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    s_ptrs = ws_ptr + expert.to(tl.int64) * stride_se + s_rows[:, None] * stride_sn + offs_g[None, :]
    if ACT != _ACT_NONE:
        su_ptrs = s_ptrs + N * stride_sn  # the up rows follow the gate rows

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ACT != _ACT_NONE:
        acc_up = tl.zeros_like(acc)
    dtype = a_desc.dtype

    # The TMA loads of a and w are software-pipelined by the compiler (num_stages deep in shared memory); the
    # small scale loads are issued one step ahead by hand.
    ws = _load_scales(s_ptrs, offs_g, K)
    if ACT != _ACT_NONE:
        us = _load_scales(su_ptrs, offs_g, K)
    for k0 in range(0, K, BLOCK_K):
        if SWAP_AB and RETIRE:
            acc = _retired(acc)
            if ACT != _ACT_NONE:
                acc_up = _retired(acc_up)
        a = a_desc.load([row0, k0])
        wb = w_desc.load([w_row, k0 // K_PER_W])
        s_ptrs += GROUPS_K
        ws_next = _load_scales(s_ptrs, offs_g, K - k0 - BLOCK_K)
        wv = expand_nvfp4(wb, ws, BLOCK_N, BLOCK_K, dtype, EXPAND, KPERM, SPLIT)
        ws = ws_next
        if ACT != _ACT_NONE:
            ub = w_desc.load([w_row + N, k0 // K_PER_W])
            su_ptrs += GROUPS_K
            us_next = _load_scales(su_ptrs, offs_g, K - k0 - BLOCK_K)
            uv = expand_nvfp4(ub, us, BLOCK_N, BLOCK_K, dtype, EXPAND, KPERM, SPLIT)
            us = us_next
        # Both halves are expanded before either product: with the up half's expansion between the gate's wgmma
        # and the up's, ptxas serialized every wgmma of the gated kernels (warning C7515; sm_90a, Triton 3.6).
        acc = _product(a, wv, acc, SWAP_AB)
        if ACT != _ACT_NONE:
            acc_up = _product(a, uv, acc_up, SWAP_AB)

    if SWAP_AB:
        acc = tl.trans(acc)
        if ACT != _ACT_NONE:
            acc_up = tl.trans(acc_up)
    gate_scale = tl.load(gs_ptr + expert * stride_ge)
    if ACT != _ACT_NONE:
        up_scale = tl.load(gs_ptr + expert * stride_ge + up_scale_offset)
    if SPLIT:
        if EXPAND == 2:  # the GPU expansion of split bits leaves the weights times 2**-8 (exact)
            gate_scale *= _SPLIT_UNSCALE
            if ACT != _ACT_NONE:
                up_scale *= _SPLIT_UNSCALE
    acc *= gate_scale
    if ACT != _ACT_NONE:
        acc_up *= up_scale
        acc = gated_activation(acc, acc_up, alpha, limit, ACT)

    out_rows = (row0 + offs_m).to(tl.int64)
    mask = (offs_m[:, None] < rows) & (offs_n[None, :] < N)
    tl.store(out_ptr + out_rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _tma_ready(t):
    """``t`` itself where TMA can read it (16-byte aligned base and row stride), else an aligned copy."""
    if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
        return t.contiguous() if not t.is_contiguous() else t.clone()
    return t


def _interpreting() -> bool:
    """Whether Triton runs the kernel in its interpreter (no inline PTX, no wgmma there)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def expand_variant(config: dict, dtype) -> int:
    """The config's ``EXPAND`` (default: the fastest measured), the portable one under the interpreter (no inline
    PTX there) or for fp16 activations."""
    if _interpreting() or dtype != torch.bfloat16:
        return EXPAND_FP16
    return config.get("EXPAND", DEFAULT_EXPAND)


def launch(
    a,
    w,
    w_block_scale,
    w_global_scale,
    out,
    counts,
    offsets,
    *,
    act: int,
    alpha: float,
    limit: float,
    capacity: int,
    config: dict,
    kperm: bool = False,
    split_bits: bool = False,
) -> None:
    """Launch on 2-D views: ``a [R, K]``, ``w [E, NW, K / 2]``, ``w_block_scale [E, NW, K / 16]``,
    ``w_global_scale`` `[E]` or `[E, 2]` (gate, up), ``out [R, N]``, all unit stride in the last dimension;
    ``counts`` `[E]` int32; ``offsets`` `[E]` int32 (contiguous) or None (masked: expert ``e`` at row
    ``e * capacity``). ``kperm``: ``w`` is in the K-permuted byte order of ``moe.packed_nvfp4`` (the config's
    ``BLOCK_K`` a multiple of 64); ``split_bits``: with split bits too (``kperm`` must be set). The grid is a
    static bound from the layout's shape (no host sync)."""
    num_experts, nw, half_k = w.shape
    k = 2 * half_k
    n = nw // 2 if act != ACT_NONE else nw
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    rows = a.shape[0]
    if offsets is None:
        num_m_tiles_bound = num_experts * triton.cdiv(capacity, block_m)
    else:
        num_m_tiles_bound = triton.cdiv(rows, block_m) + min(num_experts, rows)
    grid = (num_m_tiles_bound * triton.cdiv(n, block_n),)
    a_desc = TensorDescriptor.from_tensor(_tma_ready(a), [block_m, block_k])
    w_rows = w.reshape(num_experts * nw, half_k)
    if split_bits:  # the expansion takes whole words (see _SPLIT_ASM)
        w_desc = TensorDescriptor.from_tensor(_tma_ready(w_rows.view(torch.int32)), [block_n, block_k // 8])
    else:
        w_desc = TensorDescriptor.from_tensor(_tma_ready(w_rows), [block_n, block_k // 2])
    per_half = w_global_scale.dim() == 2
    grouped_gemm_nvfp4_kernel[grid](
        a_desc,
        w_desc,
        w_block_scale,
        w_global_scale,
        out,
        counts,
        offsets if offsets is not None else counts,
        num_experts,
        n,
        nw,
        k,
        w_block_scale.stride(0),
        w_block_scale.stride(1),
        w_global_scale.stride(0),
        w_global_scale.stride(1) if per_half else 0,
        out.stride(0),
        num_m_tiles_bound,
        capacity,
        alpha,
        limit,
        MASKED=offsets is None,
        ACT=act,
        SWAP_AB=config.get("SWAP_AB", True),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        GROUP_M=config.get("GROUP_M", 8),
        EXPAND=expand_variant(config, a.dtype),
        KPERM=kperm,
        SPLIT=split_bits,
        RETIRE=not _interpreting(),
        num_warps=config.get("num_warps", 4),
        num_stages=config.get("num_stages", 3),
    )


DEFAULT_EXPAND = EXPAND_PRMT
# Tile configs by shape class, picked in ``pick`` (measured by launch/bench_nvfp4.py --sweep on an H200; ``mid`` and
# ``mid_gated`` re-timed with ``_retired``, see CONFIGS_KPERM).
_DECODE_ROWS = 32  # rows per expert up to which the decode tiles apply
CONFIGS = {
    "decode": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "GROUP_M": 8},
    "decode_gated": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "GROUP_M": 1},
    "mid64": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "GROUP_M": 8},
    "mid64_gated": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "GROUP_M": 8},
    "mid_gated": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "GROUP_M": 8},
    "prefill": {
        "BLOCK_M": 128,
        "BLOCK_N": 128,
        "BLOCK_K": 64,
        "num_warps": 8,
        "num_stages": 3,
        "GROUP_M": 8,
        "SWAP_AB": False,
    },
    "prefill_gated": {
        "BLOCK_M": 128,
        "BLOCK_N": 64,
        "BLOCK_K": 64,
        "num_warps": 8,
        "num_stages": 3,
        "GROUP_M": 8,
        "SWAP_AB": False,
    },
}
# The prefill tile (both operands from shared memory) also measured fastest at 65-256 rows per expert.
CONFIGS["mid"] = dict(CONFIGS["prefill"])


# Where K-permuted weights (``kperm``, split bits too) measured fastest with another config than ``CONFIGS``'s:
# timed on split bits, each candidate checked against float64, on one H200 once ``_retired`` made every step's
# products complete before the next expansion (docs/perf-notes.md); the same sweep on split bits and on plain
# weights chose ``CONFIGS``' ``mid`` and ``mid_gated``.
CONFIGS_KPERM: dict[str, dict] = {
    "decode": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "GROUP_M": 8},
    "decode_gated": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "GROUP_M": 8},
    "mid64": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "GROUP_M": 8},
    "prefill": {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "GROUP_M": 1},
    "prefill_gated": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "GROUP_M": 8},
}


def shape_class(rows: int, num_experts: int, capacity: int, gated: bool) -> str:
    """The config class of a call: by the expected rows per expert (the layout's, never the counts')."""
    per_expert = min(capacity, -(-rows // max(num_experts, 1)))
    # 64 rows per expert in a 128-row tile would waste half of every wgmma.
    size = (
        "decode"
        if per_expert <= _DECODE_ROWS
        else "mid64"
        if per_expert <= 64
        else "mid"
        if per_expert <= 256
        else "prefill"
    )
    return f"{size}_gated" if gated else size


def pick(rows: int, num_experts: int, capacity: int, gated: bool, k: int, kperm: bool = False) -> dict:
    """The tile config for one call; ``BLOCK_K`` no larger than K rounded up to a power of two (K-permuted
    weights have K a multiple of 64, so their ``BLOCK_K`` stays a multiple of 64)."""
    cls = shape_class(rows, num_experts, capacity, gated)
    cfg = dict(CONFIGS_KPERM.get(cls, CONFIGS[cls]) if kperm else CONFIGS[cls])
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(32, triton.next_power_of_2(k)))
    return cfg
