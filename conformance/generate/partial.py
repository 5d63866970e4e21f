"""The partial-run directory of a ``conformance generate`` run: one finished job's result per base, the
run's identity (``key.json``), the lock that makes one run per ``--out`` (docs/distributed-generation.md).

    <out.parent>/.<out.name>.partial/
        key.json                 {"schema", "key", "arguments", "created"}: what this run makes
        model/                   the synthetic checkpoint of a --preset run (written once, reused)
        jobs/<base>/             one finished job: result.json + one .npy per array (logits.npy,
                                 router_margin.npy, embeddings.npy, media.<j>.<leaf>.npy)
        jobs/.<base>.tmp-*/      a job being written (renamed to jobs/<base>/ when complete)
        .staging-*/              the set being assembled (renamed to <out> when complete)
    <out.parent>/.<out.name>.partial.lock   held (fcntl.flock) by the run writing <out>: its pid, host
                                            and start; a second run on the same <out> stops at once
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from refimpl.synth import write_checkpoint

from ..sets.format import FixtureError

PARTIAL_SCHEMA = "gemma4-conformance/partial-run"
PARTIAL_SUFFIX = ".partial"
LOCK_SUFFIX = ".lock"
KEY_FILE = "key.json"
JOBS = "jobs"
RESULT = "result.json"
MODEL = "model"
STAGING_PREFIX = ".staging-"


class DiskFull(OSError):
    """A write of the run failed for want of space (ENOSPC, EDQUOT, or NumPy's short write, which carries no
    errno): the message says so and where; finished jobs are kept for the resume."""

    def __str__(self) -> str:
        return self.args[0]


def disk_full(e: OSError, where: Path) -> DiskFull | None:
    """``e`` as a DiskFull naming ``where`` (and the space left on its filesystem), or None when ``e`` is
    another error. NumPy's ``tofile`` reports a short write as "N requested and M written", without errno."""
    short = e.errno is None and " requested and " in str(e) and str(e).rstrip().endswith("written")
    if not (short or e.errno in (errno.ENOSPC, errno.EDQUOT)):
        return None
    try:
        st = os.statvfs(where)
        left = f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB left there"
    except OSError:
        left = "the space left there is unknown"
    what = "over quota" if e.errno == errno.EDQUOT else "full"
    return DiskFull(f"the disk holding {where} is {what} ({left}; {' '.join(str(e).split())}): free some space "
                    "there")


@contextlib.contextmanager
def full_disk_named(where: Path) -> Iterator[None]:
    """Writes inside the block that fail for want of space raise DiskFull naming ``where``."""
    try:
        yield
    except DiskFull:
        raise
    except OSError as e:
        full = disk_full(e, where)
        if full is None:
            raise
        raise full from None


class PartialRunMismatch(FixtureError):
    """The partial-run directory beside ``out`` belongs to a run with other arguments (never mixed)."""


class PartialRunBusy(FixtureError):
    """Another run holds the lock of ``out``'s partial run (RunLock): it is writing
    the same set now."""


def partial_dir(out: Path) -> Path:
    """The partial-run directory of a set: ``<out.parent>/.<out.name>.partial``."""
    out = Path(out)
    return out.parent / f".{out.name}{PARTIAL_SUFFIX}"


def lock_path(out: Path) -> Path:
    """The lock file of a set's partial run: ``<out.parent>/.<out.name>.partial.lock`` (beside the partial
    directory, so that it is taken before the directory exists or its key is known)."""
    path = partial_dir(out)
    return path.with_name(path.name + LOCK_SUFFIX)


