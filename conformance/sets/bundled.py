"""Finding fixture sets: the bundled ones (the top-level ``fixtures/`` of the source tree, shipped in the wheel
as the data package ``conformance.bundled``) and the directories a user names (``set_paths``)."""

from __future__ import annotations

import contextlib
import errno
import importlib.resources
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Sequence

from .format import MANIFEST, FixtureError

_BUNDLE_STACK = contextlib.ExitStack()


def _materialise(node) -> Path:
    """A filesystem path for an importlib.resources Traversable (extracted when in a zip)."""
    if isinstance(node, Path):
        return node
    tmp = Path(_BUNDLE_STACK.enter_context(tempfile.TemporaryDirectory(prefix="gemma4-conformance-fixtures-")))

    def copy(src, dst: Path) -> None:
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            if child.is_dir():
                copy(child, dst / child.name)
            else:
                (dst / child.name).write_bytes(child.read_bytes())

    copy(node, tmp / "fixtures")
    return tmp / "fixtures"


_BUNDLE_ROOT: list[Path] = []


# a source checkout (or an editable install of one): the sets beside the package, in the top-level fixtures/
SOURCE_TREE = Path(__file__).resolve().parents[2]


def bundle_root() -> Path | None:
    """The directory holding the bundled sets: ``fixtures/`` of the source tree the package is imported from,
    else the installed data package ``conformance.bundled`` (extracted when it lives in a zip); None when
    neither is there."""
    if (SOURCE_TREE / "pyproject.toml").is_file() and (SOURCE_TREE / "fixtures").is_dir():
        return SOURCE_TREE / "fixtures"
    spec = importlib.util.find_spec("conformance.bundled")
    if spec is None:
        return None
    for where in spec.submodule_search_locations or ():  # a data package: directories, no __init__.py
        if Path(where).is_dir():
            return Path(where)
    root = importlib.resources.files("conformance.bundled")
    return _materialise(root) if root.is_dir() else None


def bundled_sets() -> list[Path]:
    """The fixture sets shipped with the package (``fixtures/<name>/``), sorted by name."""
    if not _BUNDLE_ROOT:
        root = bundle_root()
        if root is None:
            return []
        _BUNDLE_ROOT.append(root)
    base = _BUNDLE_ROOT[0]
    return sorted(p for p in base.iterdir() if p.is_dir() and (p / MANIFEST).is_file())


def bundled_set(name: str) -> Path:
    """The bundled set called ``name`` (FixtureError listing the names when there is none)."""
    sets = bundled_sets()
    for p in sets:
        if p.name == name:
            return p
    raise FixtureError(f"no bundled fixture set {name!r}; bundled: {', '.join(p.name for p in sets) or 'none'}")


def _bundled_by_name(name: str) -> Path | None:
    """The bundled set called ``name`` (its directory's name), or None."""
    if "/" in name or name in ("", ".", ".."):
        return None
    found = [Path(b) for b in bundled_sets() if Path(b).name == name]
    return found[0] if found else None


def link_loop(path: Path) -> str | None:
    """What is wrong when ``path`` is a loop of symbolic links (it never reaches a file or directory), else
    None: Path.exists() says False for a loop as for a missing path, which would be the wrong message."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"{path}: a loop of symbolic links (it never reaches a directory or a .tar of a set)"
    return None


def set_paths(dirs: Sequence[str | Path] | None, flag: str = "--fixtures") -> list[Path]:
    """Fixture-set directories (or .tar archives of one) named by ``flag``'s arguments (``dirs``), a
    directory holding sets expanding to them; no argument: the bundled sets. ValueError naming ``flag`` when one cannot
    be used;
    FixtureError for a loop of symbolic links (a broken set: exit code 3, as ``verify`` says)."""
    if not dirs:
        paths = [Path(p) for p in bundled_sets()]
        if not paths:
            raise ValueError(f"no bundled fixture sets are installed; pass {flag} DIR (make one with: conformance "
                             "generate)")
        return paths
    out: list[Path] = []
    for d in dirs:
        p = Path(d)
        loop = link_loop(p)
        if loop is not None:
            raise FixtureError(f"{flag}: {loop}")
        if not p.exists() and _bundled_by_name(str(d)) is not None:
            p = _bundled_by_name(str(d))  # a bundled set's name: --fixtures e2b-mini
        if not p.exists():
            names = ", ".join(sorted(Path(b).name for b in bundled_sets()))
            raise ValueError(f"{flag}: no such directory: {d}" + (f" (nor a bundled set's name: {names})"
                                                                  if names and "/" not in str(d) else ""))
        if p.is_file() and p.name.endswith(".tar"):
            out.append(p)  # a set as one archive
            continue
        if not p.is_dir():
            raise ValueError(f"{flag}: not a directory or a .tar of a set: {d}")
        if (p / MANIFEST).is_file():
            out.append(p)
            continue
        subs = sorted(s for s in p.iterdir() if s.is_dir() and (s / MANIFEST).is_file())
        out.extend(subs if subs else [p])  # not a set: loading it says what is missing
    return out
