"""Old import paths that still work, with a warning: three tables and one import hook.

``OLD_MODULES``: a module that moved whole is imported under its old name as the new module itself.
``SPLIT_MODULES``: a module whose names went to several new modules is imported as a module holding those
names (the same objects). ``OLD_COMMANDS``: ``python -m OLD`` runs ``python -m NEW``. Each warns
(``DeprecationWarning`` naming the new path), so that code written against the old layout keeps running and
learns where to go (docs/architecture.md, "Migration")."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

__all__ = ["OLD_COMMANDS", "OLD_MODULES", "SPLIT_MODULES", "install", "new_paths"]

# old module -> the module it is now
OLD_MODULES = {
    "conformance.backend": "conformance.protocol",
    "conformance.backends.serving": "conformance.protocol.serving",
    "conformance.backends.transformers_backend": "conformance.backends.transformers.backend",
    "conformance.backends.mlx_backend": "conformance.backends.mlx_lm.backend",
    "conformance.backends.llama_cpp_backend": "conformance.backends.llama_cpp.backend",
    "conformance.backends.llama_cpp_engine": "conformance.backends.llama_cpp.engine",
}


def _from(module: str, *names: str) -> dict[str, str]:
    return {n: f"{module}:{n}" for n in names}


_SETS, _GENERATE = "conformance.sets", "conformance.generate"
_WIRE, _SERVER = "conformance.protocol.wire", "conformance.backends.subprocess.server"

# old module -> {its name: "new.module:name"}
SPLIT_MODULES = {
    "conformance.fixtures": {
        **_from(_SETS, "CASES", "EXPECTED", "MANIFEST", "FixtureError", "FixtureSet", "bundled_set", "bundled_sets",
                "load_set", "sha256_file"),
        **_from(_GENERATE, "CONSISTENCY_BOUND", "RECOMPUTE_BOUND", "PartialRunBusy", "PartialRunMismatch",
                "PromptError", "generate_set", "has_audio_tower", "has_vision_tower", "load_prompts",
                "synthetic_image", "synthetic_waveform", "verify_set")},
    "conformance.backends.subprocess_backend": {
        **_from(_WIRE, "CAPABILITY_FIELDS", "PROTOCOL", "RAW_DTYPES", "ST_DTYPES", "VERSIONS", "ArrayError",
                "EngineCrash", "EngineError", "EngineFailure", "EngineTimeout", "ProtocolError", "expected_rows",
                "read_array", "request_to_json"),
        "V1_CAPABILITY_FIELDS": f"{_WIRE}:CAPABILITY_FIELDS",
        **_from("conformance.backends.subprocess.client", "IsolatedBackend", "RefimplSubprocessBackend",
                "SubprocessBackend")},
    "conformance.backends.protocol_server": {
        **_from(_SERVER, "handle", "serve"), **_from(_WIRE, "jsonable", "request_from_json", "write_array"),
        "read_raw": f"{_WIRE}:read_input_array"},
}

# python -m old -> python -m new
OLD_COMMANDS = {"conformance.backends.protocol_server": "conformance.serve"}


def new_paths(old: str) -> str:
    """Where an old module went, as the warning says it: one module, or several joined by 'or'."""
    if old in OLD_MODULES:
        return OLD_MODULES[old]
    return " or ".join(dict.fromkeys(target.split(":")[0] for target in SPLIT_MODULES[old].values()))


def _split_module(old: str) -> types.ModuleType:
    module = types.ModuleType(old, f"Old import path: its names live in {new_paths(old)}.")
    for name, target in SPLIT_MODULES[old].items():
        where, attr = target.split(":")
        setattr(module, name, getattr(importlib.import_module(where), attr))
    module.__all__ = sorted(SPLIT_MODULES[old])
    return module


def _command_code(old: str) -> types.CodeType:
    new = OLD_COMMANDS[old]
    text = (f"python -m {old} is an old command: run python -m {new} instead (docs/architecture.md, 'Migration')")
    source = (f"import runpy, warnings\nwarnings.warn({text!r}, DeprecationWarning)\n"
              f"runpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n")
    return compile(source, f"<{old}>", "exec")


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as its new module (or the names of its new modules), warning once
    per import; ``get_code`` serves ``python -m`` of an old command."""

    def find_spec(self, name, path=None, target=None):
        if name not in OLD_MODULES and name not in SPLIT_MODULES:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        warnings.warn(f"{spec.name} is an old import path: import {new_paths(spec.name)} instead "
                      "(docs/architecture.md, 'Migration')", DeprecationWarning, stacklevel=2)
        if spec.name in OLD_MODULES:
            return importlib.import_module(OLD_MODULES[spec.name])
        return _split_module(spec.name)

    def exec_module(self, module) -> None:
        """The new module is already executed; a split module is filled in by create_module."""

    def get_code(self, name):
        """``python -m`` (runpy) asks for the module's code: an old command runs its new one."""
        if name not in OLD_COMMANDS:
            raise ImportError(f"{name} is an old import path: import {new_paths(name)} instead")
        return _command_code(name)


def install() -> None:
    """Put the hook on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.append(_Moved())
