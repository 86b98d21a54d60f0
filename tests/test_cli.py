"""The flashinfer-moe command, on a machine that may have no GPU."""

import os
import shutil
import subprocess
import sys

import pytest
import torch


def _cli(*args, env=None, timeout=300):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "flashinfer_moe", *args], capture_output=True, text=True, env=full_env, timeout=timeout
    )


def test_env_reports_every_field(tmp_path):
    res = _cli("env", env={"FLASHINFER_MOE_CACHE_DIR": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stderr
    for key in ("flashinfer-moe", "torch", "driver", "nvcc", "NCCL", "cache dir", "kernels"):
        assert any(line.startswith(key) for line in res.stdout.splitlines()), (key, res.stdout)
    assert "permute, probe, quant, routing" in res.stdout
    assert ("GPU 0" in res.stdout) == torch.cuda.is_available()


def test_console_script_is_installed():
    exe = shutil.which("flashinfer-moe")
    if exe is None:
        pytest.skip("package not installed with its console script (plain PYTHONPATH run)")
    res = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "clear-cache" in res.stdout


def test_usage_errors_exit_2():
    assert _cli().returncode == 2
    assert _cli("frobnicate").returncode == 2
    res = _cli("build", "--arch", "90a", "--kernel", "nope")
    assert res.returncode == 2 and "unknown kernel" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_build_without_gpu_or_arch_says_what_to_do(tmp_path):
    res = _cli("build", env={"FLASHINFER_MOE_CACHE_DIR": str(tmp_path)})
    assert res.returncode == 1
    assert "--arch" in res.stderr and "Traceback" not in res.stderr


def test_build_with_missing_nvcc_is_a_clear_error(tmp_path):
    res = _cli(
        "build",
        "--arch",
        "90a",
        env={"FLASHINFER_MOE_CACHE_DIR": str(tmp_path), "FLASHINFER_MOE_NVCC": str(tmp_path / "no-nvcc")},
    )
    assert res.returncode == 1
    assert "FLASHINFER_MOE_NVCC" in res.stderr and "Traceback" not in res.stderr


def test_build_then_cached_then_clear(tmp_path):
    """Real nvcc (compile only, no GPU needed): build every kernel for sm_90a, hit the cache, clear it."""
    from flashinfer_moe import jit

    try:
        jit.find_nvcc()
    except Exception:
        if os.environ.get("CI"):
            raise
        pytest.skip("nvcc not installed")
    env = {"FLASHINFER_MOE_CACHE_DIR": str(tmp_path / "cache")}
    first = _cli("build", "--arch", "90a", env=env, timeout=900)
    assert first.returncode == 0, first.stderr
    for kernel in ("routing", "probe"):
        assert f"compiling {kernel}" in first.stderr and f"compiled {kernel} in" in first.stderr
    second = _cli("build", "--arch", "90a", env=env)
    assert second.returncode == 0 and "compiling" not in second.stderr
    assert "routing" in _cli("env", env=env).stdout
    cleared = _cli("clear-cache", env=env)
    assert cleared.returncode == 0 and "freed" in cleared.stdout
    assert not any((tmp_path / "cache").rglob("*.so"))
