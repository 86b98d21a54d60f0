import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; it is chosen when a kernel
# module is first imported, which no test does before this point.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def generator():
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    return g


@pytest.fixture
def rng():
    """``(seed, generator)``: fresh random inputs every run, the seed to put in failure messages."""
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, torch.Generator().manual_seed(seed)


@pytest.fixture
def nvfp4_kernel():
    """The Triton kernel module (``moe/gemm_nvfp4_kernel.py``), on a GPU or under the interpreter selected before
    it was imported."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter was not selected before the kernel module was imported")
    from flashinfer_moe.moe import gemm_nvfp4_kernel

    return gemm_nvfp4_kernel


@pytest.fixture
def env(tmp_path, monkeypatch):
    """The JIT tests' fake nvcc, source tree and cache (tests/jit_cases.py)."""
    from jit_cases import jit_env

    yield from jit_env(tmp_path, monkeypatch)
