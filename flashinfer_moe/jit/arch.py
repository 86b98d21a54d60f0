"""Target architectures of the JIT: which archs to build for (``FLASHINFER_MOE_CUDA_ARCH`` or the visible GPUs),
their nvcc flags, and which of them a kernel family can be built for, checked before nvcc runs."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .. import envs
from ..errors import JitError

if TYPE_CHECKING:
    from .core import KernelSpec

_ARCH_RE = re.compile(r"^\d{2,3}[af]?$")
SUPPORTED_GPUS_HINT = 'see "Supported GPUs" in the README'


class UnsupportedArchError(JitError):
    """A kernel family cannot be built for the target architecture(s): raised before nvcc is run."""


def current_arch() -> list[str]:
    """Returns the target archs, e.g. ``["90a"]``: ``FLASHINFER_MOE_CUDA_ARCH``, else the visible GPUs'."""
    wanted = envs.cuda_arch()
    if wanted:
        return list(dict.fromkeys(wanted))
    try:
        import torch  # here, not at module level: the JIT must import without a GPU stack
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise JitError(
            "no CUDA GPU is visible, so the target architecture is unknown; pass one with "
            "FLASHINFER_MOE_CUDA_ARCH=90a or `flashinfer-moe build --arch 90a`"
        )
    caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    # From Hopper on, wgmma / tcgen05 exist only in the arch-specific ('a') targets.
    return list(dict.fromkeys(f"{ma}{mi}a" if ma >= 9 else f"{ma}{mi}" for ma, mi in caps))


def _checked_arch(arch: list[str], normalize: bool = False) -> list[str]:
    arch = [arch] if isinstance(arch, str) else list(arch)
    for a in arch:
        if not isinstance(a, str) or not _ARCH_RE.match(a):
            raise ValueError(f"invalid CUDA arch {a!r}: expected digits with an optional a/f suffix, e.g. 90a, 89")
    if not arch:
        raise ValueError("no CUDA arch given")
    # Sorted for the key, so it does not depend on the order GPUs were enumerated in.
    return sorted(set(arch), key=lambda a: (int(a.rstrip("af")), a)) if normalize else arch


def gencode_flags(arch: list[str]) -> list[str]:
    """nvcc flags embedding SASS for each arch.

    Args:
        arch: Arch strings such as ``["90a", "100a"]``.

    Returns:
        e.g. ``["-gencode=arch=compute_90a,code=sm_90a"]``.
    """
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in _checked_arch(arch)]


def _arch_number(arch: str) -> int:
    return int(arch.rstrip("af"))


def compute_capability(arch: str) -> str:
    """The compute capability an arch string stands for, e.g. ``"8.0"`` for ``"80"``, ``"10.0"`` for ``"100a"``."""
    number = _arch_number(_checked_arch([arch])[0])
    return f"{number // 10}.{number % 10}"


def arch_problem(spec: KernelSpec, arch: str) -> str | None:
    """Why ``spec`` cannot be built for ``arch``, or None when it can.

    Args:
        spec: The kernel family.
        arch: One target arch string, e.g. ``"75"``.

    Returns:
        e.g. ``"kernel family 'routing' needs sm_80 or newer (compute capability 8.0+)"``.
    """
    if spec.archs and arch not in spec.archs:
        return f"kernel family {spec.name!r} is written for sm_{', sm_'.join(spec.archs)} only"
    if spec.min_arch and _arch_number(arch) < _arch_number(spec.min_arch):
        return (
            f"kernel family {spec.name!r} needs sm_{spec.min_arch} or newer "
            f"(compute capability {compute_capability(spec.min_arch)}+)"
        )
    return None


def supported_archs(spec: KernelSpec, arch: list[str], where: str = "") -> list[str]:
    """The archs of ``arch`` that ``spec`` can be built for; checked without running nvcc.

    Args:
        spec: The kernel family.
        arch: Target arch strings.
        where: Where ``arch`` came from, for the error message (e.g. ``"the visible GPU"``).

    Returns:
        The buildable ones, in their order.

    Raises:
        UnsupportedArchError: None is buildable; the message names the family and its requirement.
    """
    arch = _checked_arch(arch)
    kept = [a for a in arch if arch_problem(spec, a) is None]
    if not kept:
        problem = arch_problem(spec, arch[0])
        targets = ", ".join(f"sm_{a} (compute capability {compute_capability(a)})" for a in arch)
        raise UnsupportedArchError(f"{problem}, not {targets}{f', {where}' if where else ''}; {SUPPORTED_GPUS_HINT}")
    return kept


def arch_origin() -> str:
    """Where ``current_arch()`` takes the archs from, in words (for messages)."""
    if envs.cuda_arch():
        return "from FLASHINFER_MOE_CUDA_ARCH"
    return "the visible GPUs' architecture"
