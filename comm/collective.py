"""Expert-parallel dispatch and combine over ``torch.distributed.all_to_all_single``: the NCCL path on GPUs,
and the gloo path on CPUs.

Every rank holds ``E / world`` experts (expert ``e`` lives on rank ``e // (E / world)``). Dispatch sends each
token once to every rank that holds one of its experts; combine brings back, for every token, the sum over
those ranks of the row each computed for it.

Dispatch exchanges the per-destination row counts first, then one packed payload (hidden row, ids,
weights, scales as bytes). On GPUs the packing, the unpacking and combine's sum are one kernel launch each
(:mod:`~flashinfer_moe.comm.collective_rows`), so an eager call is a few launches around its collectives. Every wait is bounded: a step whose peers do not arrive within
``timeout_s`` raises :class:`~flashinfer_moe.CommTimeoutError` naming the ranks that never reached it (read from
the process group's store where it is reachable), instead of hanging.

Dimension legend: ``T`` tokens on this rank, ``k`` top-k, ``H`` hidden size, ``E`` experts, ``W`` ranks,
``R`` rows received by this rank.
"""

from __future__ import annotations

import datetime
import itertools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashinfer_moe import _checks, envs
from flashinfer_moe.errors import CommTimeoutError
from flashinfer_moe.layout import ExpertLayout
from flashinfer_moe.moe.layout import moe_align_masked
from flashinfer_moe.moe.permute import permute

from . import collective_rows as _rows

__all__ = ["CollectiveAllToAll", "DispatchHandle", "DispatchOutput", "check_dispatch_inputs"]

_instances = itertools.count()


def _capturing() -> bool:
    # The CPU build of torch raises on the query itself.
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_dispatch_inputs(comm, hidden_states, topk_ids, topk_weights):
    """``(hidden_states, topk_ids, topk_weights)`` checked against a communicator's configuration (``dtype``,
    ``hidden_size``, ``max_tokens_per_rank``, ``top_k``, ``num_experts``, ``validate``, ``mode``): `[T, H]` and
    `[T, k]` shapes, dtypes, devices, and ids in ``[-1, E)`` (one host sync; skipped without ``validate`` and
    while a low-latency call is captured). Raised before any collective, on every rank."""
    h = _checks.tensor("hidden_states", hidden_states)
    _checks.ndim("hidden_states", h, 2, "[num_tokens, hidden_size]")
    if h.dtype != comm.dtype or h.shape[1] != comm.hidden_size:
        raise ValueError(
            f"hidden_states must be [T, {comm.hidden_size}] {comm.dtype} as the communicator was built, "
            f"got {tuple(h.shape)} {h.dtype}"
        )
    if h.shape[0] > comm.max_tokens_per_rank:
        raise ValueError(f"hidden_states must have at most max_tokens_per_rank = {comm.max_tokens_per_rank} "
                         f"tokens, got {h.shape[0]}")  # fmt: skip
    top_k, num_experts = comm.top_k, comm.num_experts
    check_range = comm.validate and not (comm.mode == "low_latency" and _capturing())
    ids = _checks.tensor("topk_ids", topk_ids)
    _checks.dtype_in("topk_ids", ids, (torch.int32, torch.int64))
    if tuple(ids.shape) != (h.shape[0], top_k):
        raise ValueError(f"topk_ids must have shape ({h.shape[0]}, {top_k}), got {tuple(ids.shape)}")
    _checks.same_device("topk_ids", ids, "hidden_states", h)
    if check_range and ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= num_experts):
        raise ValueError(f"topk_ids must lie in [-1, num_experts) = [-1, {num_experts}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")  # fmt: skip
    w = _checks.tensor("topk_weights", topk_weights)
    _checks.dtype_in("topk_weights", w, (torch.float32,))
    if w.shape != ids.shape:
        raise ValueError(f"topk_weights must have shape {tuple(ids.shape)}, got {tuple(w.shape)}")
    _checks.same_device("topk_weights", w, "hidden_states", h)
    return h, ids, w


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """What combine needs to send rows back: the counts both ways (low-latency: ``max_tokens_per_rank`` each way)
    and the row each token took in each destination's block.
    """

    send_counts: tuple[int, ...]  # rows this rank sent to each rank
    recv_counts: tuple[int, ...]  # rows this rank received from each rank
    num_tokens: int
    slot: torch.Tensor | None = None  # [T, W]: the token's row in rank d's block, or -1


