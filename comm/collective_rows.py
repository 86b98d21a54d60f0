"""The rows the collective all-to-all moves: how a dispatched token travels (one byte row with its hidden bytes,
ids, weights and scales), how a rank packs what it sends, unpacks what it received, and sums the rows that
come back. One CUDA launch each on GPUs (``csrc/comm/collective.cu``, groups of up to 64 ranks); the torch code
below on CPUs and larger groups, which is also the reference the GPU tests hold the kernels to.

Dimension legend: ``T`` tokens on this rank, ``k`` top-k, ``H`` hidden size, ``W`` ranks, ``R`` rows received.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from dataclasses import dataclass

import torch

from flashinfer_moe._ops import DTYPE_CODES, on_device, stream_of

from ._kernels import MAX_RANKS, PackParams, RowFormat, align16, check, comm_lib

_COMBINE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Format:
    """One dispatched row: ``[hidden bytes | ids int32 [k] | weights fp32 [k] | scales fp32 [groups]]``, each
    field from a 16-byte boundary, ``row_bytes`` a multiple of 16 (so rows and fields copy as 16-byte vectors)."""

    hidden_bytes: int
    top_k: int
    scale_bytes: int  # 0: no scales

    @property
    def ids_at(self) -> int:
        return align16(self.hidden_bytes)

    @property
    def weights_at(self) -> int:
        return self.ids_at + align16(4 * self.top_k)

    @property
    def scales_at(self) -> int:
        return self.weights_at + align16(4 * self.top_k)

    @property
    def row_bytes(self) -> int:
        return self.scales_at + align16(self.scale_bytes)

    def c_struct(self) -> RowFormat:
        return RowFormat(self.row_bytes, self.hidden_bytes, self.ids_at, self.weights_at, self.scales_at,
                         self.scale_bytes, self.top_k)  # fmt: skip


def _as_bytes(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(rows, width)


def starts(counts) -> list[int]:
    """Each block's first row, for blocks of ``counts`` rows laid end to end."""
    return [0, *itertools.accumulate(counts)][: len(counts)]


