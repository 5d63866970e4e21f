"""The oracle's threads: one pool per process, and row blocks for the steps outside BLAS.

BLAS runs its products on every core by itself; NumPy runs everything else (norms, GELU, softmax, RoPE,
the softcap, the bf16 decoding of weights) on one. The steps here spread that work over the cores:

- ``in_parts(total, work)`` splits a range of rows into contiguous parts, one per thread, and runs
  ``work(first, last)`` on each (the decoding of weights and the streamed products of ``weights.py``,
  attention's blocks of query rows in ``schedule.py``).
- ``all_finite`` checks a large array for NaN and infinities a block of rows per thread.
- ``rowwise`` wraps a step of ``ops.py`` (in ``schedule.py``) whose rows are independent (an elementwise
  formula, or one along the last axis): on a large input each thread runs the unchanged function on its own
  block of rows and writes that block of the result. Every element is computed by the same NumPy calls, in
  the same order, as in one call over the whole input, so the result does not depend on the thread count.

NumPy releases the GIL inside its loops, so the parts run on separate cores. The pool is made once per
process (again after a fork); its threads wait on locks of their own (``_Worker``), so handing out the
parts runs no Python in them. Work that a part starts in turn runs in that part's thread, and a caller
that finds the pool in use by another thread runs its parts itself.

How many threads: ``threads()``: the ``REFIMPL_THREADS`` environment variable, else the BLAS variables
(``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, as ``conformance generate`` sets them
for its worker processes), else the cores this process may run on; inside a part, the count of the call
that made it; ``use_threads(n)`` sets it within a block (tests compare thread counts with it).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import os
import threading
from typing import Callable, Iterator

import numpy as np

from . import memory
from .errors import InputError

THREADS_ENV = "REFIMPL_THREADS"
BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
ROWWISE_BLOCK = 1 << 17  # values per block of a row-blocked step (1 MiB of float64)

_override: int | None = None  # use_threads()
_pool_lock = threading.Lock()
_inside = threading.local()  # .part: the thread count of the call whose part this thread runs (0: none;
#                               nested work runs inline)


def cores() -> int:
    """The cores this process may run on (taskset, cgroup affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads() -> int:
    """Threads the oracle's own steps use (see the module's docstring)."""
    if _override is not None:
        return _override
    part = getattr(_inside, "part", 0)
    if part:  # inside a part: the count of the call that made it (the environment is not read again)
        return part
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise InputError(f"{THREADS_ENV}={value!r}: the oracle's thread count must be a positive integer")
        return int(value)
    for var in BLAS_VARS:
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return cores()


@contextlib.contextmanager
def use_threads(n: int) -> Iterator[None]:
    """Within the block, the oracle's steps use ``n`` threads (BLAS keeps its own count)."""
    global _override
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be a positive integer, got {n!r}")
    saved, _override = _override, n
    try:
        yield
    finally:
        _override = saved


def scaled(base: int) -> int:
    """Values per block for a step that ``base`` suits on a few cores, grown with the thread count (x1 up
    to 7 threads, x2 from 8, x4 from 16): every block costs some Python under the GIL, and with many
    threads bigger blocks keep them from queueing for it (the caches of such machines hold them)."""
    return base * min(4, max(1, threads() // 4))


def _openblas_threads() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """(get, set) of the thread count of the OpenBLAS loaded in this process (NumPy's scipy-openblas, or
    a system OpenBLAS), found among the mapped libraries; None elsewhere (another BLAS, no /proc)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.rsplit("/", 1)[-1].lower()}
    except OSError:
        return None
    names = [("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
             ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
             ("openblas_get_num_threads", "openblas_set_num_threads")]
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get, set_ in names:
            if hasattr(lib, get) and hasattr(lib, set_):
                getter, setter = getattr(lib, get), getattr(lib, set_)
                getter.restype, getter.argtypes = ctypes.c_int, []
                setter.restype, setter.argtypes = None, [ctypes.c_int]
                return getter, setter
    return None


_openblas: list = []  # [(get, set) or None], looked up once
_blas_lock = threading.Lock()
_blas_users = [0, 0]  # [users inside blas_on_one_thread, the count to restore]


@contextlib.contextmanager
def blas_on_one_thread() -> Iterator[None]:
    """Within the block, OpenBLAS runs each call on the calling thread alone: for products made by many
    threads at once (the streamed matrix-vector products), whose calls would otherwise queue for
    OpenBLAS's one pool of workers. Process-wide while it lasts (overlapping blocks restore the count when
    the last one ends); a no-op without OpenBLAS."""
    with _blas_lock:
        if not _openblas:
            _openblas.append(_openblas_threads())
        api = _openblas[0]
        if api is not None:
            if _blas_users[0] == 0:
                _blas_users[1] = api[0]()
                api[1](1)
            _blas_users[0] += 1
    try:
        yield
    finally:
        if api is not None:
            with _blas_lock:
                _blas_users[0] -= 1
                if _blas_users[0] == 0:
                    api[1](_blas_users[1])


class _Worker:
    """A pool thread that waits on its own lock: handing it a part and waiting for the part to end are
    lock operations done in C (no Python runs under the GIL for the hand-over, as it does per task in
    ``concurrent.futures``, for which many threads would queue)."""

    def __init__(self, name: str):
        self.go = threading.Lock()
        self.go.acquire()  # released by ``start``
        self.done = threading.Lock()
        self.done.acquire()  # released when the part has ended
        self.part: tuple[Callable[[int, int], None], int, int, int] | None = None
        self.error: BaseException | None = None
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.go.acquire()
            try:
                _run_part(*self.part)  # type: ignore[misc]
            except BaseException as e:  # noqa: BLE001 - handed to the caller by ``join``
                self.error = e
            self.done.release()

    def start(self, work: Callable[[int, int], None], first: int, last: int, count: int) -> None:
        self.part, self.error = (work, first, last, count), None
        self.go.release()

    def join(self) -> BaseException | None:
        """Wait for the part to end; its error. An interrupt raises here, even one that comes as the part ends
        (the lock is then taken: waiting again would wait for ever), and ``in_parts`` gives the pool up."""
        self.done.acquire()
        error, self.error, self.part = self.error, None, None
        return error


class _Pool:
    """The process's worker threads (made again after a fork: threads do not survive one) and the lock
    of the caller using them: a second caller at the same time runs its parts itself."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.workers: list[_Worker] = []
        self.busy = threading.Lock()

    def grow(self, workers: int) -> list[_Worker]:
        if workers and not self.workers:
            memory.for_the_oracle()  # the allocator's settings, before the first worker allocates
        while len(self.workers) < workers:
            self.workers.append(_Worker(f"refimpl-{len(self.workers)}"))
        return self.workers[:workers]


_pool = _Pool()


def _the_pool() -> _Pool:
    global _pool
    if _pool.pid != os.getpid():
        with _pool_lock:
            if _pool.pid != os.getpid():
                _pool = _Pool()
    return _pool


def _give_up(pool: _Pool) -> None:
    """Make a new pool in place of ``pool``, whose threads may still be running parts of an interrupted call
    (they end them and then wait for ever: daemon threads, never handed work again)."""
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = _Pool()


def _run_part(work: Callable[[int, int], None], first: int, last: int, count: int) -> None:
    _inside.part = count
    try:
        work(first, last)
    finally:
        _inside.part = 0


def bounds(total: int, parts: int, unit: int = 1) -> list[int]:
    """Edges of ``parts`` contiguous parts of [0, total), each but the last a whole number of ``unit``s:
    [0, e1, ..., total]."""
    return [total * i // parts // unit * unit for i in range(parts)] + [total]


def in_parts(total: int, work: Callable[[int, int], None], unit: int = 1, least: int = 1,
             own_blas: bool = False) -> None:
    """Run ``work(first, last)`` over [0, total) in contiguous parts of whole ``unit``s, one per thread,
    each part at least ``least`` units; this thread runs the first. Inside a part, ``in_parts`` runs its
    work whole in the calling thread (no nesting on the pool), as it does while another thread uses the
    pool. ``own_blas``: the parts call BLAS, each on its own thread (``blas_on_one_thread`` while they run)."""
    most = total // max(1, least * unit)  # parts the range allows (before asking how many threads: cheap)
    count = 1 if most <= 1 or getattr(_inside, "part", 0) else threads()  # parts of this call see this count
    parts = min(count, most)
    pool = _the_pool() if parts > 1 else None
    if pool is None or not pool.busy.acquire(blocking=False):
        work(0, total)
        return
    handed = joined = False
    try:
        edges = bounds(total, parts, unit)
        workers = pool.grow(parts - 1)
        with blas_on_one_thread() if own_blas else contextlib.nullcontext():
            started: list[_Worker] = []
            try:
                for worker, a, b in zip(workers, edges[1:-1], edges[2:], strict=True):
                    worker.start(work, a, b, count)
                    started.append(worker)
                handed = True
                _run_part(work, edges[0], edges[1], count)
            finally:
                errors = [worker.join() for worker in started]  # every part has ended before this returns or raises
                joined = True
        for error in errors:
            if error is not None:
                raise error  # the first part's error, if one failed
    finally:
        if handed and joined:
            pool.busy.release()
        else:  # interrupted while handing out the parts or waiting for them: a part may still be running
            _give_up(pool)


def all_finite(x: np.ndarray) -> bool:
    """``np.isfinite(x).all()``, blocks of the rows of x (ROWWISE_BLOCK values or more) split between the
    threads: the checks of the forward's large arrays (the LM head's [R, chunk] products)."""
    if not isinstance(x, np.ndarray) or x.ndim == 0 or x.shape[0] == 0:  # (a device array: one call there)
        return bool(np.isfinite(x).all())
    bad: list[int] = []

    def work(first: int, last: int) -> None:
        if not np.isfinite(x[first:last]).all():
            bad.append(first)

    in_parts(x.shape[0], work, unit=max(1, ROWWISE_BLOCK * x.shape[0] // max(1, x.size)), least=2)
    return not bad


def rowwise(aligned: int = 1, flat: bool = False) -> Callable[[Callable[..., np.ndarray]], Callable[..., np.ndarray]]:
    """Decorator for a step whose output has its first argument's shape and dtype and whose rows are
    independent along the first axis of its first ``aligned`` arguments (``apply_rope``'s x, cos and sin
    share their first axis). ``flat``: the step works along the last axis only (an elementwise formula, a
    norm), so a contiguous input of two axes or more is taken as rows of its last axis (attention's scores
    [K, G, T, S] as [K G T, S]; a 1-D input is one row: never split); a step with an ``axis`` argument is
    split only when that is the last. The result takes the dtype the step gives.

    With two threads or more, on an input of at least two blocks of ``ROWWISE_BLOCK`` values, the rows
    are split between the threads and each runs the step on blocks of its rows of about ``ROWWISE_BLOCK``
    values, writing them into the result: the step's passes over a block stay in the core's cache. On one
    thread, on a smaller input, or inside another part, the step runs in one call (the copy of each block
    into the result costs more than the cache saves on one core for the cheap steps, the norms).

    A step with an ``out`` argument writes its result there when the caller gives one (``softcap`` into
    the columns of the logits): each block then goes straight into its rows of ``out`` (split when it is
    of two axes, like its input)."""

    if flat and aligned != 1:
        raise ValueError("a flat step has one row-aligned argument")

    def wrap(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        signature = inspect.signature(fn)
        names = list(signature.parameters)[:aligned]  # the row-aligned parameters
        has_axis = "axis" in signature.parameters
        has_out = "out" in signature.parameters

        @functools.wraps(fn)
        def blocked(*args, **kwargs) -> np.ndarray:
            x = args[0] if args else kwargs.get(names[0])
            if (not isinstance(x, np.ndarray) or x.ndim < (2 if flat else 1) or x.size < 2 * ROWWISE_BLOCK
                    or getattr(_inside, "part", 0) or threads() < 2):
                return fn(*args, **kwargs)
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            params = dict(call.arguments)
            if has_axis:
                if params["axis"] not in (-1, x.ndim - 1):
                    return fn(*args, **kwargs)
                params["axis"] = -1  # (a block may have fewer axes than x)
            dest = params["out"] if has_out else None  # the caller's array for the result
            if dest is not None and (x.ndim > 2 or dest.shape != x.shape):
                return fn(*args, **kwargs)
            if flat and x.ndim > 2 and x.flags.c_contiguous:
                params[names[0]] = x.reshape(-1, x.shape[-1])
            rows = params[names[0]]
            per_row = rows.size // rows.shape[0]
            unit = max(1, ROWWISE_BLOCK // per_row)  # rows per block on a few threads
            step = max(1, scaled(ROWWISE_BLOCK) // per_row)  # rows per block of a part
            if rows.shape[0] < 2 * unit:
                return fn(*args, **kwargs)
            result: list[np.ndarray] = []  # made by the first block done: its dtype is the step's
            lock = threading.Lock()

            def work(first: int, last: int) -> None:
                for a in range(first, last, step):
                    b = min(a + step, last)
                    these = {**params, **{n: params[n][a:b] for n in names}}  # the call on rows [a, b)
                    if dest is not None:
                        fn(**{**these, "out": dest[a:b]})
                        continue
                    block = fn(**these)
                    with lock:
                        if not result:
                            result.append(np.empty(rows.shape, dtype=block.dtype))
                    out = result[0]
                    if block.dtype != out.dtype or block.shape != out[a:b].shape:
                        raise TypeError(f"{fn.__name__} is not row-wise: rows of {rows.dtype} {list(rows[a:b].shape)} "
                                        f"gave {block.dtype} {list(block.shape)}")
                    out[a:b] = block

            in_parts(rows.shape[0], work, unit=unit)
            return dest if dest is not None else result[0].reshape(x.shape)

        blocked.whole = fn  # type: ignore[attr-defined]  # the step in one call (tests compare the two)
        return blocked

    return wrap
