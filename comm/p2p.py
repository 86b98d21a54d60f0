"""One-shot P2P dispatch and combine over a symmetric workspace (csrc/comm/a2a.cu), with the semantics of
:class:`~flashinfer_moe.comm.collective.CollectiveAllToAll`: the same :class:`DispatchOutput`, row order,
padding, masked layout and combine sums, bit for bit.

Senders write their rows straight into the receivers' buffers and publish a per-(sender, receiver) flag
holding the call's epoch; nothing is reset between calls. High-throughput dispatch syncs the host once (for
the received row count); low-latency dispatch and both combines never do, and can be captured in a CUDA graph.

A wait that exceeds its budget makes the kernel record (phase, rank, peer, epoch) in a host-mapped error word
and return. The host raises :class:`~flashinfer_moe.CommTimeoutError` from it: right away in a
high-throughput dispatch (which syncs anyway), else at the next call or at :meth:`P2PAllToAll.check`. The
workspace then stays failed (its kernels return at once) until every rank calls :meth:`P2PAllToAll.recover`.

Dimension legend: ``T`` tokens on this rank, ``k`` top-k, ``H`` hidden size, ``W`` ranks, ``M``
``max_tokens_per_rank``, ``R`` rows received.
"""

from __future__ import annotations

import ctypes
import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashinfer_moe import envs
from flashinfer_moe._ops import DTYPE_CODES, on_device, stream_of
from flashinfer_moe.errors import CommTimeoutError, FlashInferMoEError
from flashinfer_moe.moe.layout import moe_align_masked

from ._kernels import Params, align16, check, comm_lib
from .collective import DispatchHandle, DispatchOutput, _permute_any
from .workspace import SymmetricWorkspace

__all__ = ["P2PAllToAll", "P2PDispatchHandle"]

# Header of the workspace, as in csrc/comm/a2a.cu.
_HEADER_BYTES = 4096
_EPOCHS_OFF, _LOCAL_STATE_OFF, _LOCAL_STATE_BYTES = 1536, 1552, 12  # epochs; done counters + error claim
MAX_RANKS = 64
_WARPS = 16  # warps per block of the kernels
_PHASES = {1: "dispatch", 2: "combine", 3: "handshake"}
_FORCE = {None: 0, "timeout": 1, "fail": 2}
_HANDSHAKE = {1: "wrong payload", 2: "TIMEOUT"}
_instances = itertools.count()


@dataclass(frozen=True, eq=False)
class P2PDispatchHandle(DispatchHandle):
    """A :class:`DispatchHandle` with what the P2P combine reads on the device. ``slot`` is `[T, W]` int32 in
    both modes (the token's row at each rank, -1 where it did not go).

    Attributes:
        recv_offsets: `[W + 1]` int32, first row received from each rank (low-latency: ``s * M``).
        recv_rows: `[W]` int32, rows received from each rank.
        owner: the communicator that made it.
    """

    recv_offsets: torch.Tensor | None = None
    recv_rows: torch.Tensor | None = None
    owner: int = -1


def _free_host(lib, pointers: list[int]) -> None:
    for ptr in pointers:
        lib.fim_ws_host_free(ptr)
    pointers.clear()


