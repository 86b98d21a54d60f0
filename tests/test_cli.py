"""The flashinfer-moe command, on a machine that may have no GPU."""

import os
import re
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


# A stand-in for nvcc: two version lines as the real one prints, compiles that sleep FAKE_NVCC_SLEEP seconds.
FAKE_NVCC = """\
#!{python}
import os, sys, time
args = sys.argv[1:]
if "--version" in args:
    print("nvcc: NVIDIA (R) Cuda compiler driver")
    print("Cuda compilation tools, release 12.8, V12.8.93")
    print("Build cuda_12.8.r12.8/compiler.fake")
    sys.exit(0)
time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP", "0")))
with open(args[args.index("-o") + 1], "wb") as f:
    f.write(b"fake")
"""


@pytest.fixture
def fake_nvcc(tmp_path):
    path = tmp_path / "fake_nvcc"
    path.write_text(FAKE_NVCC.format(python=sys.executable))
    path.chmod(0o755)
    return path


def test_env_prints_one_line_per_field(tmp_path, fake_nvcc):
    res = _cli("env", env={"FLASHINFER_MOE_CACHE_DIR": str(tmp_path / "cache"), "FLASHINFER_MOE_NVCC": str(fake_nvcc)})
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines and all(" : " in line and not line.startswith(" ") for line in lines), res.stdout
    nvcc = [line for line in lines if line.startswith("nvcc ")]
    assert len(nvcc) == 1 and "release 12.8, V12.8.93" in nvcc[0] and "Build cuda_12.8.r12.8" in nvcc[0], lines


def test_clear_cache_is_honest_about_a_missing_or_empty_folder(tmp_path):
    missing = tmp_path / "never-created"
    res = _cli("clear-cache", env={"FLASHINFER_MOE_CACHE_DIR": str(missing)})
    assert res.returncode == 0, res.stderr
    assert "does not exist" in res.stdout and str(missing) in res.stdout and "cleared" not in res.stdout
    assert not missing.exists()
    missing.mkdir()
    res = _cli("clear-cache", env={"FLASHINFER_MOE_CACHE_DIR": str(missing)})
    assert res.returncode == 0 and "is empty" in res.stdout and "cleared" not in res.stdout
    (missing / "routing" / "0123456789abcdef").mkdir(parents=True)
    (missing / "routing" / "0123456789abcdef" / "librouting.so").write_bytes(b"x" * 10)
    res = _cli("clear-cache", env={"FLASHINFER_MOE_CACHE_DIR": str(missing)})
    assert res.returncode == 0 and "cleared" in res.stdout and "1 build(s), 10 B freed" in res.stdout, res.stdout
    assert missing.is_dir() and not any(missing.iterdir())


def test_every_kernel_family_declares_its_minimum_arch():
    from flashinfer_moe.cli import _load_kernel_registry

    jit = _load_kernel_registry()
    declared = {name: spec.min_arch for name, spec in jit.REGISTRY.items()}
    assert declared == {
        "comm": "70",
        "gemm_nvfp4_sm90": "90a",
        "gemm_sm90": "90a",
        "gemm_sm90_wgmma": "90a",
        "mla_append": "80",
        "mla_decode_sm90": "90a",
        "permute": "80",
        "probe": "70",
        "quant": "80",
        "routing": "80",
    }
    hopper = ("gemm_sm90", "gemm_sm90_wgmma", "gemm_nvfp4_sm90", "mla_decode_sm90")
    assert {jit.REGISTRY[name].archs for name in hopper} == {("90a",)}


