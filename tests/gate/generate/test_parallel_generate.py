"""Parallel, resumable ``generate_set`` / ``conformance generate`` (conformance/generate/,
docs/distributed-generation.md): the same bytes whatever the executor (in this process, local
processes, a real local Dask cluster), resume after a failed or SIGKILLed run, refusal of a partial
run of other arguments, and the one-line errors of --cluster.

The Dask tests skip when ``distributed`` is not installed, unless GEMMA4_CONFORMANCE_REQUIRE_ENGINES=1
(tests/conftest.py turns those skips into failures).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from dask_local import local_cluster, need_distributed

from conformance.cli import main
from conformance.generate import PartialRunMismatch, executors, generate_set, jobs
from conformance.sets import CASES, MANIFEST, FixtureError, load_set

REPO = Path(__file__).resolve().parents[3]
TEXT = "26b-a4b-mini"  # MoE: router margins travel too
MEDIA = "e2b-vision-mini"  # text bases A, B, C, G and image bases I0, I1


def _close(x, y, where: str) -> None:
    """JSON values equal, numbers to float64 rounding (BLAS rounds differently with other thread counts)."""
    if isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for k in x:
            _close(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, list):
        assert isinstance(y, list) and len(x) == len(y), where
        for k, (u, v) in enumerate(zip(x, y, strict=True)):
            _close(u, v, f"{where}[{k}]")
    elif isinstance(x, float) and not isinstance(y, bool):
        assert y == pytest.approx(x, rel=1e-9, abs=1e-10), where
    else:
        assert x == y, where


def _same_set(a: Path, b: Path) -> None:
    """The same set: the same cases, tensors and manifest, values equal to float64 rounding (in-process
    runs use every core's BLAS threads, workers fewer; OpenBLAS's products then differ in the last bits,
    docs/distributed-generation.md)."""
    from refimpl.safetensors_io import TensorStore

    ca, cb = (json.loads((p / CASES).read_text()) for p in (a, b))
    _close(ca, cb, "cases")
    files = sorted(f for f in os.listdir(a) if f.startswith("base-"))
    assert files and files == sorted(f for f in os.listdir(b) if f.startswith("base-"))
    for f in files:
        sa, sb = TensorStore(a / f), TensorStore(b / f)
        assert sa.names == sb.names
        for name in sa.names:
            assert sa.infos[name].dtype == sb.infos[name].dtype and sa.infos[name].shape == sb.infos[name].shape, name
            if sa.infos[name].dtype == "I64" and name == "top_ids":
                continue  # near-equal logits may swap places in the top-k; the top_logits below are compared
            # 1e-10: the image rows of e2b-vision-mini amplify a one-ulp change of the soft tokens ~1000x
            assert np.max(np.abs(sa.get(name) - sb.get(name)), initial=0.0) <= 1e-10, (f, name)
    ma, mb = (json.loads((p / MANIFEST).read_text()) for p in (a, b))
    for m in (ma, mb):
        m["provenance"].pop("created")
        m["provenance"].pop("command")
    for m in (ma, mb):
        m.pop("files")  # the digests of the two files compared above
        for check in m["provenance"]["cross_checks"]:
            check.pop("agreement")  # a float64 rounding-level number
    assert ma == mb


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Path]:
    """Each preset's set made in this process (workers=1)."""
    root = tmp_path_factory.mktemp("ref")
    return {p: generate_set(root / p, preset=p, workers=1) for p in (TEXT, MEDIA)}


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory):
    """A real local Dask cluster: a scheduler and a worker process with two single-threaded workers."""
    with local_cluster(tmp_path_factory.mktemp("dask")) as cluster:
        cluster.start_scheduler()
        cluster.start_worker(nworkers=2)
        yield cluster.address


# ----------------------------------------------------------------------------------------------
# the same set whatever the executor


