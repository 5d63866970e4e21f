"""Parallel, resumable fixture generation: the jobs of ``fixtures.generate_set``, the partial-run
directory that holds their results, and the executors that run them (docs/distributed-generation.md).

One **job** per base does all the expensive work for that base: the greedy continuation of G and
P<k>, the image or audio tower and merge of I<k> / S<k>, the full float64 forward (logits [N, V]
and MoE router margins) and the KV-cache consistency check. A job writes its result into the
partial-run directory beside the set and returns only small metadata; the parent reads the results
back and assembles the set. Layout::

    <out.parent>/.<out.name>.partial/
        key.json                 {"schema", "key", "arguments", "created"}: what this run makes
        model/                   the synthetic checkpoint of a --preset run (written once, reused)
        jobs/<base>/             one finished job: result.json + one .npy per array (logits.npy,
                                 router_margin.npy, embeddings.npy, media.<j>.<leaf>.npy)
        jobs/.<base>.tmp-*/      a job being written (renamed to jobs/<base>/ when complete)
        .staging-*/              the set being assembled (renamed to <out> when complete)
    <out.parent>/.<out.name>.partial.lock   held (fcntl.flock) by the run writing <out>: its pid, host
                                            and start; a second run on the same <out> stops at once

Executors: in this process (``workers=1``), local processes (``concurrent.futures`` with the spawn
context, BLAS threads split between them), or a Dask distributed cluster (``cluster=ADDRESS``;
``distributed`` is imported only then).
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
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

PARTIAL_SCHEMA = "gemma4-conformance/partial-run"
PARTIAL_SUFFIX = ".partial"
LOCK_SUFFIX = ".lock"
KEY_FILE = "key.json"
JOBS = "jobs"
RESULT = "result.json"
MODEL = "model"
STAGING_PREFIX = ".staging-"
CONNECT_TIMEOUT_S = 10  # --cluster: connecting to the scheduler
WORKERS_TIMEOUT_S = 60  # --cluster: waiting for the first worker
BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
CLUSTER_EXTRA = "pip install 'gemma4-conformance[cluster]'"
# tests only: "BASE:fail" makes that base's job raise, "BASE:hang" makes it sleep (to be killed)
FAULT_ENV = "GEMMA4_CONFORMANCE_TEST_FAULT"


class ClusterError(ValueError):
    """--cluster cannot be used: distributed missing, scheduler unreachable, no workers, a worker that
    cannot see the shared paths (a usage error: exit code 2)."""


def _fixture_error(msg: str) -> Exception:
    from .fixtures import FixtureError

    return FixtureError(msg)


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


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------------------------
# the lock of a run


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
        from .fixtures import PartialRunBusy

        path = lock_path(Path(out))
        for _ in range(100):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise _fixture_error(f"{path}: cannot be locked ({e.strerror or e}); the directory of "
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
        raise _fixture_error(f"{path}: cannot be locked (it keeps being replaced)")  # pragma: no cover

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


# ----------------------------------------------------------------------------------------------
# the partial-run directory


class PartialRun:
    """The partial-run directory of one ``generate_set`` call (opened or created by ``open``)."""

    def __init__(self, path: Path, key: str, arguments: dict, created: bool):
        self.path, self.key, self.arguments, self.created = path, key, arguments, created

    @classmethod
    def open(cls, out: Path, arguments: dict) -> "PartialRun":
        """The partial dir beside ``out`` for these arguments: reused when its key matches, created when
        absent; a partial dir of other arguments raises fixtures.PartialRunMismatch (never mixed)."""
        from .fixtures import PartialRunMismatch as Mismatch

        path, key = partial_dir(out), run_key(arguments)
        for _ in range(2):
            if path.exists():
                try:
                    rec = json.loads((path / KEY_FILE).read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    rec = None
                if not isinstance(rec, dict) or rec.get("schema") != PARTIAL_SCHEMA:
                    raise Mismatch(f"{path} exists but is not a partial run of this generator; remove it "
                                   f"(rm -r {path}) and run again")
                if rec.get("key") != key:
                    old = rec.get("arguments") if isinstance(rec.get("arguments"), dict) else {}
                    diff = sorted(k for k in set(old) | set(arguments) if old.get(k) != arguments.get(k))
                    raise Mismatch(f"{path} holds an unfinished run with other arguments (differs in: "
                                   f"{', '.join(diff) or 'key'}); remove it (rm -r {path}) to start afresh, or "
                                   "rerun with the arguments it was made with to resume it")
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
        raise _fixture_error(f"{path}: cannot be opened")  # pragma: no cover - a racing run twice

    def clean_temporaries(self) -> None:
        """Remove what a killed run was still writing (never a finished job)."""
        for p in list(self.path.iterdir()) + list((self.path / JOBS).iterdir() if (self.path / JOBS).is_dir() else []):
            if p.name.startswith(".") and ".tmp-" in p.name or p.name.startswith(STAGING_PREFIX):
                shutil.rmtree(p, ignore_errors=True)

    @property
    def model_dir(self) -> Path:
        return self.path / MODEL

    def job_dir(self, base: str) -> Path:
        return self.path / JOBS / base

    def finished(self) -> list[str]:
        jobs = self.path / JOBS
        return sorted(p.name for p in jobs.iterdir() if (p / RESULT).is_file()) if jobs.is_dir() else []

    def is_done(self, base: str) -> bool:
        return (self.job_dir(base) / RESULT).is_file()

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
            raise _fixture_error(f"{path}: a job result of another run (key {str(meta.get('key'))[:12]}); remove "
                                 f"{path.parent.parent} and run again")
        return cls(path, meta)

    def array(self, name: str):
        import numpy as np

        return np.load(self.path / f"{name}.npy", mmap_mode="r", allow_pickle=False)

    def has(self, name: str) -> bool:
        return (self.path / f"{name}.npy").is_file()


def write_result(job_dir: Path, meta: dict, arrays: Mapping[str, Any]) -> None:
    """Write one job's result atomically: a temporary directory beside ``job_dir``, renamed to it.
    A result that is already there (the same job run twice, e.g. retried by a cluster) is kept."""
    import numpy as np

    tmp = Path(tempfile.mkdtemp(prefix=f".{job_dir.name}.tmp-", dir=job_dir.parent))
    try:
        for name, a in arrays.items():
            with open(tmp / f"{name}.npy", "wb") as f:
                np.save(f, np.ascontiguousarray(a), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
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


# ----------------------------------------------------------------------------------------------
# the worker side


def where() -> str:
    """This worker, for error messages: the Dask worker address, or host and pid."""
    import sys

    if "distributed" in sys.modules:
        with contextlib.suppress(Exception):
            return f"{sys.modules['distributed'].get_worker().address} ({socket.gethostname()})"
    return f"{socket.gethostname()} pid {os.getpid()}"


class _Context:
    """What a worker keeps between jobs of one run: the model (memory-mapped weights), tokenizer,
    random-id pool and the towers, each loaded on first use."""

    def __init__(self, model_dir: Path, model=None):
        from refimpl.model import Gemma4
        from refimpl.tokenizer import Tokenizer

        self.model_dir = model_dir
        self.model = model if model is not None else Gemma4(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self._lock = threading.Lock()
        self._pool = self._vision = self._audio = None

    @property
    def pool(self):
        from .fixtures import _ordinary_ids

        with self._lock:
            if self._pool is None:
                self._pool = _ordinary_ids(self.tokenizer, self.model.cfg.vocab_size)
            return self._pool

    @property
    def vision(self):
        from .fixtures import _Vision

        with self._lock:
            if self._vision is None:
                self._vision = _Vision(self.model_dir)
            return self._vision

    @property
    def audio(self):
        from .fixtures import _Audio

        with self._lock:
            if self._audio is None:
                self._audio = _Audio(self.model_dir)
            return self._audio


_CONTEXTS: dict[tuple[str, str], _Context] = {}
_CONTEXTS_LOCK = threading.Lock()


def _context(model_dir: str, key: str) -> _Context:
    """The worker's context for a run (one kept: a new run's model replaces the last one)."""
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get((model_dir, key))
        if ctx is None:
            path = Path(model_dir)
            if not path.is_dir() or not (path / "config.json").is_file():
                raise _fixture_error(f"worker {where()} cannot see the model directory {model_dir}; the model and "
                                     "--out's parent must be on storage every worker mounts at the same absolute path")
            _CONTEXTS.clear()
            ctx = _CONTEXTS[(model_dir, key)] = _Context(path)
        return ctx


def run_job(spec: dict, context: _Context | None = None) -> dict:
    """Run one job (``spec`` from fixtures' planner: small and picklable) and write its result into the
    partial-run directory; returns small metadata only (never the arrays)."""
    import numpy as np

    from . import fixtures as fx

    t0 = time.perf_counter()
    job_dir = Path(spec["partial"]) / JOBS / spec["base"]
    if not job_dir.parent.is_dir():
        raise _fixture_error(f"worker {where()} cannot see the partial-run directory {job_dir.parent.parent}; "
                             "--out's parent must be on storage every worker mounts at the same absolute path")
    if (job_dir / RESULT).is_file():  # finished meanwhile (a retried task)
        meta = json.loads((job_dir / RESULT).read_text(encoding="utf-8"))
        return {k: meta[k] for k in ("base", "tokens", "seconds", "worker")}
    fault = os.environ.get(FAULT_ENV, "")
    if fault.partition(":")[0] == spec["base"]:
        if fault.endswith(":hang"):
            time.sleep(3600)
        raise RuntimeError(f"base {spec['base']}: injected failure ({FAULT_ENV}={fault})")
    ctx = context if context is not None else _context(spec["model_dir"], spec["key"])
    model, kind, base = ctx.model, spec["kind"], spec["base"]
    arrays: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if kind == "text":
        ids = [int(t) for t in spec["ids"]]
        if spec["greedy"]:
            ids = ids + fx._greedy(model, ids, spec["greedy"])
        logits, margin = fx._base_logits(model, ids)
        worst = fx._consistency(model, ids, logits)
    else:
        sources = {int(k): tuple(v) for k, v in spec["sources"].items()}
        if kind == "image":
            mb = fx._make_image_base(model, ctx.vision, ctx.pool, spec["bos"], spec["seed"], sources, spec["b_index"],
                                     n_sources=spec["n_sources"])
            for j, (img, pr, st) in enumerate(zip(mb.originals, mb.processed, mb.soft)):
                arrays.update({f"media.{j}.pixels": np.asarray(img, dtype=np.uint8),
                               f"media.{j}.resized": np.asarray(pr.pixels, dtype=np.uint8),
                               f"media.{j}.pixel_values": pr.pixel_values,
                               f"media.{j}.positions": np.asarray(pr.positions, dtype=np.int64),
                               f"media.{j}.soft_tokens": st})
                extra.setdefault("num_soft_tokens", []).append(int(pr.num_soft_tokens))
        else:
            mb = fx._make_audio_base(model, ctx.audio, ctx.pool, spec["bos"], spec["seed"], sources, spec["b_index"],
                                     n_sources=spec["n_sources"])
            for j, (wave, f, st) in enumerate(zip(mb.waveforms, mb.features, mb.soft)):
                arrays.update({f"media.{j}.waveform": np.asarray(wave, dtype=np.float64),
                               f"media.{j}.features": np.asarray(f.features, dtype=np.float64),
                               f"media.{j}.mask": np.asarray(f.mask, dtype=bool),
                               f"media.{j}.soft_tokens": st})
        ids = [int(t) for t in mb.ids]
        logits, margin = fx._base_logits(model, ids, mb.inputs)
        worst = fx._image_consistency(model, mb, logits)
        arrays["embeddings"] = np.asarray(mb.inputs.embeddings, dtype=np.float64)
        extra.update({"spans": [[int(a), int(n)] for a, n in mb.spans], "info": mb.info, "n_media": len(mb.soft)})
    arrays["logits"] = logits
    if margin is not None:
        arrays["router_margin"] = margin
    seconds = time.perf_counter() - t0
    meta = {"key": spec["key"], "base": base, "kind": kind, "ids": ids, "tokens": len(ids), "consistency": worst,
            "seconds": round(seconds, 3), "worker": where(), "versions": fx._job_versions(),
            "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"), **extra}
    write_result(job_dir, meta, arrays)
    return {"base": base, "tokens": len(ids), "seconds": meta["seconds"], "worker": meta["worker"]}


# ----------------------------------------------------------------------------------------------
# executors


OnDone = Callable[[dict], None]


def run_jobs(specs: list[dict], *, workers: int, cluster: Any = None, on_done: OnDone,
             context: _Context | None = None) -> None:
    """Run every job (``specs`` in dispatch order: longest first) and call ``on_done(metadata)`` in this
    process as each finishes. ``cluster``: a connected ``DaskCluster``; else ``workers`` local processes
    (1: in this process, with ``context``). The first failure stops the rest (pending jobs are
    cancelled, running local workers terminated) and is raised; finished results stay on disk."""
    if not specs:
        return
    if cluster is not None:
        cluster.run(specs, on_done)
    elif workers <= 1:
        for spec in specs:
            on_done(run_job(spec, context))
    else:
        _run_local(specs, workers, on_done)


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """Set the BLAS thread variables to ``n`` for child processes started inside; restore afterwards."""
    saved = {v: os.environ.get(v) for v in BLAS_VARS}
    try:
        for v in BLAS_VARS:
            os.environ[v] = str(n)
        yield
    finally:
        for v, old in saved.items():
            if old is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = old


def _run_local(specs: list[dict], workers: int, on_done: OnDone) -> None:
    import concurrent.futures as cf
    import multiprocessing
    from concurrent.futures.process import BrokenProcessPool

    n = min(workers, len(specs))
    threads = max(1, (os.cpu_count() or 1) // n)
    futures: dict[cf.Future, str] = {}
    with blas_threads(threads):  # the children start during submit (spawn context), inheriting these
        pool = cf.ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=_worker_init)
        try:
            for spec in specs:
                futures[pool.submit(run_job, spec)] = spec["base"]
        except BaseException:
            _stop(pool, futures)
            raise
    try:
        for fut in cf.as_completed(futures):
            try:
                meta = fut.result()
            except BrokenProcessPool as e:
                raise _fixture_error(f"a local worker process died while running base {futures[fut]} ({e}); "
                                     "finished bases are kept, run again to resume") from None
            on_done(meta)
    except BaseException:
        _stop(pool, futures)
        raise
    pool.shutdown(wait=True)


def _worker_init() -> None:
    """In a local worker process: exit when the parent dies (e.g. SIGKILL), instead of lingering."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is not None:
        def watch() -> None:
            parent.join()
            os._exit(1)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _stop(pool, futures: Iterable) -> None:
    """Cancel pending jobs and terminate running worker processes (their jobs are lost, finished ones kept)."""
    for f in futures:
        f.cancel()
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        with contextlib.suppress(Exception):
            p.terminate()
    with contextlib.suppress(Exception):
        pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(5)


def _check_paths(paths: list[str]) -> str | None:
    """On a cluster worker: the first path it cannot see (or write, for the last), else None."""
    for i, p in enumerate(paths):
        path = Path(p)
        if not path.is_dir():
            return f"cannot see {p}"
        if i == len(paths) - 1 and not os.access(path, os.W_OK):
            return f"cannot write to {p}"
    return None


class DaskCluster:
    """A connection to a Dask distributed scheduler (``distributed`` is imported here only)."""

    def __init__(self, address: str):
        try:
            import distributed
        except ImportError:
            raise ClusterError(f"--cluster needs the Dask 'distributed' package, which is not installed; "
                               f"{CLUSTER_EXTRA}") from None
        self.address, self._distributed = address, distributed
        try:
            self.client = distributed.Client(address, timeout=f"{CONNECT_TIMEOUT_S}s", set_as_default=False)
        except Exception as e:  # noqa: BLE001 - OSError/TimeoutError/ValueError for a bad or dead address
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ClusterError(f"--cluster: cannot connect to the Dask scheduler at {address} within "
                               f"{CONNECT_TIMEOUT_S} s ({reason})") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()

    def check_workers(self, paths: list[str], timeout: float = WORKERS_TIMEOUT_S) -> list[str]:
        """Wait for at least one worker, then check that every worker sees ``paths`` (the last must be
        writable); returns the worker addresses."""
        try:
            self.client.wait_for_workers(1, timeout=timeout)
        except Exception:  # noqa: BLE001 - TimeoutError
            raise ClusterError(f"--cluster: the Dask scheduler at {self.address} has no worker (waited {timeout:g} s); "
                               f"start some with: dask worker {self.address}") from None
        problems = self.client.run(_check_paths, paths)
        for worker, problem in sorted(problems.items()):
            if problem:
                raise ClusterError(f"--cluster: worker {worker} {problem}; the model directory and --out's parent "
                                   "must be on storage every worker mounts at the same absolute path")
        return sorted(problems)

    def run(self, specs: list[dict], on_done: OnDone) -> None:
        import uuid

        tag = uuid.uuid4().hex[:8]
        futures = [self.client.submit(run_job, spec, key=f"gemma4-fixture-{spec['base']}-{tag}", pure=False,
                                      priority=len(specs) - i)
                   for i, spec in enumerate(specs)]
        try:
            with self.client.as_current():
                for fut in self._distributed.as_completed(futures):
                    on_done(fut.result())
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.cancel(futures)
            raise
