"""Per-phase wall times of one call, for reports: the device is synchronized around each phase."""

from __future__ import annotations

import time

import torch

__all__ = ["PhaseClock"]


class PhaseClock:
    """Times the phases of one forward into a dict (seconds), synchronizing the device around each; a no-op
    without a dict."""

    def __init__(self, times: dict | None, device: torch.device):
        self.times, self.device = times, device
        self.name = None

    def __call__(self, name: str):
        self.name = name
        return self

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        if self.times is not None:
            self._sync()
            self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.times is not None and exc[0] is None:
            self._sync()
            self.times[self.name] = self.times.get(self.name, 0.0) + time.perf_counter() - self.start
