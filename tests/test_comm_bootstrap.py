"""The process group from mpi4py (an mpirun job): ranks join over MPI and run a dispatch and a combine."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("mpi_job.py")


def _mpiexec():
    pytest.importorskip("mpi4py")
    launcher = shutil.which("mpiexec") or shutil.which("mpirun")
    if launcher is None:
        pytest.skip("no mpiexec")
    # Open MPI refuses root unless told; other MPIs ignore these.
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return launcher, env


def _run(ranks: int, backend: str):
    launcher, env = _mpiexec()
    proc = subprocess.run(
        [launcher, "-n", str(ranks), sys.executable, str(JOB), backend],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(ranks):
        assert f"rank {rank} of {ranks} ok ({backend})" in proc.stdout, proc.stdout + proc.stderr


def test_mpi_bootstrap_gloo():
    _run(3, "gloo")


@pytest.mark.multigpu
def test_mpi_bootstrap_nccl():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _run(2, "nccl")
