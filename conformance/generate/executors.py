"""The executors of generation jobs: in this process (``workers=1``), local processes (``concurrent.futures``
with the spawn context, BLAS threads split between them), or a Dask distributed cluster (``cluster=ADDRESS``;
``distributed`` is imported only then). The first failure stops the rest; finished results stay on disk."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import multiprocessing
import os
import threading
import time
import uuid
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from refimpl import memory
from refimpl.arrays import DEVICE_ENV, gpus
from refimpl.threads import cores

from .jobs import JobContext, run_job
from .progress import Sink, set_sink

CONNECT_TIMEOUT_S = 10  # --cluster: connecting to the scheduler


WORKERS_TIMEOUT_S = 60  # --cluster: waiting for the first worker


BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


CLUSTER_EXTRA = "pip install 'gemma4-conformance[cluster]'"


WORKER_LOSS_S = 60  # --cluster: how long a run waits while the cluster has no worker before it gives up


POLL_S = 1.0  # --cluster: how often the run looks at the cluster while it waits for jobs


KEPT = "finished bases are kept, run the same command again to resume"


class ClusterError(ValueError):
    """--cluster cannot be used: distributed missing, a malformed address, scheduler unreachable, no workers,
    a worker that cannot see the shared paths (a usage error: exit code 2)."""


class WorkerLost(RuntimeError):
    """The run lost what computes its jobs: a local worker process died, a Dask worker died (every one,
    for longer than WORKER_LOSS_S, or the same job's worker repeatedly: KilledWorker), or the connection
    to the Dask scheduler. Finished bases are kept for the resume (``conformance generate``: exit code 6).
    ``reason``: what was lost (the message without the advice to resume)."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}; {KEPT}")
        self.reason = reason


OnDone = Callable[[dict], None]


def run_jobs(specs: list[dict], *, workers: int, cluster: Any = None, on_done: OnDone,
             context: JobContext | None = None, on_stage: Sink | None = None) -> None:
    """Run every job (``specs`` in dispatch order: longest first) and call ``on_done(metadata)`` in this
    process as each finishes. ``cluster``: a connected ``DaskCluster``; else ``workers`` local processes
    (1: in this process, with ``context``). The first failure stops the rest (pending jobs are
    cancelled, running local workers terminated) and is raised; finished results stay on disk.
    ``on_stage(event)`` is called in this process with the jobs' stage events (``conformance.generate.progress``;
    a job's before its ``on_done``); Dask workers send none."""
    if not specs:
        return
    if cluster is not None:
        cluster.run(specs, on_done)
    elif workers <= 1:
        for spec in specs:
            on_done(run_job(spec, context, on_stage))
    else:
        _run_local(specs, workers, on_done, on_stage)


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


STAGE_POLL_S = 0.25  # local workers: how often the parent looks for stage events between finished jobs


