"""Old import paths that still work, with a warning: one table (``OLD_MODULES``) and one import hook.

A module that moved is imported under its old name as the new module itself, and the import warns
(``DeprecationWarning`` naming the new path), so that code written against the old layout keeps running and
learns where to go (docs/architecture.md, "Migration")."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["OLD_MODULES", "install"]

# old module -> the module it is now
OLD_MODULES = {
    "conformance.backend": "conformance.protocol",
    "conformance.backends.serving": "conformance.protocol.serving",
    "conformance.backends.transformers_backend": "conformance.backends.transformers.backend",
    "conformance.backends.mlx_backend": "conformance.backends.mlx_lm.backend",
    "conformance.backends.llama_cpp_backend": "conformance.backends.llama_cpp.backend",
    "conformance.backends.llama_cpp_engine": "conformance.backends.llama_cpp.engine",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as its new module, warning once per import."""

    def find_spec(self, name, path=None, target=None):
        if name not in OLD_MODULES:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = OLD_MODULES[spec.name]
        warnings.warn(f"{spec.name} is an old import path: import {new} instead (docs/architecture.md, "
                      "'Migration')", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """The new module is already executed."""


def install() -> None:
    """Put the hook on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.append(_Moved())
