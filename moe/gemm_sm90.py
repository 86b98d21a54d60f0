"""The Hopper FP8 block-scaled grouped GEMMs: CUTLASS's (``csrc/gemm/sm90_fp8_block_grouped*.cu``) and our own
wgmma kernel (``csrc/gemm/sm90_fp8_block_wgmma.cu``); ``pick`` chooses among them by shape.

It serves the block-scaled GEMM on sm_90 GPUs, where it overlaps the per-128 scale promotion with the tensor
cores better than the Triton kernel can: with bf16 output directly, and with a gated activation (GEMM1) in our
kernel's epilogue (bf16, fp32, or FP8 per 128 columns), or, where ``pick`` chooses a CUTLASS kernel, as a bf16
GEMM followed by ``moe/act_kernel.py``. Everything else, and every other GPU, stays on the Triton kernel
(``moe/gemm_kernel.py``). ``FLASHINFER_MOE_GEMM_BACKEND=triton`` turns it off. Dimension legend as in
``moe/gemm.py``.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from flashinfer_moe import envs
from flashinfer_moe._ops import check_launch, is_sm90, kernel_library, stream_of
from flashinfer_moe.errors import JitError
from flashinfer_moe.jit import KernelSpec, register

from .gemm_op import ACT_CODES
from .packed import PackedFp8BlockWeights

logger = logging.getLogger("flashinfer_moe")

SPEC = register(
    KernelSpec(
        "gemm_sm90",
        (
            "gemm/sm90_fp8_block_grouped_coop.cu",
            "gemm/sm90_fp8_block_grouped_pingpong.cu",
            "gemm/sm90_fp8_block_grouped_coop_n2.cu",
            "gemm/sm90_common.cu",
        ),
        # NDEBUG drops CUTLASS's device asserts, whose calls would make ptxas serialize the wgmma pipeline.
        ("-DNDEBUG",),
        header_sets=("cutlass",),
        archs=("90a",),  # wgmma, TMA and setmaxnreg: sm_90a exactly
        min_arch="90a",
    )
)

WGMMA_SPEC = register(
    KernelSpec(
        "gemm_sm90_wgmma",
        ("gemm/sm90_fp8_block_wgmma.cu", "gemm/sm90_common.cu"),
        archs=("90a",),  # wgmma, TMA (cp.async.bulk), mbarrier and setmaxnreg: sm_90a exactly
        min_arch="90a",
    )
)

# CUTLASS: coop: 128x128 tiles, both consumer warpgroups on one tile; pingpong: 64x128 tiles, one per
# warpgroup; coop_n2: coop in clusters of two CTAs sharing the activation tile (TMA multicast).
CUTLASS_CONFIGS = ("coop", "pingpong", "coop_n2")
# Ours: 128x128 tiles (the warpgroups split the rows), 64x256 (they split the columns), 128x256 (rows; each
# warpgroup runs its two 128-column halves in turn) and 128x256 in 64-column quarters (each promoted while the
# next one runs).
WGMMA_CONFIGS = {"wg128": "m128n128", "wg64": "m64n256", "wg128w": "m128n256", "wg128q": "m128n256s64"}
CONFIGS = (*CUTLASS_CONFIGS, *WGMMA_CONFIGS)
# Ours with GEMM1's activation in the epilogue: the 256-column tiles (one 128-column output group per tile).
GATED_CONFIGS = ("wg64", "wg128w", "wg128q")
# Ours that read packed weights (moe/packed.py): the same 256-column tiles, one packed piece of 256 rows
# per stage.
PACKED_CONFIGS = GATED_CONFIGS
_OUT_KINDS = {torch.bfloat16: 0, torch.float32: 1, torch.float8_e4m3fn: 2}

_vp, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {}
for _name in CUTLASS_CONFIGS:
    _SIGNATURES[f"fim_sm90_fp8_block_grouped_{_name}"] = (
        [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _int, _int, _int, _int, _int, _int, _vp, _i64, _int, _vp],
        _int,
    )
    _SIGNATURES[f"fim_sm90_fp8_block_grouped_{_name}_workspace"] = ([_int, _int], _i64)


_WGMMA_SIGNATURES = {
    f"fim_sm90_fp8_block_wgmma_{_suffix}": (
        [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _int, _int, _int, _int, _int, _int, _int, _int, _float, _float, _vp]
        + [_int, _int, _int, _vp],
        _int,
    )
    for _suffix in WGMMA_CONFIGS.values()
}


def _lib() -> ctypes.CDLL:
    return kernel_library("gemm_sm90", _SIGNATURES)


def _wgmma_lib() -> ctypes.CDLL:
    return kernel_library("gemm_sm90_wgmma", _WGMMA_SIGNATURES)


@functools.cache
def _headers_found() -> bool:
    try:
        from flashinfer_moe.jit.core import HEADER_SETS

        HEADER_SETS["cutlass"]()
        return True
    except JitError as e:
        logger.warning(
            "FP8 block-scaled grouped GEMM: no CUTLASS kernels on Hopper (our wgmma kernel serves up to %d experts,"
            " the Triton kernel more), because %s",
            WGMMA_MAX_EXPERTS,
            e,
        )
        return False


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def usable(a, w, out, a_scale, w_scale, n: int, k: int) -> bool:
    """Whether these kernels take the call: sm_90, dense 16-byte-aligned operands (``out`` None: a bf16 buffer
    the caller makes), and our wgmma kernel (up to ``WGMMA_MAX_EXPERTS`` experts) or CUTLASS's headers."""
    if envs.gemm_backend() == "triton" or not is_sm90(a.device.index) or n % 128 or k % 128:
        return False
    if out is not None and out.dtype != torch.bfloat16:
        return False
    if not all(t.is_contiguous() for t in (a, w, a_scale, w_scale, out) if t is not None):
        return False
    if any(t.data_ptr() % 16 for t in (a, w, out) if t is not None):
        return False
    return w.shape[0] <= WGMMA_MAX_EXPERTS or _headers_found()


