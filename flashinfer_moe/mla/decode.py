"""Paged MLA decode (the absorbed form of DeepSeek-V2/V3's attention) over a latent cache of bf16/fp16 or FP8
pages, with split-KV scheduled on the device.

A decode step is two calls, both host-sync free and CUDA-graph capturable::

    plan = mla_decode_plan(seq_lens, s_q, num_heads)        # split-KV schedule + workspace, on the device
    out = mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, sm_scale, plan=plan)

The plan depends on the values of ``seq_lens``: recompute it (into the same buffers, ``out=plan``) whenever they
change, e.g. both calls inside the captured graph. Sizes depend only on the batch, ``s_q`` and the head count.

Dimension legend: ``B`` sequences, ``s_q`` new tokens per sequence (1..8), ``Hq`` query heads, ``P`` pages of
the pool, ``page`` tokens per page (1, 16, 32, 64 or 128). Latent width 512, rope width 64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from flashinfer_moe import _checks
from flashinfer_moe import reference_mla as ref
from flashinfer_moe._ops import LIB, on_device

from . import decode_sm90
from .decode_checks import D_LATENT, D_ROPE, FP8, MAX_S_Q, PAGE_SIZES, Q_DTYPES  # noqa: F401 (re-exported)
from .decode_checks import caches as _caches
from .decode_checks import outputs as _outputs
from .decode_checks import queries as _queries
from .decode_checks import scale as _scale
from .decode_checks import seq_lens_arg as _seq_lens
from .decode_checks import table as _table
from .decode_configs import CONFIGS, TMA_CONFIGS, tma_layout

__all__ = ["MLADecodePlan", "mla_decode", "mla_decode_plan"]

UNIT, OVERHEAD, SNAP = 64, 2, 8  # the schedule's cost model (plan_kernel.py)
CPU_NUM_SMS = 8  # the schedule's program count where there are no SMs (the CPU path ignores it)

LIB.define("mla_decode_plan_(Tensor seq_lens, Tensor(a!) sched, int num_programs) -> ()")
LIB.define(
    "mla_decode_(Tensor q_nope, Tensor q_pe, Tensor ckv, Tensor kpe, Tensor block_table, Tensor seq_lens, "
    "Tensor sched, Tensor(a!) part_out, Tensor(b!) part_lse, Tensor(c!) out, Tensor(d!)? lse, float sm_scale, "
    "Tensor? kv_scale_tensor, float kv_scale, bool causal, int num_programs, int block_m, int block_n, "
    "int num_warps, int num_stages, int prefetch, int tma=0) -> ()"
)


def _on(t: torch.Tensor):
    """``on_device`` for a GPU tensor; nothing for a CPU one (the Triton interpreter's tests call the CUDA
    implementations on CPU tensors)."""
    return on_device(t) if t.is_cuda else contextlib.nullcontext()


def _plan_cpu(seq_lens, sched, num_programs):
    s = ref.mla_decode_split_plan(seq_lens, num_programs, UNIT, OVERHEAD, SNAP)
    batch = seq_lens.shape[0]
    sched[0], sched[1] = s["chunk"], s["total"]
    for i, key in enumerate(("starts", "ends", "splits", "slot")):
        sched[2 + i * batch : 2 + (i + 1) * batch] = s[key].to(torch.int32)
    sched[2 + 4 * batch :] = s["first_seq"].to(torch.int32)


def _plan_cuda(seq_lens, sched, num_programs):
    from . import plan_kernel

    with _on(seq_lens):
        plan_kernel.launch_plan(seq_lens, sched, num_programs)


def _decode_cpu(
    q_nope,
    q_pe,
    ckv,
    kpe,
    block_table,
    seq_lens,
    sched,
    part_out,
    part_lse,
    out,
    lse,
    sm_scale,
    kv_scale_tensor,
    kv_scale,
    causal,
    num_programs,
    block_m,
    block_n,
    num_warps,
    num_stages,
    prefetch,
    tma=0,
):
    scale = float(kv_scale_tensor.reshape(())) if kv_scale_tensor is not None else kv_scale
    o, s = ref.mla_decode(
        q_nope,
        q_pe,
        ckv[..., :D_LATENT],
        block_table,
        seq_lens,
        sm_scale,
        kpe_cache=kpe,
        kv_scale=scale,
        causal=causal,
        compute_dtype=torch.float32,
    )
    out.copy_(o)
    if lse is not None:
        lse.copy_(s)


def _decode_cuda(
    q_nope,
    q_pe,
    ckv,
    kpe,
    block_table,
    seq_lens,
    sched,
    part_out,
    part_lse,
    out,
    lse,
    sm_scale,
    kv_scale_tensor,
    kv_scale,
    causal,
    num_programs,
    block_m,
    block_n,
    num_warps,
    num_stages,
    prefetch,
    tma=0,
):
    from . import decode_kernel

    if decode_sm90.usable(q_nope, ckv, kpe, block_m):
        with _on(q_nope):
            decode_sm90.launch(
                q_nope, q_pe, ckv, kpe, block_table, seq_lens, sched, part_out, part_lse, out, lse, sm_scale, causal,
                num_programs, kv_scale_tensor if kv_scale_tensor is not None else kv_scale,
            )  # fmt: skip
        return
    config = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        PREFETCH=prefetch,
        TMA=tma > 0,
        SWAP=tma == 2,
    )
    scale = kv_scale_tensor if kv_scale_tensor is not None else kv_scale
    with _on(q_nope):
        decode_kernel.launch_decode(
            q_nope,
            q_pe,
            ckv,
            kpe,
            block_table,
            seq_lens,
            sched,
            part_out,
            part_lse,
            out,
            lse,
            sm_scale,
            scale,
            causal,
            num_programs,
            config,
        )


for _name, _cpu, _cuda in (("mla_decode_plan_", _plan_cpu, _plan_cuda), ("mla_decode_", _decode_cpu, _decode_cuda)):
    LIB.impl(_name, _cpu, "CPU")
    LIB.impl(_name, _cuda, "CUDA")
    torch.library.register_fake(f"flashinfer_moe::{_name}", lambda *args: None, lib=LIB)

# What the public functions call; the CPU tier points them at the CUDA implementations to run the Triton
# kernels in the interpreter on CPU tensors.
_plan_op = torch.ops.flashinfer_moe.mla_decode_plan_
_decode_op = torch.ops.flashinfer_moe.mla_decode_


# ------------------------------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class MLADecodePlan:
    """The split-KV schedule of one decode step and the workspace of its split sequences.

    Attributes:
        batch, s_q, num_heads: the shapes the plan serves.
        num_programs: attention programs per row block; also the most pieces one sequence is split into.
        block_m: (new token, head) rows per program.
        sched: `[2 + 4 B + num_programs]` int32 schedule (layout in ``plan_kernel.py``).
        part_out: `[S, s_q * Hq, 512]` fp32 partial outputs of split sequences (``S`` slots).
        part_lse: `[S, s_q * Hq]` fp32 their log2-sum-exp2.
    """

    batch: int
    s_q: int
    num_heads: int
    num_programs: int
    block_m: int
    sched: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.sched.device


def block_m_for(rows: int) -> int:
    """Rows per program for ``rows = s_q * Hq``: 16 and 32 fit the smallest tensor-core tiles; more take 64."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def make_plan(seq_lens: torch.Tensor, s_q: int, num_heads: int, num_programs: int, block_m: int) -> MLADecodePlan:
    """A plan with an explicit program count and row block (the public call derives both); allocates."""
    batch, rows = seq_lens.shape[0], s_q * num_heads
    # Every chunk boundary splits at most one sequence, and a split sequence holds at least one boundary.
    slots = max(1, min(batch + num_programs - 1, 2 * (num_programs - 1)))
    dev = seq_lens.device
    plan = MLADecodePlan(
        batch,
        s_q,
        num_heads,
        num_programs,
        block_m,
        torch.empty(2 + 4 * batch + num_programs, dtype=torch.int32, device=dev),
        torch.empty(slots, rows, D_LATENT, dtype=torch.float32, device=dev),
        torch.empty(slots, rows, dtype=torch.float32, device=dev),
    )
    _plan_op(seq_lens, plan.sched, num_programs)
    return plan


