"""The package's layout: moe/ and comm/ install inside the package and never as top-level modules."""

import os
import subprocess
import sys
from pathlib import Path

import flashinfer_moe

REPO = Path(__file__).resolve().parents[1]


def _run_outside(code: str, tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_top_level_comm_and_moe_do_not_resolve_here(tmp_path):
    code = (
        "import importlib.util, json\n"
        "out = {}\n"
        "for name in ('comm', 'moe', 'csrc'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    out[name] = None if spec is None else str(spec.origin or list(spec.submodule_search_locations))\n"
        "print(json.dumps(out))\n"
    )
    import json

    found = json.loads(_run_outside(code, tmp_path))
    for name, origin in found.items():
        assert origin is None or str(REPO) not in origin, f"`import {name}` resolves into this project: {origin}"


def test_subpackages_resolve_inside_the_package(tmp_path):
    out = _run_outside(
        "import flashinfer_moe.moe, flashinfer_moe.comm, flashinfer_moe.moe.routing as r; "
        "print(flashinfer_moe.moe.__name__, flashinfer_moe.comm.__name__, r.route is flashinfer_moe.route)",
        tmp_path,
    )
    assert out == "flashinfer_moe.moe flashinfer_moe.comm True"


def test_public_api_is_flat_and_complete():
    for name in flashinfer_moe.__all__:
        assert hasattr(flashinfer_moe, name), name
    assert "route" in flashinfer_moe.__all__


def test_import_compiles_nothing(tmp_path):
    # An nvcc that cannot run: importing (and using the CPU path) must never reach for it.
    env_code = (
        "import os; os.environ['FLASHINFER_MOE_NVCC'] = '/nonexistent/nvcc'; "
        f"os.environ['FLASHINFER_MOE_CACHE_DIR'] = {str(tmp_path / 'cache')!r}; "
        "import torch, flashinfer_moe; w, i = flashinfer_moe.route(torch.randn(3, 8), 2); "
        "print(tuple(w.shape), os.path.exists(os.environ['FLASHINFER_MOE_CACHE_DIR']))"
    )
    assert _run_outside(env_code, tmp_path) == "(3, 2) False"


def test_kernel_sources_ship_with_the_package():
    from flashinfer_moe import jit
    from flashinfer_moe.cli import _load_kernel_registry

    _load_kernel_registry()
    assert {"routing", "probe"} <= set(jit.REGISTRY)
    root = jit.csrc_dir()
    for spec in jit.REGISTRY.values():
        for src in spec.sources:
            assert (root / src).is_file(), f"{spec.name}: {src} missing under {root}"


def test_every_environment_variable_is_in_the_readme():
    from flashinfer_moe import envs

    readme = (REPO / "README.md").read_text()
    for name in envs.VARIABLES:
        assert f"`{name}`" in readme, f"{name} is parsed in envs.py but missing from the README's table"
