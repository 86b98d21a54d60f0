"""The one-shot P2P all-to-all with two ranks (processes) on one GPU: dispatch and combine exact against the CPU
tests' reference in both modes, bf16 and FP8 rows, then a rank that skips a call makes the other raise
``CommTimeoutError`` naming it, and the same processes call again correctly (``launch/a2a_shared_gpu.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SMOKE = Path(__file__).resolve().parent.parent / "launch" / "a2a_shared_gpu.py"


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
def test_p2p_all_to_all_ranks_sharing_one_gpu(world):
    # The ranks are separate processes (CUDA IPC between them), so the smoke runs as its own program.
    run = subprocess.run(
        [sys.executable, str(SMOKE), "--world", str(world), "--deadline", "600"],
        capture_output=True,
        text=True,
        timeout=700,
    )
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 0, "\n".join(lines[-40:])
    assert any(line.startswith("PASS") for line in lines), "\n".join(lines[-40:])
    assert not any(line.startswith("FAIL") for line in lines), "\n".join(lines[-40:])
