"""``MoEAllToAll``: expert-parallel dispatch and combine with a backend chosen once, collectively.

``backend="p2p"``: the one-shot kernels over a symmetric workspace (:mod:`flashinfer_moe.comm.p2p`).
``backend="nccl"``: :class:`~flashinfer_moe.comm.collective.CollectiveAllToAll` (NCCL on GPUs, gloo on CPUs).
``backend="auto"``: P2P when, on every rank, CUDA works, all ranks share one host, every pair of distinct GPUs
has peer access and native P2P atomics, the workspace maps, and a live flag check over it passes between every
pair of ranks; else the collective path, with ``fallback_reason`` saying why. Every rank takes the same decision.

Several ranks may share one GPU (one process each, e.g. to exercise the kernels on a one-GPU machine): their
buffers are mapped through CUDA IPC like any peer's, need no peer access, and the kernels' system-scope flags
work on local memory; their kernels are time-sliced, so the waits progress slowly but within their bounds.

Both backends return the same :class:`DispatchOutput` (same rows, order, padding, layout) and the same combine
sums, bit for bit. Construction checks each rank's arguments, then agrees in one small all-gather that every
rank's are valid and the same (:func:`~flashinfer_moe.comm.agreement.validate_collectively`): a bad argument on
any rank, or one that differs between ranks, raises ``ValueError``/``TypeError`` naming it on every rank, before
any other communication. Bad arguments of a call raise on the rank that got them, before any communication.

Dimension legend: ``T`` tokens on this rank, ``k`` top-k, ``H`` hidden size, ``E`` experts, ``W`` ranks,
``R`` rows received.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from flashinfer_moe import _checks, envs

from .agreement import validate_collectively
from .collective import CollectiveAllToAll, DispatchHandle, DispatchOutput, check_dispatch_inputs

__all__ = ["MoEAllToAll"]

_BACKENDS = ("auto", "p2p", "nccl")
_COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The live check's bound: the ranks have just met in the workspace exchange, so a healthy link answers in us.
_LIVE_CHECK_S = 10.0


def _gather(group, obj) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _first(reasons: list) -> str | None:
    found = [(r, why) for r, why in enumerate(reasons) if why]
    if not found:
        return None
    more = f" (and {len(found) - 1} more rank(s))" if len(found) > 1 else ""
    return f"rank {found[0][0]}: {found[0][1]}{more}"


class MoEAllToAll:
    """Dispatch/combine of one expert-parallel group (expert ``e`` lives on rank ``e // (E / W)``).

    Collective to construct: every rank of ``group`` builds it at the same point with the same arguments (checked:
    an argument that is bad on any rank, or differs between ranks, raises on every rank).

    Args:
        group: the ``torch.distributed`` process group (None: the default group).
        num_experts: ``E``, divisible by the group size.
        top_k: ``k``.
        hidden_size: ``H``.
        max_tokens_per_rank: the most tokens a rank dispatches in one call.
        dtype: dtype of the dispatched hidden states; ``torch.float8_e4m3fn`` sends FP8 rows (pass their
            per-128 scales as ``scales``).
        mode: ``"high_throughput"`` (exact row counts, one host sync) or ``"low_latency"`` (fixed blocks of
            ``max_tokens_per_rank`` rows per source rank, no host sync, CUDA-graph capturable, plus the masked
            expert-major layout `[E / W, capacity, H]` that the masked grouped GEMM consumes).
        backend: ``"auto"``, ``"p2p"`` or ``"nccl"``.
        capacity: low-latency: slots per local expert of the masked layout (default ``W * max_tokens_per_rank``).
        combine_dtype: dtype of combine's input and output; default ``dtype`` for 16/32-bit floats, else bf16.
        scale_groups: floats of scales per token a dispatch may carry; default ``ceil(H / 128)``.
        timeout_s: bound of every wait (default ``FLASHINFER_MOE_A2A_TIMEOUT_S``); the first P2P calls wait up
            to ``FLASHINFER_MOE_A2A_FIRST_TIMEOUT_S``.
        fallback_on_timeout: after a P2P timeout, :meth:`recover` moves every rank to the collective path.
        validate: check the ids' range on the host (one sync; skipped while capturing a graph).
        handle_type: the P2P workspace's handles: ``"auto"``, ``"ipc"`` or ``"fabric"``.

    Attributes:
        backend: ``"p2p"`` or ``"nccl"`` (the collective path, which runs on gloo for CPU groups).
        fallback_reason: why ``"auto"`` (or the timeout policy) did not end on P2P; None otherwise.
    """

    def __init__(
        self,
        group,
        *,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        max_tokens_per_rank: int,
        dtype: torch.dtype = torch.bfloat16,
        mode: str = "high_throughput",
        backend: str = "auto",
        capacity: int | None = None,
        combine_dtype: torch.dtype | None = None,
        scale_groups: int | None = None,
        timeout_s: float | None = None,
        fallback_on_timeout: bool = False,
        validate: bool = True,
        handle_type: str = "auto",
    ):
        if not dist.is_initialized():
            raise ValueError("group must come from an initialized torch.distributed, got no process group")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

        # Every check is local; validate_collectively then makes every rank raise when any rank's arguments
        # are bad or the ranks' arguments differ, before the first collective that depends on them.
        def check() -> None:
            self.num_experts = _checks.integer("num_experts", num_experts, 1)
            if num_experts % self.world_size:
                raise ValueError(
                    f"num_experts must be divisible by the group size {self.world_size}, got {num_experts}"
                )
            self.experts_per_rank = num_experts // self.world_size
            self.top_k = _checks.integer("top_k", top_k, 1, num_experts)
            self.hidden_size = _checks.integer("hidden_size", hidden_size, 1)
            self.max_tokens_per_rank = _checks.integer("max_tokens_per_rank", max_tokens_per_rank, 0, 2**31 - 1)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
            self.dtype = dtype
            combine = combine_dtype
            if combine is None:
                combine = dtype if dtype in _COMBINE_DTYPES else torch.bfloat16
            if combine not in _COMBINE_DTYPES:
                raise TypeError(f"combine_dtype must be one of bfloat16, float16, float32, got {combine!r}")
            self.combine_dtype = combine
            default_groups = -(-hidden_size // 128)
            self.scale_groups = (
                default_groups if scale_groups is None else _checks.integer("scale_groups", scale_groups, 0)
            )
            if mode not in ("high_throughput", "low_latency"):
                raise ValueError(f"mode must be 'high_throughput' or 'low_latency', got {mode!r}")
            self.mode = mode
            if backend not in _BACKENDS:
                raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
            rows = self.world_size * self.max_tokens_per_rank
            self.capacity = rows if capacity is None else _checks.integer("capacity", capacity, 0)
            self.timeout_s = envs.a2a_timeout_s() if timeout_s is None else float(timeout_s)
            if not self.timeout_s > 0:
                raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
            if handle_type not in ("auto", "ipc", "fabric"):
                raise ValueError(f"handle_type must be 'auto', 'ipc' or 'fabric', got {handle_type!r}")
            if backend == "p2p" and not torch.cuda.is_available():
                raise ValueError(
                    "backend='p2p' needs a CUDA GPU on every rank, got none (torch.cuda.is_available() is False); "
                    "use backend='auto' or 'nccl'"
                )
            self.fallback_on_timeout = bool(fallback_on_timeout)
            self.validate = bool(validate)

        agreed = dict(
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden_size,
            max_tokens_per_rank=max_tokens_per_rank,
            dtype=dtype,
            mode=mode,
            backend=backend,
            capacity=capacity,
            combine_dtype=combine_dtype,
            scale_groups=scale_groups,
            timeout_s=timeout_s,
            fallback_on_timeout=fallback_on_timeout,
            validate=validate,
            handle_type=handle_type,
        )
        validate_collectively(group, "MoEAllToAll", agreed, check)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.fallback_reason: str | None = None
        self._impl = None
        if backend != "nccl":
            self._impl, self.fallback_reason = self._try_p2p(handle_type, required=backend == "p2p")
        if self._impl is None:
            self._impl = self._collective()
            self.backend = "nccl"
        else:
            self.backend = "p2p"

    # --------------------------------------------------------------------------------- backend choice

    def _collective(self) -> CollectiveAllToAll:
        return CollectiveAllToAll(
            self.group,
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden_size=self.hidden_size,
            max_tokens_per_rank=self.max_tokens_per_rank,
            dtype=self.dtype,
            mode=self.mode,
            capacity=self.capacity,
            timeout_s=self.timeout_s,
            validate=False,  # checked here, once
        )

    def _local_blocker(self) -> tuple[str | None, str, str]:
        """(why this rank cannot take P2P or None, host, GPU uuid). Compiles and loads the kernels here, so
        that a compile error shows as a reason on every rank instead of one rank failing alone."""
        host = socket.gethostname()
        if not torch.cuda.is_available():
            return "CUDA is not available (torch.cuda.is_available() is False)", host, ""
        if self.world_size > 64:
            return f"the P2P backend supports at most 64 ranks, got {self.world_size}", host, ""
        try:
            from . import p2p_check
            from ._kernels import check, comm_lib

            with torch.cuda.device(self.device):
                check(comm_lib().fim_a2a_preload(), "loading the all-to-all kernels")
            p2p_check._lib()  # the peer attributes come from the probe's kernels
            return None, host, str(torch.cuda.get_device_properties(self.device).uuid)
        except Exception as exc:  # any failure here is a reason to fall back, on every rank alike
            return f"the P2P kernels are unavailable: {type(exc).__name__}: {exc}", host, ""

    def _pair_blocker(self, uuids: list[str]) -> str | None:
        from .p2p_check import pair_attributes

        local = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
        me = self.device.index
        for peer, uuid in enumerate(uuids):
            # A rank on this very GPU (ranks sharing a GPU) needs no peer access: its buffer is local memory,
            # and the runtime's peer queries refuse the pair (d, d), which would wrongly rule P2P out.
            if peer == self.rank or uuid == uuids[self.rank]:
                continue
            if uuid not in local:
                return (
                    f"the GPU of rank {peer} is not visible here (CUDA_VISIBLE_DEVICES); peer access cannot be set up"
                )
            attrs = pair_attributes(me, local[uuid])
            if not attrs.can_access_peer:
                return f"GPU {me} cannot access the GPU of rank {peer} (no peer access)"
            if not attrs.native_atomics:
                return f"GPU {me} -> GPU of rank {peer}: no native P2P atomics"
        return None

    def _try_p2p(self, handle_type: str, required: bool):
        """Collective. Returns (P2PAllToAll, None) or (None, reason); with ``required`` a failure raises on every
        rank instead."""
        blocker, host, uuid = self._local_blocker()
        votes = _gather(self.group, (blocker, host, uuid))
        reason = _first([v[0] for v in votes])
        if reason is None and len({v[1] for v in votes}) > 1 and handle_type != "fabric":
            reason = (
                f"the ranks span {len({v[1] for v in votes})} hosts; the P2P backend maps peers on one node "
                "(pass handle_type='fabric' for multi-node NVLink)"
            )
        if reason is None and len({v[1] for v in votes}) == 1:
            try:
                blocker = self._pair_blocker([v[2] for v in votes])
            except Exception as exc:
                blocker = f"peer attributes: {type(exc).__name__}: {exc}"
            reason = _first(_gather(self.group, blocker))
        impl = None
        if reason is None:
            from .p2p import P2PAllToAll

            try:
                impl = P2PAllToAll(
                    self.group,
                    num_experts=self.num_experts,
                    top_k=self.top_k,
                    hidden_size=self.hidden_size,
                    max_tokens_per_rank=self.max_tokens_per_rank,
                    dtype=self.dtype,
                    combine_dtype=self.combine_dtype,
                    scale_groups=self.scale_groups,
                    mode=self.mode,
                    capacity=self.capacity,
                    timeout_s=self.timeout_s,
                    handle_type=handle_type,
                )
            except RuntimeError as exc:  # the workspace's failures are collective: every rank gets here
                reason = f"the symmetric workspace could not be mapped: {exc}"
        if impl is not None:
            # Every pair of ranks, those sharing a GPU included: for them the writer and the waiter are kernels
            # of two processes on that one GPU, so the check runs there alone and proves what the all-to-all
            # needs of such a pair (IPC mapping of local memory, system-scope flags between time-sliced
            # contexts). It is not skipped: it is the only check such a pair gets.
            check = impl.live_check(min(_LIVE_CHECK_S, self.timeout_s))
            reason = _first(_gather(self.group, check))
            if reason is not None:
                reason = f"live flag check over the workspace failed: {reason}"
                impl.close()
                impl = None
        if impl is None and required:
            raise RuntimeError(f"backend='p2p' is not possible: {reason}; use backend='auto' or 'nccl'")
        return impl, reason

    # ------------------------------------------------------------------------------------- validation

    def _check_dispatch(self, hidden_states, topk_ids, topk_weights, scales):
        h, ids, w = check_dispatch_inputs(self, hidden_states, topk_ids, topk_weights)
        if self.backend == "p2p" and h.device != self.device:
            raise ValueError(f"hidden_states must be on {self.device} (the communicator's GPU), got {h.device}")
        if scales is not None:
            scales = _checks.tensor("scales", scales)
            _checks.dtype_in("scales", scales, (torch.float32,))
            if tuple(scales.shape) != (h.shape[0], self.scale_groups):
                raise ValueError(f"scales must have shape ({h.shape[0]}, {self.scale_groups}) (scale_groups), "
                                 f"got {tuple(scales.shape)}")  # fmt: skip
            _checks.same_device("scales", scales, "hidden_states", h)
        return h, ids, w, scales

    # ---------------------------------------------------------------------------------------- the calls

    def dispatch(self, hidden_states, topk_ids, topk_weights, *, scales=None) -> DispatchOutput:
        """Sends each token once to every rank that holds one of its experts.

        Args:
            hidden_states: `[T, H]` of ``dtype``, ``T <= max_tokens_per_rank``.
            topk_ids: `[T, k]` int32 (or int64) GLOBAL expert ids, -1 for none.
            topk_weights: `[T, k]` float32.
            scales: optional `[T, scale_groups]` float32 (FP8 rows: one scale per 128 channels). Pass them on
                every rank or on none.

        Returns:
            :class:`DispatchOutput`: rows `[R, H]` grouped by source rank (ascending), tokens ascending within
            each; ``topk_ids`` LOCAL (-1 for experts elsewhere); ``tokens_per_expert`` `[E / W]`; the handle for
            :meth:`combine`. Low-latency: `R = W * max_tokens_per_rank` (padding rows have ids -1, weights 0),
            plus ``layout``, ``expert_hidden_states`` `[E / W, capacity, H]` and ``expert_scales``.
        """
        h, ids, w, scales = self._check_dispatch(hidden_states, topk_ids, topk_weights, scales)
        return self._impl.dispatch(h, ids, w, scales=scales)

    def combine(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Brings each received row back to its token and sums over the ranks (fp32, ranks ascending).

        Args:
            x: `[R, H]` in ``combine_dtype``, the rows this rank computed for what it received (routing
                weights applied).
            handle: from the matching :meth:`dispatch`.

        Returns:
            `[T, H]` in ``combine_dtype``; tokens sent nowhere are zero.
        """
        x = _checks.tensor("x", x)
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be the DispatchHandle of a dispatch, got {type(handle).__name__}")
        rows = sum(handle.recv_counts)
        if x.dtype != self.combine_dtype or tuple(x.shape) != (rows, self.hidden_size):
            raise ValueError(f"x must be [{rows}, {self.hidden_size}] {self.combine_dtype} (combine_dtype), "
                             f"got {tuple(x.shape)} {x.dtype}")  # fmt: skip
        if self.backend == "p2p" and x.device != self.device:
            raise ValueError(f"x must be on {self.device} (the communicator's GPU), got {x.device}")
        return self._impl.combine(x, handle)

    def check(self) -> None:
        """Waits for the current stream and raises the error a P2P kernel recorded (low-latency calls and
        combines report a timeout only here or at the next call). Nothing to do on the collective path."""
        if self.backend == "p2p":
            self._impl.check(synchronize=True)

    def recover(self) -> None:
        """After a :class:`~flashinfer_moe.CommTimeoutError` on the P2P path: every rank calls this (collective),
        the ones that saw the error and the ones that did not. The ranks agree on where the call sequence
        stands and the next calls succeed; with ``fallback_on_timeout`` every rank moves to the collective path
        instead. The collective path cannot be recovered (NCCL aborts the group on a timeout): build a new
        process group."""
        if self.backend != "p2p":
            if getattr(self._impl, "_aborted", None):
                raise RuntimeError(
                    f"the collective all-to-all was aborted after a timeout ({self._impl._aborted}); it cannot be "
                    "recovered: build a new process group and a new MoEAllToAll"
                )
            return
        errors = self._impl.recover()
        if errors and self.fallback_on_timeout:
            self._impl.close()
            self._impl = self._collective()
            self.backend = "nccl"
            self.fallback_reason = f"the P2P all-to-all failed ({errors[0]}); continuing on the collective path"

    def close(self) -> None:
        """Releases the P2P workspace (idempotent). Call it on every rank at the same point."""
        if self.backend == "p2p":
            self._impl.close()

    def __repr__(self) -> str:
        return (
            f"MoEAllToAll(rank={self.rank}/{self.world_size}, backend={self.backend!r}, mode={self.mode!r}, "
            f"E={self.num_experts}, k={self.top_k}, H={self.hidden_size}, M={self.max_tokens_per_rank}, "
            f"dtype={self.dtype}, fallback_reason={self.fallback_reason!r})"
        )