def gated_output_ok(out, out_scale) -> bool:
    """Whether our kernel's activation epilogue can write GEMM1's output: dense, 16-byte aligned, bf16 or fp32,
    or e4m3 with its float32 scales `[rows, I / 128]`."""
    if not out.is_contiguous() or out.data_ptr() % 16:
        return False
    if out_scale is None:
        return out.dtype in (torch.bfloat16, torch.float32)
    return out.dtype == torch.float8_e4m3fn and out_scale.dtype == torch.float32 and out_scale.is_contiguous()


# On by default; launch/profile_gemm_sm90.py --gemm1 turns it off to time the split path in the same run.
FUSED_ACTIVATION = True


def pick_gated(rows: int, num_experts: int, capacity: int | None, n: int, k: int) -> tuple[str, int, str] | None:
    """``pick``'s choice for GEMM1 (``n = 2 I`` weight rows) when it is one of ours that runs the activation in
    its epilogue, else None (the caller splits: GEMM, then ``moe/act_kernel.py``)."""
    if not FUSED_ACTIVATION or n % 256:
        return None
    chosen = _buildable(pick(rows, num_experts, capacity, n, k), num_experts)
    return chosen if chosen[0] in GATED_CONFIGS else None


def pick_packed(rows: int, num_experts: int, capacity: int | None, n: int, k: int) -> tuple[str, int, str]:
    """``pick``'s choice for packed weights: one of ``PACKED_CONFIGS``, ``wg128w`` where ``pick`` chose another
    (with or without an activation: packed GEMM1 weights have no split path)."""
    chosen = pick(rows, num_experts, capacity, n, k)
    return chosen if chosen[0] in PACKED_CONFIGS else ("wg128w", *DEFAULT_ORDERS["wg128w"])


def _buildable(chosen: tuple[str, int, str], num_experts: int) -> tuple[str, int, str]:
    """``pick``'s ``chosen``, or the closest of ours where it is CUTLASS's and CUTLASS's headers are missing."""
    if chosen[0] in CUTLASS_CONFIGS and num_experts <= WGMMA_MAX_EXPERTS and not _headers_found():
        return "wg128w", *DEFAULT_ORDERS["wg128w"]  # docs/perf-notes.md
    return chosen


# Rows per expert from which GEMM1 with a gated activation runs as this GEMM plus a separate activation pass
# (moe/act_kernel.py) rather than the Triton kernel with the activation fused: measured on an H200
# (launch/profile_gemm_sm90.py --gemm1, docs/perf-notes.md): the split won at every size measured, down to one row.
SPLIT_MIN_ROWS_PER_EXPERT = 1


