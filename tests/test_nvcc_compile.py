"""Every CUDA source compiles for sm_90a without a warning (compile only: CI has nvcc but no GPU).

ptxas's notice that it serialized the wgmma pipeline (it does when a call, such as a device assert, sits
between wgmma instructions) fails the test too: the kernel would run, only far slower. So does an instruction of
the SASS that writes the register operand, or touches the accumulators, of a wgmma still in flight
(``sass_wgmma.hazards``): the kernel would run and read whatever the register held by then."""

import os
import subprocess
from pathlib import Path

import pytest
import sass_wgmma

from flashinfer_moe import jit

SOURCES = sorted(jit.csrc_dir().rglob("*.cu"))


def _registry():
    from flashinfer_moe.cli import _load_kernel_registry

    return _load_kernel_registry().REGISTRY


def test_every_source_belongs_to_a_registered_family():
    owned = {src for spec in _registry().values() for src in spec.sources}
    assert {p.relative_to(jit.csrc_dir()).as_posix() for p in SOURCES} <= owned


def _nvcc():
    try:
        return jit.find_nvcc()
    except Exception:
        if os.environ.get("CI"):
            raise
        pytest.skip("nvcc not installed")


def test_there_are_sources():
    assert SOURCES, f"no .cu files under {jit.csrc_dir()}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(jit.csrc_dir())))
def test_compiles_for_sm90a(source: Path, tmp_path):
    nvcc = _nvcc()
    rel = source.relative_to(jit.csrc_dir()).as_posix()
    # A registered family's own flags and header sets (CUTLASS's include path, -DNDEBUG), where it has any.
    owner = next((s for s in _registry().values() if rel in s.sources), None)
    extra = dict(extra_cuda_flags=owner.extra_cuda_flags, header_sets=owner.header_sets) if owner else {}
    spec = jit.KernelSpec("compile_check", (rel,), **extra)
    flags = jit.nvcc_flags(spec, ["90a"])
    res = subprocess.run(
        [nvcc, *flags, "-Werror", "all-warnings", "-c", str(source), "-o", str(tmp_path / "out.o")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "instructions are serialized" not in res.stdout + res.stderr, res.stdout + res.stderr
    if sass_wgmma.cuobjdump():
        racy = sass_wgmma.hazards(sass_wgmma.sass_of(tmp_path / "out.o"))
        assert not racy, f"instructions touch the registers of a wgmma in flight: {racy[:5]}"
