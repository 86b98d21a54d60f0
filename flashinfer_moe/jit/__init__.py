"""Just-in-time compilation of the CUDA kernels in ``csrc/``, cached on disk; see ``core``."""

from .core import (
    REGISTRY,
    KernelSpec,
    build,
    cache_key,
    cache_root,
    cache_size,
    clear_cache,
    csrc_dir,
    current_arch,
    find_nvcc,
    gencode_flags,
    load,
    nvcc_flags,
    nvcc_version,
    register,
    source_files,
)

__all__ = [
    "REGISTRY",
    "KernelSpec",
    "build",
    "cache_key",
    "cache_root",
    "cache_size",
    "clear_cache",
    "csrc_dir",
    "current_arch",
    "find_nvcc",
    "gencode_flags",
    "load",
    "nvcc_flags",
    "nvcc_version",
    "register",
    "source_files",
]