def destinations(ids: torch.Tensor, num_experts: int, experts_per_rank: int, world: int) -> torch.Tensor:
    """`[T, W]` bool: does token t go to rank d (ids outside ``[0, E)`` go nowhere)."""
    dest = torch.where((ids >= 0) & (ids < num_experts), ids.long() // experts_per_rank, world)  # [T, k]
    goes = torch.zeros(ids.shape[0], world + 1, dtype=torch.bool, device=ids.device)
    goes.scatter_(1, dest, True)
    return goes[:, :world]


def _use_kernels(t: torch.Tensor, world: int) -> bool:
    # The kernels take the ranks' first rows by value (at most MAX_RANKS); larger groups run the torch code.
    return t.is_cuda and world <= MAX_RANKS


def _pack_params(fmt, h, ids, w, scales, world, num_experts, per_rank) -> PackParams:
    """The kernel's parameters; ``h, ids, w, scales`` contiguous (the kernel reads them as dense rows)."""
    p = PackParams()
    p.f = fmt.c_struct()
    p.hidden = h.data_ptr()
    p.ids = ids.data_ptr()
    p.weights = w.data_ptr()
    p.scales = scales.data_ptr() if scales is not None else None
    p.num_tokens, p.world, p.num_experts, p.experts_per_rank = h.shape[0], world, num_experts, per_rank
    p.ids_64 = int(ids.dtype == torch.int64)
    return p


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _blocks(device) -> int:
    """Two blocks a multiprocessor: the most any of these launches takes."""
    return 2 * _sms(device.index if device.index is not None else torch.cuda.current_device())


def _grid(n: int, device) -> int:
    """Blocks for ``n`` units of work."""
    return max(1, min(_blocks(device), n))


def count(fmt: Format, h, ids, w, scales, world: int, num_experts: int, per_rank: int) -> torch.Tensor:
    """`[W]` int64: how many of this rank's tokens go to each rank."""
    if not _use_kernels(h, world):
        return destinations(ids, num_experts, per_rank, world).sum(0)
    counts = torch.empty(world, dtype=torch.int32, device=h.device)
    p = _pack_params(fmt, h, ids.contiguous(), w, scales, world, num_experts, per_rank)  # reads only the ids
    p.counts, p.count_only = counts.data_ptr(), 1
    with on_device(h):
        check(comm_lib().fim_coll_pack(ctypes.byref(p), 1, stream_of(h)), "collective all-to-all (count)")
    return counts.long()


def pack(fmt: Format, h, ids, w, scales, *, world: int, num_experts: int, per_rank: int, offsets: list[int],
         rows: int, pad_to: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The rows this rank sends: destination d's from row ``offsets[d]``, tokens ascending.

    Args:
        fmt: the row format.
        h: `[T, H]` (any dtype: moved as bytes); ids `[T, k]` int32/int64 global; w `[T, k]` float32;
            scales `[T, groups]` float32 or None.
        world, num_experts, per_rank: the group.
        offsets: ``W`` first rows.
        rows: rows of the buffer.
        pad_to: low-latency: each destination's block holds this many rows; those past its count get ids -1
            and weights 0 (their other bytes unspecified).

    Returns:
        ``(send [rows, row_bytes] uint8, slot [T, W] int64)``: slot is the token's row in destination d's
        block, -1 where it does not go.
    """
    device, num_tokens = h.device, h.shape[0]
    send = torch.empty(rows, fmt.row_bytes, dtype=torch.uint8, device=device)
    if _use_kernels(h, world):
        h, ids, w = h.contiguous(), ids.contiguous(), w.contiguous()
        scales = scales.contiguous() if scales is not None else None
        slot = torch.empty(num_tokens, world, dtype=torch.int64, device=device)
        p = _pack_params(fmt, h, ids, w, scales, world, num_experts, per_rank)
        p.send, p.slot, p.pad_to = send.data_ptr(), slot.data_ptr(), pad_to
        for d, o in enumerate(offsets):
            p.offsets[d] = o
        # Blocks (d, c) take destination d's rows of the c-th range of tokens: about two blocks a multiprocessor
        # in all, and at least 64 tokens a range (each block counts the tokens before its range again).
        chunks = max(1, min(-(-num_tokens // 64), -(-_blocks(device) // world)))
        with on_device(h):
            check(comm_lib().fim_coll_pack(ctypes.byref(p), chunks, stream_of(h)), "collective all-to-all (pack)")
        return send, slot
    goes = destinations(ids, num_experts, per_rank, world)
    slot = torch.where(goes, goes.long().cumsum(0) - 1, -1)  # [T, W]
    if pad_to:
        send[:, fmt.ids_at : fmt.ids_at + 4 * fmt.top_k] = 0xFF
        send[:, fmt.weights_at : fmt.weights_at + 4 * fmt.top_k] = 0
    tokens = torch.zeros(num_tokens, fmt.row_bytes, dtype=torch.uint8, device=device)
    k = fmt.top_k
    tokens[:, : fmt.hidden_bytes] = _as_bytes(h, num_tokens, fmt.hidden_bytes)
    tokens[:, fmt.ids_at : fmt.ids_at + 4 * k] = _as_bytes(ids.to(torch.int32), num_tokens, 4 * k)
    tokens[:, fmt.weights_at : fmt.weights_at + 4 * k] = _as_bytes(w, num_tokens, 4 * k)
    if scales is not None:
        tokens[:, fmt.scales_at : fmt.scales_at + fmt.scale_bytes] = _as_bytes(scales, num_tokens, fmt.scale_bytes)
    for d in range(world):
        here = goes[:, d]
        send[offsets[d] + slot[here, d]] = tokens[here]
    return send, slot


def unpack(fmt: Format, received: torch.Tensor, dtype: torch.dtype, *, first: int, per_rank: int,
           count_experts: bool):  # fmt: skip
    """What a rank received, field by field.

    Returns:
        ``(hidden [R, H] dtype, local_ids [R, k] int32 (-1 for experts elsewhere), weights [R, k] float32,
        scales [R, groups] float32 or None, tokens_per_expert [E / W] int32 or None)``.
    """
    rows, device = received.shape[0], received.device
    k, elem = fmt.top_k, torch.empty(0, dtype=dtype).element_size()
    if _use_kernels(received, 1):  # no per-rank arguments: any group size
        received = received.contiguous()
        hidden = torch.empty(rows, fmt.hidden_bytes // elem, dtype=dtype, device=device)
        local = torch.empty(rows, k, dtype=torch.int32, device=device)
        weights = torch.empty(rows, k, dtype=torch.float32, device=device)
        scales = (
            torch.empty(rows, fmt.scale_bytes // 4, dtype=torch.float32, device=device) if fmt.scale_bytes else None
        )
        per_expert = torch.zeros(per_rank, dtype=torch.int32, device=device) if count_experts else None
        with on_device(received):
            status = comm_lib().fim_coll_unpack(
                ctypes.byref(fmt.c_struct()), received.data_ptr(), rows, first, per_rank, hidden.data_ptr(),
                local.data_ptr(), weights.data_ptr(), scales.data_ptr() if scales is not None else None,
                per_expert.data_ptr() if per_expert is not None else None, _grid(-(-rows // 8), device),
                stream_of(received),
            )  # fmt: skip
            check(status, "collective all-to-all (unpack)")
        return hidden, local, weights, scales, per_expert
    hidden = received[:, : fmt.hidden_bytes].contiguous().view(dtype)
    ids = received[:, fmt.ids_at : fmt.ids_at + 4 * k].contiguous().view(torch.int32)
    weights = received[:, fmt.weights_at : fmt.weights_at + 4 * k].contiguous().view(torch.float32)
    scales = None
    if fmt.scale_bytes:
        scales = received[:, fmt.scales_at : fmt.scales_at + fmt.scale_bytes].contiguous().view(torch.float32)
    mine = (ids >= first) & (ids < first + per_rank)
    local = torch.where(mine, ids - first, -1).to(torch.int32)
    per_expert = None
    if count_experts:
        per_expert = torch.bincount(local[mine].long(), minlength=per_rank).to(torch.int32)
    return hidden, local, weights, scales, per_expert


def combine_rows(back: torch.Tensor, slot: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """`[T, H]` in ``back``'s dtype: for each token the sum, in fp32 over the ranks ascending, of the rows
    ``back[offsets[d] + slot[t, d]]`` where ``slot[t, d] >= 0``; tokens sent nowhere are zero.

    Args:
        back: `[rows, H]` float32, float16 or bfloat16: the rows the ranks sent back, destination d's block
            from row ``offsets[d]``.
        slot: `[T, W]` int64 from :func:`pack`.
        offsets: ``W`` first rows.
    """
    num_tokens, world = slot.shape
    hidden = back.shape[1]
    if _use_kernels(back, world) and back.dtype in _COMBINE_DTYPES:
        back, slot = back.contiguous(), slot.contiguous()
        out = torch.empty(num_tokens, hidden, dtype=back.dtype, device=back.device)
        host = (ctypes.c_int64 * max(1, world))(*offsets)
        with on_device(back):
            status = comm_lib().fim_coll_combine(
                DTYPE_CODES[back.dtype], back.data_ptr(), slot.data_ptr(), host, num_tokens, world, hidden,
                out.data_ptr(), _grid(-(-num_tokens * hidden // 2048), back.device), stream_of(back),
            )  # fmt: skip
            check(status, "collective all-to-all (combine)")
        return out
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=back.device)
    if back.shape[0] == 0:
        return out.to(back.dtype)
    for d in range(world):  # ranks ascending: the same fp32 sums as the kernel
        s = slot[:, d]
        rows = back.index_select(0, (offsets[d] + s).clamp(min=0)).float()
        out += torch.where((s >= 0).unsqueeze(-1), rows, 0.0)
    return out.to(back.dtype)
