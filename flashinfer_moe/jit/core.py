"""Compile the CUDA sources in ``csrc/`` on first use and cache the shared libraries.

A ``KernelSpec`` is a few ``.cu`` files that nvcc turns into one ``lib<name>.so`` of ``extern "C"``
launchers, loaded with ctypes. A build is keyed by a hash of everything that can change the binary, lives
in ``<cache_root>/<name>/<key>/`` and is published by an atomic rename, so nobody sees half a build; a
per-key lock file lets one process (one torchrun rank) compile while the others wait for its result. The lock,
ninja and the compile's log lines are in ``runner``; the target architectures and their checks in ``arch``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .. import envs
from .._version import __version__
from ..errors import JitError
from .arch import (
    _arch_number,
    _checked_arch,
    arch_origin,
    arch_problem,
    current_arch,
    gencode_flags,
    supported_archs,
)
from .runner import (
    _exclusive_lock,
    _is_executable,
    _make_logging_visible,
    _ninja_cmd,
    _ninja_path,
    _run_ninja,
    _seconds,
)

logger = logging.getLogger("flashinfer_moe.jit")

_RECIPE = "1"  # bump when the build procedure changes in a way the hashed inputs do not show
_DEFAULT_NVCC = "/usr/local/cuda/bin/nvcc"
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)
_BASE_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", "-lineinfo")
# Seconds between the lines that show a compile (or a wait for another process's compile) is still going.
BUILD_COMMAND = "flashinfer-moe build"  # the reason `flashinfer-moe build` gives for its compiles


@dataclass(frozen=True)
class KernelSpec:
    """One kernel family, compiled into ``lib<name>.so``.

    Args:
        name: Family name; also names the library and its cache folder.
        sources: ``.cu`` files relative to ``root``.
        extra_cuda_flags: nvcc flags appended to the common ones.
        root: Source folder and ``-I`` root; None means ``csrc_dir()``.
        header_sets: Third-party header sets to add to the include path (see ``HEADER_SETS``).
        archs: The only target archs the sources are written for (e.g. ``("90a",)``); empty means any.
        min_arch: The oldest arch the sources can be compiled for (e.g. ``"80"`` where they use sm_80
            instructions); targets below it are refused with an ``UnsupportedArchError`` before nvcc runs.
            Empty means no minimum.
    """

    name: str
    sources: tuple[str, ...]
    extra_cuda_flags: tuple[str, ...] = ()
    root: Path | None = None
    header_sets: tuple[str, ...] = ()
    archs: tuple[str, ...] = ()
    min_arch: str = ""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", self.name or "") or not self.sources:
            raise ValueError(f"KernelSpec needs a plain file name and sources, got {self.name!r}, {self.sources}")
        # Lists would make specs unhashable and unequal to the tuple form of the same spec.
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "extra_cuda_flags", tuple(self.extra_cuda_flags))
        object.__setattr__(self, "header_sets", tuple(self.header_sets))
        object.__setattr__(self, "archs", tuple(_checked_arch(list(self.archs))) if self.archs else ())
        if self.min_arch:
            _checked_arch([self.min_arch])
            below = [a for a in self.archs if _arch_number(a) < _arch_number(self.min_arch)]
            if below:
                raise ValueError(f"KernelSpec {self.name!r}: archs {below} are below its min_arch {self.min_arch!r}")
        unknown = [h for h in self.header_sets if h not in HEADER_SETS]
        if unknown:
            raise ValueError(f"unknown header sets {unknown}; known: {sorted(HEADER_SETS)}")
        object.__setattr__(self, "root", None if self.root is None else Path(self.root))


def _cutlass_include() -> tuple[Path, str]:
    """CUTLASS's include folder and the text that identifies its release (its ``version.h``)."""
    where = envs.cutlass_dir()
    if where is None:
        import importlib.util

        # Located without importing it: the package's Python side pulls in modules a build never needs.
        found = importlib.util.find_spec("cutlass_library")
        if found is None or not found.origin:
            raise JitError(
                "this kernel is built on CUTLASS, whose headers were not found: `pip install nvidia-cutlass` "
                "or point FLASHINFER_MOE_CUTLASS_DIR at a CUTLASS include folder"
            )
        where = Path(found.origin).parent / "source" / "include"
    version = where / "cutlass" / "version.h"
    if not version.is_file() or not (where / "cute").is_dir():
        raise JitError(f"{where} is not a CUTLASS include folder (no cutlass/version.h and cute/ there)")
    return where, version.read_text(encoding="utf-8", errors="replace")


# name -> function returning (include folder, identity). Builds are keyed by the identity, not the folder,
# so the same release installed elsewhere (another venv, another machine) reuses the build.
HEADER_SETS = {"cutlass": _cutlass_include}


