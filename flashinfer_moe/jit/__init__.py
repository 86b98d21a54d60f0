"""Just-in-time compilation of the CUDA kernels in ``csrc/``, cached on disk; see ``core`` (and ``arch`` for the
target architectures)."""

from .arch import UnsupportedArchError, arch_problem, compute_capability, current_arch, gencode_flags, supported_archs
from .core import (
    REGISTRY,
    KernelSpec,
    build,
    cache_key,
    cache_root,
    cache_size,
    clear_cache,
    csrc_dir,
    find_nvcc,
    load,
    nvcc_flags,
    nvcc_version,
    register,
    source_files,
)

__all__ = [
    "REGISTRY",
    "KernelSpec",
    "UnsupportedArchError",
    "arch_problem",
    "build",
    "cache_key",
    "cache_root",
    "cache_size",
    "clear_cache",
    "compute_capability",
    "csrc_dir",
    "current_arch",
    "find_nvcc",
    "gencode_flags",
    "load",
    "nvcc_flags",
    "nvcc_version",
    "register",
    "source_files",
    "supported_archs",
]
