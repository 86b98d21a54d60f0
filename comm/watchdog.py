"""The bound on the collective path's low-latency calls, kept off the calling thread.

An NCCL collective whose peer never comes spins on the GPU for ever. High-throughput calls wait on the host for
each collective (they need the counts anyway) and raise at the deadline. Low-latency calls do not wait: the host
goes on queueing work, as over P2P, and this thread watches their collectives instead. Past a collective's
deadline it calls ``on_timeout`` (which aborts the communicator: that ends the stuck kernel, so anything
waiting on the stream returns) and the calling thread raises at its next call. NCCL runs a group's collectives
in order, so the oldest one not completed is the one that waits.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref

_POLL_S = 0.002


class Watchdog:
    """Watches ``(work, deadline, phase, epoch)`` entries of one communicator.

    Args:
        owner: the communicator; held weakly (the thread ends once it is gone).
        on_timeout: ``owner.method(phase, epoch)``-style callback name, called once, on the watching thread.
    """

    def __init__(self, owner, on_timeout: str):
        self._owner = weakref.ref(owner)
        self._on_timeout = on_timeout
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, work, timeout_s: float, phase: str, epoch: int) -> None:
        with self._lock:
            self._pending.append((work, time.monotonic() + timeout_s, phase, epoch))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flashinfer_moe-a2a-watchdog", daemon=True)
                self._thread.start()
        self._wake.set()

    def outstanding(self) -> int:
        """Watched collectives not completed yet."""
        with self._lock:
            while self._pending and self._pending[0][0].is_completed():
                self._pending.popleft()
            return len(self._pending)

    def _front(self):
        with self._lock:
            while self._pending and self._pending[0][0].is_completed():
                self._pending.popleft()
            return self._pending[0] if self._pending else None

    def _run(self) -> None:
        while True:
            front = self._front()
            if front is None:
                # Idle: sleep until the next watched call (a timeout so that the thread sees its owner go).
                self._wake.wait(1.0)
                self._wake.clear()
                if self._owner() is None:
                    return
                continue
            _, deadline, phase, epoch = front
            if time.monotonic() > deadline:
                owner = self._owner()
                if owner is not None:
                    getattr(owner, self._on_timeout)(phase, epoch)
                with self._lock:
                    self._pending.clear()
                    self._thread = None
                return
            time.sleep(_POLL_S)