def test_build_for_an_unsupported_arch_names_families_and_minimum(tmp_path):
    # An nvcc that does not exist: the arch check must come first, so nvcc is never looked for.
    env = {"FLASHINFER_MOE_CACHE_DIR": str(tmp_path / "cache"), "FLASHINFER_MOE_NVCC": str(tmp_path / "no-nvcc")}
    res = _cli("build", "--arch", "75", env=env)
    assert res.returncode == 1, res.stderr
    for family in ("permute", "quant", "routing"):
        assert (
            f"flashinfer-moe build: kernel family '{family}' needs sm_80 or newer (compute capability 8.0+), "
            "not sm_75 (compute capability 7.5)" in res.stderr
        ), res.stderr
    assert "nothing was compiled (`--kernel comm --kernel probe` builds the families" in res.stderr
    assert "FLASHINFER_MOE_NVCC" not in res.stderr and "Traceback" not in res.stderr and "nvcc" not in res.stderr
    assert not (tmp_path / "cache").exists()
    res = _cli("build", "--arch", "89", "--kernel", "gemm_sm90_wgmma", env=env)
    assert res.returncode == 1 and "kernel family 'gemm_sm90_wgmma' is written for sm_90a only" in res.stderr
    assert "Traceback" not in res.stderr


def test_build_on_an_unsupported_gpu_arch_from_the_environment(tmp_path):
    env = {"FLASHINFER_MOE_CACHE_DIR": str(tmp_path), "FLASHINFER_MOE_CUDA_ARCH": "75"}
    res = _cli("build", "--kernel", "routing", env=env)
    assert res.returncode == 1
    assert "'routing' needs sm_80 or newer" in res.stderr and "from FLASHINFER_MOE_CUDA_ARCH" in res.stderr


def test_build_without_cutlass_skips_its_family_unless_named(tmp_path, fake_nvcc):
    """CUTLASS is optional: building everything skips the families on it; naming one is an error."""
    from flashinfer_moe.cli import _load_kernel_registry

    jit = _load_kernel_registry()
    on_cutlass = sorted(n for n, spec in jit.REGISTRY.items() if "cutlass" in spec.header_sets)
    assert on_cutlass, "no kernel family uses the CUTLASS headers"
    env = {
        "FLASHINFER_MOE_CACHE_DIR": str(tmp_path / "cache"),
        "FLASHINFER_MOE_NVCC": str(fake_nvcc),
        "FLASHINFER_MOE_CUTLASS_DIR": str(tmp_path / "no_cutlass"),
    }
    every = _cli("build", "--arch", "90a", env=env)
    assert every.returncode == 0, every.stderr
    for name in on_cutlass:
        assert f"{name}: skipped (" in every.stdout and "not a CUTLASS include folder" in every.stdout, every.stdout
    assert "routing: " in every.stdout and "permute: " in every.stdout
    named = _cli("build", "--arch", "90a", "--kernel", on_cutlass[0], "--kernel", "routing", env=env)
    assert named.returncode == 1
    assert f"flashinfer-moe build: {on_cutlass[0]}: " in named.stderr and "CUTLASS" in named.stderr, named.stderr
    assert "`--kernel routing` builds the families" in named.stderr, named.stderr


def test_build_command_reports_progress_and_never_says_first_use(tmp_path, fake_nvcc):
    # The progress interval shortened in the child: three translation units of one second each (in parallel).
    code = (
        "import sys\n"
        "from flashinfer_moe.jit import runner\n"
        "runner.PROGRESS_INTERVAL_S = 0.2\n"
        "from flashinfer_moe.cli import main\n"
        "sys.exit(main(['build', '--arch', '90a', '--kernel', 'permute', '--kernel', 'routing']))\n"
    )
    env = dict(os.environ)
    env.update(
        FLASHINFER_MOE_CACHE_DIR=str(tmp_path / "cache"), FLASHINFER_MOE_NVCC=str(fake_nvcc), FAKE_NVCC_SLEEP="1"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    err = res.stderr.splitlines()
    assert (
        f"[flashinfer_moe] compiling permute for sm_90a (flashinfer-moe build): 3 translation units, cached in "
        f"{tmp_path / 'cache'}" in err
    ), err
    progress = [line for line in err if line.startswith("[flashinfer_moe] still compiling permute for sm_90a")]
    assert progress, err
    assert all(
        re.search(r"\(flashinfer-moe build\): \d+\.\d s, [0-3] of 3 translation units done", p) for p in progress
    )
    assert any("compiling routing for sm_90a (flashinfer-moe build): 1 translation unit" in line for line in err)
    assert "first use" not in res.stderr and "ahead of time" not in res.stderr
    assert "permute: " in res.stdout and "routing: " in res.stdout
