"""The JIT tests' fixture: a fake nvcc (so no CUDA toolkit or GPU is needed), a small source tree with quoted
includes, and an empty cache folder. `env` in tests/conftest.py yields :func:`jit_env`'s :class:`Env`."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

from flashinfer_moe.jit import core

PACKAGE_DIR = Path(core.__file__).resolve().parent.parent

# Behaves like nvcc for the command lines the JIT writes; every call is logged as "<kind> <args>".
FAKE_NVCC = """\
#!{python}
import hashlib, os, sys, time
args = sys.argv[1:]
kind = "version" if "--version" in args else "compile" if "-c" in args else "link"
log = os.environ.get("FAKE_NVCC_LOG")
if log:
    with open(log, "a") as f:
        f.write(kind + " " + " ".join(args) + "\\n")
if kind == "version":
    print("nvcc: NVIDIA (R) Cuda compiler driver")
    print("Cuda compilation tools, release " + os.environ.get("FAKE_NVCC_VERSION", "12.8") + ", V0.0.0")
    print("Build cuda_fake")
    sys.exit(0)
# FAKE_NVCC_SLEEP_<stem of the source> (or FAKE_NVCC_SLEEP_link) overrides FAKE_NVCC_SLEEP for one step.
step = os.path.splitext(os.path.basename(args[args.index("-c") + 1]))[0] if kind == "compile" else "link"
time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP_" + step, os.environ.get("FAKE_NVCC_SLEEP", "0"))))
if os.environ.get("FAKE_NVCC_FAIL"):
    print(os.environ["FAKE_NVCC_FAIL"], file=sys.stderr)
    sys.exit(1)
out = args[args.index("-o") + 1]
if kind == "compile":
    data = b"OBJ " + hashlib.sha256(open(args[args.index("-c") + 1], "rb").read()).hexdigest().encode()
else:
    data = b"SO " + b"".join(open(a, "rb").read() for a in args if a.endswith(".o"))
with open(out, "wb") as f:
    f.write(data)
"""

SOURCES = {
    "k/a.cu": '#include "common/h.cuh"\n#include "local.cuh"\n#include <cstdint>\nint a() { return A; }\n',
    "k/b.cu": '#include "common/h.cuh"\nextern "C" int b() { return 2; }\n',
    "k/local.cuh": "#define A 1\n",
    "common/h.cuh": '#pragma once\n#include "inner.cuh"\n',  # found next to h.cuh, not in root
    "common/inner.cuh": "#pragma once\n",
    "common/unused.cuh": "#pragma once\n",
}


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def make_executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


class Env:
    def __init__(self, tmp_path: Path):
        self.root = tmp_path / "src"
        self.cache = tmp_path / "cache"
        self.log = tmp_path / "nvcc.log"
        self.nvcc = make_executable(tmp_path / "fake_nvcc", FAKE_NVCC.format(python=sys.executable))
        write_tree(self.root, SOURCES)
        self.spec = core.KernelSpec("k", ("k/a.cu", "k/b.cu"), root=self.root)

    def calls(self, kind: str | None = None) -> list[str]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [ln for ln in lines if kind is None or ln.split(" ", 1)[0] == kind]

    def key(self, spec: core.KernelSpec | None = None, arch: tuple[str, ...] = ("90a",)) -> str:
        return core.cache_key(spec or self.spec, list(arch), str(self.nvcc))


def jit_env(tmp_path, monkeypatch):
    """The `env` fixture (tests/conftest.py): a fake nvcc, a source tree and an empty cache, with every variable
    the JIT reads set for them."""
    e = Env(tmp_path)
    for var in (
        "FAKE_NVCC_VERSION",
        "FAKE_NVCC_SLEEP",
        "FAKE_NVCC_SLEEP_a",
        "FAKE_NVCC_SLEEP_b",
        "FAKE_NVCC_SLEEP_link",
        "FAKE_NVCC_FAIL",
        "FLASHINFER_MOE_JIT_VERBOSE",
        "FLASHINFER_MOE_JIT_LOCK_TIMEOUT_S",
        "NVCC_PREPEND_FLAGS",
        "NVCC_APPEND_FLAGS",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FAKE_NVCC_LOG", str(e.log))
    monkeypatch.setenv("FLASHINFER_MOE_NVCC", str(e.nvcc))
    monkeypatch.setenv("FLASHINFER_MOE_CACHE_DIR", str(e.cache))
    monkeypatch.setenv("FLASHINFER_MOE_CUDA_ARCH", "90a")
    # Both memos outlive a test, and keys do not depend on where the sources live.
    core._nvcc_version.cache_clear()
    core._loaded.clear()
    yield e
    core._nvcc_version.cache_clear()
    core._loaded.clear()
