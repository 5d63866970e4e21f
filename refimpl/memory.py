"""The oracle's settings of the C allocator (glibc's malloc), made once per process: when the first model,
tower or drafter is made, or the pool of ``threads.py`` starts.

A forward makes and frees large arrays all the time: every product's output, the MLP's [T, I]
activations, the row blocks of the threaded steps, the [R, V] logits. glibc's defaults suit programs
that keep what they allocate, not this:

- each thread that allocates gets an arena of its own (up to 8 a core), which keeps what the thread
  freed: with the pool's threads the resident set grew by about 20 MiB a thread;
- an array of 32 MiB or more (and any array before the first large one is freed) is mapped from the
  kernel and unmapped when freed, and freed memory beyond 128 KiB at the top of the heap is returned:
  the next such array is new memory, which the kernel zeroes as it is first written. On the 10-layer
  E2B cut that was 2.5 s of kernel time in a 13.5 s all-rows forward on two cores (``clear_page``
  under the page faults of large copies); returning memory costs most in a virtual machine that hands
  freed guest memory back to its host, as Firecracker's do.

``for_the_oracle()`` puts every thread on the one main arena (``M_ARENA_MAX`` 1: the other arenas are
made of 64 MiB heaps, which map anything larger from the kernel and unmap their empty heaps whatever the
settings), serves every allocation from it (``M_MMAP_MAX`` 0) and never gives freed memory back to the
kernel (``M_TRIM_THRESHOLD`` -1, "disables trimming completely" in glibc's words). A freed array is
reused by the next, the peak resident set stays what the process needs at once, and the process keeps
that much until it ends. These settings change how fast memory comes, never a result.

A thread keeps the arena it had before the settings, and once a process has two arenas glibc hands
them out in turn to new threads: the settings hold whole only where they are made before any other thread
allocates. ``conformance generate`` makes them first in each worker; a process whose other threads
allocated first (a Dask worker, the check's supervisor thread) may run some pool threads on another
arena, whose arrays over 64 MiB come from the kernel each time (correct, slower).

Nothing is set where the user tunes the allocator (any ``MALLOC_*`` variable: glibc's, or another
allocator's such as jemalloc's ``MALLOC_CONF``; ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``; an allocator
in ``LD_PRELOAD``), with ``REFIMPL_MALLOC=default`` (a process that also runs other work and wants its
memory back), or without glibc's ``mallopt`` (macOS).
"""

from __future__ import annotations

import ctypes
import os
import threading

ARENAS = 1  # arenas the process's threads share
MALLOC_ENV = "REFIMPL_MALLOC"  # "default": leave glibc's settings alone

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters
SETTINGS = ((M_ARENA_MAX, ARENAS), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))  # (parameter, value)

_lock = threading.Lock()
_applied: list[bool] = []  # whether the settings were made, once per process
if hasattr(os, "register_at_fork"):  # a fork while another thread held the lock must not leave it held
    os.register_at_fork(after_in_child=lambda: globals().update(_lock=threading.Lock()))


def user_tuned(environ=os.environ) -> str | None:
    """Why the allocator is left alone (a short reason), or None."""
    if environ.get(MALLOC_ENV, "").strip() == "default":
        return f"{MALLOC_ENV}=default"
    for name in sorted(environ):
        if name.startswith("MALLOC_") and name != MALLOC_ENV:
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if any("malloc" in lib.rsplit("/", 1)[-1] for lib in environ.get("LD_PRELOAD", "").replace(":", " ").split()):
        return "LD_PRELOAD"  # jemalloc, tcmalloc, mimalloc, ...
    return None


def _mallopt():
    """glibc's mallopt from the running process, or None (another C library without it)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.restype, mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    return mallopt


def for_the_oracle() -> bool:
    """Make the settings above, once per process (before the pool's threads first allocate: an arena,
    once made, stays); whether they were made."""
    with _lock:
        if not _applied:
            mallopt = None if user_tuned() else _mallopt()
            _applied.append(mallopt is not None and all([mallopt(param, value) for param, value in SETTINGS]))
        return _applied[0]