@dataclass(frozen=True, eq=False)
class DispatchOutput:
    """The rows a rank received. Rows come grouped by source rank (ascending), tokens ascending within each.
    In the low-latency layout each source rank has a fixed block of ``max_tokens_per_rank`` rows; rows past
    its count are padding, with every id -1, weight 0 and unspecified hidden states.

    Attributes:
        hidden_states: `[R, H]`.
        scales: `[R, groups]` float32 when scales were dispatched, else None.
        topk_ids: `[R, k]` int32 LOCAL expert ids, -1 for experts on other ranks (and padding).
        topk_weights: `[R, k]` float32.
        tokens_per_expert: `[E / W]` int32, pairs received per local expert (low-latency: at most the capacity).
        handle: for :meth:`CollectiveAllToAll.combine`.
        layout: low-latency only: the masked expert-major layout of the received pairs (pairs past the
            capacity are dropped and counted in ``layout.overflow``).
        expert_hidden_states: low-latency only: `[E / W, capacity, H]`, the rows in that layout.
        expert_scales: low-latency only, with scales: `[E / W, capacity, groups]`.
    """

    hidden_states: torch.Tensor
    scales: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: DispatchHandle
    layout: ExpertLayout | None = None
    expert_hidden_states: torch.Tensor | None = None
    expert_scales: torch.Tensor | None = None


