"""A fixture set given as a single uncompressed ``.tar``: its files at the top level, or under one
directory. ``unpack`` extracts it into a temporary directory removed at exit, refusing anything but
plain files and directories with plain relative names (no links, devices, absolute paths or '..')."""

from __future__ import annotations

import atexit
import shutil
import tarfile
import tempfile
from pathlib import Path

from .format import MANIFEST, FixtureError, checkpoint_name_problem

_UNPACKED: list[str] = []


@atexit.register
def _remove_unpacked() -> None:
    for d in _UNPACKED:
        shutil.rmtree(d, ignore_errors=True)


def is_archive(path: Path) -> bool:
    return path.is_file() and path.name.endswith(".tar")


def unpack(path: Path) -> Path:
    """The set directory inside the archive ``path``, extracted into a temporary directory (removed at
    exit). FixtureError for an archive that is not a plain tar of a set."""
    try:
        tar = tarfile.open(path, mode="r:")
    except (OSError, tarfile.TarError) as e:
        raise FixtureError(f"{path}: not an uncompressed tar archive ({e})") from None
    with tar:
        try:
            members = tar.getmembers()  # reads the whole index: a truncated archive fails here
        except (OSError, tarfile.TarError) as e:
            raise FixtureError(f"{path}: a damaged or truncated tar archive ({e})") from None
        for m in members:
            why = checkpoint_name_problem(m.name.rstrip("/"))
            if why is not None:
                raise FixtureError(f"{path}: member {m.name!r} is not a plain relative path ({why})")
            if not (m.isfile() or m.isdir()):
                raise FixtureError(f"{path}: member {m.name!r} is not a plain file or directory (links and devices "
                                   "are refused)")
        tops = {m.name.split("/")[0] for m in members}
        if MANIFEST in tops:
            inner = ""
        elif len(tops) == 1 and any(m.name == f"{next(iter(tops))}/{MANIFEST}" for m in members):
            inner = next(iter(tops))
        else:
            raise FixtureError(f"{path}: holds no {MANIFEST} at its top level or under one directory; it is not a "
                               "fixture set")
        dest = tempfile.mkdtemp(prefix="gemma4-conformance-set-")
        _UNPACKED.append(dest)
        try:
            for m in members:
                target = Path(dest, m.name)
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                assert src is not None
                with src, open(target, "wb") as f:
                    shutil.copyfileobj(src, f, 1 << 20)
        except (OSError, tarfile.TarError) as e:
            raise FixtureError(f"{path}: cannot be extracted ({e})") from None
    return Path(dest, inner) if inner else Path(dest)