def _rows_per_expert(rows: int, num_experts: int, capacity: int | None) -> int:
    """The masked capacity, or the contiguous layout's mean rows per expert (rounded up)."""
    return capacity if capacity is not None else -(-rows // max(num_experts, 1))


def split_activation(rows: int, num_experts: int, capacity: int | None) -> bool:
    """Whether GEMM1 with an activation takes the split path; static facts only (graph-safe)."""
    return _rows_per_expert(rows, num_experts, capacity) >= SPLIT_MIN_ROWS_PER_EXPERT


# Contiguous groups up to this mean size take the 64-row tiles: with random top-8 routing (uneven groups) they
# led the 128-row ones at means of 128 and 192 rows, and trailed them at 256 (docs/perf-notes.md).
CONTIGUOUS_WG64_MAX_ROWS = 192

# Most experts the wgmma kernel takes (its per-expert tables live in shared memory).
WGMMA_MAX_EXPERTS = 1024

# Each configuration's best tile order on the benchmark shapes (launch/tune_gemm_sm90.py, docs/perf-notes.md).
DEFAULT_ORDERS = {
    "coop": (2, "m"),
    "pingpong": (2, "m"),
    "coop_n2": (1, "n"),
    "wg128": (4, "m"),  # never the fastest on the benchmark shapes; kept for the sweeps
    "wg64": (4, "n"),
    "wg128w": (1, "m"),
    "wg128q": (2, "m"),
}


def pick(rows: int, num_experts: int, capacity: int | None, n: int, k: int) -> tuple[str, int, str]:
    """``(config, swizzle, raster)`` for a shape; static facts only, so a captured graph replays what it captured."""
    per_expert = _rows_per_expert(rows, num_experts, capacity)
    # From launch/tune_gemm_sm90.py on an H200 (docs/perf-notes.md); neighbours in that sweep were within ~2 %.
    ours = num_experts <= WGMMA_MAX_EXPERTS
    if per_expert <= 64:  # weight-bandwidth bound: 64-row tiles waste fewer rows, 256 columns stream more
        return ("wg64", *DEFAULT_ORDERS["wg64"]) if ours else ("pingpong", 2, "m")
    if capacity is not None and per_expert <= 128:  # masked, every slot a row to compute
        return ("wg128q", *DEFAULT_ORDERS["wg128q"]) if ours else ("coop", 1, "n")
    if capacity is None and per_expert <= CONTIGUOUS_WG64_MAX_ROWS:
        # Routed groups of this mean size are uneven: 64-row tiles leave less of the last tile of each group
        # empty than 128-row ones (launch/tune_gemm_sm90.py --shapes routed).
        return ("wg64", 1, "m") if ours else ("coop", 1, "n")
    if n >= 2 * k and per_expert >= 1024:  # few, large groups with wide N: CUTLASS's activation multicast
        return "coop_n2", 1, "n"
    return ("wg128w", *DEFAULT_ORDERS["wg128w"]) if ours else ("coop", 2, "m")


RASTERS = {"auto": 0, "m": 1, "n": 2}


def launch(
    a,
    a_scale,
    w,
    w_scale,
    out,
    counts,
    offsets,
    capacity: int | None,
    config: str | None = None,
    swizzle: int = 1,
    raster: str = "m",
    *,
    activation: str | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    out_scale=None,
    packed: bool = False,
) -> None:
    """``out[rows of e] = (a * a_scale)[rows of e] @ (w[e] * w_scale[e])^T`` in one grouped kernel, or with an
    activation ``out[rows of e] = act(gate, up)`` of that product's two halves (GEMM1, our kernels only).

    Args:
        a: `[R, K]` e4m3 (contiguous layout) or `[E * C, K]` (masked, flattened).
        a_scale: `[R, K / 128]` float32.
        w: `[E, N, K]` e4m3, or with ``packed`` the `[E, N / 256, K / 128, 256, 128]` data of
            ``moe/packed.py`` (gate and up rows interleaved there when packed for an activation).
        w_scale: `[E, N / 128, K / 128]` float32.
        out: `[R, N]` bf16; with an activation `[R, N / 2]` bf16, float32, or e4m3 with ``out_scale``; rows of
            no expert are left as they are.
        counts: `[E]` int32 rows per expert (masked: clamped to ``capacity`` here).
        offsets: `[E + 1]` int32 first row of each expert (contiguous), or None (masked).
        capacity: ``C`` of the masked layout, or None.
        config: one of ``CONFIGS``; None picks it, the swizzle and the raster by shape (``pick``).
        swizzle: 1, 2, 4 or 8 tiles side by side in the order tiles are handed out (L2 reuse).
        raster: ``"m"`` (down the rows first), ``"n"``, or ``"auto"`` (CUTLASS decides).
        activation: None, ``"silu"`` (``silu(gate) * up``; gate rows ``[0, N / 2)`` of ``w``) or
            ``"clamped_silu"`` (gpt-oss, with ``alpha`` and ``limit``); N a multiple of 256.
        out_scale: `[R, N / 256]` float32 for an e4m3 ``out`` (one scale per row and 128 columns), else None.
        packed: ``w`` is packed; only our 256-column tiles read that (a pick of another runs ``wg128w``).
    """
    num_experts, n, k = PackedFp8BlockWeights(w, False).shape if packed else w.shape
    if activation not in ACT_CODES:
        raise ValueError(f"activation must be one of {list(ACT_CODES)}, got {activation!r}")
    gated = activation is not None
    if config is None and packed:
        config, swizzle, raster = pick_packed(a.shape[0], num_experts, capacity, n, k)
    elif config is None and gated:
        chosen = pick_gated(a.shape[0], num_experts, capacity, n, k)
        if chosen is None:
            raise ValueError(
                f"no kernel here runs the activation in its epilogue for E={num_experts}, N={n}, K={k}"
                " (pick_gated); run the GEMM and moe/act_kernel.py"
            )
        config, swizzle, raster = chosen
    elif config is None:
        config, swizzle, raster = _buildable(pick(a.shape[0], num_experts, capacity, n, k), num_experts)
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {CONFIGS}, got {config!r}")
    if packed and config not in PACKED_CONFIGS:  # N is a multiple of 256 by construction
        raise ValueError(f"packed weights need one of {PACKED_CONFIGS}, got config={config!r}")
    if gated and (config not in GATED_CONFIGS or n % 256):
        raise ValueError(
            f"an activation needs one of {GATED_CONFIGS} and N a multiple of 256, got config={config!r}, N={n}"
        )
    out_kind = _OUT_KINDS.get(out.dtype)
    if out_kind is None or (out_kind == 2) != (out_scale is not None) or (not gated and out_kind != 0):
        raise ValueError(
            "out must be bf16 without an activation; with one bf16, float32, or e4m3 with out_scale; got "
            f"out {out.dtype}, out_scale {'given' if out_scale is not None else None}, activation={activation!r}"
        )
    if swizzle not in (1, 2, 4, 8) or raster not in RASTERS:
        raise ValueError(f"swizzle must be 1, 2, 4 or 8 and raster one of {list(RASTERS)}, got {swizzle}, {raster!r}")
    sms = _sm_count(a.device.index)
    # Both libraries take the operands, the layout and the tile order in this order.
    operands = (
        a.data_ptr(),
        a_scale.data_ptr(),
        w.data_ptr(),
        w_scale.data_ptr(),
        out.data_ptr(),
        counts.data_ptr(),
        None if offsets is None else offsets.data_ptr(),
        0 if capacity is None else capacity,
        num_experts,
    )
    order = (swizzle, RASTERS[raster])
    if config in WGMMA_CONFIGS:
        if num_experts > WGMMA_MAX_EXPERTS:
            raise ValueError(f"the wgmma kernel takes at most {WGMMA_MAX_EXPERTS} experts, got {num_experts}")
        lib = _wgmma_lib()
        fn = getattr(lib, f"fim_sm90_fp8_block_wgmma_{WGMMA_CONFIGS[config]}")
        act = (ACT_CODES[activation], float(alpha), float(limit), None if out_scale is None else out_scale.data_ptr())
        status = fn(*operands, a.shape[0], n, k, *order, *act, out_kind, int(packed), sms, stream_of(a))
        check_launch(lib, status, f"grouped GEMM (wgmma {config}, E={num_experts}, N={n}, K={k})")
        return
    lib = _lib()
    size = getattr(lib, f"fim_sm90_fp8_block_grouped_{config}_workspace")(num_experts, sms)
    if size <= 0:
        raise RuntimeError(f"grouped GEMM workspace query failed for E = {num_experts}")
    workspace = torch.empty(size, dtype=torch.uint8, device=a.device)
    fn = getattr(lib, f"fim_sm90_fp8_block_grouped_{config}")
    status = fn(*operands, n, k, *order, workspace.data_ptr(), size, sms, stream_of(a))
    check_launch(lib, status, f"grouped GEMM (CUTLASS {config}, E={num_experts}, N={n}, K={k})")
