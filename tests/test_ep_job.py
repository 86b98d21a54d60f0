"""The main job, ``launch/ep_moe.py``, run as the README runs it (``torchrun --nproc-per-node N
launch/ep_moe.py``) on CPU ranks over gloo: it must check its expert-parallel layers against the
single-process reference and pass."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(ranks: int, *options: str) -> str:
    """``torchrun --nproc-per-node {ranks} launch/ep_moe.py {options}`` from the checkout; its output."""
    # A free port, not torchrun's fixed 29500: other jobs may run on this machine at the same time. No GPU:
    # this is the CPU tier, also where a GPU is present.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    cmd += ["--master-port", str(_free_port()), "launch/ep_moe.py", *options]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd[1:])} exited {proc.returncode}:\n{out}"
    assert "\nPASS\n" in proc.stdout, out
    return proc.stdout


def test_default_job():
    out = _torchrun(2)
    assert "world 2 (torchrun), device cpu" in out
    assert "prefill" in out and "decode" in out and "tokens/s" in out


def test_odd_world_fp8_high_throughput():
    out = _torchrun(3, "--quant", "fp8_block", "--mode", "high_throughput", "--decode-steps", "1")
    assert "quant fp8_block" in out and "high_throughput" in out and "low_latency" not in out


def test_checkpoint_round_trip(tmp_path):
    # Written from the random weights, loaded by every rank, checked against the weights it was written from.
    out = _torchrun(2, "--layers", "2", "--decode-steps", "1", "--save-checkpoint", str(tmp_path),
                    "--checkpoint", str(tmp_path))  # fmt: skip
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert "loading layer 2/2 from" in out and "layer   1 prefill" in out