def _run_local(specs: list[dict], workers: int, on_done: OnDone, on_stage: Sink | None = None) -> None:
    n = min(workers, len(specs))
    threads = max(1, cores() // n)  # BLAS and the oracle's own steps (refimpl.threads) in each worker
    futures: dict[cf.Future, str] = {}
    spawn = multiprocessing.get_context("spawn")
    # stage events: written synchronously by the workers, so a job's are in the pipe before its result
    events = spawn.SimpleQueue() if on_stage is not None else None
    devices = _gpu_slots(spawn, n)
    with blas_threads(threads):  # the children start during submit (spawn context), inheriting these
        pool = cf.ProcessPoolExecutor(max_workers=n, mp_context=spawn, initializer=_worker_init,
                                      initargs=(events, devices))
        try:
            for spec in specs:
                futures[pool.submit(run_job, spec)] = spec["base"]
        except BaseException:
            _stop(pool, futures)
            raise
    try:
        pending = set(futures)
        while pending:
            done, pending = cf.wait(pending, timeout=STAGE_POLL_S if events is not None else None,
                                    return_when=cf.FIRST_COMPLETED)
            _drain(events, on_stage)
            for fut in done:
                try:
                    meta = fut.result()
                except BrokenProcessPool as e:
                    raise WorkerLost(f"a local worker process died while running base {futures[fut]} ({e})") from None
                on_done(meta)
    except BaseException:
        _stop(pool, futures)
        raise
    pool.shutdown(wait=True)
    _drain(events, on_stage)
    if events is not None:
        events.close()


def _drain(events, on_stage: Sink | None) -> None:
    """Hand the stage events waiting in ``events`` to ``on_stage``, in the order they were sent."""
    while events is not None and not events.empty():
        on_stage(events.get())


def gpu_plan(gpus: list[str], n: int) -> list[str]:
    """The GPU of each of ``n`` workers: in turn over ``gpus`` (one worker per GPU at the default)."""
    return [gpus[k % len(gpus)] for k in range(n)]


def _gpu_slots(spawn, n: int):
    """With the oracle on the GPU (REFIMPL_DEVICE=cuda, ``--device cuda``): a queue of each worker's GPU
    (``gpu_plan``), each worker taking one as it starts (``_worker_init``); None on the CPU."""
    if os.environ.get(DEVICE_ENV) != "cuda":
        return None
    slots = spawn.SimpleQueue()
    for gpu in gpu_plan(gpus(), n):
        slots.put(gpu)
    return slots


def _worker_init(events=None, devices=None) -> None:
    """In a local worker process: its GPU, when the oracle runs on GPUs (``devices``, a queue of them: this worker
    sees only the one it takes, as CUDA_VISIBLE_DEVICES, before CuPy starts), the oracle's allocator settings
    (before any other thread allocates: ``refimpl.memory``), the queue for stage events (``events``; None: nobody
    listens), then exit when the parent dies (e.g. SIGKILL), instead of lingering."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices.get()
    memory.for_the_oracle()
    set_sink(events.put if events is not None else None)
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


def check_address(address: str) -> str:
    """A --cluster address as Dask reads it (``tcp://HOST:PORT``, ``HOST:PORT``, ``tls://``, ``ws://`` ...),
    or ClusterError naming what is wrong: before any connection is tried."""
    from distributed.comm.addressing import parse_address, parse_host_port
    from distributed.comm.registry import get_backend

    try:
        scheme, loc = parse_address(address)
        get_backend(scheme)
        if scheme in ("tcp", "tls", "ws", "wss"):
            host, port = parse_host_port(loc)
            if not host or not 0 < port < 65536:
                raise ValueError(f"no host in {loc!r}" if not host else f"port {port} is out of range")
    except (ValueError, TypeError) as e:
        raise ClusterError(f"--cluster: {address!r} is not a Dask scheduler address ({' '.join(str(e).split())}); "
                           "give tcp://HOST:PORT, e.g. tcp://head:8786") from None
    return address


class DaskCluster:
    """A connection to a Dask distributed scheduler (``distributed`` is imported here only)."""

    def __init__(self, address: str):
        try:
            import distributed
        except ImportError:
            raise ClusterError(f"--cluster needs the Dask 'distributed' package, which is not installed; "
                               f"{CLUSTER_EXTRA}") from None
        self.address, self._distributed = check_address(address), distributed
        quiet_dask_logs()
        try:
            self.client = distributed.Client(address, timeout=f"{CONNECT_TIMEOUT_S}s", set_as_default=False)
        except Exception as e:  # noqa: BLE001 - OSError/TimeoutError/ValueError for a bad or dead address
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ClusterError(f"--cluster: cannot connect to the Dask scheduler at {address} within "
                               f"{CONNECT_TIMEOUT_S} s ({reason})") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close(timeout=CONNECT_TIMEOUT_S)

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
        """Submit every job, hand each result to ``on_done`` as it comes (in the set's order among those that
        finish together), and watch the cluster meanwhile: WorkerLost when the scheduler is lost, when a job's
        workers keep dying (KilledWorker) or when no worker has been there for WORKER_LOSS_S."""
        tag = uuid.uuid4().hex[:8]
        futures = [self.client.submit(run_job, spec, key=f"gemma4-fixture-{spec['base']}-{tag}", pure=False,
                                      priority=len(specs) - i)
                   for i, spec in enumerate(specs)]
        try:
            with self.client.as_current():  # distributed.wait uses the current client
                self._collect(futures, specs, on_done)
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.cancel(futures)
            raise

    def _collect(self, futures: list, specs: list[dict], on_done: OnDone) -> None:
        order = {f.key: i for i, f in enumerate(futures)}
        base = {f.key: spec["base"] for f, spec in zip(futures, specs, strict=True)}
        pending, alone_since = list(futures), None
        while pending:
            done = self._wait(pending)
            for fut in sorted(done, key=lambda f: order[f.key]):
                on_done(self._result(fut, base[fut.key]))
            pending = [f for f in pending if f not in done]
            if pending and not done:
                alone_since = self._watch(alone_since, [base[f.key] for f in pending])

    def _wait(self, pending: list) -> set:
        """The futures of ``pending`` that finished within POLL_S (maybe none)."""
        from distributed.client import FutureCancelledError, FuturesCancelledError

        try:
            return set(self._distributed.wait(pending, timeout=POLL_S, return_when="FIRST_COMPLETED").done)
        except TimeoutError:
            return set()
        except (FutureCancelledError, FuturesCancelledError) as e:
            groups = getattr(e, "error_groups", None)
            reason = groups[0].reason if groups else getattr(e, "reason", "unknown")
            raise self._lost(f"the jobs were cancelled ({reason})") from None
        except OSError as e:  # CommClosedError included: the scheduler's connection
            raise self._lost(" ".join(str(e).split()) or type(e).__name__) from None

    def _result(self, fut, base: str) -> dict:
        from distributed.client import FutureCancelledError

        try:
            return fut.result()
        except self._distributed.KilledWorker as e:
            raise WorkerLost(f"base {base}: every Dask worker that ran it died (KilledWorker: "
                             f"{' '.join(str(e).split())[:300]})") from None
        except FutureCancelledError as e:
            raise self._lost(f"base {base} was cancelled ({e.reason})") from None

    def _watch(self, alone_since: float | None, waiting: list[str]) -> float | None:
        """Between results: WorkerLost when the scheduler is gone or has had no worker for WORKER_LOSS_S;
        returns since when it has had none (None while it has some)."""
        if self.client.status not in ("running", "newly-created"):
            raise self._lost(f"the client is {self.client.status}")
        try:
            workers = self.client.scheduler_info(n_workers=-1).get("workers", {})
        except Exception as e:  # noqa: BLE001 - the scheduler went away between two looks
            raise self._lost(" ".join(str(e).split()) or type(e).__name__) from None
        if workers:
            return None
        now = time.monotonic()
        if alone_since is None:
            return now
        if now - alone_since >= WORKER_LOSS_S:
            raise WorkerLost(f"--cluster: the Dask scheduler at {self.address} has had no worker for "
                             f"{WORKER_LOSS_S:g} s, with {len(waiting)} base{'s' if len(waiting) != 1 else ''} "
                             f"({', '.join(waiting)}) not finished: its workers were lost")
        return alone_since

    def _lost(self, reason: str) -> WorkerLost:
        return WorkerLost(f"--cluster: lost the connection to the Dask scheduler at {self.address} ({reason})")


def quiet_dask_logs() -> None:
    """In the parent, Dask's own log lines (reconnect attempts, tracebacks of a lost scheduler) say what our
    one line says: only its critical ones are shown."""
    for name in ("distributed", "distributed.client", "distributed.core", "distributed.comm", "tornado"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
