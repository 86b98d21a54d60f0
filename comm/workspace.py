"""Symmetric workspace: one device buffer per rank, mapped by every rank of the group.

Each rank allocates its buffer outside torch's caching allocator (so that the exported handle covers exactly
that buffer), exports a handle, and opens every peer's. Two handle types:

- ``"fabric"``: FABRIC handles (``cuMemCreate`` + ``cuMemExportToShareableHandle``), the driver's path for
  NVLink across nodes; chosen by ``"auto"`` when every rank's driver reports support.
- ``"ipc"``: legacy CUDA IPC (``cudaIpcGetMemHandle``), every rank on one node.

Every choice is collective: each rank reports what it can do (and then whether its allocation, export and
imports worked), and all ranks take the same path, so no rank goes on alone. With ``"auto"`` a FABRIC
attempt that fails anywhere falls back to IPC everywhere.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import weakref

import torch
import torch.distributed as dist

from flashinfer_moe import _checks

from ._kernels import HANDLE_BYTES, comm_lib, error_text

__all__ = ["SymmetricWorkspace"]

logger = logging.getLogger("flashinfer_moe.comm")
HANDLE_TYPES = ("auto", "ipc", "fabric")


def _gather(group, obj) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _release(device: int, entries: list) -> None:
    """Unmaps the peers' buffers, then frees this rank's own (entries: (kind, ptr, size, handle, is_local))."""
    lib = comm_lib()
    for kind, ptr, size, handle, is_local in sorted(entries, key=lambda e: e[4]):  # peers first
        if kind == "ipc":
            status = lib.fim_ws_free(device, ptr) if is_local else lib.fim_ws_ipc_close(device, ptr)
        else:
            status = lib.fim_ws_fabric_release(device, ptr, size, handle)
        if status != 0:
            logger.warning("releasing a workspace mapping failed: %s", error_text(status))
    entries.clear()


class SymmetricWorkspace:
    """``nbytes`` of zeroed device memory on every rank, each rank's buffer mapped into every rank.

    Collective: every rank of ``group`` constructs it at the same point, with the same ``nbytes``.

    Args:
        group: the ``torch.distributed`` process group (None: the default group); used only to exchange handles.
        nbytes: bytes per rank.
        handle_type: ``"auto"``, ``"ipc"`` or ``"fabric"`` (see the module docstring).
        device: CUDA device index; default the current device.

    Attributes:
        ptrs: `[W]` the address of every rank's buffer as mapped in this process (``ptrs[rank]`` is this rank's).
        ptr_table: `[W]` int64 on the device, the same addresses, for kernels.
        handle_type: the type every rank took, ``"ipc"`` or ``"fabric"``.
    """

    def __init__(self, group, nbytes: int, *, handle_type: str = "auto", device: int | None = None):
        self.nbytes = _checks.integer("nbytes", nbytes, 1)
        if handle_type not in HANDLE_TYPES:
            raise ValueError(f"handle_type must be one of {HANDLE_TYPES}, got {handle_type!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("SymmetricWorkspace needs a CUDA device, got none (torch.cuda.is_available() is False)")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.cuda.current_device() if device is None else int(device)
        self._entries: list = []
        self._finalizer = weakref.finalize(self, _release, self.device, self._entries)
        lib = comm_lib()
        supported = ctypes.c_int(0)
        fabric = lib.fim_ws_fabric_supported(self.device, ctypes.byref(supported)) == 0 and supported.value == 1
        votes = _gather(group, (socket.gethostname(), fabric))
        one_host = len({host for host, _ in votes}) == 1
        all_fabric = all(ok for _, ok in votes)
        if handle_type == "ipc":
            candidates = ["ipc"] if one_host else []
        elif handle_type == "fabric":
            candidates = ["fabric"] if all_fabric else []
        else:
            candidates = (["fabric"] if all_fabric else []) + (["ipc"] if one_host else [])
        if not candidates:
            no_fabric = [r for r, (_, ok) in enumerate(votes) if not ok]
            raise RuntimeError(
                f"no handle type fits handle_type={handle_type!r}: the ranks span "
                f"{len({h for h, _ in votes})} host(s) (legacy IPC needs one) and rank(s) {no_fabric} report no "
                "FABRIC handle support"
            )
        failures = []
        for kind in candidates:
            failure = self._map(kind)
            if failure is None:
                self.handle_type = kind
                break
            failures.append(f"{kind}: {failure}")
            logger.info("symmetric workspace: %s handles failed (%s)", kind, failure)
        else:
            raise RuntimeError("could not map the symmetric workspace on every rank: " + "; ".join(failures))
        self.ptr_table = torch.tensor(self.ptrs, dtype=torch.int64, device=f"cuda:{self.device}")

    @property
    def local_ptr(self) -> int:
        return self.ptrs[self.rank]

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _map(self, kind: str) -> str | None:
        """Allocates, exports, exchanges and imports with one handle type. Collective; returns None when every
        rank succeeded, else the same reason on every rank (everything mapped here is released then)."""
        lib, dev = comm_lib(), self.device
        ptr, size, handle = ctypes.c_void_p(), ctypes.c_int64(self.nbytes), ctypes.c_uint64(0)
        exported = ctypes.create_string_buffer(HANDLE_BYTES)
        if kind == "ipc":
            status = lib.fim_ws_alloc(dev, self.nbytes, ctypes.byref(ptr))
            if status == 0:
                self._entries.append(("ipc", ptr.value, self.nbytes, 0, True))
                status = lib.fim_ws_ipc_handle(ptr, exported)
        else:
            status = lib.fim_ws_fabric_alloc(
                dev, self.nbytes, ctypes.byref(ptr), ctypes.byref(size), ctypes.byref(handle), exported
            )
            if ptr.value:
                self._entries.append(("fabric", ptr.value, size.value, handle.value, True))
        mine = None if status == 0 else f"rank {self.rank}: allocation/export: {error_text(status)}"
        shared = _gather(self.group, (mine, exported.raw, size.value))
        failure = next((err for err, _, _ in shared if err), None)
        ptrs = [0] * self.world_size
        if failure is None:
            ptrs[self.rank] = ptr.value
            for r, (_, theirs, their_size) in enumerate(shared):
                if r == self.rank:
                    continue
                peer, peer_handle = ctypes.c_void_p(), ctypes.c_uint64(0)
                if kind == "ipc":
                    status = lib.fim_ws_ipc_open(dev, theirs, ctypes.byref(peer))
                    entry = ("ipc", peer.value, their_size, 0, False)
                else:
                    status = lib.fim_ws_fabric_import(
                        dev, theirs, their_size, ctypes.byref(peer), ctypes.byref(peer_handle)
                    )
                    entry = ("fabric", peer.value, their_size, peer_handle.value, False)
                if status != 0:
                    mine = f"rank {self.rank}: opening rank {r}'s handle: {error_text(status)}"
                    break
                self._entries.append(entry)
                ptrs[r] = peer.value
            failure = next((err for err in _gather(self.group, mine) if err), None)
        if failure is not None:
            _release(dev, self._entries)
            return failure
        self.ptrs = ptrs
        return None

    def close(self) -> None:
        """Unmaps the peers' buffers and frees this rank's. Idempotent; also runs when the workspace is garbage
        collected and at interpreter exit. Not collective, but peers must not use this buffer afterwards: close
        every rank's workspace at the same point of the program."""
        if self._finalizer.alive:
            try:
                torch.cuda.synchronize(self.device)  # no kernel may still use the memory
            except Exception:  # noqa: S110 - a broken context is no reason to leak the mappings too
                pass
            self._finalizer()
            self.ptr_table = None

    def __enter__(self) -> SymmetricWorkspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
