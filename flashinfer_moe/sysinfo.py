"""Facts about the machine that several commands report: driver, NCCL."""

from __future__ import annotations

import shutil
import subprocess


def driver_versions() -> str:
    """The NVIDIA driver's version and the CUDA version it supports, or why they are unknown."""
    parts = []
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            res = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            if res.returncode == 0 and res.stdout.strip():
                parts.append(res.stdout.strip().splitlines()[0])
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        # cuda-python is imported here only: the package must import on machines without a driver.
        from cuda.bindings import driver  # type: ignore[import-not-found]

        (err,) = driver.cuInit(0)
        if err == driver.CUresult.CUDA_SUCCESS:
            err, version = driver.cuDriverGetVersion()
            if err == driver.CUresult.CUDA_SUCCESS:
                parts.append(f"CUDA {version // 1000}.{(version % 1000) // 10}")
        else:
            parts.append(f"cuInit failed: {err.name}")
    except ImportError:
        parts.append("cuda-python not installed")
    except Exception as exc:  # a missing libcuda surfaces as various errors depending on the version
        parts.append(f"no driver ({type(exc).__name__}: {exc})")
    return ", ".join(parts) if parts else "not found"


def nccl_library() -> str:
    """The NCCL that torch's distributed backend uses: version and the file the process loaded."""
    import torch

    try:
        version = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:
        return f"not available ({type(exc).__name__})"
    path = "path unknown"
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libnccl" in line:
                    path = line.split()[-1]
                    break
    except OSError:
        pass
    return f"{version} ({path})"
