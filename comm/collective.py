"""Expert-parallel dispatch and combine over ``torch.distributed.all_to_all_single``: the NCCL path on GPUs,
and the gloo path on CPUs.

Every rank holds ``E / world`` experts (expert ``e`` lives on rank ``e // (E / world)``). Dispatch sends each
token once to every rank that holds one of its experts; combine brings back, for every token, the sum over
those ranks of the row each computed for it.

Dispatch exchanges the per-destination row counts first, then one packed payload (hidden row, ids,
weights, scales as bytes). Every wait is bounded: a step whose peers do not arrive within
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

__all__ = ["CollectiveAllToAll", "DispatchHandle", "DispatchOutput"]

_instances = itertools.count()


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """What combine needs to send rows back: counts both ways and the source token of each sent row."""

    send_counts: tuple[int, ...]  # rows this rank sent to each rank
    recv_counts: tuple[int, ...]  # rows this rank received from each rank
    send_token: torch.Tensor  # [S] int64, the local token of each sent row, grouped by destination rank
    num_tokens: int


@dataclass(frozen=True, eq=False)
class DispatchOutput:
    """The rows a rank received. Rows come grouped by source rank (ascending), tokens ascending within each.

    Attributes:
        hidden_states: `[R, H]`.
        scales: `[R, H / group]` float32 when scales were dispatched, else None.
        topk_ids: `[R, k]` int32 LOCAL expert ids, -1 for experts on other ranks.
        topk_weights: `[R, k]` float32.
        tokens_per_expert: `[E / W]` int32, pairs received per local expert.
        handle: for :meth:`CollectiveAllToAll.combine`.
    """

    hidden_states: torch.Tensor
    scales: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: DispatchHandle


class CollectiveAllToAll:
    """Dispatch/combine of one expert-parallel group over collectives (high-throughput layout).

    Args:
        group: the ``torch.distributed`` process group (None: the default group). NCCL for CUDA tensors,
            gloo for CPU tensors.
        num_experts: ``E``, divisible by the group size.
        top_k: ``k``.
        hidden_size: ``H``.
        max_tokens_per_rank: the most tokens any rank dispatches in one call.
        dtype: dtype of the hidden states.
        timeout_s: bound of every wait; default ``FLASHINFER_MOE_A2A_TIMEOUT_S`` (30 s).
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
        timeout_s: float | None = None,
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
        return f"flashinfer_moe/a2a/{self._uid}/rank{rank}"

    def _arrive(self) -> None:
        """Starts a call: advances the epoch and records it under this rank's one key (overwritten, so the
        store does not grow), for a peer that times out to see who never came."""
        self.epoch += 1
        store = self._store()
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
        h = _checks.tensor("hidden_states", hidden_states)
        _checks.ndim("hidden_states", h, 2, "[num_tokens, hidden_size]")
        if h.dtype != self.dtype or h.shape[1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [T, {self.hidden_size}] {self.dtype} as the communicator was built, "
                f"got {tuple(h.shape)} {h.dtype}"
            )
        if h.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"hidden_states must have at most max_tokens_per_rank = {self.max_tokens_per_rank} "
                             f"tokens, got {h.shape[0]}")  # fmt: skip
        ids = _checks.tensor("topk_ids", topk_ids)
        _checks.dtype_in("topk_ids", ids, (torch.int32, torch.int64))
        if tuple(ids.shape) != (h.shape[0], self.top_k):
            raise ValueError(f"topk_ids must have shape ({h.shape[0]}, {self.top_k}), got {tuple(ids.shape)}")
        _checks.same_device("topk_ids", ids, "hidden_states", h)
        if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= self.num_experts):
            raise ValueError(f"topk_ids must lie in [-1, num_experts) = [-1, {self.num_experts}), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")  # fmt: skip
        w = _checks.tensor("topk_weights", topk_weights)
        _checks.dtype_in("topk_weights", w, (torch.float32,))
        if w.shape != ids.shape:
            raise ValueError(f"topk_weights must have shape {tuple(ids.shape)}, got {tuple(w.shape)}")
        _checks.same_device("topk_weights", w, "hidden_states", h)
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
        device, world, per_rank = h.device, self.world_size, self.experts_per_rank
        dest = torch.where(ids >= 0, ids.long() // per_rank, world)  # [T, k], `world` for none
        goes = torch.zeros(h.shape[0], world + 1, dtype=torch.bool, device=device)
        goes.scatter_(1, dest, True)
        goes = goes[:, :world]  # [T, W]: does token t go to rank d
        rank_of_row, send_token = goes.t().nonzero(as_tuple=True)  # grouped by rank, tokens ascending
        send_counts = torch.bincount(rank_of_row, minlength=world)  # [W]
        recv_counts = torch.empty_like(send_counts)
        self._all_to_all(recv_counts, send_counts, None, None, "dispatch counts")
        send_list, recv_list = send_counts.tolist(), recv_counts.tolist()  # one host sync for the split sizes

        # Rows move as bytes: one payload collective, and any dtype (FP8 included) on any backend.
        parts = [h.contiguous(), ids.to(torch.int32), w.contiguous()] + (
            [scales.contiguous()] if scales is not None else []
        )
        parts = [p.view(torch.uint8)[send_token] for p in parts]
        widths = [p.shape[1] for p in parts]
        packed = torch.cat(parts, dim=1)  # [S, row bytes]
        received = torch.empty(sum(recv_list), packed.shape[1], dtype=torch.uint8, device=device)
        self._all_to_all(received, packed, recv_list, send_list, "dispatch payload")

        fields = received.split(widths, dim=1)
        rows_h = fields[0].contiguous().view(h.dtype)  # [R, H]
        rows_ids = fields[1].contiguous().view(torch.int32)  # [R, k], global
        rows_w = fields[2].contiguous().view(torch.float32)  # [R, k]
        rows_s = fields[3].contiguous().view(torch.float32) if scales is not None else None
        first = self.rank * per_rank
        mine = (rows_ids >= first) & (rows_ids < first + per_rank)
        local_ids = torch.where(mine, rows_ids - first, -1).to(torch.int32)
        counts = torch.bincount(local_ids[mine].long(), minlength=per_rank).to(torch.int32)
        handle = DispatchHandle(tuple(send_list), tuple(recv_list), send_token, h.shape[0])
        return DispatchOutput(rows_h, rows_s, local_ids, rows_w, counts, handle)

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
        self._all_to_all(
            back.view(torch.uint8),
            x.contiguous().view(torch.uint8),
            list(handle.send_counts),
            list(handle.recv_counts),
            "combine",
        )
        out = torch.zeros(handle.num_tokens, self.hidden_size, dtype=torch.float32, device=x.device)
        start = 0
        for count in handle.send_counts:  # one rank's rows at a time: no token twice in an index_add
            rows = slice(start, start + count)
            out.index_add_(0, handle.send_token[rows], back[rows].float())
            start += count
        return out.to(x.dtype)
