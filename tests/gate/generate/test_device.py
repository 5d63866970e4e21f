"""``conformance generate|check|explain --device cuda`` (issue 53) on every machine: CuPy stood in for by
tests/strict_device.py (NumPy's arithmetic, CuPy's refusals of every implicit host/device crossing). A set
written by the oracle on the device is one the host oracle passes at exact-f64 (text, images, audio, MTP);
the check's oracle on the device (rows rebuilt through the head, embeddings, hidden rows, MTP rows) passes the
bundled sets; without CuPy the flag is one line, exit 2, nothing written; REFIMPL_DEVICE is restored after the
command."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import strict_device

from conformance.cli import main
from refimpl.arrays import DEVICE_ENV

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("preset", ["e2b-mini", "e2b-vision-mini", "e2b-audio-mini", "e2b-assistant-mini"])
def test_a_set_written_on_the_device_is_the_host_oracles(preset, tmp_path, monkeypatch):
    strict_device.install(monkeypatch)
    out = tmp_path / preset
    assert main(["generate", "--preset", preset, "--device", "cuda", "--out", str(out), "-q"]) == 0
    assert DEVICE_ENV not in os.environ  # (the command's setting ends with it)
    monkeypatch.delitem(sys.modules, "cupy")
    assert main(["check", "--backend", "refimpl", "--device", "cpu", "--fixtures", str(out), "-q",
                 "--profile", "exact-f64"]) == 0


@pytest.mark.parametrize("fixture", ["e2b-mini", "e2b-assistant-mini", "e2b-audio-mini"])
def test_the_check_oracle_and_the_refimpl_backend_on_the_device(fixture, monkeypatch):
    strict_device.install(monkeypatch)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert main(["check", "--backend", "refimpl", "--device", "cuda", "--backend-option", "device=cuda",
                 "--fixtures", str(ROOT / "fixtures" / fixture), "-q"]) == 0
    assert os.environ[DEVICE_ENV] == "cpu"  # restored


def test_explain_on_the_device(monkeypatch, capsys):
    """The oracle's traces on the device are the host's: every traced case of a set is within the floor."""
    strict_device.install(monkeypatch)
    argv = ["explain", "--backend", "refimpl", "--fixtures", str(ROOT / "fixtures" / "e2b-mini"), "-k", "prefill",
            "-q"]
    host = main(argv)
    host_out = capsys.readouterr().out
    assert main([*argv, "--device", "cuda", "--backend-option", "device=cuda"]) == host
    assert capsys.readouterr().out == host_out


@pytest.mark.parametrize("command", ["generate", "check", "explain"])
def test_device_cuda_without_cupy_is_one_line(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    out = tmp_path / "set"
    argv = {"generate": ["generate", "--preset", "e2b-mini", "--out", str(out)],
            "check": ["check", "--backend", "refimpl", "--json", str(tmp_path / "r.json")],
            "explain": ["explain", "--backend", "refimpl", "--json", str(tmp_path / "r.json")]}[command]
    assert main([*argv, "--device", "cuda", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("conformance: error: device cuda: CuPy is not installed (") and "\n" not in err
    assert err.endswith("pip install 'gemma4-conformance[cuda12]' or 'gemma4-conformance[cuda13]' "
                        "(docs/refimpl.md, 'GPU')")
    assert list(tmp_path.iterdir()) == []


def test_generate_on_gpus_plans_a_worker_on_each(monkeypatch):
    """``--device cuda`` defaults to a worker per GPU CuPy sees (CUDA_VISIBLE_DEVICES' names where it is set), the
    workers over the GPUs in turn when ``--workers`` asks for more."""
    from conformance.generate.executors import gpu_plan
    from refimpl.arrays import gpus

    cp = strict_device.install(monkeypatch)
    monkeypatch.setattr(cp.cuda.runtime, "getDeviceCount", lambda: 3)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus() == ["0", "1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6,7,9")
    assert gpus() == ["4", "6", "7"]
    assert gpu_plan(["4", "6"], 5) == ["4", "6", "4", "6", "4"]


def test_a_local_worker_sees_only_its_gpu(monkeypatch):
    """A worker process of ``generate --device cuda`` takes its GPU from the parent's queue as it starts, before
    CuPy does: CUDA_VISIBLE_DEVICES names that one alone there."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from conformance.generate.executors import _worker_init

    spawn = multiprocessing.get_context("spawn")
    slots = spawn.SimpleQueue()
    slots.put("6")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=_worker_init, initargs=(None, slots)) as pool:
        assert pool.submit(os.getenv, "CUDA_VISIBLE_DEVICES").result(timeout=60) == "6"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"  # (the parent's own is untouched)


def test_a_job_runs_on_the_runs_device_not_its_workers(preset_dirs, monkeypatch):
    """A job carries its run's device: a Dask worker whose own REFIMPL_DEVICE says cpu (or nothing) builds the
    run's oracle on the GPU all the same, and a cpu run's stays on the host."""
    from conformance.generate.jobs import job_context

    strict_device.install(monkeypatch)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert job_context(str(preset_dirs["e2b-mini"]), "run-a", device="cuda").model.device == "cuda"
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert job_context(str(preset_dirs["e2b-mini"]), "run-b", device="cpu").model.device == "cpu"
