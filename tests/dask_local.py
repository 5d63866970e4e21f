"""A real Dask cluster on 127.0.0.1 for the tests: a scheduler and one worker command (with its nanny), each
started in its own session by the test and stopped (or killed mid-run) by it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest


def need_distributed() -> None:
    try:
        import distributed  # noqa: F401 - only: is it installed
    except ImportError as e:
        pytest.skip(f"distributed is not installed ({e})")  # a failure with GEMMA4_CONFORMANCE_REQUIRE_ENGINES=1


class LocalCluster:
    """The processes of a local cluster: ``scheduler`` and ``worker`` (the ``dask worker`` command, whose
    nanny starts the worker processes in its session)."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env = root, env
        exe = Path(sys.executable).parent / "dask"
        self.command = [str(exe)] if exe.is_file() else [sys.executable, "-m", "dask"]
        self.scheduler: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.address = ""

    def _start(self, args: list[str], log: str, env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(self.command + args, cwd=self.root, env=env, stdout=subprocess.DEVNULL,
                                stderr=open(self.root / log, "w"), start_new_session=True)

    def start_scheduler(self, env: dict[str, str] | None = None) -> None:
        file = self.root / "scheduler.json"
        self.scheduler = self._start(["scheduler", "--host", "127.0.0.1", "--port", "0", "--scheduler-file",
                                      str(file), "--no-dashboard"], "scheduler.log", {**self.env, **(env or {})})
        deadline = time.time() + 60
        while not file.is_file() and time.time() < deadline:
            time.sleep(0.1)
        assert file.is_file(), (self.root / "scheduler.log").read_text()
        self.address = json.loads(file.read_text())["address"]

    def start_worker(self, nworkers: int = 1, env: dict[str, str] | None = None) -> None:
        import distributed

        self.worker = self._start(["worker", self.address, "--nworkers", str(nworkers), "--nthreads", "1",
                                   "--no-dashboard"], "worker.log", {**self.env, **(env or {})})
        with distributed.Client(self.address, timeout="30s") as client:
            client.wait_for_workers(nworkers, timeout=90)

    @staticmethod
    def kill(p: subprocess.Popen | None) -> None:
        """SIGKILL the process's whole session (a worker command: its nanny and the worker processes)."""
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def stop(self) -> None:
        for p in (self.worker, self.scheduler):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(3)
                except subprocess.TimeoutExpired:
                    pass
            self.kill(p)


@contextlib.contextmanager
def local_cluster(root: Path) -> Iterator[LocalCluster]:
    """A LocalCluster whose processes are stopped when the block ends, however it ends."""
    need_distributed()
    cluster = LocalCluster(root, {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"})
    try:
        yield cluster
    finally:
        cluster.stop()
