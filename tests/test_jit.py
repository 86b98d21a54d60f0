"""JIT build, cache and lock behaviour, driven by a fake nvcc (tests/jit_cases.py) so no CUDA toolkit or GPU is
needed."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jit_cases import PACKAGE_DIR, write_tree

from flashinfer_moe.errors import JitError
from flashinfer_moe.jit import arch, core


def test_first_build_compiles_and_logs(env, caplog):
    caplog.set_level(logging.INFO, logger="flashinfer_moe.jit")
    so = core.build(env.spec, why="first use")
    key = env.key()
    assert so == env.cache / "k" / key / "libk.so"
    assert so.read_bytes().startswith(b"SO OBJ ")
    assert len(env.calls("compile")) == 2 and len(env.calls("link")) == 1
    link = env.calls("link")[0]
    assert "-gencode=arch=compute_90a,code=sm_90a" in link and link.endswith("-o libk.so")
    messages = [r.getMessage() for r in caplog.records if r.name == "flashinfer_moe.jit"]
    assert f"compiling k for sm_90a (first use): 2 translation units, cached in {env.cache}; " in messages[0]
    assert "`flashinfer-moe build` compiles every kernel ahead of time" in messages[0]
    assert any(m.startswith("compiled k in ") and m.endswith(" s") for m in messages)
    meta = json.loads((so.parent / "meta.json").read_text())
    assert meta["arch"] == ["90a"] and meta["flags"] == core.nvcc_flags(env.spec, ["90a"])
    assert "release 12.8" in meta["nvcc_version"] and meta["seconds"] >= 0
    assert (so.parent / "build.ninja").is_file()
    # Only the published build remains: no temp folder, no lock file.
    assert [p.name for p in (env.cache / "k").iterdir()] == [key]


def test_second_build_is_a_cache_hit_without_lock_or_compiler(env, monkeypatch):
    first = core.build(env.spec)
    calls = len(env.calls())

    def no_lock(*args, **kwargs):
        raise AssertionError("a cache hit must not take the lock")

    monkeypatch.setattr(core, "_exclusive_lock", no_lock)
    assert core.build(env.spec) == first
    assert core.build(env.spec, ["90a"]) == first
    assert len(env.calls()) == calls


def _edit(path: Path) -> None:
    path.write_text(path.read_text() + "// edited\n")


# name -> (change applied to (env, monkeypatch), returns (spec, arch)), whether the key must change
KEY_CASES = {
    "source byte": (lambda e, mp: _edit(e.root / "k/b.cu"), True),
    "included header": (lambda e, mp: _edit(e.root / "common/h.cuh"), True),
    "nested header": (lambda e, mp: _edit(e.root / "common/inner.cuh"), True),
    "header next to source": (lambda e, mp: _edit(e.root / "k/local.cuh"), True),
    "flag": (lambda e, mp: (dataclasses.replace(e.spec, extra_cuda_flags=("-DX=1",)), None), True),
    "arch": (lambda e, mp: (e.spec, ("100a",)), True),
    "extra arch": (lambda e, mp: (e.spec, ("90a", "100a")), True),
    "nvcc version": (lambda e, mp: mp.setenv("FAKE_NVCC_VERSION", "12.9"), True),
    "NVCC_APPEND_FLAGS": (lambda e, mp: mp.setenv("NVCC_APPEND_FLAGS", "-DY"), True),
    "package version": (lambda e, mp: mp.setattr(core, "__version__", "9.9.9"), True),
    "unrelated file": (lambda e, mp: _edit(e.root / "common/unused.cuh"), False),
    "new file in root": (lambda e, mp: write_tree(e.root, {"k/c.cu": "int c;\n", "x.txt": "x"}), False),
    "arch order": (lambda e, mp: (e.spec, ("90a", "90a")), False),
}


@pytest.mark.parametrize("case", list(KEY_CASES))
def test_key_tracks_every_input(env, monkeypatch, case):
    change, must_change = KEY_CASES[case]
    before = env.key()
    first = core.build(env.spec, ["90a"])
    compiles = len(env.calls("compile"))
    result = change(env, monkeypatch)
    core._nvcc_version.cache_clear()
    spec, arch = result if isinstance(result, tuple) else (env.spec, None)
    arch = arch or ("90a",)
    after = env.key(spec, arch)
    assert (after != before) == must_change
    second = core.build(spec, list(arch))
    assert (second != first) == must_change
    assert (len(env.calls("compile")) > compiles) == must_change


def test_key_does_not_depend_on_where_the_sources_live(env, tmp_path):
    moved = tmp_path / "elsewhere" / "src"
    shutil.copytree(env.root, moved)
    assert env.key(dataclasses.replace(env.spec, root=moved)) == env.key()


def test_source_files_follow_quoted_includes(env):
    files = [p.relative_to(env.root).as_posix() for p in core.source_files(env.spec)]
    assert files == ["common/h.cuh", "common/inner.cuh", "k/a.cu", "k/b.cu", "k/local.cuh"]


def test_compiler_failure_raises_with_output_and_leaves_nothing(env, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_FAIL", 'a.cu(4): error: identifier "boom" is undefined')
    with pytest.raises(JitError, match="'k'") as info:
        core.build(env.spec)
    assert 'identifier "boom" is undefined' in str(info.value)
    assert list((env.cache / "k").iterdir()) == []
    assert core.cache_size() == (0, 0)
    monkeypatch.delenv("FAKE_NVCC_FAIL")
    assert core.build(env.spec).is_file()  # a later fixed build is not blocked by the failure


def test_missing_quoted_include_raises(env):
    write_tree(env.root, {"k/a.cu": '#include "nope/missing.cuh"\n'})
    with pytest.raises(JitError, match=r"a\.cu.*nope/missing\.cuh"):
        core.build(env.spec)
    assert env.calls("compile") == []


def test_missing_source_raises(env):
    with pytest.raises(JitError, match="k/zzz.cu"):
        core.source_files(dataclasses.replace(env.spec, sources=("k/zzz.cu",)))


@pytest.mark.parametrize("target", ["missing", "not executable"])
def test_bad_flashinfer_moe_nvcc_is_named(env, monkeypatch, tmp_path, target):
    path = tmp_path / "nvcc-x"
    if target == "not executable":
        path.write_text("#!/bin/sh\n")
    monkeypatch.setenv("FLASHINFER_MOE_NVCC", str(path))
    with pytest.raises(JitError, match="FLASHINFER_MOE_NVCC"):
        core.find_nvcc()


def test_no_nvcc_anywhere(env, monkeypatch, tmp_path):
    for var in ("FLASHINFER_MOE_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(core, "_DEFAULT_NVCC", str(tmp_path / "no" / "nvcc"))
    with pytest.raises(JitError, match="nvcc was not found.*FLASHINFER_MOE_NVCC or CUDA_HOME"):
        core.build(env.spec)


def test_cuda_home_comes_before_path(env, monkeypatch, tmp_path):
    monkeypatch.delenv("FLASHINFER_MOE_NVCC")
    home_nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    home_nvcc.parent.mkdir(parents=True)
    shutil.copy(env.nvcc, home_nvcc)
    path_dir = tmp_path / "path"
    path_dir.mkdir()
    shutil.copy(env.nvcc, path_dir / "nvcc")
    monkeypatch.setenv("PATH", str(path_dir))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert core.find_nvcc() == str(home_nvcc)
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert core.find_nvcc() == str(path_dir / "nvcc")


def test_nvcc_version_is_memoized(env):
    assert core.nvcc_version(str(env.nvcc)) == "Cuda compilation tools, release 12.8, V0.0.0\nBuild cuda_fake"
    core.nvcc_version(str(env.nvcc))
    assert len(env.calls("version")) == 1


def test_current_arch_from_env(monkeypatch):
    monkeypatch.setenv("FLASHINFER_MOE_CUDA_ARCH", "90a, 100a,90a")
    assert arch.current_arch() == ["90a", "100a"]


def test_current_arch_without_gpu_or_env(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("FLASHINFER_MOE_CUDA_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(JitError, match="no CUDA GPU is visible.*FLASHINFER_MOE_CUDA_ARCH.*--arch"):
        arch.current_arch()


def test_current_arch_from_visible_gpus(monkeypatch):
    torch = pytest.importorskip("torch")
    caps = [(9, 0), (8, 0), (9, 0), (10, 0), (12, 0), (8, 9)]
    monkeypatch.delenv("FLASHINFER_MOE_CUDA_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    assert arch.current_arch() == ["90a", "80", "100a", "120a", "89"]


@pytest.mark.parametrize("bad", ["9.0", "sm_90", "90x", "", "1000a", "9", "90aa"])
def test_invalid_arch_is_rejected(env, bad):
    with pytest.raises(ValueError, match="arch"):
        arch.gencode_flags([bad])
    with pytest.raises(ValueError, match="arch"):
        core.build(env.spec, [bad])


def test_gencode_flags():
    assert arch.gencode_flags(["90a", "100f", "89"]) == [
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_100f,code=sm_100f",
        "-gencode=arch=compute_89,code=sm_89",
    ]


def _build_in_child(root: str, barrier, results) -> None:
    from flashinfer_moe.jit import core as child_core

    spec = child_core.KernelSpec("k", ("k/a.cu", "k/b.cu"), root=Path(root))
    barrier.wait(timeout=60)
    try:
        results.put(("ok", str(child_core.build(spec))))
    except BaseException as e:  # noqa: B036 - report anything to the parent instead of hanging it
        results.put(("error", repr(e)))


def test_two_processes_compile_once(env, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "1")
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(env.root), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [kind for kind, _ in outcomes] == ["ok", "ok"], outcomes
    assert outcomes[0][1] == outcomes[1][1] == str(env.cache / "k" / env.key() / "libk.so")
    assert len(env.calls("compile")) == 2 and len(env.calls("link")) == 1
    assert [p.name for p in (env.cache / "k").iterdir()] == [env.key()]


def test_lock_timeout_names_the_lock(env, monkeypatch):
    monkeypatch.setenv("FLASHINFER_MOE_JIT_LOCK_TIMEOUT_S", "0.5")
    lock = env.cache / "k" / f"{env.key()}.lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(JitError, match="0.5 s") as info:
            core.build(env.spec)
        elapsed = time.monotonic() - start
    assert str(lock) in str(info.value)
    assert 0.4 < elapsed < 10
    assert env.calls("compile") == []


def test_stale_lock_file_does_not_block(env):
    lock = env.cache / "k" / f"{env.key()}.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")  # left by a process that died: flock locks die with their process
    assert core.build(env.spec).is_file()
    assert not lock.exists()


def test_build_published_meanwhile_is_kept(env, monkeypatch):
    final = env.cache / "k" / env.key()
    real_run = core._run_ninja

    def run_then_publish_elsewhere(build_dir, verbose, progress=None):
        result = real_run(build_dir, verbose, progress)
        final.mkdir()
        (final / "libk.so").write_bytes(b"other process")
        return result

    monkeypatch.setattr(core, "_run_ninja", run_then_publish_elsewhere)
    so = core.build(env.spec)
    assert so.read_bytes() == b"other process"
    assert [p.name for p in (env.cache / "k").iterdir()] == [final.name]


def test_incomplete_build_folder_is_replaced(env):
    final = env.cache / "k" / env.key()
    final.mkdir(parents=True)
    (final / "0_a.o").write_bytes(b"half")
    assert core.build(env.spec).read_bytes().startswith(b"SO ")


def test_source_edited_during_compile_is_not_cached(env, monkeypatch):
    real_run = core._run_ninja

    def run_and_edit(build_dir, verbose, progress=None):
        result = real_run(build_dir, verbose, progress)
        _edit(env.root / "k/a.cu")
        return result

    monkeypatch.setattr(core, "_run_ninja", run_and_edit)
    with pytest.raises(JitError, match="changed while compiling"):
        core.build(env.spec)
    assert list((env.cache / "k").iterdir()) == []


def test_verbose_prints_command_lines(env, monkeypatch, capsys):
    monkeypatch.setenv("FLASHINFER_MOE_JIT_VERBOSE", "1")
    core.build(env.spec)
    err = capsys.readouterr().err
    assert str(env.nvcc) in err and " -c " in err and "-shared" in err and "ninja" in err


def test_load_is_memoized_and_wraps_os_errors(env, monkeypatch):
    opened = []

    def fake_cdll(path):
        opened.append(path)
        if "bad" in path:
            raise OSError("invalid ELF header")
        return object()

    monkeypatch.setattr(core.ctypes, "CDLL", fake_cdll)
    lib = core.load(env.spec)
    assert core.load(env.spec) is lib
    assert opened == [str(core.build(env.spec))]
    with pytest.raises(JitError, match="invalid ELF header"):
        core.load(dataclasses.replace(env.spec, name="bad"))


def test_clear_cache_and_cache_size(env):
    assert core.cache_size() == (0, 0) and core.clear_cache() == 0
    core.build(env.spec)
    core.build(dataclasses.replace(env.spec, name="k2", sources=("k/b.cu",)))
    count, size = core.cache_size()
    on_disk = sum(p.stat().st_size for p in env.cache.rglob("*") if p.is_file())
    assert count == 2 and size == on_disk > 0
    assert core.clear_cache() == on_disk
    assert core.cache_size() == (0, 0) and env.cache.is_dir() and not any(env.cache.iterdir())


def test_register_rejects_a_different_spec_under_the_same_name(monkeypatch, tmp_path):
    monkeypatch.setattr(core, "REGISTRY", {})
    spec = core.KernelSpec("r", ("r.cu",), root=tmp_path)
    assert core.register(spec) is spec
    assert core.register(core.KernelSpec("r", ["r.cu"], root=tmp_path)) is not None  # equal: fine
    with pytest.raises(ValueError, match="'r'"):
        core.register(core.KernelSpec("r", ("r.cu",), ("-DX",), root=tmp_path))
    assert core.REGISTRY == {"r": spec}


def test_kernel_spec_validates_its_name():
    with pytest.raises(ValueError):
        core.KernelSpec("../evil", ("a.cu",))
    with pytest.raises(ValueError):
        core.KernelSpec("k", ())


def test_csrc_dir(monkeypatch, tmp_path):
    assert core.csrc_dir().is_dir()
    fake_pkg = tmp_path / "site" / "flashinfer_moe"
    (fake_pkg / "jit").mkdir(parents=True)
    monkeypatch.setattr(core, "__file__", str(fake_pkg / "jit" / "core.py"))
    with pytest.raises(JitError, match="CUDA sources not found"):
        core.csrc_dir()
    (fake_pkg / "_csrc").mkdir()
    assert core.csrc_dir() == fake_pkg / "_csrc"


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    # The child imports the package the way this process did (installed or editable), never the bare
    # checkout, whose moe/ and comm/ only become flashinfer_moe.moe / .comm when installed.
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_neither_compiles_nor_imports_torch(env):
    # A stub parent package keeps flashinfer_moe/__init__.py (which may import torch) out of the picture.
    proc = _run_python(
        """
        import sys, types
        pkg = types.ModuleType("flashinfer_moe")
        pkg.__path__ = [sys.argv[1]]
        sys.modules["flashinfer_moe"] = pkg
        sys.modules["torch"] = None  # any import of torch now raises
        import flashinfer_moe.jit
        """,
        str(PACKAGE_DIR),
    )
    assert proc.returncode == 0, proc.stderr
    assert env.calls() == []


def test_compile_messages_are_visible_once(env):
    proc = _run_python(
        """
        import logging, sys
        from flashinfer_moe.jit import core
        root = sys.argv[1]
        core.ctypes.CDLL = lambda path: None  # the fake nvcc's libraries cannot be loaded
        core.load(core.KernelSpec("k1", ("k/a.cu",), root=root))  # no logging configured
        logging.basicConfig(level=logging.INFO, format="APP %(message)s")
        core.load(core.KernelSpec("k2", ("k/a.cu",), root=root))  # the app's handler only
        logging.getLogger().setLevel(logging.WARNING)
        core.load(core.KernelSpec("k3", ("k/a.cu",), root=root))  # the app asked for quiet
        """,
        str(env.root),
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    k1 = [ln for ln in lines if "compiling k1" in ln]
    k2 = [ln for ln in lines if "compiling k2" in ln]
    assert len(k1) == 1 and k1[0].startswith("[flashinfer_moe] compiling k1 for sm_90a (first use): "), lines
    assert len(k2) == 1 and k2[0].startswith("APP compiling k2 for sm_90a (first use): "), lines
    assert not [ln for ln in lines if "k3" in ln]