def _header_includes(spec: KernelSpec) -> list[tuple[str, Path, str]]:
    return [(name, *HEADER_SETS[name]()) for name in spec.header_sets]


def header_problem(spec: KernelSpec) -> str | None:
    """Why ``spec``'s third-party headers cannot be used here, or None when they all can.

    Args:
        spec: The kernel family.

    Returns:
        The message a build of ``spec`` would fail with, or None.
    """
    try:
        _header_includes(spec)
    except JitError as exc:
        return str(exc)
    return None


REGISTRY: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    """Add ``spec`` to ``REGISTRY`` (what ``flashinfer-moe build`` precompiles); an equal spec twice is fine.

    Args:
        spec: The kernel family.

    Returns:
        ``spec``, so the call can wrap a module-level assignment.
    """
    existing = REGISTRY.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"kernel {spec.name!r} is already registered with a different spec: {existing}")
    REGISTRY[spec.name] = spec
    return spec


def csrc_dir() -> Path:
    """Returns the CUDA source root: ``_csrc`` inside an installed wheel, else the checkout's ``csrc``."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_csrc", package.parent / "csrc"):
        if candidate.is_dir():
            return candidate
    raise JitError(f"CUDA sources not found: looked for {package / '_csrc'} and {package.parent / 'csrc'}")


def _root(spec: KernelSpec) -> Path:
    return (spec.root if spec.root is not None else csrc_dir()).resolve()


def find_nvcc() -> str:
    """Returns nvcc's path: ``FLASHINFER_MOE_NVCC``, else ``$CUDA_HOME/bin``, PATH, /usr/local/cuda."""
    wanted = envs.nvcc()
    if wanted is not None:
        path = wanted if os.sep in wanted else (shutil.which(wanted) or wanted)
        if not _is_executable(path):
            raise JitError(f"FLASHINFER_MOE_NVCC={wanted!r} is not an executable file")
        return path
    home = envs.cuda_home()
    for path in (str(home / "bin" / "nvcc") if home else "", shutil.which("nvcc") or "", _DEFAULT_NVCC):
        if path and _is_executable(path):
            return path
    raise JitError(
        "nvcc was not found (looked in $CUDA_HOME/bin, PATH and /usr/local/cuda/bin); install the CUDA "
        "toolkit and set FLASHINFER_MOE_NVCC or CUDA_HOME"
    )


@cache
def _nvcc_version(path: str, _mtime_ns: int, _size: int) -> str:
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise JitError(f"could not run {path} --version: {e}") from e
    if proc.returncode != 0:
        raise JitError(f"{path} --version failed:\n{proc.stdout}{proc.stderr}")
    lines = [ln.strip() for ln in proc.stdout.splitlines()]
    return "\n".join([ln for ln in lines if "release" in ln or ln.startswith("Build")] or lines)


def nvcc_version(nvcc: str) -> str:
    """The 'release ...' and 'Build ...' lines of ``nvcc --version``.

    Args:
        nvcc: Compiler path.

    Returns:
        Those lines, newline-joined. Memoized per path and file identity, so an in-place upgrade shows.
    """
    real = os.path.realpath(nvcc)
    try:
        st = os.stat(real)
    except OSError as e:
        raise JitError(f"nvcc {nvcc!r} cannot be read: {e}") from e
    return _nvcc_version(real, st.st_mtime_ns, st.st_size)


def _compile_flags(spec: KernelSpec, arch: list[str], include_root: str, headers: list[str] | None = None) -> list[str]:
    if headers is None:
        headers = [str(path) for _, path, _ in _header_includes(spec)]
    return [
        *_BASE_FLAGS,
        f"-I{include_root}",
        *(f"-I{h}" for h in headers),
        *gencode_flags(arch),
        *spec.extra_cuda_flags,
    ]


def nvcc_flags(spec: KernelSpec, arch: list[str]) -> list[str]:
    """The flags each source of ``spec`` is compiled with (without ``-c``/``-o``).

    Args:
        spec: The kernel family.
        arch: Target arch strings.

    Returns:
        nvcc arguments.
    """
    return _compile_flags(spec, arch, str(_root(spec)))


