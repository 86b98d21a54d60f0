"""Grouped expert GEMMs with NVFP4 weights and bf16/fp16 activations (W4A16), over the contiguous and the masked
layouts: ``out[rows of e] = act(A[rows of e] @ W[e]^T)`` with ``W[e] = e2m1(w) * block_scale * global_scale``.

Weights are ModelOpt's NVFP4 as stored: ``w`` `[E, N, K / 2]` uint8 (E2M1 codes, element ``2i`` in the low
nibble), ``w_block_scale`` `[E, N, K / 16]` float8_e4m3fn (``weight_scale``), ``w_global_scale`` `[E]` fp32
(``weight_scale_2``); for GEMM1 with an activation also `[E, 2]`, one global scale for the gate rows and one
for the up rows, since a checkpoint quantizes ``gate_proj`` and ``up_proj`` separately and their
``weight_scale_2`` may differ (kept exact rather than requantized to a common scale). On a GPU a call launches
the Triton kernel of ``gemm_nvfp4_kernel`` (no host sync beyond the optional value check); on a CPU the
reference runs on the dequantized weights. On Hopper, K-permuted weights with bf16 activations take the CUDA
kernel of ``gemm_nvfp4_sm90`` instead, at every group size. With ``float8_e4m3fn`` activations and their scales the
calls are W4A8, on weights packed for it (``moe/gemm_nvfp4_w4a8.py``).

Dimension legend: ``E`` experts, ``R`` rows of the contiguous layout, ``C`` masked capacity, ``K`` reduction,
``N`` weight rows (``2 I`` for GEMM1 with an activation, whose output has ``I`` columns).
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks
from flashinfer_moe import reference_gemm as ref
from flashinfer_moe import reference_quant as ref_quant
from flashinfer_moe._ops import LIB, on_device

from .gemm import _ACT_DOC, _activation, _check_experts, _outputs, _rows_and_groups
from .gemm_nvfp4_w4a8 import check_activation_scale
from .gemm_op import ACT_NAMES
from .packed_nvfp4 import PLAIN, SPLIT_BITS, PackedNvfp4Weights, check_packable
from .quant import FP8

__all__ = ["grouped_gemm_nvfp4_contiguous", "grouped_gemm_nvfp4_masked"]

K_MULTIPLE = 32  # K granularity: whole bytes and whole 16-element scale groups in every kernel step
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)

LIB.define(
    "grouped_gemm_nvfp4_(Tensor a, Tensor w, Tensor w_block_scale, Tensor w_global_scale, Tensor counts, "
    "Tensor? offsets, Tensor(a!) out, int act, float alpha, float limit, int capacity, int wlayout) -> ()"
)


def dequantize_weights(w: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, dtype=torch.float32):
    """`[E, NW, K]` values in ``dtype`` of NVFP4 weights, global scale as
    :func:`~flashinfer_moe.reference_quant.nvfp4_global_scaled` takes it."""
    return ref_quant.nvfp4_global_scaled(ref_quant.dequantize_nvfp4(w, block_scale, 1.0).to(dtype), global_scale)


def _gemm_cpu(a, w, w_block_scale, w_global_scale, counts, offsets, out, act, alpha, limit, capacity, wlayout):
    # wlayout: PLAIN, KPERM or SPLIT_BITS (moe/packed_nvfp4.py)
    plain = w if wlayout == PLAIN else PackedNvfp4Weights(w, split_bits=wlayout == SPLIT_BITS).unpack()
    wf = dequantize_weights(plain, w_block_scale, w_global_scale)
    kind = ACT_NAMES[act]
    ref.grouped_gemm_into(out, a, wf, counts, offsets, capacity, activation_kind=kind, alpha=alpha, limit=limit)


def _gemm_cuda(a, w, w_block_scale, w_global_scale, counts, offsets, out, act, alpha, limit, capacity, wlayout):
    from . import gemm_nvfp4_kernel as kernel
    from . import gemm_nvfp4_sm90 as sm90

    kperm, split = wlayout != PLAIN, wlayout == SPLIT_BITS
    kw = dict(act=act, alpha=alpha, limit=limit, capacity=capacity, kperm=kperm, split_bits=split)
    if sm90.run_if_usable(a, w, w_block_scale, w_global_scale, out, counts, offsets, **kw):
        return
    config = kernel.pick(a.shape[0], w.shape[0], capacity, bool(act), 2 * w.shape[2], kperm)
    with on_device(a):
        kernel.launch(
            a,
            w,
            w_block_scale,
            w_global_scale,
            out,
            counts,
            offsets,
            act=act,
            alpha=alpha,
            limit=limit,
            capacity=capacity,
            config=config,
            kperm=kperm,
            split_bits=split,
        )


LIB.impl("grouped_gemm_nvfp4_", _gemm_cpu, "CPU")
LIB.impl("grouped_gemm_nvfp4_", _gemm_cuda, "CUDA")
torch.library.register_fake("flashinfer_moe::grouped_gemm_nvfp4_", lambda *args: None, lib=LIB)


# ------------------------------------------------------------------------------------------- checking


def _value_check_applies(t: torch.Tensor) -> bool:
    # Reading values costs a host sync on a GPU; skipped where it cannot happen (capture, compile, meta).
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_global_scale_values(**scales: torch.Tensor) -> None:
    """Raises unless every value of each ``name=tensor`` is positive and finite (one host sync on a GPU for
    all of them together)."""
    scales = {name: g for name, g in scales.items() if g.numel() and _value_check_applies(g)}
    if not scales:
        return
    bad = [~(torch.isfinite(g) & (g > 0)) for g in scales.values()]
    counts = torch.stack([b.sum() for b in bad]).tolist()
    for (name, g), b, count in zip(scales.items(), bad, counts, strict=True):
        if count:
            first = g.reshape(-1)[b.reshape(-1)][0].item()
            raise ValueError(
                f"{name} must hold positive finite numbers, got {count} others of {g.numel()} (e.g. {first})"
            )


def check_weights(
    w: object,
    block_scale: object,
    global_scale: object,
    k: int,
    like: torch.Tensor,
    names: tuple[str, str, str, str] = ("w", "w_block_scale", "w_global_scale", "a"),
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w, block_scale, global_scale)`` checked against ``K`` and ``like``'s device: ``w`` `[E, N, K / 2]`
    uint8, ``block_scale`` `[E, N, K / 16]` float8_e4m3fn, ``global_scale`` fp32 `[E]` (or `[E, 2]` when
    ``gated``). ``names``: the three arguments' names and the name of the tensor K comes from. The global
    scale's values are not read here (see :func:`check_global_scale_values`). ``w`` may be
    :class:`PackedNvfp4Weights` (returned as given, its data checked); W4A8 words exactly when ``like`` is
    float8_e4m3fn (W4A8)."""
    w_name, s_name, g_name, k_name = names
    w4a8 = isinstance(w, PackedNvfp4Weights) and w.w4a8
    if w4a8 and like.dtype != FP8:
        raise ValueError(
            f"{w_name} holds W4A8 words (pack_nvfp4_weights(w, w4a8=True)), which take float8_e4m3fn activations "
            f"only, got {k_name} of dtype {like.dtype}"
        )
    if like.dtype == FP8 and not w4a8:
        got = repr(w) if isinstance(w, PackedNvfp4Weights) else type(w).__name__
        raise ValueError(
            f"{w_name} must be packed with pack_nvfp4_weights(w, w4a8=True) for float8_e4m3fn {k_name}, got {got}"
        )
    if k % K_MULTIPLE:
        raise ValueError(f"{k_name} must have K a multiple of {K_MULTIPLE} for NVFP4 weights, got K = {k}")
    given = w
    if isinstance(w, PackedNvfp4Weights):
        w = check_packable(w_name, w.data)
    w = _checks.tensor(w_name, w)
    _checks.ndim(w_name, w, 3, "[E, N, K / 2]")
    _checks.dtype_in(w_name, w, (torch.uint8,))
    _checks.unit_last_stride(w_name, w)
    _checks.same_device(w_name, w, k_name, like)
    if w.shape[2] != k // 2:
        raise ValueError(
            f"{w_name} must have K / 2 = {k // 2} bytes per row (two E2M1 codes each), got shape {tuple(w.shape)}"
        )
    if 0 in w.shape:
        raise ValueError(f"{w_name} must have at least one expert and row, got shape {tuple(w.shape)}")
    num_experts, nw = w.shape[:2]
    s = _checks.tensor(s_name, block_scale)
    _checks.dtype_in(s_name, s, (FP8,))
    if tuple(s.shape) != (num_experts, nw, k // 16):
        raise ValueError(
            f"{s_name} must have shape {(num_experts, nw, k // 16)} ([E, N, K / 16]), got {tuple(s.shape)}"
        )
    _checks.unit_last_stride(s_name, s)
    _checks.same_device(s_name, s, k_name, like)
    g = _checks.tensor(g_name, global_scale)
    _checks.dtype_in(g_name, g, (torch.float32,))
    shapes = ((num_experts,), (num_experts, 2)) if gated else ((num_experts,),)
    if tuple(g.shape) not in shapes:
        doc = "[E] or [E, 2] (gate, up)" if gated else "[E]"
        raise ValueError(f"{g_name} must have shape {' or '.join(map(str, shapes))} ({doc}), got {tuple(g.shape)}")
    _checks.same_device(g_name, g, k_name, like)
    return (given if isinstance(given, PackedNvfp4Weights) else w), s, g.contiguous()


def check_moe_weights(hidden, w13, w2, w13_scale, w2_scale, w13_global_scale, w2_global_scale):
    """``fused_moe``'s NVFP4 weights checked against ``hidden`` `[T, H]`: ``w13`` `[E, 2I, H / 2]`,
    ``w2`` `[E, H, I / 2]` and their scales; returns ``(E, (w13, s13, g13), (w2, s2, g2))``."""
    h = hidden.shape[1]
    first = check_weights(
        w13, w13_scale, w13_global_scale, h, hidden, ("w13", "w13_scale", "w13_global_scale", "hidden_states"), True
    )
    num_experts, two_i = first[0].shape[:2]
    if two_i % (2 * K_MULTIPLE):
        raise ValueError(
            f"w13 must have 2I rows (gate then up) with I a multiple of {K_MULTIPLE} (GEMM2's K), got {two_i} rows"
        )
    second = check_weights(
        w2, w2_scale, w2_global_scale, two_i // 2, hidden, ("w2", "w2_scale", "w2_global_scale", "w13")
    )
    if second[0].shape[:2] != (num_experts, h):
        raise ValueError(
            f"w2 must have shape {(num_experts, h, two_i // 4)} ([E, H, I / 2]), got {tuple(second[0].shape)}"
        )
    return num_experts, first, second


def _nvfp4(
    a, a_scale, w, w_block_scale, w_global_scale, layout, masked, activation, alpha, limit, out_dtype, out, validate
):
    a = _checks.tensor("a", a)
    _checks.ndim("a", a, 3 if masked else 2, "[E, C, K]" if masked else "[R, K]")
    _checks.dtype_in("a", a, (*ACTIVATION_DTYPES, FP8))
    _checks.unit_last_stride("a", a)
    a8 = a.dtype == FP8
    if a8:
        a_scale = check_activation_scale(a_scale, a)
    elif a_scale is not None:
        raise ValueError(f"a_scale is for float8_e4m3fn activations only, got a of dtype {a.dtype}")
    w, s, g = check_weights(w, w_block_scale, w_global_scale, a.shape[-1], a, gated=activation is not None)
    counts, offsets, capacity = _rows_and_groups(a, layout, masked)
    _check_experts(w, counts, "tokens_per_expert" if masked else "layout")
    act, n, alpha, limit = _activation(activation, w, alpha, limit)
    default_dtype = torch.bfloat16 if a8 else a.dtype
    (out,) = _outputs(out, a, n, default_dtype if out_dtype is None else out_dtype, False)
    if validate:
        check_global_scale_values(w_global_scale=g)
        if a8 and _value_check_applies(s):
            # W4A8 folds the block scale into each weight's e4m3 table and ors in the weight's sign.
            negative = (s.view(torch.uint8) >= 0x80).reshape(-1)
            if bool(negative.any()):
                first = float(s.reshape(-1)[negative][0].float())
                raise ValueError(
                    "w_block_scale must be non-negative for W4A8 (float8_e4m3fn a), as NVFP4's block scales are, "
                    f"got {int(negative.sum())} with the sign bit set (e.g. {first})"
                )
    packed = isinstance(w, PackedNvfp4Weights)
    if a.numel() and out.numel():
        a2 = (a.contiguous() if a8 else a).reshape(-1, a.shape[-1])
        rest = (s, g, counts, offsets, out.view(-1, n), act, alpha, limit, capacity)
        if a8:
            torch.ops.flashinfer_moe.grouped_gemm_nvfp4_w4a8_(a2, a_scale, w.data, *rest)
        else:
            torch.ops.flashinfer_moe.grouped_gemm_nvfp4_(
                a2, w.data if packed else w, *rest, w.layout if packed else PLAIN
            )
    return out


# ---------------------------------------------------------------------------------------------- public

_WEIGHTS_DOC = """w: `[E, N, K / 2]` uint8, two E2M1 codes per byte, element ``2i`` in the low nibble (ModelOpt
            ``weight``); or the same K-permuted by :func:`pack_nvfp4_weights` (faster on Hopper); with FP8
            activations, the same packed by ``pack_nvfp4_weights(w, w4a8=True)`` (only those).
        w_block_scale: `[E, N, K / 16]` float8_e4m3fn, one scale per 16 elements along K (``weight_scale``).
        w_global_scale: `[E]` float32, positive and finite (``weight_scale_2``); with an activation also
            `[E, 2]`: the gate rows' and the up rows' global scales."""


def grouped_gemm_nvfp4_contiguous(
    a,
    w,
    w_block_scale,
    w_global_scale,
    layout,
    *,
    a_scale=None,
    activation=None,
    alpha=1.702,
    limit=7.0,
    out_dtype=None,
    validate=True,
    out=None,
) -> torch.Tensor:
    """NVFP4-weight grouped GEMM over the contiguous layout: the weights are expanded to the dtype of ``a``
    (exactly), multiplied with fp32 accumulation, and the global scale applied to the fp32 sum. Rows no
    expert owns (padding) are not written. With float8_e4m3fn ``a`` (W4A8) each block scale is folded into its
    weights as ``e4m3(|e2m1| x scale / 8)``, an E4M3 rounding (``moe/gemm_nvfp4_w4a8.py``; its error against
    W4A16 in docs/perf.md).

    Args:
        a: `[R, K]` bfloat16 or float16, ``K`` a multiple of 32 (e.g. from :func:`permute`); or float8_e4m3fn
            (W4A8: ``K`` a multiple of 64 and ``a_scale`` given).
        {weights}
        layout: the contiguous :class:`ExpertLayout` ``a`` is in.
        a_scale: float8_e4m3fn ``a``'s float32 dequantization scales: `[R]` (one per row) or one element.
        {act}
        out_dtype: default the dtype of ``a`` (bfloat16 for float8_e4m3fn ``a``); or float32.
        validate: check that the global scales are positive and finite, and for W4A8 that the block scales are
            non-negative (one host sync on a GPU; skipped under CUDA-graph capture and torch.compile).
        out: optional `[R, N]` (or `[R, N / 2]`) buffer.

    Returns:
        `[R, N]` (or `[R, N / 2]`).
    """
    return _nvfp4(
        a, a_scale, w, w_block_scale, w_global_scale, layout, False, activation, alpha, limit, out_dtype, out, validate
    )


def grouped_gemm_nvfp4_masked(
    a,
    w,
    w_block_scale,
    w_global_scale,
    tokens_per_expert,
    *,
    a_scale=None,
    activation=None,
    alpha=1.702,
    limit=7.0,
    out_dtype=None,
    validate=True,
    out=None,
) -> torch.Tensor:
    """:func:`grouped_gemm_nvfp4_contiguous` over the masked layout (decode): ``out[e, :m_e]`` with
    ``m_e = min(tokens_per_expert[e], C)``; slots past ``m_e`` are not written.

    Args:
        a: `[E, C, K]` bfloat16 or float16, ``K`` a multiple of 32; or float8_e4m3fn (W4A8, as in the
            contiguous form).
        {weights}
        tokens_per_expert: `[E]` int32 on the device (or the masked :class:`ExpertLayout`).
        a_scale: float8_e4m3fn ``a``'s float32 scales: `[E, C]` (one per row) or one element.
        {act}
        out_dtype: default the dtype of ``a`` (bfloat16 for float8_e4m3fn ``a``); or float32.
        validate: as in the contiguous form.
        out: optional `[E, C, N]` (or `[E, C, N / 2]`) buffer.

    Returns:
        `[E, C, N]` (or `[E, C, N / 2]`).
    """
    return _nvfp4(
        a,
        a_scale,
        w,
        w_block_scale,
        w_global_scale,
        tokens_per_expert,
        True,
        activation,
        alpha,
        limit,
        out_dtype,
        out,
        validate,
    )


for _fn in (grouped_gemm_nvfp4_contiguous, grouped_gemm_nvfp4_masked):
    _fn.__doc__ = _fn.__doc__.replace("{weights}", _WEIGHTS_DOC).replace("{act}", _ACT_DOC)
