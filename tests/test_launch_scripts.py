"""The scripts in launch/ that need GPUs say so and exit with status 2 on a machine without them, before they
import the library or do any work (``launch/timing.py``: ``require_gpus``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

LAUNCH = Path(__file__).resolve().parent.parent / "launch"

# script -> what its message says it needs
GPU_SCRIPTS = {
    "a2a_shared_gpu.py": "needs a CUDA GPU",
    "bench_a2a.py": "needs a CUDA GPU",
    "bench_gemm.py": "needs a CUDA GPU",
    "bench_mla.py": "needs a CUDA GPU",
    "bench_nvfp4.py": "needs a CUDA GPU",
    "bench_nvfp4_tiles.py": "needs a CUDA GPU of compute capability 9.0 (sm_90)",
    "bench_nvfp4_w4a8.py": "needs a CUDA GPU",
    "bench_mla_prefill.py": "needs a CUDA GPU",
    "bench_permute.py": "needs a CUDA GPU",
    "bench_routing.py": "needs a CUDA GPU",
    "bench_sglang.py": "needs a CUDA GPU",
    "mla_page_read_ceiling.py": "needs a CUDA GPU",
    "power_gemm.py": "needs a CUDA GPU",
    "profile_gemm_sm90.py": "needs a CUDA GPU of compute capability 9.0 (sm_90)",
    "profile_permute.py": "needs a CUDA GPU",
    "requant_error.py": "needs a CUDA GPU",
    "tune_gemm.py": "needs a CUDA GPU",
    "tune_gemm_sm90.py": "needs a CUDA GPU of compute capability 9.0 (sm_90)",
}
# Run on CPUs too (the expert-parallel job and benchmark have their own checks), or are not scripts.
OTHER = {
    "ep_moe.py",
    "ep_common.py",
    "bench_ep.py",
    "timing.py",
    "plot_perf.py",
    "plot_style.py",
    "mla_sdpa.py",
    "nvfp4_sweep_space.py",
}

# Runs the script as `python script` would (its folder first on sys.path), and reports on exit whether the
# library was imported by then.
RUNNER = (
    "import atexit, runpy, sys\n"
    "atexit.register(lambda: print('LIBRARY IMPORTED:', 'flashinfer_moe' in sys.modules, file=sys.stderr))\n"
    "path = sys.argv[1]\n"
    "sys.argv = sys.argv[1:]\n"
    "sys.path.insert(0, path.rsplit('/', 1)[0])\n"
    "runpy.run_path(path, run_name='__main__')\n"
)


def test_every_launch_script_is_classified():
    scripts = {p.name for p in LAUNCH.glob("*.py")}
    assert scripts - set(GPU_SCRIPTS) - OTHER == set(), "a new launch/ script: does it need a GPU?"
    assert set(GPU_SCRIPTS) <= scripts


def test_gpu_scripts_without_a_gpu_exit_2_and_say_so():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("LOCAL_RANK", None)
    env.pop("LOCAL_WORLD_SIZE", None)
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", RUNNER, str(LAUNCH / name)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=LAUNCH.parent,
        )
        for name in GPU_SCRIPTS
    }
    failures = []
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        ok = (
            proc.returncode == 2
            and f"{name} {GPU_SCRIPTS[name]}; " in err
            and "LIBRARY IMPORTED: False" in err
            and "Traceback" not in err
        )
        if not ok:
            failures.append(f"{name}: exit {proc.returncode}\n{out}{err}")
    assert not failures, "\n\n".join(failures)


def test_help_is_readable_without_a_gpu():
    res = subprocess.run(
        [sys.executable, str(LAUNCH / "bench_permute.py"), "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        timeout=180,
    )
    assert res.returncode == 0 and "usage:" in res.stdout, res.stderr


@pytest.fixture
def timing(monkeypatch):
    spec = importlib.util.spec_from_file_location("launch_timing", LAUNCH / "timing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["bench_x.py"])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return module


def _fake_gpus(monkeypatch, caps):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(caps))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    monkeypatch.setattr(torch.version, "cuda", "12.8")


def test_require_gpus_counts_and_capability(timing, monkeypatch, capsys):
    _fake_gpus(monkeypatch, [(9, 0), (9, 0)])
    timing.require_gpus(2)
    timing.require_gpus(1, capability=(9, 0))
    with pytest.raises(SystemExit) as info:
        timing.require_gpus(4, "bench_a2a.py")
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == "bench_a2a.py needs 4 CUDA GPUs; 2 visible to torch"
    _fake_gpus(monkeypatch, [(8, 0)])
    with pytest.raises(SystemExit) as info:
        timing.require_gpus(1, capability=(9, 0))
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "bench_x.py needs a CUDA GPU of compute capability 9.0 (sm_90); GPU 0 is 8.0"
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _fake_gpus(monkeypatch, [])
    with pytest.raises(SystemExit):
        timing.require_gpus(1)
    assert "0 visible with CUDA_VISIBLE_DEVICES=''" in capsys.readouterr().err


def test_require_gpus_prints_once_per_machine_and_lets_help_through(timing, monkeypatch, capsys):
    _fake_gpus(monkeypatch, [])
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit):
        timing.require_gpus(1)
    assert capsys.readouterr().err == ""  # rank 0 of this machine says it
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--help"])
    timing.require_gpus(1)  # returns: argparse prints the usage