class P2PAllToAll:
    """The P2P engine behind :class:`~flashinfer_moe.comm.MoEAllToAll` (which validates the arguments).

    Collective to construct (it maps the workspace). Calls are ordered on the current CUDA stream; every rank
    makes the same sequence of dispatch and combine calls.

    Args:
        group: the ``torch.distributed`` process group (None: default); used only to bootstrap and to recover.
        num_experts, top_k, hidden_size, max_tokens_per_rank, mode, capacity: as for ``MoEAllToAll``.
        dtype: dtype of the dispatched hidden states (FP8 included).
        combine_dtype: dtype of combine's rows and output: float32, float16 or bfloat16.
        scale_groups: floats of scales per token that a dispatch may carry.
        timeout_s: bound of every wait.
        handle_type: of the workspace (``"auto"``, ``"ipc"``, ``"fabric"``).
    """

    def __init__(
        self,
        group,
        *,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        max_tokens_per_rank: int,
        dtype: torch.dtype,
        combine_dtype: torch.dtype,
        scale_groups: int,
        mode: str,
        capacity: int,
        timeout_s: float,
        handle_type: str = "auto",
    ):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if self.world_size > MAX_RANKS:
            raise ValueError(f"the P2P backend supports at most {MAX_RANKS} ranks, got a group of {self.world_size}")
        self.device = torch.cuda.current_device()
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.experts_per_rank = num_experts // self.world_size
        self.max_tokens_per_rank, self.mode, self.capacity = max_tokens_per_rank, mode, capacity
        self.dtype, self.combine_dtype, self.scale_groups = dtype, combine_dtype, scale_groups
        self.timeout_s = float(timeout_s)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._uid = next(_instances)
        lib = self._lib = comm_lib()
        if lib.fim_a2a_header_bytes() != _HEADER_BYTES or lib.fim_a2a_max_ranks() != MAX_RANKS:
            raise RuntimeError("csrc/comm/a2a.cu and flashinfer_moe/comm/p2p.py disagree on the workspace header")
        with torch.cuda.device(self.device):
            check(lib.fim_a2a_preload(), "loading the all-to-all kernels")

        world, m = self.world_size, max_tokens_per_rank
        hidden_bytes = hidden_size * torch.empty((), dtype=dtype).element_size()
        row_stride = align16(hidden_bytes) + align16(4 * scale_groups) + 2 * align16(4 * top_k)
        combine_stride = align16(hidden_size * torch.empty((), dtype=combine_dtype).element_size())
        dispatch_off = _HEADER_BYTES
        combine_off = dispatch_off + 2 * world * m * row_stride
        self.workspace = SymmetricWorkspace(
            group, combine_off + 2 * world * m * combine_stride, handle_type=handle_type
        )

        # Host-mapped words the kernels write: the error word [8] int64, then the counts [2 * W] int32.
        self._host: list[int] = []
        self._finalizer = weakref.finalize(self, _free_host, lib, self._host)
        ptr = ctypes.c_void_p()
        check(lib.fim_ws_host_alloc(64 + 8 * world, ctypes.byref(ptr)), "cudaHostAlloc")
        self._host.append(ptr.value)
        self._error = (ctypes.c_longlong * 8).from_address(ptr.value)
        self._counts_ptr = ptr.value + 64
        self._counts = (ctypes.c_int * (2 * world)).from_address(self._counts_ptr)
        self.params = Params(
            peers=self.workspace.ptr_table.data_ptr(),
            local=self.workspace.local_ptr,
            error=ptr.value,
            hidden_bytes=hidden_bytes,
            scale_bytes=4 * scale_groups,
            row_stride=row_stride,
            combine_stride=combine_stride,
            dispatch_off=dispatch_off,
            combine_off=combine_off,
            timeout_ns=0,
            rank=self.rank,
            world=world,
            max_tokens=m,
            top_k=top_k,
            num_experts=num_experts,
            experts_per_rank=self.experts_per_rank,
        )
        self._calls = {"dispatch": 0, "combine": 0}
        self._handshakes = 0
        self._failed: CommTimeoutError | FlashInferMoEError | None = None
        self._last_timeout_s = self.timeout_s

    # ------------------------------------------------------------------------------------------- helpers

    def _arm(self, phase: str) -> ctypes.pointer:
        """Counts the call and sets its wait bound: the first of each kind (since construction or recover())
        gets the longer warm-up bound, for peers that are still starting."""
        self._calls[phase] += 1
        first = self._calls[phase] == 1
        self._last_timeout_s = max(self.timeout_s, envs.a2a_first_timeout_s()) if first else self.timeout_s
        self.params.timeout_ns = int(self._last_timeout_s * 1e9)
        return ctypes.byref(self.params)

    def _parts(self, units: int) -> int:
        # Rows split among several warps when there are too few rows to keep every SM busy (decode).
        return max(1, min(16, (self.num_sms * _WARPS) // max(units, 1)))

    def _grid(self, units: int) -> int:
        return max(1, min(self.num_sms, -(-units // _WARPS)))

    def _read_error(self):
        code = self._error[0]
        if code == 0:
            return None
        phase, rank, peer, epoch, detail = (int(v) for v in self._error[1:6])
        name = _PHASES.get(phase, f"phase {phase}")
        if code == 1:
            return CommTimeoutError(
                f"P2P all-to-all {name} (epoch {epoch}) on rank {rank} timed out after {self._last_timeout_s:g} s "
                f"waiting for rank {peer}; call recover() on every rank before the next call",
                phase=name, rank=rank, peers=(peer,), epoch=epoch,
            )  # fmt: skip
        return FlashInferMoEError(
            f"P2P all-to-all {name} (epoch {epoch}) on rank {rank}: rank {peer} announced {detail} rows, more than "
            f"max_tokens_per_rank = {self.max_tokens_per_rank} (nothing was written); call recover() on every rank"
        )

    def check(self, synchronize: bool = True) -> None:
        """Raises the error a kernel recorded, if any (a low-latency call or a combine reports it only here or
        at the next call). ``synchronize`` waits for the current stream first (not while capturing)."""
        if self._failed is not None:
            raise self._failed
        if synchronize:
            torch.cuda.current_stream(self.device).synchronize()
        error = self._read_error()
        if error is not None:
            self._failed = error
            raise error

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    # ------------------------------------------------------------------------------------------ dispatch

    def dispatch(self, h, ids, w, scales=None) -> DispatchOutput:
        """As :meth:`CollectiveAllToAll.dispatch`; the arguments are checked by the caller."""
        self.check(synchronize=False)
        h, ids, w = h.contiguous(), ids.contiguous(), w.contiguous()
        scales = scales.contiguous() if scales is not None else None
        world, k, num_tokens = self.world_size, self.top_k, h.shape[0]
        lib, dev = self._lib, h.device
        send_slot = torch.empty(num_tokens, world, dtype=torch.int32, device=dev)
        params = self._arm("dispatch")
        with on_device(h):
            stream = stream_of(h)
            status = lib.fim_a2a_dispatch_send(
                params, h.data_ptr(), scales.data_ptr() if scales is not None else None, ids.data_ptr(),
                int(ids.dtype == torch.int64), w.data_ptr(), num_tokens, self._parts(num_tokens), send_slot.data_ptr(),
                max(1, min(self.num_sms, num_tokens)), stream,
            )  # fmt: skip
            check(status, "all-to-all dispatch (send)")
            if self.mode == "low_latency":
                rows = world * self.max_tokens_per_rank
            else:
                check(lib.fim_a2a_dispatch_wait(params, self._counts_ptr, stream), "all-to-all dispatch (wait)")
                torch.cuda.current_stream(dev).synchronize()  # the kernel's wait is bounded: so is this one
                self.check(synchronize=False)
                counts = list(self._counts)
                rows = sum(counts[:world])
            out_h = torch.empty(rows, self.hidden_size, dtype=h.dtype, device=dev)
            out_s = (
                torch.empty(rows, self.scale_groups, dtype=torch.float32, device=dev) if scales is not None else None
            )
            out_ids = torch.empty(rows, k, dtype=torch.int32, device=dev)
            out_w = torch.empty(rows, k, dtype=torch.float32, device=dev)
            recv_rows = torch.empty(world, dtype=torch.int32, device=dev)
            recv_offsets = torch.empty(world + 1, dtype=torch.int32, device=dev)
            per_expert = (
                None
                if self.mode == "low_latency"
                else torch.zeros(self.experts_per_rank, dtype=torch.int32, device=dev)
            )
            parts = self._parts(rows)
            status = lib.fim_a2a_dispatch_recv(
                params, int(self.mode == "low_latency"), int(self.mode != "low_latency"), rows, parts,
                out_h.data_ptr(), out_s.data_ptr() if out_s is not None else None, out_ids.data_ptr(),
                out_w.data_ptr(), recv_rows.data_ptr(), recv_offsets.data_ptr(),
                per_expert.data_ptr() if per_expert is not None else None, self._grid(rows * parts), stream,
            )  # fmt: skip
            check(status, "all-to-all dispatch (receive)")
        if self.mode == "low_latency":
            m = self.max_tokens_per_rank
            handle = P2PDispatchHandle((m,) * world, (m,) * world, num_tokens, send_slot, recv_offsets, recv_rows, self._uid)  # fmt: skip
            layout = moe_align_masked(out_ids, self.experts_per_rank, self.capacity, validate=False)
            expert_h = _permute_any(out_h, layout)
            expert_s = _permute_any(out_s, layout) if out_s is not None else None
            return DispatchOutput(out_h, out_s, out_ids, out_w, layout.tokens_per_expert, handle, layout, expert_h, expert_s)  # fmt: skip
        handle = P2PDispatchHandle(
            tuple(counts[world:]),
            tuple(counts[:world]),
            num_tokens,
            send_slot,
            recv_offsets,
            recv_rows,
            self._uid,
        )
        return DispatchOutput(out_h, out_s, out_ids, out_w, per_expert, handle)

    # ------------------------------------------------------------------------------------------- combine

    def combine(self, x: torch.Tensor, handle: P2PDispatchHandle) -> torch.Tensor:
        """As :meth:`CollectiveAllToAll.combine`: `[R, H]` rows back to their tokens, summed in fp32 over the
        ranks ascending. Returns `[T, H]` in the combine dtype, without waiting for the host."""
        self.check(synchronize=False)
        if not isinstance(handle, P2PDispatchHandle) or handle.owner != self._uid:
            raise ValueError("handle must come from a dispatch of this communicator, got one from another")
        x = x.contiguous()
        lib, rows = self._lib, x.shape[0]
        out = torch.empty(handle.num_tokens, self.hidden_size, dtype=x.dtype, device=x.device)
        params = self._arm("combine")
        with on_device(x):
            stream = stream_of(x)
            parts = self._parts(rows)
            status = lib.fim_a2a_combine_send(
                params, x.data_ptr(), self.hidden_size * x.element_size(), handle.recv_offsets.data_ptr(),
                handle.recv_rows.data_ptr(), rows, parts, self._grid(rows * parts), stream,
            )  # fmt: skip
            check(status, "all-to-all combine (send)")
            parts = self._parts(handle.num_tokens)
            status = lib.fim_a2a_combine_recv(
                params, DTYPE_CODES[x.dtype], handle.slot.data_ptr(), handle.num_tokens, self.hidden_size, parts,
                out.data_ptr(), self._grid(handle.num_tokens * parts), stream,
            )  # fmt: skip
            check(status, "all-to-all combine (receive)")
        return out

    # ------------------------------------------------------------------------------------ checks, recovery

    def live_check(self, timeout_s: float) -> str | None:
        """The live flag check over the mapped workspace, every pair both ways: a payload store and a
        system-scope release atomic into the peer's buffer, acquire loads bounded by ``timeout_s`` here.
        Honors ``FLASHINFER_MOE_PROBE_FORCE``. Collective. Returns None, or what failed on this rank."""
        self._handshakes += 1
        result = torch.full((self.world_size,), -1, dtype=torch.int32, device=f"cuda:{self.device}")
        params = Params.from_buffer_copy(self.params)
        params.timeout_ns = int(timeout_s * 1e9)
        with torch.cuda.device(self.device):
            status = self._lib.fim_a2a_handshake(
                ctypes.byref(params), self._handshakes, _FORCE[envs.probe_force()], result.data_ptr(), self._stream()
            )
            check(status, "all-to-all live flag check")
            torch.cuda.current_stream(self.device).synchronize()
        bad = [(peer, code) for peer, code in enumerate(result.tolist()) if code != 0]
        if not bad:
            return None
        return "; ".join(
            f"flag from rank {peer} to rank {self.rank}: {_HANDSHAKE.get(code, code)}" for peer, code in bad
        )

    def _state_bytes(self, nbytes: int, offset: int, data: bytes | None = None) -> bytes:
        buf = ctypes.create_string_buffer(data if data is not None else nbytes, nbytes)
        src, dst = self.workspace.local_ptr + offset, ctypes.addressof(buf)
        if data is not None:
            src, dst = dst, src
        check(self._lib.fim_ws_copy(self.device, dst, src, nbytes), "reading the workspace header")
        return buf.raw

    def recover(self) -> list[str]:
        """After a timeout: waits for this rank's kernels, agrees with every rank on the epochs (the largest
        any rank reached, so no stale flag can satisfy a later wait), and clears the error. Collective: every
        rank calls it, whether or not it saw the error.

        Returns:
            The error each rank had recorded (empty when none had).
        """
        torch.cuda.synchronize(self.device)
        error = self._failed or self._read_error()
        epochs = ctypes.c_uint64 * 2
        mine = epochs.from_buffer_copy(self._state_bytes(16, _EPOCHS_OFF))
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, (tuple(mine), str(error) if error else None), group=self.group)
        agreed = epochs(*(max(g[0][i] for g in gathered) for i in range(2)))
        self._state_bytes(16, _EPOCHS_OFF, bytes(agreed))
        self._state_bytes(_LOCAL_STATE_BYTES, _LOCAL_STATE_OFF, bytes(_LOCAL_STATE_BYTES))
        for i in range(8):
            self._error[i] = 0
        torch.cuda.synchronize(self.device)
        self._failed = None
        self._calls = {"dispatch": 0, "combine": 0}
        return [g[1] for g in gathered if g[1]]

    def close(self) -> None:
        """Releases the workspace and the mapped host words. Idempotent."""
        self.workspace.close()
        self._finalizer()
