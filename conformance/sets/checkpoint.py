"""The checkpoint a fixture set was made from, found by content: every file the manifest records (relative
name, size, sha256) must be in the directory, with that size and digest; the recorded path is provenance,
tried only when no directory is given (``--model DIR``).

Digests are cached, so a second ``check`` of a 60 GB checkpoint reads nothing: the sha256 of a file is kept
under its identity (real path, size, mtime, inode, device) in ``digests.json`` in the cache directory
(``$CONFORMANCE_CACHE_DIR``, else ``$XDG_CACHE_HOME/gemma4-conformance``, else
``~/.cache/gemma4-conformance``). A file changed in the RACY_NS before it was hashed is not cached (its
mtime might not show a later change of the same size); a cache that cannot be read is ignored and one
that cannot be written leaves the digests uncached. ``rehash=True`` hashes every file again.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Mapping

from refimpl.threads import cores

from .format import FixtureError, sha256_file

CACHE_ENV = "CONFORMANCE_CACHE_DIR"
CACHE_NAME = "digests.json"
CACHE_SCHEMA = "gemma4-conformance/digests"
CACHE_VERSION = 1
RACY_NS = 2_000_000_000  # a file modified this close to its hashing is hashed again next time
IDENTITY = ("size", "mtime_ns", "ino", "dev")
MODEL_HINT = "pass the directory of the checkpoint the set was made from with --model DIR"


def cache_path() -> Path | None:
    """The digest cache file (None when no cache directory can be named: no home directory)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env) / CACHE_NAME
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "gemma4-conformance" / CACHE_NAME
    try:
        return Path.home() / ".cache" / "gemma4-conformance" / CACHE_NAME
    except RuntimeError:
        return None


def _identity(real: str) -> dict[str, int]:
    st = os.stat(real)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev}


def _valid(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
            and all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool) for k in IDENTITY))


def _read_cache(path: Path | None) -> dict[str, dict]:
    """The cache's entries; {} for a cache that is missing, unreadable or not one."""
    if path is None:
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("schema") != CACHE_SCHEMA or not isinstance(doc.get("files"), dict):
        return {}
    return {k: v for k, v in doc["files"].items() if isinstance(k, str) and _valid(v)}