class CollectiveAllToAll:
    """Dispatch/combine of one expert-parallel group over collectives.

    ``mode="high_throughput"`` (prefill) sends exactly the rows each rank needs, after exchanging the counts
    (one host sync for the split sizes). ``mode="low_latency"`` (decode) sends every rank a fixed block of
    ``max_tokens_per_rank`` rows, so nothing waits for the host and the calls can be captured in a CUDA
    graph; it also returns the received pairs in the masked expert-major layout that the masked grouped GEMM
    consumes.

    Args:
        group: the ``torch.distributed`` process group (None: the default group). NCCL for CUDA tensors,
            gloo for CPU tensors.
        num_experts: ``E``, divisible by the group size.
        top_k: ``k``.
        hidden_size: ``H``.
        max_tokens_per_rank: the most tokens any rank dispatches in one call.
        dtype: dtype of the hidden states.
        mode: ``"high_throughput"`` or ``"low_latency"``.
        capacity: low-latency: slots per local expert of the masked layout; default every row a rank can
            receive (``W * max_tokens_per_rank``), so that nothing is ever dropped.
        timeout_s: bound of every wait; default ``FLASHINFER_MOE_A2A_TIMEOUT_S`` (30 s). Not polled while a
            CUDA graph is being captured.
        validate: check the ids' range on the host (one sync); low-latency calls skip it while capturing.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        max_tokens_per_rank: int,
        dtype: torch.dtype = torch.bfloat16,
        mode: str = "high_throughput",
        capacity: int | None = None,
        timeout_s: float | None = None,
        validate: bool = True,
    ):
        if not dist.is_initialized():
            raise ValueError("group must come from an initialized torch.distributed, got no process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.num_experts = _checks.integer("num_experts", num_experts, 1)
        if num_experts % self.world_size:
            raise ValueError(f"num_experts must be divisible by the group size {self.world_size}, got {num_experts}")
        self.experts_per_rank = num_experts // self.world_size
        self.top_k = _checks.integer("top_k", top_k, 1, num_experts)
        self.hidden_size = _checks.integer("hidden_size", hidden_size, 1)
        self.max_tokens_per_rank = _checks.integer("max_tokens_per_rank", max_tokens_per_rank, 0)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.dtype = dtype
        if mode not in ("high_throughput", "low_latency"):
            raise ValueError(f"mode must be 'high_throughput' or 'low_latency', got {mode!r}")
        self.mode = mode
        rows = self.world_size * self.max_tokens_per_rank
        self.capacity = rows if capacity is None else _checks.integer("capacity", capacity, 0)
        self.validate = bool(validate)
        self.timeout_s = envs.a2a_timeout_s() if timeout_s is None else float(timeout_s)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.epoch = 0
        self._aborted: str | None = None
        self._uid = next(_instances)  # the same on every rank when ranks build communicators in the same order

    # ------------------------------------------------------------------------------------------ waits

    def _store(self):
        try:  # private in torch; without it the peers named are every other rank
            return dist.distributed_c10d._get_default_store()
        except Exception:
            return None

    def _key(self, rank: int) -> str:
        # By global rank: the store is the whole job's, and processes of other groups write to it too.
        global_rank = rank if self.group is None else dist.get_global_rank(self.group, rank)
        return f"flashinfer_moe/a2a/{self._uid}/rank{global_rank}"

    def _arrive(self) -> None:
        """Starts a call: advances the epoch and records it under this rank's one key (overwritten, so the
        store does not grow), for a peer that times out to see who never came."""
        self.epoch += 1
        store = None if _capturing() else self._store()
        if store is not None:
            store.set(self._key(self.rank), str(self.epoch))

    def _late_peers(self) -> tuple[int, ...]:
        others = tuple(r for r in range(self.world_size) if r != self.rank)
        store = self._store()
        if store is None:
            return others
        try:
            late = tuple(
                r for r in others if not store.check([self._key(r)]) or int(store.get(self._key(r))) < self.epoch
            )
        except Exception:  # the store's host may be gone too: no one can be ruled out
            return others
        return late or others

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, phase: str) -> None:
        if self._aborted is not None:
            raise CommTimeoutError(
                f"all-to-all {phase} on rank {self.rank}: this communicator was aborted after a timeout "
                f"({self._aborted}); build a new process group",
                phase=phase, rank=self.rank, peers=(), epoch=self.epoch,
            )  # fmt: skip
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        deadline = time.monotonic() + self.timeout_s
        try:
            if out.is_cuda:
                # NCCL's wait only orders the current stream (it returns at once); completion is polled
                # against the deadline, since a collective whose peer never comes spins on the GPU forever.
                work.wait()
                if _capturing():
                    return
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise RuntimeError("the collective did not complete")
                    time.sleep(20e-6)
            else:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            peers = self._late_peers()
            message = (
                f"all-to-all {phase} (epoch {self.epoch}) on rank {self.rank} timed out after {self.timeout_s:g} s; "
                f"rank(s) {', '.join(map(str, peers))} did not arrive ({exc})"
            )
            if out.is_cuda:
                self._abort(message)
            raise CommTimeoutError(message, phase=phase, rank=self.rank, peers=peers, epoch=self.epoch) from None

    def _abort(self, reason: str) -> None:
        # The stuck NCCL kernel holds the stream: aborting the communicator ends it, so the process (and its
        # CUDA context) stays usable; the group itself is gone.
        self._aborted = reason
        group = self.group if self.group is not None else dist.group.WORLD
        try:
            group.abort()
        except Exception:
            dist.distributed_c10d._abort_process_group(group)

    # ---------------------------------------------------------------------------------------- dispatch

    def _check_dispatch(self, hidden_states, topk_ids, topk_weights, scales):
        h, ids, w = check_dispatch_inputs(self, hidden_states, topk_ids, topk_weights)
        if scales is not None:
            scales = _checks.tensor("scales", scales)
            _checks.dtype_in("scales", scales, (torch.float32,))
            if scales.dim() != 2 or scales.shape[0] != h.shape[0]:
                raise ValueError(f"scales must be [{h.shape[0]}, groups], got {tuple(scales.shape)}")
            _checks.same_device("scales", scales, "hidden_states", h)
        return h, ids, w, scales

    def dispatch(self, hidden_states, topk_ids, topk_weights, *, scales=None) -> DispatchOutput:
        """Send each token to every rank that holds one of its experts.

        Args:
            hidden_states: `[T, H]` of the communicator's dtype (FP8 included), ``T <= max_tokens_per_rank``.
            topk_ids: `[T, k]` int32/int64 GLOBAL expert ids, -1 for none.
            topk_weights: `[T, k]` float32.
            scales: optional `[T, groups]` float32 (FP8 payloads), sent along with the rows.

        Returns:
            The :class:`DispatchOutput` of this rank.
        """
        h, ids, w, scales = self._check_dispatch(hidden_states, topk_ids, topk_weights, scales)
        self._arrive()
        world, per_rank, m = self.world_size, self.experts_per_rank, self.max_tokens_per_rank
        fmt = _rows.Format(h.shape[1] * h.element_size(), self.top_k, 4 * scales.shape[1] if scales is not None else 0)
        group = dict(world=world, num_experts=self.num_experts, per_rank=per_rank)
        low_latency = self.mode == "low_latency"
        if low_latency:  # a fixed block of M rows each way: nothing waits for the host
            send_counts = recv_counts = (m,) * world
            offsets = _rows.starts(send_counts)
            send, slot = _rows.pack(fmt, h, ids, w, scales, **group, offsets=offsets, rows=world * m, pad_to=m)
            received = torch.empty(world * m, fmt.row_bytes, dtype=torch.uint8, device=h.device)
            self._all_to_all(received, send, None, None, "dispatch payload")
        else:
            counts = _rows.count(fmt, h, ids, w, scales, **group)
            recv = torch.empty_like(counts)
            self._all_to_all(recv, counts, None, None, "dispatch counts")
            send_counts, recv_counts = tuple(counts.tolist()), tuple(recv.tolist())  # one host sync for the splits
            offsets = _rows.starts(send_counts)
            send, slot = _rows.pack(fmt, h, ids, w, scales, **group, offsets=offsets, rows=sum(send_counts))
            received = torch.empty(sum(recv_counts), fmt.row_bytes, dtype=torch.uint8, device=h.device)
            self._all_to_all(received, send, list(recv_counts), list(send_counts), "dispatch payload")
        rows_h, local_ids, rows_w, rows_s, counts = _rows.unpack(
            fmt, received, h.dtype, first=self.rank * per_rank, per_rank=per_rank, count_experts=not low_latency
        )
        handle = DispatchHandle(send_counts, recv_counts, h.shape[0], slot)
        if not low_latency:
            return DispatchOutput(rows_h, rows_s, local_ids, rows_w, counts, handle)
        layout = moe_align_masked(local_ids, per_rank, self.capacity, validate=False)
        expert_h = _permute_any(rows_h, layout)
        expert_s = _permute_any(rows_s, layout) if rows_s is not None else None
        return DispatchOutput(
            rows_h, rows_s, local_ids, rows_w, layout.tokens_per_expert, handle, layout, expert_h, expert_s
        )

    def combine(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Bring each received row back to its token and sum per token over the ranks (fp32, ranks ascending).

        Args:
            x: `[R, H]`, the rows this rank computed for what it received, routing weights already applied.
            handle: from the matching :meth:`dispatch`.

        Returns:
            `[T, H]` in ``x``'s dtype; tokens sent nowhere are zero.
        """
        x = _checks.tensor("x", x)
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be the DispatchHandle of a dispatch, got {type(handle).__name__}")
        if tuple(x.shape) != (sum(handle.recv_counts), self.hidden_size):
            raise ValueError(f"x must have shape ({sum(handle.recv_counts)}, {self.hidden_size}), got {tuple(x.shape)}")
        self._arrive()
        back = torch.empty(sum(handle.send_counts), self.hidden_size, dtype=x.dtype, device=x.device)
        split = self.mode != "low_latency"
        self._all_to_all(
            back.view(torch.uint8),
            x.contiguous().view(torch.uint8),
            list(handle.send_counts) if split else None,
            list(handle.recv_counts) if split else None,
            "combine",
        )
        return _rows.combine_rows(back, handle.slot, _rows.starts(handle.send_counts))


def _permute_any(rows: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """``rows`` [R, n] into the masked layout `[E, C, n]`: the permute kernel for floats, and for one-byte rows
    (FP8) of even width too, moved as fp16 pairs (a copy moves the bits unchanged); an indexed copy of the bytes
    otherwise. Slots without a pair are unspecified."""
    if rows.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return permute(rows, layout)
    if rows.element_size() == 1 and rows.shape[1] % 2 == 0 and rows.stride(1) == 1:
        # The indexed copy below expands every row top_k times first: at 512 tokens per rank on 4 GPUs it made
        # the low-latency FP8 dispatch take over a millisecond.
        return permute(rows.view(torch.float16), layout).view(rows.dtype)
    out = torch.empty(layout.num_rows + 1, rows.shape[1], dtype=rows.dtype, device=rows.device)
    target = torch.where(layout.row_of >= 0, layout.row_of, layout.num_rows).long()  # [R, k]
    source = rows.view(torch.uint8).unsqueeze(1).expand(-1, target.shape[1], -1)
    out.view(torch.uint8).index_put_((target.reshape(-1),), source.reshape(-1, source.shape[-1]))
    return out[: layout.num_rows].view(*layout.rows_shape, rows.shape[1])
