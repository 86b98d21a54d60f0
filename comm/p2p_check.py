"""GPU-to-GPU capability checks: attributes, peer access, and the live system-scope flag check.

The live check is the one primitive that both ``flashinfer-moe probe`` and the all-to-all backend choice
use: a kernel on the writer GPU stores a payload into the waiter GPU's memory and publishes a flag there
with a release atomic at system scope; a kernel on the waiter GPU waits for it with acquire loads, bounded
by a wall-clock timeout. Nothing here can hang: the kernels bound their own waits, and the host bounds its
wait for them too.

A GPU paired with itself (several ranks, i.e. processes, sharing one GPU) needs no peer access and has no peer
attributes; :func:`pair_attributes` and :func:`enable_peer_access` treat such a pair as capable as it is.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass

import torch

from flashinfer_moe import envs
from flashinfer_moe._ops import check_launch, kernel_library
from flashinfer_moe.jit import KernelSpec, register

__all__ = [
    "FlagCheck",
    "PairAttributes",
    "enable_peer_access",
    "live_flag_check",
    "pair_attributes",
    "pci_bus_id",
    "pingpong_latency_us",
]

# sm_70: system-scope acquire/release (ld.acquire.sys, st.release.sys) and __nanosleep.
SPEC = register(KernelSpec("probe", ("probe/p2p_probe.cu",), min_arch="70"))

_vp, _int, _u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64
_SIGNATURES = {
    "fim_probe_device_count": ([ctypes.POINTER(_int)], _int),
    "fim_probe_pci_bus_id": ([_int, ctypes.c_char_p, _int], _int),
    "fim_probe_pair_attributes": ([_int, _int, ctypes.POINTER(_int)], _int),
    "fim_probe_enable_peer_access": ([_int, _int], _int),
    "fim_probe_preload": ([], _int),
    "fim_probe_launch_wait": ([_vp, _vp, _int, _u64, _vp, _vp], _int),
    "fim_probe_launch_signal": ([_vp, _vp, _int, _int, _vp], _int),
    "fim_probe_launch_pingpong": ([_vp, _vp, _int, _int, _u64, _vp, _vp], _int),
}
# Kernel status codes, as in csrc/probe/p2p_probe.cu.
_STATUS = {0: "OK", 1: "FAIL", 2: "TIMEOUT"}
_FORCE = {None: 0, "timeout": 1, "fail": 2}
# How long past the kernels' own bound the host waits before declaring a kernel stuck.
_HOST_GRACE_S = 5.0


_preloaded: set[int] = set()


def _lib() -> ctypes.CDLL:
    return kernel_library("probe", _SIGNATURES)


def _preload(*devices: int) -> None:
    """Loads the probe kernels on each device before any of them spins (see fim_probe_preload)."""
    lib = _lib()
    for d in devices:
        if d not in _preloaded:
            with torch.cuda.device(d):
                check_launch(lib, lib.fim_probe_preload(), f"loading the probe kernels on GPU {d}")
            _preloaded.add(d)


@dataclass(frozen=True)
class PairAttributes:
    """What the CUDA runtime reports for kernels on ``device`` accessing ``peer``'s memory."""

    can_access_peer: bool
    access_supported: bool
    native_atomics: bool
    performance_rank: int


@dataclass(frozen=True)
class FlagCheck:
    """Outcome of one live flag check: ``status`` is OK, FAIL, TIMEOUT or ERROR."""

    writer: int
    waiter: int
    status: str
    detail: str
    waited_us: int = 0


def pci_bus_id(device: int) -> str:
    buf = ctypes.create_string_buffer(64)
    lib = _lib()
    check_launch(lib, lib.fim_probe_pci_bus_id(device, buf, len(buf)), "cudaDeviceGetPCIBusId")
    return buf.value.decode()


def pair_attributes(device: int, peer: int) -> PairAttributes:
    """What the runtime reports for ``device`` -> ``peer``. A GPU paired with itself (several ranks sharing one
    GPU) uses its own memory: the runtime refuses peer queries for that pair (cudaErrorInvalidDevice, seen on an
    H100) and none are needed, and device atomics on local memory are native, so it counts as fully capable."""
    if device == peer:
        return PairAttributes(True, True, True, 0)
    attrs = (_int * 4)()
    lib = _lib()
    check_launch(lib, lib.fim_probe_pair_attributes(device, peer, attrs), f"P2P attributes {device}->{peer}")
    return PairAttributes(bool(attrs[0]), bool(attrs[1]), bool(attrs[2]), int(attrs[3]))


def enable_peer_access(device: int, peer: int) -> str | None:
    """Lets kernels on ``device`` use ``peer``'s memory. Returns None, or the CUDA error's text.

    Nothing to do when ``device == peer``: local memory needs no peer access, and
    ``cudaDeviceEnablePeerAccess(d, d)`` is an error (cudaErrorPeerAccessUnsupported, seen on an H100), not a
    no-op; worse, the error stays in the runtime's last-error slot, where the next launch check would find it."""
    if device == peer:
        return None
    lib = _lib()
    status = lib.fim_probe_enable_peer_access(device, peer)
    return None if status == 0 else lib.fim_error_string(status).decode(errors="replace")