def _write_cache(path: Path | None, new: dict[str, dict]) -> None:
    """Merge ``new`` into the cache (what other runs wrote meanwhile is kept; entries whose file changed or
    went away are dropped) and replace the file atomically. Silently does nothing when it cannot."""
    if path is None or not new:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = {**_read_cache(path), **new}
        kept = {}
        for real, entry in entries.items():
            try:
                if _identity(real) == {k: entry[k] for k in IDENTITY}:
                    kept[real] = entry
            except OSError:
                pass
        fd, tmp = tempfile.mkstemp(prefix=f".{CACHE_NAME}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"schema": CACHE_SCHEMA, "version": CACHE_VERSION, "files": kept}, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


class DigestCache:
    """sha256 of files through the cache: ``sha256(path)`` for each file, then ``save()`` once.
    ``rehash``: cached digests are not used (they are refreshed)."""

    def __init__(self, *, rehash: bool = False, path: Path | None = None):
        self.path = path if path is not None else cache_path()
        self.rehash = rehash
        self._entries: dict[str, dict] | None = None
        self._new: dict[str, dict] = {}

    def sha256(self, file: str | Path) -> str:
        """The file's sha256 hex digest (OSError when it cannot be read)."""
        real = os.path.realpath(file)
        before = _identity(real)
        if not self.rehash:
            entry = self._new.get(real) or self._cached().get(real)
            if entry is not None and {k: entry[k] for k in IDENTITY} == before:
                return entry["sha256"]
        started = time.time_ns()
        digest = sha256_file(Path(real))
        if _identity(real) == before and started - before["mtime_ns"] >= RACY_NS:
            self._new[real] = {**before, "sha256": digest}
        return digest

    def _cached(self) -> dict[str, dict]:
        """The cache file's entries, read at the first use."""
        if self._entries is None:
            self._entries = _read_cache(self.path)
        return self._entries

    def sha256_all(self, files: list[str | Path]) -> list[str | OSError]:
        """The sha256 of each file, or the OSError reading it raised, in order: files not in the cache are read
        side by side on up to ``cores()`` threads (hashlib lets go of the GIL), so the shards of a real
        checkpoint (a 31B's 62 GB in a dozen files) are hashed together, not one after another."""
        if not self.rehash:
            self._cached()  # read once, before the threads

        def one(file):
            try:
                return self.sha256(file)
            except OSError as e:
                return e
        workers = min(len(files), cores())
        if workers <= 1:
            return [one(f) for f in files]
        pool = ThreadPoolExecutor(workers, thread_name_prefix="sha256")
        try:
            return list(pool.map(one, files))
        finally:  # an interrupt: the files not started are not read
            pool.shutdown(wait=True, cancel_futures=True)

    def save(self) -> None:
        _write_cache(self.path, self._new)
        self._new = {}


def file_digests(directory: str | Path, names: Iterable[str], *, rehash: bool = False) -> dict[str, str]:
    """name -> sha256 of ``directory / name``, through the digest cache (OSError for a file that cannot be read)."""
    cache = DigestCache(rehash=rehash)
    names = list(names)
    try:
        digests = cache.sha256_all([Path(directory) / n for n in names])
    finally:
        cache.save()
    for d in digests:
        if isinstance(d, OSError):
            raise d
    return dict(zip(names, digests, strict=True))


def checkpoint_record(directory: str | Path, names: Iterable[str], *, rehash: bool = False) -> dict[str, dict]:
    """What a manifest records of an external checkpoint's files: {"sha256": {name: hex}, "size": {name: bytes}}."""
    names = list(names)
    return {"sha256": file_digests(directory, names, rehash=rehash),
            "size": {n: os.stat(Path(directory) / n).st_size for n in names}}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def recorded_dir(model: Mapping[str, Any]) -> Path | None:
    """The path the manifest's model record was made from, when it is here (a directory, or a GGUF file; else
    None)."""
    path = model.get("path")
    return Path(path) if isinstance(path, str) and path and os.path.exists(path) else None


def not_checked_note(model: Mapping[str, Any]) -> str:
    """What ``conformance verify`` says of an external set whose checkpoint it could not look at."""
    names = list(model["sha256"])
    return (f"the checkpoint was NOT checked: it is not at the path the set records ({model.get('path')}); "
            f"{MODEL_HINT} to check its {_plural(len(names), 'recorded file')} ({', '.join(names)})")


def checkpoint_problems(model: Mapping[str, Any], model_dir: str | Path | None = None, *, where: str,
                        rehash: bool = False) -> list[str]:
    """Every way the checkpoint in ``model_dir`` (default: the recorded path) differs from the manifest's
    ``model`` record (its ``sha256`` map, and ``size`` where recorded): a directory that is not there, a
    recorded file missing, of another size (found without reading it), unreadable or of another sha256.
    Empty when it is the set's checkpoint. ``where`` (the set) starts every message."""
    names, sizes = list(model["sha256"]), model.get("size") or {}
    if model_dir is None:
        d = Path(str(model.get("path")))
        place = f"{d} (the path the set records)"
        if not d.exists():
            return [f"{where}: the checkpoint is not at the path the set records ({d}), so none of its "
                    f"{_plural(len(names), 'recorded file')} ({', '.join(names)}) could be checked; {MODEL_HINT}"]
    else:
        d = Path(model_dir)
        place = f"{d} (--model)"
        if not d.exists():
            return [f"{where}: --model {d}: no such directory; {MODEL_HINT}"]
    files = {n: d / n for n in names}
    if d.is_file():  # a one-file checkpoint (a GGUF): the file itself, whatever its name
        if len(names) != 1:
            return [f"{where}: {d} is a file, but the set records a checkpoint of {_plural(len(names), 'file')} "
                    f"({', '.join(names)}); {MODEL_HINT}"]
        files = {names[0]: d}
    problems, todo = [], []
    for n in names:
        f, want_size, want = files[n], sizes.get(n), model["sha256"][n]
        recorded = f"{want_size} bytes, sha256 {want}" if want_size is not None else f"sha256 {want}"
        try:
            size = os.stat(f).st_size if f.is_file() else None
        except OSError:
            size = None
        if size is None:
            problems.append(f"{where}: {n} is missing from the checkpoint directory {place}: the set records it "
                            f"({recorded}); {MODEL_HINT}")
        elif want_size is not None and size != want_size:
            problems.append(f"{where}: {n} in the checkpoint directory {place} differs from the set's: {size} bytes, "
                            f"the set records {recorded}; {MODEL_HINT}, or regenerate the set for this checkpoint")
        else:
            todo.append(n)
    cache = DigestCache(rehash=rehash)
    try:
        digests = cache.sha256_all([files[n] for n in todo])
    finally:
        cache.save()
    for n, got in zip(todo, digests, strict=True):
        want = model["sha256"][n]
        if isinstance(got, OSError):
            problems.append(f"{where}: {n} in the checkpoint directory {place} cannot be read ({got.strerror or got})")
        elif got != want:
            problems.append(f"{where}: {n} in the checkpoint directory {place} differs from the set's: sha256 "
                            f"{got}, the set records {want}; {MODEL_HINT}, or regenerate the set for this "
                            "checkpoint")
    return problems


def find_checkpoint(model: Mapping[str, Any], model_dir: str | Path | None = None, *, where: str,
                    rehash: bool = False) -> Path:
    """The checkpoint directory of the manifest's ``model`` record (of a GGUF set, its file): ``model_dir``
    (``--model``) or else the recorded path, as an absolute path, once every recorded file matches;
    FixtureError (exit 3) with the first problem of ``checkpoint_problems`` otherwise."""
    problems = checkpoint_problems(model, model_dir, where=where, rehash=rehash)
    if problems:
        more = f" (and {_plural(len(problems) - 1, 'more problem')})" if len(problems) > 1 else ""
        raise FixtureError(problems[0] + more)
    path = Path(os.path.abspath(model_dir if model_dir is not None else str(model["path"])))
    names = list(model["sha256"])
    if path.is_dir() and len(names) == 1 and names[0].endswith(".gguf"):
        return path / names[0]  # a GGUF set's checkpoint is its file, found in the directory given
    return path
