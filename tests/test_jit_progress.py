"""The JIT's third-party header sets (CUTLASS: on the include path, keyed by its release), arch-specific kernels,
and what it says while a compile runs (progress, first use, waiting for another process); the fake nvcc
of tests/jit_cases.py."""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import re
import time
from pathlib import Path

import pytest
from jit_cases import write_tree

from flashinfer_moe.errors import JitError
from flashinfer_moe.jit import arch, core, runner

# ------------------------------------------------------------------------------ third-party header sets


def _fake_cutlass(where: Path, release: str = "4.2.0") -> Path:
    write_tree(
        where, {"cutlass/version.h": f"#define CUTLASS_VERSION {release}\n", "cute/tensor.hpp": "#pragma once\n"}
    )
    return where


@pytest.fixture
def cutlass_env(env, monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHINFER_MOE_CUTLASS_DIR", str(_fake_cutlass(tmp_path / "cutlass_a")))
    write_tree(env.root, {"g/g.cu": '#include "cute/tensor.hpp"\n#include "common/h.cuh"\nint g;\n'})
    env.spec = core.KernelSpec("g", ("g/g.cu",), root=env.root, header_sets=("cutlass",))
    return env


def test_header_set_is_on_the_include_path_but_keyed_by_its_release(cutlass_env, monkeypatch, tmp_path):
    env = cutlass_env
    flags = core.nvcc_flags(env.spec, ["90a"])
    assert f"-I{tmp_path / 'cutlass_a'}" in flags
    # The set's files are not walked (its release stands for them); ours still are.
    files = [p.relative_to(env.root).as_posix() for p in core.source_files(env.spec)]
    assert files == ["common/h.cuh", "common/inner.cuh", "g/g.cu"]
    before = env.key()
    monkeypatch.setenv("FLASHINFER_MOE_CUTLASS_DIR", str(_fake_cutlass(tmp_path / "cutlass_b")))
    assert env.key() == before, "the same release elsewhere must reuse the build"
    monkeypatch.setenv("FLASHINFER_MOE_CUTLASS_DIR", str(_fake_cutlass(tmp_path / "cutlass_c", "4.3.0")))
    assert env.key() != before
    so = core.build(env.spec)
    assert any(f"-I{tmp_path / 'cutlass_c'}" in c for c in env.calls("compile")), env.calls("compile")
    assert so.is_file()


def test_missing_header_set_is_a_clear_error(cutlass_env, monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHINFER_MOE_CUTLASS_DIR", str(tmp_path / "nothing"))
    with pytest.raises(JitError, match="not a CUTLASS include folder"):
        core.build(cutlass_env.spec)


def test_unknown_header_set_is_rejected():
    with pytest.raises(ValueError, match="unknown header sets"):
        core.KernelSpec("k", ("a.cu",), header_sets=("boost",))


def test_arch_specific_kernel_builds_only_for_its_arch(env):
    spec = dataclasses.replace(env.spec, archs=("90a",))
    with pytest.raises(JitError, match=r"written for sm_90a only"):
        core.build(spec, ["100a"])
    so = core.build(spec, ["90a", "100a"])  # the other arch is dropped, not compiled for
    assert all("compute_100a" not in c for c in env.calls())
    assert so == core.build(spec, ["90a"])


# ------------------------------------------------------------------------------ progress while compiling

PROGRESS_RE = re.compile(
    r"^still compiling k for sm_90a \(first use\): (\d+(?:\.\d)?) s, (\d) of 2 translation units done(, linking)?$"
)


def _jit_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flashinfer_moe.jit"]


def test_slow_compile_prints_progress_with_elapsed_time_and_units_done(env, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="flashinfer_moe.jit")
    monkeypatch.setattr(runner, "PROGRESS_INTERVAL_S", 0.1)
    monkeypatch.setattr(core.ctypes, "CDLL", lambda path: object())
    # a.cu is done at once, b.cu after 1.5 s, then the link takes 0.6 s.
    monkeypatch.setenv("FAKE_NVCC_SLEEP_b", "1.5")
    monkeypatch.setenv("FAKE_NVCC_SLEEP_link", "0.6")
    core.load(env.spec)
    messages = _jit_messages(caplog)
    assert messages[0].startswith(f"compiling k for sm_90a (first use): 2 translation units, cached in {env.cache}")
    progress = [PROGRESS_RE.match(m) for m in messages if m.startswith("still compiling")]
    assert all(progress), messages
    assert len(progress) >= 8, messages
    seconds = [float(m.group(1)) for m in progress]
    done = [int(m.group(2)) for m in progress]
    assert seconds == sorted(seconds) and seconds[0] < 1.0 and seconds[-1] >= 1.5, messages
    assert done == sorted(done) and 1 in done and done[-1] == 2, messages
    assert all(bool(m.group(3)) == (int(m.group(2)) == 2) for m in progress), messages  # linking once all are done
    assert messages[-1].startswith("compiled k in ")


def test_progress_of_a_single_unit_shows_the_elapsed_time(env, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="flashinfer_moe.jit")
    monkeypatch.setattr(runner, "PROGRESS_INTERVAL_S", 0.1)
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0.5")
    core.build(dataclasses.replace(env.spec, sources=("k/a.cu",)), why="first use")
    messages = _jit_messages(caplog)
    assert messages[0].startswith("compiling k for sm_90a (first use): 1 translation unit, cached in ")
    progress = [m for m in messages if m.startswith("still compiling")]
    assert progress and all(re.fullmatch(r"still compiling k for sm_90a \(first use\): \d\.\d s", m) for m in progress)


def test_first_use_is_said_only_by_the_call_that_compiles(env, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="flashinfer_moe.jit")
    monkeypatch.setattr(core.ctypes, "CDLL", lambda path: object())
    core.load(env.spec)
    core._loaded.clear()
    core.load(env.spec)  # a cache hit: no compile, nothing to say
    first = _jit_messages(caplog)
    assert sum("compiling" in m for m in first) == 1 and "(first use)" in first[0]
    caplog.clear()
    core.build(env.spec, ["100a"], why=core.BUILD_COMMAND)  # as `flashinfer-moe build` does
    ahead = _jit_messages(caplog)
    assert ahead[0].startswith(
        f"compiling k for sm_100a (flashinfer-moe build): 2 translation units, cached in {env.cache}"
    )
    assert "first use" not in " ".join(ahead) and "ahead of time" not in ahead[0]
    caplog.clear()
    core.build(env.spec, ["89"])  # a direct call with no reason
    plain = _jit_messages(caplog)
    assert plain[0].startswith("compiling k for sm_89: 2 translation units") and "first use" not in " ".join(plain)
    assert "`flashinfer-moe build` compiles every kernel ahead of time" in plain[0]


def test_waiting_for_another_process_reports_progress(env, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="flashinfer_moe.jit")
    monkeypatch.setattr(runner, "PROGRESS_INTERVAL_S", 0.1)
    monkeypatch.setenv("FLASHINFER_MOE_JIT_LOCK_TIMEOUT_S", "0.8")
    lock = env.cache / "k" / f"{env.key()}.lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(JitError, match="timed out"):
            core.build(env.spec)
    waits = [m for m in _jit_messages(caplog) if m.startswith("still waiting for another process compiling k: ")]
    assert len(waits) >= 3, _jit_messages(caplog)


def test_interrupted_compile_stops_ninja_and_leaves_nothing(env, monkeypatch):
    monkeypatch.setattr(runner, "PROGRESS_INTERVAL_S", 0.1)
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "30")

    def interrupt(elapsed, finished):
        raise KeyboardInterrupt

    real_run = core._run_ninja
    monkeypatch.setattr(
        core, "_run_ninja", lambda build_dir, verbose, progress=None: real_run(build_dir, verbose, interrupt)
    )
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        core.build(env.spec)
    assert time.monotonic() - start < 20
    assert list((env.cache / "k").iterdir()) == []


# ------------------------------------------------------------------------------ minimum architecture


def test_compute_capability():
    assert [arch.compute_capability(a) for a in ("75", "80", "89", "90a", "100a", "121")] == [
        "7.5",
        "8.0",
        "8.9",
        "9.0",
        "10.0",
        "12.1",
    ]


def test_arch_problem_and_supported_archs(tmp_path):
    spec = core.KernelSpec("m", ("m.cu",), root=tmp_path, min_arch="80")
    assert arch.arch_problem(spec, "80") is None and arch.arch_problem(spec, "100a") is None
    assert arch.arch_problem(spec, "75") == "kernel family 'm' needs sm_80 or newer (compute capability 8.0+)"
    assert arch.supported_archs(spec, ["75", "90a", "80"]) == ["90a", "80"]
    with pytest.raises(arch.UnsupportedArchError) as info:
        arch.supported_archs(spec, ["75"], "the visible GPUs' architecture")
    assert str(info.value) == (
        "kernel family 'm' needs sm_80 or newer (compute capability 8.0+), not sm_75 (compute capability 7.5), "
        'the visible GPUs\' architecture; see "Supported GPUs" in the README'
    )
    exact = core.KernelSpec("h", ("h.cu",), root=tmp_path, archs=("90a",), min_arch="90a")
    assert arch.arch_problem(exact, "90a") is None
    assert (
        arch.arch_problem(exact, "100a")
        == arch.arch_problem(exact, "80")
        == ("kernel family 'h' is written for sm_90a only")
    )
    assert issubclass(arch.UnsupportedArchError, JitError)


def test_kernel_spec_validates_its_min_arch(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        core.KernelSpec("m", ("m.cu",), root=tmp_path, min_arch="8.0")
    with pytest.raises(ValueError, match="below its min_arch"):
        core.KernelSpec("m", ("m.cu",), root=tmp_path, archs=("80", "90a"), min_arch="90a")


def test_unsupported_arch_is_refused_before_nvcc_runs(env, monkeypatch):
    spec = dataclasses.replace(env.spec, min_arch="80")
    with pytest.raises(
        arch.UnsupportedArchError, match=r"'k' needs sm_80 or newer .*not sm_75 \(compute capability 7\.5\)"
    ):
        core.build(spec, ["75"])
    monkeypatch.setenv("FLASHINFER_MOE_CUDA_ARCH", "75")
    with pytest.raises(arch.UnsupportedArchError, match="from FLASHINFER_MOE_CUDA_ARCH"):
        core.load(spec)
    assert env.calls() == [] and not env.cache.exists()  # not even `nvcc --version`


def test_first_call_on_an_unsupported_gpu_names_family_and_minimum(env, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("FLASHINFER_MOE_CUDA_ARCH")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (7, 5))
    with pytest.raises(arch.UnsupportedArchError) as info:
        core.load(dataclasses.replace(env.spec, min_arch="80"))
    message = str(info.value)
    assert "'k' needs sm_80 or newer" in message and "sm_75" in message and "visible GPUs'" in message
    assert "Supported GPUs" in message
    assert env.calls() == []


def test_archs_below_the_minimum_are_left_out_with_a_warning(env, caplog, monkeypatch):
    monkeypatch.setattr(core, "_warned_below", set())
    caplog.set_level(logging.INFO, logger="flashinfer_moe.jit")
    so = core.build(dataclasses.replace(env.spec, min_arch="80"), ["75", "90a"])
    assert so.is_file()
    assert env.calls("compile") and all("compute_75" not in c for c in env.calls())
    core.build(dataclasses.replace(env.spec, min_arch="80"), ["75", "90a"])  # a cache hit, and said once only
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "kernel family 'k' needs sm_80 or newer (compute capability 8.0+): not building it for sm_75, "
        "so GPUs of that architecture cannot run it"
    ]