def mla_decode_plan(
    seq_lens: torch.Tensor,
    s_q: int,
    num_heads: int,
    *,
    num_sms: int | None = None,
    max_splits: int | None = None,
    kv_dtype: torch.dtype | None = None,
    out: MLADecodePlan | None = None,
) -> MLADecodePlan:
    """The split-KV schedule of a decode step, computed on the device from ``seq_lens`` (one kernel, no host
    sync, capturable in a CUDA graph), with the workspace that :func:`mla_decode` writes split sequences'
    partial results to.

    Sequences' costs are balanced over a fixed number of programs: long sequences are split, many short ones
    share a program; equal sequences go whole to the programs where that is at most ``SNAP`` schedule units (of
    64 tokens) longer than an even split, so that none is split and merged. The sizes depend only on ``B``,
    ``s_q`` and ``num_heads``, so a graph that captured this call and :func:`mla_decode` replays with new
    ``seq_lens`` values.

    Args:
        seq_lens: `[B]` int32 cached tokens per sequence (the new ones included).
        s_q: new tokens per sequence, 1..8.
        num_heads: query heads ``Hq``.
        num_sms: SMs to plan for; default the device's (8 on a CPU).
        max_splits: the most pieces one sequence may be split into (caps the program count).
        kv_dtype: the cache's dtype, to plan for the kernel that reads it: on Hopper, bf16/fp16 pages (the default)
            and FP8 pages (latent and rope) go to the CUDA kernels, planned as 64-row blocks and one program per
            SM; elsewhere the Triton one (either kind of kernel runs any plan correctly; a plan for the other one
            is slower).
        out: an earlier plan of the same ``B``, ``s_q``, ``num_heads`` and device to refill in place (no
            allocation); its program count is kept.

    Returns:
        The :class:`MLADecodePlan`.
    """
    seq_lens = _seq_lens(seq_lens)
    s_q = _checks.integer("s_q", s_q, 1, MAX_S_Q)
    num_heads = _checks.integer("num_heads", num_heads, 1)
    if out is not None:
        if not isinstance(out, MLADecodePlan):
            raise TypeError(f"out must be an MLADecodePlan, got {type(out).__name__}")
        got = (out.batch, out.s_q, out.num_heads, out.device)
        want = (seq_lens.shape[0], s_q, num_heads, seq_lens.device)
        if got != want:
            raise ValueError(f"out must be a plan for (B, s_q, num_heads, device) = {want}, got {got}")
        _plan_op(seq_lens, out.sched, out.num_programs)
        return out
    if num_sms is None:
        num_sms = _sm_count(seq_lens.device.index or 0) if seq_lens.is_cuda else CPU_NUM_SMS
    num_sms = _checks.integer("num_sms", num_sms, 1)
    block_m = block_m_for(s_q * num_heads)
    ctas_per_sm = CONFIGS[(block_m, False)]["ctas_per_sm"]
    if kv_dtype is not None and not isinstance(kv_dtype, torch.dtype):
        raise TypeError(f"kv_dtype must be a torch.dtype or None, got {type(kv_dtype).__name__}")
    if decode_sm90.planned_for(seq_lens.device, s_q * num_heads, kv_dtype):
        block_m, ctas_per_sm = decode_sm90.BLOCK_M, decode_sm90.CTAS_PER_SM
    row_blocks = -(-s_q * num_heads // block_m)
    programs = max(1, num_sms * ctas_per_sm // row_blocks)
    if max_splits is not None:
        programs = min(programs, _checks.integer("max_splits", max_splits, 1))
    return make_plan(seq_lens, s_q, num_heads, programs, block_m)


# ----------------------------------------------------------------------------------------------- decode


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    kpe_cache: torch.Tensor | None = None,
    kv_scale: float | torch.Tensor | None = None,
    causal: bool = True,
    plan: MLADecodePlan | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool = False,
):
    """MLA decode, absorbed form, over a paged latent cache: per head ``softmax(sm_scale * (q_nope . ckv +
    q_pe . kpe)) . ckv``, reading bf16/fp16 or FP8 pages directly (FP8 is widened on chip: in shared memory by
    the Hopper CUDA kernel, ``decode_sm90.py``, in registers by the Triton one; no dequantized copy of the
    cache). FP8 pages there take the products in fp16, with the queries times ``sm_scale`` rounded to fp16.

    Query ``i`` of the ``s_q`` new tokens (already in the cache, its last ``s_q`` positions) sees positions
    ``< seq_len - s_q + i + 1`` when ``causal``, all ``seq_len`` otherwise. A query that sees no position (e.g.
    ``seq_len`` 0) gets output 0 and LSE -inf. With ``plan`` and ``out`` given the call allocates nothing.

    Args:
        q_nope: `[B, s_q, Hq, 512]` bf16 or fp16, the queries projected into the latent space; ``s_q`` <= 8.
        q_pe: `[B, s_q, Hq, 64]` same dtype, the rope part.
        kv_cache: `[P, page, 576]` (512 latent then 64 rope) or, with ``kpe_cache``, `[P, page, 512]`; the
            queries' dtype or float8_e4m3fn; page in (1, 16, 32, 64, 128); unit stride in the last dimension
            (page and token strides are free, e.g. one layer's slice of a larger pool).
        block_table: `[B, max_pages]` int32 page ids of each sequence.
        seq_lens: `[B]` int32 cached tokens per sequence, the ``s_q`` new ones included.
        sm_scale: the scores' scale (e.g. ``192 ** -0.5`` for DeepSeek-V3, times any YaRN factor).
        kpe_cache: `[P, page, 64]` rope pages for the two-tensor layout; the latent's dtype, or bf16/fp16 (the
            queries' dtype) beside FP8 latent pages.
        kv_scale: for FP8 pages, the per-tensor dequantization factor (``real = stored * kv_scale``, SGLang's
            ``k_scale``): a float, or a 1-element float32 tensor on the device (for CUDA graphs); it applies
            to FP8 rope pages too. Required for FP8, ignored otherwise.
        causal: the mask among the new tokens (False: every query sees all ``seq_len`` positions).
        plan: from :func:`mla_decode_plan` for these ``seq_lens`` values; computed here when None.
        out: `[B, s_q, Hq, 512]` output buffer in the queries' dtype.
        lse: `[B, s_q, Hq]` float32 buffer for the log-sum-exp (natural log) of the scaled scores.
        return_lse: also return the LSE (allocated unless ``lse`` is given).
        validate: check on a GPU that ``seq_lens`` fit the block table (a host sync; always done on a CPU).

    Returns:
        ``out`` `[B, s_q, Hq, 512]`, or ``(out, lse)`` when ``return_lse`` or ``lse`` is given.
    """
    q_nope, q_pe = _queries(q_nope, q_pe)
    ckv, kpe = _caches(kv_cache, kpe_cache, q_nope)
    block_table, seq_lens = _table(block_table, seq_lens, q_nope, ckv.shape[1], validate)
    sm_scale = _checks.positive_float("sm_scale", sm_scale)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale_tensor, scale_value = _scale(kv_scale, ckv.dtype == FP8, q_nope)
    if return_lse and lse is None:
        lse = torch.empty(q_nope.shape[:3], dtype=torch.float32, device=q_nope.device)
    out, lse = _outputs(out, lse, q_nope)
    batch, s_q, heads, _ = q_nope.shape
    if plan is None:
        plan = mla_decode_plan(seq_lens, s_q, heads, kv_dtype=ckv.dtype)
    elif not isinstance(plan, MLADecodePlan):
        raise TypeError(f"plan must be an MLADecodePlan (from mla_decode_plan), got {type(plan).__name__}")
    elif (plan.batch, plan.s_q, plan.num_heads, plan.device) != (batch, s_q, heads, q_nope.device):
        raise ValueError(
            f"plan must be for (B, s_q, num_heads, device) = {(batch, s_q, heads, q_nope.device)}, "
            f"got {(plan.batch, plan.s_q, plan.num_heads, plan.device)}"
        )
    key = (plan.block_m, ckv.dtype == FP8)
    tma = key in TMA_CONFIGS and tma_layout(ckv, kpe, TMA_CONFIGS[key]["BLOCK_N"])
    config = dict(CONFIGS[key], PREFETCH=0, **TMA_CONFIGS[key]) if tma else CONFIGS[key]
    _decode_op(
        q_nope,
        q_pe,
        ckv,
        kpe,
        block_table,
        seq_lens,
        plan.sched,
        plan.part_out,
        plan.part_lse,
        out,
        lse,
        sm_scale,
        scale_tensor,
        scale_value,
        causal,
        plan.num_programs,
        plan.block_m,
        config["BLOCK_N"],
        config["num_warps"],
        config["num_stages"],
        config["PREFETCH"],
        1 + config["SWAP"] if tma else 0,
    )
    return (out, lse) if lse is not None else out
