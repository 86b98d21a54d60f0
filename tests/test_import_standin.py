"""The import-only stand-ins that let SGLang's modules import where torchvision / sgl_kernel cannot."""

import importlib
import sys
import types

import pytest

from flashinfer_moe._import_standin import _StandInFinder, install_import_standin


@pytest.fixture
def package():
    name = "fimoe_standin_probe"
    yield name
    sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, _StandInFinder) and f.package == name)]
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def test_imports_resolve_and_calls_raise(package):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(package)
    install_import_standin(package)
    top = importlib.import_module(package)
    sub = importlib.import_module(f"{package}.ops.moe")
    fn = sub.fused_kernel.variant
    with pytest.raises(RuntimeError, match=rf"{package}\.ops\.moe\.fused_kernel\.variant: {package} is not installed"):
        fn(1, 2)
    with pytest.raises(RuntimeError, match=rf"{package}\.anything: {package}"):
        top.anything()
    # dunder lookups stay absent: inspect, pickle and hasattr rely on that
    assert not hasattr(top.fused, "__wrapped__")
    assert not hasattr(top, "__version__")


def test_drops_a_partial_import_and_installs_once(package):
    sys.modules[package] = types.ModuleType(package)  # what a failed import can leave behind
    install_import_standin(package)
    install_import_standin(package)
    assert sum(isinstance(f, _StandInFinder) and f.package == package for f in sys.meta_path) == 1
    assert type(importlib.import_module(package).kernel).__name__ == "_StandIn"
    with pytest.raises(RuntimeError):
        importlib.import_module(package).kernel()


def test_other_names_untouched(package):
    install_import_standin(package)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(package + "_other")


@pytest.mark.parametrize(
    "bad, exc, match",
    [(None, TypeError, "package: expected a module name"), ("", ValueError, "top-level"), ("a.b", ValueError, "'a.b'")],
)
def test_bad_package_name(bad, exc, match):
    with pytest.raises(exc, match=match):
        install_import_standin(bad)
