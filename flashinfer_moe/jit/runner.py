"""The processes behind a build: the per-key lock file, ninja and its progress, and the log lines a compile prints.

Kept apart from ``core`` (what to build, where it is cached, loading it) because these talk to the operating
system: file locks, a child process and a reader thread. ``PROGRESS_INTERVAL_S`` is how often a wait or a compile
reports that it is still going.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import JitError

logger = logging.getLogger("flashinfer_moe.jit")

PROGRESS_INTERVAL_S = 10.0


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


class _FallbackHandler(logging.StreamHandler):
    """Prints our lines to stderr only while the application has no logging configured."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:  # otherwise the record reaches the app's handlers
            super().emit(record)


_fallback = _FallbackHandler(sys.stderr)
_fallback.setFormatter(logging.Formatter("[flashinfer_moe] %(message)s"))
_owns_level = False


def _make_logging_visible() -> None:
    # Checked per compile, not at import: apps often configure logging after their imports.
    global _owns_level
    if logging.getLogger().handlers or any(h is not _fallback for h in logger.handlers):
        if _owns_level:  # the app has taken over: its levels decide now
            logger.setLevel(logging.NOTSET)
            _owns_level = False
        logger.removeHandler(_fallback)
        return
    if _fallback not in logger.handlers:
        logger.addHandler(_fallback)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
        _owns_level = True


def _seconds(elapsed: float) -> str:
    return f"{elapsed:.0f} s" if elapsed >= 10 else f"{elapsed:.1f} s"


@contextmanager
def _exclusive_lock(path: Path, timeout_s: float, name: str) -> Iterator[None]:
    start = time.monotonic()
    deadline, delay, next_report = start + timeout_s, 0.01, start + PROGRESS_INTERVAL_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            now = time.monotonic()
            if delay == 0.01:
                logger.info("waiting for another process compiling %s (lock %s)", name, path)
            elif now >= next_report:
                logger.info("still waiting for another process compiling %s: %s", name, _seconds(now - start))
                next_report = now + PROGRESS_INTERVAL_S
            if time.monotonic() >= deadline:
                raise JitError(
                    f"timed out after {timeout_s:g} s waiting for the lock {path}, held by another process "
                    f"compiling {name!r}; raise FLASHINFER_MOE_JIT_LOCK_TIMEOUT_S if its compile is slow"
                ) from None
            time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(delay * 2, 0.25)
            continue
        # Holders unlink the file before unlocking it, and a lock on an unlinked inode guards nothing.
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _find_ninja() -> str:
    try:
        import ninja

        if _is_executable(path := os.path.join(ninja.BIN_DIR, "ninja")):
            return path
    except ImportError:
        pass
    if path := shutil.which("ninja"):
        return path
    raise JitError("the ninja build tool was not found; install it with `pip install ninja`")


def _ninja_path(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _ninja_cmd(args: list[str]) -> str:
    return shlex.join(args).replace("$", "$$")


# Ninja prints this before each build step's description as the step finishes (its output is not a terminal):
# how many steps are finished, of how many.
_NINJA_STATUS = "[flashinfer_moe %f/%t] "
_NINJA_STATUS_RE = re.compile(r"^\[flashinfer_moe (\d+)/(\d+)\] ")


def _run_ninja(build_dir: Path, verbose: bool, progress: Callable[[float, int], None] | None = None) -> tuple[int, str]:
    """Runs ninja in ``build_dir``; calls ``progress(seconds, steps finished)`` every ``PROGRESS_INTERVAL_S``.

    Ninja compiles the translation units in parallel, then links. Returns its exit code and output.
    """
    cmd = [_find_ninja(), "-C", str(build_dir)] + (["-v"] if verbose else [])
    if verbose:
        print("[flashinfer_moe] " + shlex.join(cmd), file=sys.stderr, flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env={**os.environ, "NINJA_STATUS": _NINJA_STATUS},
    )
    lines: list[str] = []
    finished = [0]

    def read_output() -> None:
        for line in proc.stdout:
            status = _NINJA_STATUS_RE.match(line)
            if status:
                finished[0] = int(status.group(1))
                line = line[status.end() :]
            lines.append(line)
            if verbose:
                print(line, end="", file=sys.stderr, flush=True)

    reader = threading.Thread(target=read_output, name="flashinfer_moe-ninja", daemon=True)
    reader.start()
    try:
        while True:
            try:
                proc.wait(timeout=PROGRESS_INTERVAL_S)
                break
            except subprocess.TimeoutExpired:
                if progress is not None:
                    progress(time.monotonic() - start, finished[0])
    except BaseException:  # e.g. KeyboardInterrupt: ninja stops its compilers when terminated
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=1)
        raise
    reader.join(timeout=60)
    return proc.returncode, "".join(lines)
