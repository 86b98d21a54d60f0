"""Import-only stand-ins for packages that SGLang imports at module level but the MoE path never calls
(``torchvision`` on a CPU-only machine, ``sgl_kernel`` where its CUDA library does not load). The SGLang
plugin's tests and ``launch/bench_sglang.py`` install one so that SGLang's modules import; a call into a
stand-in raises, naming what was called, so a path that does need the package cannot pass silently.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__all__ = ["install_import_standin"]


class _StandIn:
    """Any attribute of a stand-in module: attributes of it are stand-ins too, calling it raises."""

    def __init__(self, name: str, package: str):
        self._name = name
        self._package = package

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StandIn(f"{self._name}.{attr}", self._package)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: {self._package} is not installed (a stand-in for import only)")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str):
        self.package = package

    def find_spec(self, name, path=None, target=None):
        if name == self.package or name.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        # The module's missing attributes resolve as a stand-in named after it would resolve its own.
        module.__getattr__ = _StandIn(spec.name, self.package).__getattr__
        return module

    def exec_module(self, module):
        pass


def install_import_standin(package: str) -> None:
    """Answer every later import of ``package`` and its submodules with stand-in modules.

    Modules of ``package`` already imported (a failed or partial import) are dropped first. Installing the
    same package twice is a no-op.

    Args:
        package: top-level module name, e.g. ``"torchvision"``.

    Raises:
        TypeError: ``package`` is not a string.
        ValueError: ``package`` is empty or dotted.
    """
    if not isinstance(package, str):
        raise TypeError(f"package: expected a module name (str), got {type(package).__name__}")
    if not package or "." in package:
        raise ValueError(f"package: expected a top-level module name, got {package!r}")
    if any(isinstance(f, _StandInFinder) and f.package == package for f in sys.meta_path):
        return
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _StandInFinder(package))