def run_key(arguments: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(arguments, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def finished_bases(path: Path) -> list[str]:
    """The bases with a finished job in the partial-run directory ``path`` (none when it does not exist)."""
    jobs = Path(path) / JOBS
    return sorted(p.name for p in jobs.iterdir() if (p / RESULT).is_file()) if jobs.is_dir() else []


def _mismatch(path: Path, diff: list[str]) -> str:
    """Why a partial run of other arguments is in the way, and what to do: resume it or choose another
    --out; removing it is advised only when it holds no finished job (nothing would be lost)."""
    n = len(finished_bases(path))
    head = f"{path} holds an unfinished run with other arguments (differs in: {', '.join(diff) or 'key'}"
    if n == 0:
        return f"{head}); it holds no finished base: remove it (rm -r {path}) and run again"
    return (f"{head}; {n} finished base{'s' if n != 1 else ''} kept): to resume it, rerun with the arguments it "
            f"was made with (recorded in {path / KEY_FILE}); to make this set without touching it, choose another "
            "--out")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class RunLock:
    """The exclusive lock of the one run that may write a set's partial directory and publish the set.

    ``fcntl.flock`` on :func:`lock_path`: the kernel drops it when its holder exits, however it exits
    (a crashed or SIGKILLed run leaves at most an unlocked file, which the next run takes over). The
    holder writes its pid, host and start time into the file; a second run fails at once with
    fixtures.PartialRunBusy naming them. The file is unlinked (while still locked) on release; a run
    that locked a file unlinked meanwhile notices (another inode at the path) and tries again."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, out: Path) -> "RunLock":
        path = lock_path(Path(out))
        for _ in range(100):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise FixtureError(f"{path}: cannot be locked ({e.strerror or e}); the directory of "
                                           "--out must be on a filesystem with file locks") from None
                    raise PartialRunBusy(f"{out} is being generated by another run ({_holder(fd)}; lock {path}); "
                                         "wait for it to finish, or choose another --out") from None
                try:
                    st = os.stat(path)
                    same = (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
                except FileNotFoundError:
                    same = False
                if not same:  # released and unlinked by its holder between our open and flock
                    os.close(fd)
                    continue
                started = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
                rec = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}) + "\n"
                os.ftruncate(fd, 0)
                os.pwrite(fd, rec.encode(), 0)
                return cls(path, fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
        raise FixtureError(f"{path}: cannot be locked (it keeps being replaced)")  # pragma: no cover

    def release(self) -> None:
        """Unlink the lock file, then unlock it (closing it); idempotent."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> str:
    """'pid P on host H, started T' from a held lock file (what its holder wrote), or why not."""
    try:
        rec = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (OSError, ValueError):
        rec = None
    if not (isinstance(rec, dict) and isinstance(rec.get("pid"), int) and isinstance(rec.get("host"), str)):
        return "its holder has not recorded itself yet"
    return f"pid {rec['pid']} on host {rec['host']}" + (f", started {rec['started']}" if rec.get("started") else "")


class PartialRun:
    """The partial-run directory of one ``generate_set`` call (opened or created by ``open``)."""

    def __init__(self, path: Path, key: str, arguments: dict, created: bool):
        self.path, self.key, self.arguments, self.created = path, key, arguments, created

    @classmethod
    def open(cls, out: Path, arguments: dict) -> "PartialRun":
        """The partial dir beside ``out`` for these arguments: reused when its key matches, created when
        absent; a partial dir of other arguments raises PartialRunMismatch (never mixed)."""
        path, key = partial_dir(out), run_key(arguments)
        for _ in range(2):
            if path.exists():
                try:
                    rec = json.loads((path / KEY_FILE).read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    rec = None
                if not isinstance(rec, dict) or rec.get("schema") != PARTIAL_SCHEMA:
                    raise PartialRunMismatch(f"{path} exists but is not a partial run of this generator; remove it "
                                   f"(rm -r {path}) and run again")
                if rec.get("key") != key:
                    old = rec.get("arguments") if isinstance(rec.get("arguments"), dict) else {}
                    diff = sorted(k for k in set(old) | set(arguments) if old.get(k) != arguments.get(k))
                    raise PartialRunMismatch(_mismatch(path, diff))
                run = cls(path, key, arguments, created=False)
                run.clean_temporaries()
                return run
            tmp = Path(tempfile.mkdtemp(prefix=f".{Path(out).name}.partial-new-", dir=path.parent))
            try:
                (tmp / JOBS).mkdir()
                created = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
                (tmp / KEY_FILE).write_text(json.dumps({"schema": PARTIAL_SCHEMA, "key": key, "arguments": arguments,
                                                        "created": created}, indent=1) + "\n", encoding="utf-8")
                os.rename(tmp, path)
                _fsync_dir(path.parent)
                return cls(path, key, arguments, created=True)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                if not path.exists():
                    raise
        raise FixtureError(f"{path}: cannot be opened")  # pragma: no cover - a racing run twice

    def clean_temporaries(self) -> None:
        """Remove what a killed run was still writing (never a finished job)."""
        for p in list(self.path.iterdir()) + list((self.path / JOBS).iterdir() if (self.path / JOBS).is_dir() else []):
            if p.name.startswith(".") and ".tmp-" in p.name or p.name.startswith(STAGING_PREFIX):
                shutil.rmtree(p, ignore_errors=True)

    @property
    def model_dir(self) -> Path:
        return self.path / MODEL

    def synthetic_model(self, preset: str, seed: int) -> tuple[Path, bool]:
        """The preset's checkpoint in the partial run (deterministic: written once, renamed into place when
        complete), and whether an earlier run had written it."""
        src = self.model_dir
        if src.is_dir():
            return src, True
        tmp = Path(tempfile.mkdtemp(prefix=".model.tmp-", dir=self.path))
        try:
            os.rename(write_checkpoint(preset, seed, tmp / "model", dtype="f32"), src)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return src, False

    def job_dir(self, base: str) -> Path:
        return self.path / JOBS / base

    def finished(self) -> list[str]:
        return finished_bases(self.path)

    def is_done(self, base: str) -> bool:
        return (self.job_dir(base) / RESULT).is_file()

    def damaged(self, base: str) -> str | None:
        """Why the finished job of ``base`` cannot be used, naming the file (result.json unreadable or of
        another run, an array missing, of another size than was written, or with a broken header), or None.
        Cheap: sizes and headers, not contents."""
        path = self.job_dir(base)
        try:
            meta = json.loads((path / RESULT).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return f"{path / RESULT}: {' '.join(str(e).split()) or type(e).__name__}"
        if not isinstance(meta, dict) or meta.get("key") != self.key:
            return f"{path / RESULT}: not a result of this run"
        files = meta.get("files") if isinstance(meta.get("files"), dict) else {}
        for name in sorted(set(files) | {p.stem for p in path.glob("*.npy")}):
            f = path / f"{name}.npy"
            try:
                size = f.stat().st_size
                if name in files and size != files[name]:
                    return f"{f}: {size} bytes, where {files[name]} were written"
                np.load(f, mmap_mode="r", allow_pickle=False)
            except FileNotFoundError:
                return f"{f}: missing"
            except (OSError, ValueError, EOFError) as e:
                return f"{f}: {' '.join(str(e).split()) or type(e).__name__}"
        return None

    def discard(self, base: str) -> None:
        """Remove the finished job of ``base`` (renamed aside first, so that it is never half there)."""
        path = self.job_dir(base)
        aside = Path(tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=path.parent))
        os.rename(path, aside / "job")
        shutil.rmtree(aside, ignore_errors=True)

    def result(self, base: str) -> "JobResult":
        return JobResult.read(self.job_dir(base), self.key)

    def staging(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.path))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class JobResult:
    """A finished job read back: ``meta`` (result.json) and its arrays, memory-mapped on demand."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta = path, meta

    @classmethod
    def read(cls, path: Path, key: str) -> "JobResult":
        meta = json.loads((path / RESULT).read_text(encoding="utf-8"))
        if meta.get("key") != key:
            raise FixtureError(f"{path}: a job result of another run (key {str(meta.get('key'))[:12]}); remove "
                                 f"{path.parent.parent} and run again")
        return cls(path, meta)

    def array(self, name: str):
        return np.load(self.path / f"{name}.npy", mmap_mode="r", allow_pickle=False)

    def has(self, name: str) -> bool:
        return (self.path / f"{name}.npy").is_file()


def write_result(job_dir: Path, meta: dict, arrays: Mapping[str, Any]) -> None:
    """Write one job's result atomically: a temporary directory beside ``job_dir``, renamed to it.
    A result that is already there (the same job run twice, e.g. retried by a cluster) is kept."""
    with full_disk_named(job_dir.parent):
        _write_result(job_dir, meta, arrays)


def _write_result(job_dir: Path, meta: dict, arrays: Mapping[str, Any]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{job_dir.name}.tmp-", dir=job_dir.parent))
    meta = {**meta, "files": {}}  # each array's size as written: a damaged job is found on resume
    try:
        for name, a in arrays.items():
            with open(tmp / f"{name}.npy", "wb") as f:
                np.save(f, np.ascontiguousarray(a), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
                meta["files"][name] = os.fstat(f.fileno()).st_size
        with open(tmp / RESULT, "w", encoding="utf-8") as f:
            f.write(json.dumps(meta, indent=1, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.rename(tmp, job_dir)
        except OSError:
            if not (job_dir / RESULT).is_file():
                raise
        _fsync_dir(job_dir.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