def _wait_events(events: list[torch.cuda.Event], deadline: float) -> bool:
    """Polls until every event completed or the deadline passed; never blocks in the driver."""
    while not all(e.query() for e in events):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def live_flag_check(writer: int, waiter: int, timeout_s: float = 2.0, force: str | None = None) -> FlagCheck:
    """Publishes a flag from ``writer`` into ``waiter``'s memory and checks that ``waiter`` sees it.

    Args:
        writer: CUDA device index whose kernel writes (payload store + release atomic, system scope).
        waiter: CUDA device index whose kernel waits with acquire loads.
        timeout_s: the waiting kernel's wall-clock bound.
        force: ``"timeout"`` (the flag is never written) or ``"fail"`` (a wrong payload is written) to exercise
            the failure paths; default: ``FLASHINFER_MOE_PROBE_FORCE``.

    Returns:
        A :class:`FlagCheck`; TIMEOUT or FAIL never raise.
    """
    if force is None:
        force = envs.probe_force()
    if force not in _FORCE:
        raise ValueError(f"force must be None, 'timeout' or 'fail', got {force!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    lib = _lib()
    _preload(writer, waiter)
    # writer == waiter is a real check, not a skip: both kernels run on that GPU (on two streams, below), so it
    # exercises the same system-scope release/acquire pair on local memory that ranks sharing a GPU rely on.
    error = enable_peer_access(writer, waiter)
    if error is not None:
        return FlagCheck(writer, waiter, "ERROR", f"cudaDeviceEnablePeerAccess({writer} -> {waiter}): {error}")
    # [flag, payload, pad, pad, status, flag seen, payload seen, us waited]; zeros: nothing published yet
    buf = torch.zeros(8, dtype=torch.int32, device=f"cuda:{waiter}")
    token = int.from_bytes(os.urandom(4), "little") & 0x3FFFFFFF | 1
    base = buf.data_ptr()
    # Side streams from torch's pool (non-blocking): the waiter spins until the signal lands, so the two
    # kernels must never queue behind each other, which they would on one stream when writer == waiter.
    torch.cuda.synchronize(waiter)  # the zeroing must land before the waiter starts reading
    with torch.cuda.device(waiter):
        wait_stream = torch.cuda.Stream(waiter)
        status = lib.fim_probe_launch_wait(
            base, base + 4, token, int(timeout_s * 1e9), base + 16, wait_stream.cuda_stream
        )
        check_launch(lib, status, "probe wait kernel")
        waited = torch.cuda.Event()
        waited.record(wait_stream)
    with torch.cuda.device(writer):
        write_stream = torch.cuda.Stream(writer)
        status = lib.fim_probe_launch_signal(base, base + 4, token, _FORCE[force], write_stream.cuda_stream)
        check_launch(lib, status, "probe signal kernel")
        written = torch.cuda.Event()
        written.record(write_stream)
    if not _wait_events([waited, written], time.monotonic() + timeout_s + _HOST_GRACE_S):
        return FlagCheck(writer, waiter, "TIMEOUT", "a probe kernel did not finish within its bound (host watchdog)")
    code, seen, payload, waited_us = buf[4:8].tolist()
    result = _STATUS.get(code, "ERROR")
    if result == "OK":
        detail = f"flag and payload seen after {waited_us} us"
    elif result == "TIMEOUT":
        detail = f"flag not seen within {timeout_s:g} s (last value {seen})"
    else:
        detail = f"flag {seen} (expected 1), payload {payload:#x} (expected {token:#x})"
    return FlagCheck(writer, waiter, result, detail, waited_us)


def pingpong_latency_us(a: int, b: int, rounds: int = 2000, timeout_s: float = 2.0) -> float | None:
    """One-way flag latency between GPUs ``a`` and ``b`` from a ping-pong of ``rounds``; None on timeout."""
    lib = _lib()
    _preload(a, b)
    for x, y in ((a, b), (b, a)):
        if enable_peer_access(x, y) is not None:
            return None
    # per side: [my flag, pad, result int64 x3] on its GPU; each side writes the other's flag. Indexed by side,
    # not by GPU: with a == b the two sides still need a buffer each.
    bufs = [torch.zeros(8, dtype=torch.int64, device=f"cuda:{d}") for d in (a, b)]
    for d in (a, b):
        torch.cuda.synchronize(d)
    events = []
    for me, peer, initiator in ((1, 0, 0), (0, 1, 1)):  # the responder (b) first, so it is waiting
        device = (a, b)[me]
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            mine, theirs = bufs[me].data_ptr(), bufs[peer].data_ptr()
            status = lib.fim_probe_launch_pingpong(
                mine, theirs, rounds, initiator, int(timeout_s * 1e9), mine + 16, stream.cuda_stream
            )
            check_launch(lib, status, "probe ping-pong kernel")
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
    if not _wait_events(events, time.monotonic() + 2 * timeout_s + rounds * 1e-4 + _HOST_GRACE_S):
        return None
    status, done, elapsed_ns = bufs[0][2:5].tolist()
    if status != 0 or done != rounds:
        return None
    return elapsed_ns / 1e3 / (2 * rounds)
