"""Backend discovery: a registered name (entry-point group ``gemma4_conformance.backends``) or a
Python object given as ``module:attr``.

    load_backend("refimpl")                                       # registered name
    load_backend("refimpl", dtype="float32")                      # options go to the class / factory
    load_backend("mypkg.engine:MyBackend")                        # a class, a factory or an instance

Every failure raises ``conformance.protocol.BackendError`` with one message that says what is wrong
and how to fix it (the command line exits with code 4).
"""

from __future__ import annotations

import importlib
import json
from importlib.metadata import EntryPoint, PackageNotFoundError, distribution, entry_points
from pathlib import Path
from typing import Any

from .protocol.types import Backend, BackendError, Capabilities

GROUP = "gemma4_conformance.backends"
DISTRIBUTION = "gemma4-conformance"
PROTOCOL_MEMBERS = ("name", "capabilities", "open", "run", "close")

# top-level modules that an extra of this distribution provides
EXTRA_FOR_MODULE = {"torch": "hf", "transformers": "hf", "google.protobuf": "hf", "mlx": "mlx", "mlx_lm": "mlx",
                    "mlx_vlm": "mlx", "llama_cpp": "llama-cpp"}

__all__ = ["GROUP", "available_backends", "load_backend", "open_backend", "check_backend", "parse_option",
           "not_installed_note"]


def _entry_points() -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, ep)  # the first distribution that registers a name wins
    return found


def available_backends() -> dict[str, str]:
    """Registered backends: name -> entry-point value (``module:attr``), sorted by name."""
    return {name: ep.value for name, ep in sorted(_entry_points().items())}


def load_backend(spec: str, **options: Any) -> Backend:
    """The backend named by ``spec`` (a registered name or ``module:attr``), not yet opened.

    A class or factory is called with ``options``; an instance is returned as it is (and takes no
    options). The result must have ``name``, ``capabilities``, ``open``, ``run`` and ``close``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise BackendError(f"backend spec must be a registered name or module:attr, got {spec!r}")
    spec = spec.strip()
    extras: tuple[str, ...] = ()
    if ":" in spec:
        module, _, attr = spec.partition(":")
        if not module or not attr or ":" in attr:
            raise BackendError(f"backend spec {spec!r} is not of the form module:attr "
                               f"(e.g. mypackage.backend:MyBackend)")
    else:
        eps = _entry_points()
        if spec not in eps:
            known = ", ".join(sorted(eps)) or "(none)"
            raise BackendError(f"unknown backend {spec!r}; registered backends: "
                               f"{known}{'' if eps else not_installed_note()}. Give a registered name or a Python "
                               "object as module:attr (e.g. mypackage.backend:MyBackend)")
        ep = eps[spec]
        module, attr = ep.module, ep.attr
        extras = tuple(ep.extras)
    obj = _resolve(spec, module, attr, extras)
    backend = _instantiate(spec, obj, options)
    check_backend(backend, spec)
    return backend


def parse_option(text: str) -> tuple[str, Any]:
    """A backend option ``KEY=VALUE`` (``--backend-option``): VALUE is read as JSON when it is a number,
    true/false or null, else kept as the string. Raises ValueError naming the problem."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ValueError(f"must be KEY=VALUE with KEY a Python identifier, got {text!r}")
    try:
        parsed = json.loads(value)
        if parsed is not None and not isinstance(parsed, (int, float, bool)):
            parsed = value
    except ValueError:
        parsed = value
    return key, parsed


def not_installed_note() -> str:
    """Why no backend is registered when the reason is that this distribution is not installed (a plain
    checkout run with ``python -m conformance``; the entry points come with the installed package), else ""."""
    try:
        distribution(DISTRIBUTION)
    except PackageNotFoundError:
        return (f" ({DISTRIBUTION} is not installed, and its backends are registered when it is: pip install -e . "
                "in the checkout, or make check)")
    return ""


def _install_hint(missing: str, extras: tuple[str, ...]) -> str:
    top = missing.split(".")[0]
    extra = EXTRA_FOR_MODULE.get(missing) or EXTRA_FOR_MODULE.get(top)
    if extra is not None:
        return f"install the '{extra}' extra: pip install '{DISTRIBUTION}[{extra}]'"
    if extras:
        return f"install the backend's extras: pip install '{DISTRIBUTION}[{','.join(extras)}]'"
    return f"install the package that provides {top!r}"


def _resolve(spec: str, module: str, attr: str, extras: tuple[str, ...]) -> Any:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or module
        if module == missing or module.startswith(missing + "."):
            raise BackendError(f"backend {spec!r}: no module named {missing!r}; check the module path, or "
                               f"{_install_hint(missing, extras)}") from exc
        raise BackendError(f"backend {spec!r}: module {module!r} needs {missing!r}, which is not installed; "
                           f"{_install_hint(missing, extras)}") from exc
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # any import-time failure (SystemExit too) is a load failure
        raise BackendError(f"backend {spec!r}: importing module {module!r} failed: "
                           f"{type(exc).__name__}: {exc}") from exc
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BackendError(f"backend {spec!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _looks_like_backend(obj: Any) -> bool:
    return all(hasattr(obj, m) for m in PROTOCOL_MEMBERS)


def _instantiate(spec: str, obj: Any, options: dict[str, Any]) -> Any:
    if isinstance(obj, type) or (callable(obj) and not _looks_like_backend(obj)):
        what = "class" if isinstance(obj, type) else "factory"
        try:
            return obj(**options)
        except KeyboardInterrupt:
            raise
        except BackendError as exc:  # already says what is wrong: once, not wrapped in 'raised BackendError'
            raise BackendError(f"backend {spec!r}: {exc}") from exc
        except BaseException as exc:  # a constructor failure (SystemExit too) is a load failure
            raise BackendError(f"backend {spec!r}: the {what} raised {type(exc).__name__}: {exc}") from exc
    if options:
        raise BackendError(f"backend {spec!r} is an instance, not a class or factory; it takes no options "
                           f"(got {', '.join(sorted(options))})")
    return obj


def check_backend(backend: Any, spec: str | None = None) -> None:
    """Raise BackendError unless ``backend`` satisfies the protocol (``conformance.protocol.Backend``)."""
    label = f"backend {spec!r}" if spec is not None else f"backend object {type(backend).__name__}"
    missing = [m for m in PROTOCOL_MEMBERS if not hasattr(backend, m)]
    if missing:
        raise BackendError(f"{label} does not satisfy the backend protocol (conformance.protocol.Backend): "
                           f"missing {', '.join(missing)}")
    problems = []
    name = backend.name
    if not isinstance(name, str) or not name:
        problems.append(f"name must be a non-empty str, got {name!r}")
    if not isinstance(backend.capabilities, Capabilities):
        problems.append(f"capabilities must be a conformance.protocol.Capabilities, "
                        f"got {type(backend.capabilities).__name__}")
    problems += [f"{m} is not callable" for m in ("open", "run", "close") if not callable(getattr(backend, m))]
    if problems:
        raise BackendError(f"{label} does not satisfy the backend protocol (conformance.protocol.Backend): "
                           + "; ".join(problems))


def open_backend(backend: Backend, model_dir: Path | str) -> None:
    """``backend.open(model_dir)``; any failure becomes a BackendError naming the backend and the directory."""
    try:
        backend.open(Path(model_dir))
    except (BackendError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # a backend that cannot open (SystemExit too) stops the run (exit 4)
        raise BackendError(f"backend {backend.name!r} could not open {model_dir}: "
                           f"{type(exc).__name__}: {exc}") from exc