@pytest.mark.parametrize("preset", [TEXT, MEDIA])
def test_local_processes_give_the_same_set(reference, tmp_path, preset):
    before = {v: os.environ.get(v) for v in executors.BLAS_VARS}
    seen = []
    out = generate_set(tmp_path / "w2", preset=preset, workers=2, progress=lambda *a: seen.append(a))
    _same_set(reference[preset], out)
    assert {v: os.environ.get(v) for v in executors.BLAS_VARS} == before  # the parent's environment restored
    assert not (tmp_path / ".w2.partial").exists()  # published: the partial run removed
    assert [d for d, _, _ in seen] == list(range(1, len(seen) + 1)) and seen[0][2] == "model"
    jobs = [label for _, _, label in seen if label.startswith("base ")]
    assert len(jobs) == len(load_set(out).bases())
    assert all(re.fullmatch(r"base \w+: \d+ tokens, \d+ cases, \d+\.\d s", label) for label in jobs)
    counts = [int(re.search(r"(\d+) cases", label).group(1)) for label in jobs]
    assert sum(counts) == len(load_set(out).cases)


def test_dask_cluster_gives_the_same_set(reference, dask_cluster, tmp_path):
    for preset in (TEXT, MEDIA):
        _same_set(reference[preset], generate_set(tmp_path / preset, preset=preset, cluster=dask_cluster))
    assert sorted(os.listdir(tmp_path)) == sorted([TEXT, MEDIA])


def test_dask_cluster_from_the_cli(reference, dask_cluster, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["generate", "--preset", TEXT, "--cluster", dask_cluster, "--out", str(out)]) == 0
    _same_set(reference[TEXT], out)
    err = capsys.readouterr().err
    assert re.search(r"\[\d/6\] base [ABCG]: \d+ tokens, \d+ cases", err), err


def test_a_worker_that_cannot_see_the_model_is_named(dask_cluster, tmp_path):
    cluster = executors.DaskCluster(dask_cluster)
    try:
        with pytest.raises(executors.ClusterError, match=r"^--cluster: worker tcp://\S+ cannot see /nonexistent/model; "
                                                         r"the model directory and --out's parent must be"):
            cluster.check_workers(["/nonexistent/model", str(tmp_path)])
        assert len(cluster.check_workers([str(tmp_path), str(tmp_path)])) == 2
    finally:
        cluster.close()


# ----------------------------------------------------------------------------------------------
# resume