def source_files(spec: KernelSpec) -> list[Path]:
    """The sources of ``spec`` plus every header they pull in with ``#include "..."``, recursively.

    Args:
        spec: The kernel family.

    Returns:
        Absolute paths, sorted and de-duplicated.
    """
    root = _root(spec)
    external = [path for _, path, _ in _header_includes(spec)]
    pending = [(root / src).resolve() for src in spec.sources]
    for src, path in zip(spec.sources, pending, strict=True):
        if not path.is_file():
            raise JitError(f"kernel {spec.name!r}: source {src!r} not found under {root}")
    seen: set[Path] = set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for inc in _INCLUDE_RE.findall(path.read_text(encoding="utf-8", errors="replace")):
            # As the preprocessor does: next to the including file first, then -I<root>.
            found = [base / inc for base in (path.parent, root) if (base / inc).is_file()]
            if not found and any((base / inc).is_file() for base in external):
                continue  # a header set's file: the key holds that set's release instead
            if not found:
                raise JitError(f'{path}: #include "{inc}" not found (looked in {path.parent} and {root})')
            pending.append(found[0].resolve())
    return sorted(seen)


def cache_key(spec: KernelSpec, arch: list[str], nvcc: str) -> str:
    """Hash of everything that determines the built library.

    Args:
        spec: The kernel family.
        arch: Target arch strings.
        nvcc: Compiler path.

    Returns:
        16 hex characters.
    """
    root, arch = _root(spec), _checked_arch(arch, normalize=True)
    h = hashlib.sha256()

    def put(data: str | bytes) -> None:
        data = data.encode() if isinstance(data, str) else data
        h.update(len(data).to_bytes(8, "little") + data)  # length-prefixed, so no two inputs run together

    for part in (_RECIPE, spec.name, __version__, nvcc_version(nvcc), *arch):
        put(part)
    # The root's location is left out, so a moved checkout or a wheel reuses the same builds; so are the
    # header sets' locations, which stand in the key by their release.
    headers = _header_includes(spec)
    put("\0".join(_compile_flags(spec, arch, "<root>", [f"<{name}>" for name, _, _ in headers])))
    for name, _, identity in headers:
        put(name)
        put(identity)
    # nvcc reads these itself: they change the binary without showing on our command line.
    put(os.environ.get("NVCC_PREPEND_FLAGS", "") + "\0" + os.environ.get("NVCC_APPEND_FLAGS", ""))
    for path in source_files(spec):
        put(os.path.relpath(path, root))
        put(path.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """Returns the folder holding every build (``FLASHINFER_MOE_CACHE_DIR``)."""
    return envs.cache_dir()


def _write_build_ninja(spec: KernelSpec, arch: list[str], nvcc: str, build_dir: Path) -> None:
    lines = [
        f"nvcc = {_ninja_cmd([nvcc])}",
        f"cflags = {_ninja_cmd(nvcc_flags(spec, arch))}",
        f"ldflags = {_ninja_cmd(['-shared', *gencode_flags(arch)])}",
        "rule cuda_compile\n  command = $nvcc $cflags -c $src -o $out\n  description = nvcc $src",
        "rule cuda_link\n  command = $nvcc $ldflags $in -o $out\n  description = link $out",
    ]
    objects = []
    for i, src in enumerate(spec.sources):
        src_path = str((_root(spec) / src).resolve())
        objects.append(f"{i}_{Path(src).stem}.o")  # numbered: two sources may share a file name
        lines.append(f"build {objects[-1]}: cuda_compile {_ninja_path(src_path)}\n  src = {_ninja_cmd([src_path])}")
    lines.append(f"build lib{spec.name}.so: cuda_link {' '.join(objects)}")
    (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")


def _compile(spec: KernelSpec, arch: list[str], nvcc: str, key: str, final: Path, why: str | None) -> None:
    lib = f"lib{spec.name}.so"
    # Same folder as the final one, so the rename that publishes it is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=final.parent))
    try:
        _write_build_ninja(spec, arch, nvcc, tmp)
        what = f"{spec.name} for {', '.join(f'sm_{a}' for a in arch)}" + (f" ({why})" if why else "")
        units = len(spec.sources)
        hint = "" if why == BUILD_COMMAND else f"; `{BUILD_COMMAND}` compiles every kernel ahead of time"
        logger.info(
            "compiling %s: %d translation unit%s, cached in %s%s",
            what,
            units,
            "" if units == 1 else "s",
            cache_root(),
            hint,
        )

        def progress(elapsed: float, steps_finished: int) -> None:
            done = min(steps_finished, units)  # the link is the last step
            count = f", {done} of {units} translation units done" if units > 1 else ""
            linking = ", linking" if done == units and units > 1 else ""
            logger.info("still compiling %s: %s%s%s", what, _seconds(elapsed), count, linking)

        start = time.perf_counter()
        rc, output = _run_ninja(tmp, envs.jit_verbose(), progress)
        seconds = time.perf_counter() - start
        if rc != 0 or not (tmp / lib).is_file():
            tail = "\n".join(output.rstrip().splitlines()[-60:])
            raise JitError(
                f"compiling kernel {spec.name!r} failed (exit code {rc}); compiler output:\n{tail}\n"
                "(FLASHINFER_MOE_JIT_VERBOSE=1 prints every command line)"
            )
        meta = dict(name=spec.name, key=key, sources=list(spec.sources), flags=nvcc_flags(spec, arch), arch=arch)
        meta.update(nvcc=nvcc, nvcc_version=nvcc_version(nvcc), version=__version__, seconds=round(seconds, 3))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp's 0700 would keep a shared cache private to its first user
        if final.exists() and not (final / lib).is_file():
            shutil.rmtree(final)  # an incomplete folder someone left behind
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / lib).is_file():
                raise
            # Published meanwhile by a process our lock did not stop (flock unsupported on this filesystem).
        logger.info("compiled %s in %.1f s", spec.name, seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_warned_below: set[tuple[str, ...]] = set()


def build(spec: KernelSpec, arch: list[str] | None = None, *, why: str | None = None) -> Path:
    """Compile ``spec`` unless an identical build is cached.

    Args:
        spec: The kernel family.
        arch: Target arch strings; None means ``current_arch()``. Those ``spec`` is not written for are left
            out (with a warning where they are below its ``min_arch``).
        why: Shown in the log lines of a compile, e.g. ``"first use"``.

    Returns:
        Path of ``lib<name>.so`` in the cache.

    Raises:
        UnsupportedArchError: ``spec`` cannot be built for any of the archs (checked before nvcc runs).
        JitError: No nvcc, a compiler error, a lock timeout.
    """
    where = arch_origin() if arch is None else ""
    wanted = _checked_arch(current_arch() if arch is None else arch, normalize=True)
    arch = supported_archs(spec, wanted, where)
    below = [a for a in wanted if a not in arch and spec.min_arch and _arch_number(a) < _arch_number(spec.min_arch)]
    if below and (spec.name, *below) not in _warned_below:
        _warned_below.add((spec.name, *below))  # once per process, not on every call
        _make_logging_visible()
        logger.warning(
            "%s: not building it for %s, so GPUs of %s cannot run it",
            arch_problem(spec, below[0]),
            ", ".join(f"sm_{a}" for a in below),
            "that architecture" if len(below) == 1 else "those architectures",
        )
    nvcc = find_nvcc()
    key = cache_key(spec, arch, nvcc)
    final = cache_root() / spec.name / key
    lib = final / f"lib{spec.name}.so"
    if lib.is_file():
        return lib
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JitError(f"cannot create the kernel cache {final.parent} (see FLASHINFER_MOE_CACHE_DIR): {e}") from e
    _make_logging_visible()
    with _exclusive_lock(final.parent / f"{key}.lock", envs.jit_lock_timeout_s(), spec.name):
        if lib.is_file():  # another process (another rank) built it while we waited
            return lib
        _compile(spec, arch, nvcc, key, final, why)
        if cache_key(spec, arch, nvcc) != key:
            # A source was edited mid-compile: the binary may not match the key it would be stored under.
            shutil.rmtree(final, ignore_errors=True)
            raise JitError(f"the sources of kernel {spec.name!r} changed while compiling; call again")
    return lib


_loaded: dict[tuple[str, str], ctypes.CDLL] = {}
_loaded_lock = threading.Lock()


def load(spec: KernelSpec) -> ctypes.CDLL:
    """Build ``spec`` if needed and load its library, once per process and build.

    Args:
        spec: The kernel family.

    Returns:
        The library; its ``extern "C"`` functions are attributes.
    """
    lib = build(spec, why="first use")  # only a call that finds no cached build compiles (and says so)
    memo = (spec.name, lib.parent.name)
    with _loaded_lock:
        if memo not in _loaded:
            try:
                _loaded[memo] = ctypes.CDLL(str(lib))
            except OSError as e:
                raise JitError(f"could not load kernel {spec.name!r} from {lib}: {e}") from e
        return _loaded[memo]


def _tree_bytes(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(path) for f in files)


def clear_cache() -> int:
    """Delete every cached build; a compile running meanwhile in another process will fail.

    Returns:
        Bytes freed.
    """
    root = cache_root()
    freed = 0
    for child in root.iterdir() if root.is_dir() else ():
        freed += _tree_bytes(child)
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    return freed


def cache_size() -> tuple[int, int]:
    """Returns ``(number of cached builds, total bytes under the cache root)``."""
    root = cache_root()
    if not root.is_dir():
        return 0, 0
    libs = [p for p in root.glob("*/*/lib*.so") if not p.parent.name.startswith(".")]
    return sum(p.name == f"lib{p.parent.parent.name}.so" for p in libs), _tree_bytes(root)
