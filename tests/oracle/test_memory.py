"""refimpl.memory: the allocator settings the oracle makes once per process (glibc only).

Each case runs in a child process: the settings belong to a process and last as long as it does."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from refimpl import memory

pytestmark = [
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's"),
    pytest.mark.skipif(not getattr(sys, "_is_gil_enabled", lambda: True)(),
                       reason="free-threaded CPython allocates through mimalloc, not glibc's malloc"),
]

_ARENAS = """
import ctypes, threading
from refimpl import threads
kept, together = [], threading.Barrier(8, timeout=60)
def work(a, b):  # every part allocates small blocks (from its thread's arena) and holds them until all have
    kept.append([bytearray(4096) for _ in range(64)])
    together.wait()
with threads.use_threads(8):
    threads.in_parts(8, work)  # the pool starts: the settings are made before its threads allocate
ctypes.CDLL(None).malloc_stats()  # one "Arena i:" section per arena, on stderr
"""

_REUSE = """
import json, os, resource, sys, threading
import numpy as np
from refimpl import memory
from refimpl.model import Gemma4
if len(sys.argv) > 1:  # a checkpoint: making the model must have made the settings (asked later, they would not be)
    Gemma4(sys.argv[1])
    os.environ[memory.MALLOC_ENV] = "default"
made = memory.for_the_oracle()
def faults_writing(n):  # minor page faults while writing a new array of n float64 (freed at once)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty(n)
    a[:] = 1.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
def in_a_thread(n):  # as a pool thread allocates: from another thread than the main one
    got = []
    t = threading.Thread(target=lambda: got.append(faults_writing(n)))
    t.start(); t.join()
    return got[0]
n = 256 << 17  # 256 MiB: above what glibc maps by default and a thread arena's 64 MiB heaps (8 pages at the least)
out = {"made": made}
for name, write in (("main", faults_writing), ("thread", in_a_thread)):
    out[name] = [write(n) for _ in range(4)]  # the first is new memory; the next ones new again, or reused
print(json.dumps(out))
"""


def _clean_env(**env: str) -> dict[str, str]:
    """This process's environment without anything that tunes the allocator, plus ``env``."""
    return {**{k: v for k, v in os.environ.items()
               if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD", memory.MALLOC_ENV)}, **env}


def _child(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose environment tunes no allocator but as given."""
    run = subprocess.run([sys.executable, "-c", code, *args], env=_clean_env(**env), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return run


@pytest.mark.parametrize("user_setting", [None, "8"])
def test_the_pool_s_threads_share_one_arena_unless_the_user_set_them(user_setting):
    run = _child(_ARENAS, **({} if user_setting is None else {"MALLOC_ARENA_MAX": user_setting}))
    arenas = len(re.findall(r"^Arena \d+:", run.stderr, flags=re.M))
    if user_setting is None:
        assert arenas == memory.ARENAS == 1
    else:  # eight threads allocating at once get arenas of their own (up to the user's cap)
        assert 1 < arenas <= 8


def test_a_freed_large_array_is_reused_in_every_thread():
    got = json.loads(_child(_REUSE).stdout)
    assert got["made"] is True
    assert got["main"][0] >= 8  # the very first array is new memory
    for where in ("main", "thread"):  # the same memory again, already in place (a thread's own stack aside)
        assert max(got[where][1:]) <= 4, (where, got[where])


def test_making_a_model_makes_the_settings(preset_dirs):
    got = json.loads(_child(_REUSE, str(preset_dirs["e2b-mini"])).stdout)
    assert got["made"] is True and max(got["main"][1:] + got["thread"][1:]) <= 4


_GENERATE_WORKER = """
import json, multiprocessing, resource, sys, threading
from concurrent.futures import ProcessPoolExecutor
import numpy as np
from conformance.generate.executors import _worker_init
from refimpl import threads

def pool_threads_refault():  # in the worker: each of 4 pool threads writes a new 80 MiB array twice
    faults = []
    def work(a, b):
        def write():
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            x = np.empty(80 << 17)
            x[:] = 1.0
            return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        write()
        faults.append(write())  # the second: reused memory, or new again
    with threads.use_threads(4):
        threads.in_parts(4, work)
    return faults

if __name__ == "__main__":
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init) as pool:
        print(json.dumps(pool.submit(pool_threads_refault).result()))
"""


def test_a_generate_worker_s_pool_threads_reuse_large_arrays(tmp_path):
    # the worker's parent-watch thread starts before any model is made: the settings must come first, or
    # some pool threads land on a second arena, which takes arrays over 64 MiB from the kernel every time
    script = tmp_path / "worker.py"
    script.write_text(_GENERATE_WORKER)
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(script)], env=_clean_env(PYTHONPATH=str(root)), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert max(json.loads(run.stdout)) <= 4


@pytest.mark.parametrize("env", [{memory.MALLOC_ENV: "default"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}])
def test_nothing_is_set_where_the_user_tunes_the_allocator(env):
    got = json.loads(_child(_REUSE, **env).stdout)
    assert got["made"] is False
    if memory.MALLOC_ENV in env:  # glibc's defaults: a large array is new memory each time
        assert min(got["main"][1:] + got["thread"]) >= 8


def test_user_tuned_names_the_reason():
    assert memory.user_tuned({}) is None
    assert memory.user_tuned({"REFIMPL_MALLOC": "default"}) == "REFIMPL_MALLOC=default"
    assert memory.user_tuned({"MALLOC_ARENA_MAX": "4", "PATH": "/bin"}) == "MALLOC_ARENA_MAX"
    assert memory.user_tuned({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}) is None
    assert memory.user_tuned({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}) == "GLIBC_TUNABLES"
    assert memory.user_tuned({"LD_PRELOAD": "/lib/libfaketime.so:/usr/lib/libjemalloc.so.2"}) == "LD_PRELOAD"
    assert memory.user_tuned({"LD_PRELOAD": "/lib/libfaketime.so"}) is None