def test_a_failed_job_keeps_the_finished_ones_and_a_rerun_resumes(reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "set"
    partial = tmp_path / ".set.partial"
    monkeypatch.setenv(jobs.FAULT_ENV, "G:fail")
    with pytest.raises(RuntimeError, match="base G: injected failure"):
        generate_set(out, preset=TEXT, workers=1)
    assert not out.exists()
    assert sorted(os.listdir(partial / "jobs")) == ["A", "B", "C"]  # G is dispatched last (the shortest)
    assert (partial / "model" / "model.safetensors").is_file()
    stamps = {b: (partial / "jobs" / b / "hidden.npy").stat().st_mtime_ns for b in "ABC"}

    # a rerun with other arguments is refused, naming the directory, and changes nothing
    monkeypatch.delenv(jobs.FAULT_ENV)
    with pytest.raises(PartialRunMismatch) as e:
        generate_set(out, preset=TEXT, seed=1, workers=1)
    assert str(e.value) == (f"{partial} holds an unfinished run with other arguments (differs in: model; 3 finished "
                            "bases kept): to resume it, rerun with the arguments it was made with (recorded in "
                            f"{partial / 'key.json'}); to make this set without touching it, choose another --out")
    assert isinstance(e.value, FixtureError)
    assert main(["generate", "--preset", TEXT, "--seed", "1", "--out", str(out), "-q"]) == 2
    assert capsys.readouterr().err == f"conformance: error: {e.value}\n"
    assert {b: (partial / "jobs" / b / "hidden.npy").stat().st_mtime_ns for b in "ABC"} == stamps  # untouched
    assert not out.exists()

    # the same arguments resume: the finished jobs are skipped, and reported so
    code = main(["generate", "--preset", TEXT, "--out", str(out), "--workers", "2"])
    assert code == 0
    err = capsys.readouterr().err
    for b in "ABC":
        assert f"base {b}: done in an earlier run" in err
    assert re.search(r"\[5/6\] base G: \d+ tokens, \d+ cases, \d+\.\d s", err), err
    assert "model: reused from an earlier run" in err
    _same_set(reference[TEXT], out)
    assert sorted(os.listdir(tmp_path)) == ["set"]  # the partial run removed after the publish


def _finished_jobs(partial: Path) -> list[str]:
    """The bases whose job is complete in a partial directory (jobs/<base>/result.json), not those being
    written (jobs/.<base>.tmp-*/, renamed when complete: a glob's * matches their dot names too)."""
    return sorted(p.parent.name for p in partial.glob("jobs/*/result.json") if not p.parent.name.startswith("."))


def test_sigkill_keeps_finished_jobs_and_a_rerun_resumes(reference, tmp_path):
    out = tmp_path / "set"
    partial = tmp_path / ".set.partial"
    cmd = [sys.executable, "-m", "conformance.cli", "generate", "--preset", MEDIA, "--workers", "2",
           "--out", str(out)]
    env = {**os.environ, jobs.FAULT_ENV: "I1:hang"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(_finished_jobs(partial)) < 5:
            time.sleep(0.05)
        assert len(_finished_jobs(partial)) == 5, proc.stderr.read().decode() if proc.poll() else ""
        os.kill(proc.pid, signal.SIGKILL)  # the CLI process only: its workers notice and exit
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        deadline, left = time.time() + 15, True
        while left and time.time() < deadline:  # the workers notice their parent is gone and exit
            try:
                os.killpg(proc.pid, 0)
                time.sleep(0.1)
            except ProcessLookupError:
                left = False
        if left:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not left, "a local worker outlived the killed CLI process"
    assert not out.exists()
    done = _finished_jobs(partial)
    assert done == ["A", "B", "C", "G", "I0"]
    meta = json.loads((partial / "jobs" / "A" / "result.json").read_text())
    assert meta["blas_threads"] == str(max(1, (os.cpu_count() or 1) // 2))  # BLAS threads split between workers

    rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(re.findall(r"base (\w+): done in an earlier run", rerun.stderr)) == done
    assert re.search(r"base I1: \d+ tokens, \d+ cases", rerun.stderr)
    _same_set(reference[MEDIA], out)
    assert not partial.exists()


# ----------------------------------------------------------------------------------------------
# command-line errors


def test_cli_cluster_errors(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "x")
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed -> ImportError
    assert main(["generate", "--preset", TEXT, "--cluster", "tcp://127.0.0.1:9", "--out", out]) == 2
    assert capsys.readouterr().err == ("conformance: error: --cluster needs the Dask 'distributed' package, which is "
                                       "not installed; pip install 'gemma4-conformance[cluster]'\n")
    assert main(["generate", "--preset", TEXT, "--workers", "2", "--cluster", "tcp://h:1", "--out", out]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["generate", "--preset", TEXT, "--workers", "0", "--out", out]) == 2
    assert capsys.readouterr().err == "conformance: error: --workers must be at least 1, got 0\n"
    assert os.listdir(tmp_path) == []


def test_cli_unreachable_scheduler(tmp_path, monkeypatch, capsys):
    need_distributed()
    monkeypatch.setattr(executors, "CONNECT_TIMEOUT_S", 2)
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["generate", "--preset", TEXT, "--cluster", f"tcp://127.0.0.1:{port}", "--out",
                 str(tmp_path / "x"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"conformance: error: --cluster: cannot connect to the Dask scheduler at "
                          f"tcp://127.0.0.1:{port} within 2 s (") and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []


def test_distributed_is_not_imported_without_cluster(tmp_path):
    code = ("import sys; from conformance.generate import generate_set; import conformance.cli; "
            f"generate_set({str(tmp_path / 'x')!r}, preset={TEXT!r}, workers=2); "
            "print('distributed' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
