"""Every environment variable the library reads, parsed in one place.

Values are read when asked for, not at import, so a process (or a test) may change them at run time.
The README's table lists the same variables; keep the two in step.
"""

from __future__ import annotations

import os
from pathlib import Path

# name -> (default shown in docs, description)
VARIABLES: dict[str, tuple[str, str]] = {
    "FLASHINFER_MOE_CACHE_DIR": (
        "~/.cache/flashinfer_moe",
        "where compiled kernels are cached",
    ),
    "FLASHINFER_MOE_NVCC": (
        "$CUDA_HOME/bin/nvcc, else nvcc on PATH",
        "the CUDA compiler used by the JIT",
    ),
    "FLASHINFER_MOE_CUDA_ARCH": (
        "the current GPU's (e.g. 90a)",
        "target architecture(s) for the JIT, comma-separated, e.g. 90a or 90a,100a",
    ),
    "FLASHINFER_MOE_JIT_LOCK_TIMEOUT_S": (
        "900",
        "seconds a process waits for another one's compile of the same kernel before giving up",
    ),
    "FLASHINFER_MOE_JIT_VERBOSE": ("0", "1 prints the compiler's command lines and output"),
    "FLASHINFER_MOE_CUTLASS_DIR": (
        "the headers of the installed nvidia-cutlass package",
        "a CUTLASS include folder (holding cutlass/ and cute/) for the kernels built on CUTLASS",
    ),
    "FLASHINFER_MOE_GEMM_BACKEND": (
        "auto",
        "`triton` makes the FP8 block-scaled grouped GEMM skip its CUTLASS kernel on Hopper; `auto` uses it there",
    ),
    "FLASHINFER_MOE_MLA_BACKEND": (
        "auto",
        "`triton` makes the paged MLA decode skip its CUDA kernels on Hopper (bf16/fp16 and FP8 pages); `auto` "
        "uses them there",
    ),
    "FLASHINFER_MOE_MLA_FP8_PV": (
        "1",
        "`0` keeps the softmax weights of the FP8-page MLA decode at 17-32 (new token, head) rows (bf16 queries, "
        "Hopper) in fp16 instead of rounding them to E4M3 for FP8 tensor-core products (docs/perf.md: 1.01-1.16x "
        "faster; 0.7-1.4% relative error against exact products, fp16 weights 0.1-0.2%)",
    ),
    "FLASHINFER_MOE_NVFP4_SPLIT_BITS": (
        "1",
        "`0` makes the SGLang plugin pack NVFP4 layers as K-permuted bytes only "
        "(`pack_nvfp4_weights(split_bits=False)`) instead of split bits",
    ),
    "FLASHINFER_MOE_A2A_TIMEOUT_S": (
        "30",
        "seconds an all-to-all step waits for its peers before raising CommTimeoutError",
    ),
    "FLASHINFER_MOE_A2A_FIRST_TIMEOUT_S": (
        "300",
        "the same bound for the first P2P dispatch and combine of a communicator, while peers may still be starting",
    ),
    "FLASHINFER_MOE_PROBE_FORCE": (
        "unset",
        "`timeout` or `fail` makes every live P2P flag check fail that way (tests the failure paths)",
    ),
}


def _str(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _float(name: str, default: float) -> float:
    raw = _str(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {raw!r}")
    return value


def _bool(name: str, default: bool = False) -> bool:
    raw = _str(name)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0/1/true/false, got {raw!r}")


def cache_dir() -> Path:
    raw = _str("FLASHINFER_MOE_CACHE_DIR")
    return Path(raw).expanduser() if raw else Path("~/.cache/flashinfer_moe").expanduser()


def nvcc() -> str | None:
    """The nvcc the user asked for, or None to search CUDA_HOME and PATH."""
    return _str("FLASHINFER_MOE_NVCC")


def cuda_arch() -> list[str] | None:
    raw = _str("FLASHINFER_MOE_CUDA_ARCH")
    if raw is None:
        return None
    return [a.strip() for a in raw.split(",") if a.strip()]


def jit_lock_timeout_s() -> float:
    return _float("FLASHINFER_MOE_JIT_LOCK_TIMEOUT_S", 900.0)


def a2a_timeout_s() -> float:
    return _float("FLASHINFER_MOE_A2A_TIMEOUT_S", 30.0)


def a2a_first_timeout_s() -> float:
    return _float("FLASHINFER_MOE_A2A_FIRST_TIMEOUT_S", 300.0)


def jit_verbose() -> bool:
    return _bool("FLASHINFER_MOE_JIT_VERBOSE")


def cutlass_dir() -> Path | None:
    raw = _str("FLASHINFER_MOE_CUTLASS_DIR")
    return Path(raw).expanduser() if raw else None


def gemm_backend() -> str:
    raw = _str("FLASHINFER_MOE_GEMM_BACKEND") or "auto"
    if raw not in ("auto", "triton"):
        raise ValueError(f"FLASHINFER_MOE_GEMM_BACKEND must be 'auto' or 'triton', got {raw!r}")
    return raw


def mla_backend() -> str:
    raw = _str("FLASHINFER_MOE_MLA_BACKEND") or "auto"
    if raw not in ("auto", "triton"):
        raise ValueError(f"FLASHINFER_MOE_MLA_BACKEND must be 'auto' or 'triton', got {raw!r}")
    return raw


def mla_fp8_pv() -> bool:
    return _bool("FLASHINFER_MOE_MLA_FP8_PV", True)


def nvfp4_split_bits() -> bool:
    return _bool("FLASHINFER_MOE_NVFP4_SPLIT_BITS", True)


def cuda_home() -> Path | None:
    # Not ours to rename: CUDA_HOME / CUDA_PATH are the toolkit's own conventions.
    raw = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return Path(raw) if raw else None


def probe_force() -> str | None:
    raw = _str("FLASHINFER_MOE_PROBE_FORCE")
    if raw is None:
        return None
    if raw not in ("timeout", "fail"):
        raise ValueError(f"FLASHINFER_MOE_PROBE_FORCE must be 'timeout' or 'fail', got {raw!r}")
    return raw
