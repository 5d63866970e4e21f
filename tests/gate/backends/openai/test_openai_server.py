"""The openai backend on a real server: llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``,
the ``server`` extra) started on the loopback address with the bundled GGUF set's checkpoint, graded on that set
with and without concurrency, and with the fault proxy (fault_proxy.py) between the gate and the server: every
planted fault is caught, one line per case, nothing hangs past the case timeout.

llama-cpp-python's server takes text prompts only and keys its logprobs by text: the backend runs in text mode
(a prompt is sent only where its text comes back as its ids through the server's tokenizer) and needs
``--logits_all`` for prompt rows (``echo``). The set is made under ggml's CPU activation convention, which the
server follows (the backend is told so: ``activations``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build-llama-cpp.sh)")
pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python's server is not installed (the server extra)")

from fault_proxy import FaultProxy

from conformance.cli import main

REPO = Path(__file__).resolve().parents[4]
SET = REPO / "fixtures" / "e2b-mini-q4-0"
ACTIVATIONS = json.loads((SET / "manifest.json").read_text())["model"]["quantisation"]["activations"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """llama-cpp-python's server on the bundled GGUF; its URL. Stopped at the end of the module."""
    port, log = _free_port(), tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(SET / "checkpoint" / "model.gguf"), "--host",
           "127.0.0.1", "--port", str(port), "--logits_all", "true", "--n_ctx", "2048", "--n_threads", "2"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(url + "/models", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"llama_cpp.server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _check(url: str, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    code = main(["check", "--backend", "openai", "--backend-option", f"url={url}", "--backend-option",
                 f"activations={ACTIVATIONS}", "--fixtures", str(SET), "--json", str(report), "-q", *extra])
    return code, json.loads(report.read_text())


def _statuses(report: dict) -> dict[str, str]:
    return {c["id"].split("/", 1)[1]: c["status"] for c in report["cases"]}


def test_graded_on_the_bundled_set(server, tmp_path):
    code, report = _check(server, tmp_path)
    got = Counter(_statuses(report).values())
    assert code == 0 and got["fail"] == got["error"] == 0 and got["pass"] >= 15, got
    caps = report["backend"]["capabilities"]
    assert caps["top_logprobs"] and caps["interior_rows"] and not caps["last_seq_id"]
    cases = {c["id"].split("/", 1)[1]: c for c in report["cases"]}
    assert cases["last/plain/A/T7/pos3"]["status"] == "pass"  # an interior row, from echo
    assert cases["last/plain/A/T7/pos6"]["executed"]["prompts"] == "text"
    assert "refused by the backend: row 0" in cases["full/A/T9"]["message"]
    assert "needs last_seq_id" in cases["last/seq_id/B/T7/pos6"]["message"]


def test_concurrency_and_prefix_reuse_grade_the_same(server, tmp_path):
    (tmp_path / "alone").mkdir()
    (tmp_path / "together").mkdir()
    _, alone = _check(server, tmp_path / "alone")
    code, together = _check(server, tmp_path / "together", "--concurrency", "4")
    assert code == 0 and _statuses(together) == _statuses(alone)


# the fault, what the gate says of the first case it spoils (check, then a piece of the message)
FAULTS = {
    "shift": ("fail", None),
    "drop": ("error", "Remote end closed connection without response"),
    "reorder": ("error", "a reply for another request"),
    "stale": ("error", "a reply for another request"),
    "malformed": ("error", "malformed JSON in the reply"),
    "http500": ("error", "HTTP 500 Internal Server Error"),
    "hang": ("error", "no answer within"),
    "no-logprobs": ("error", "logprobs missing"),
    "fewer": ("error", "logprobs missing"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_planted_fault_is_caught(fault, server, tmp_path):
    proxy = FaultProxy(server, fault)
    # hang: one case (each of its calls waits out the case timeout)
    extra = ["--match", "last/plain/A/T7/pos6$" if fault == "hang" else "last/plain/A|multi|chunks",
             "--case-timeout", "1" if fault == "hang" else "30"]
    if fault == "reorder":
        extra += ["--concurrency", "4"]
    t0 = time.monotonic()
    try:
        code, report = _check(proxy.url, tmp_path, *extra)
    finally:
        proxy.close()
    status, piece = FAULTS[fault]
    spoiled = [c for c in report["cases"] if c["status"] in ("fail", "error")]
    assert code == 1 and spoiled, Counter(_statuses(report).values())
    first = spoiled[0]
    if fault == "reorder" and first["status"] == "fail":  # two replies of prompts of one length: rows graded wrong
        status, piece = "fail", None
    assert first["status"] == status, first["message"]
    assert piece is None or piece in first["message"], first["message"]
    assert status != "fail" or first["check"] in ("logprob", "top1", "topk")
    assert all("\n" not in c["message"] for c in spoiled)
    assert time.monotonic() - t0 < 120
    if fault == "hang":  # a case's calls give up together at the case timeout, whatever their number
        assert first["check"] == "timeout", first["message"]
        assert first["duration"] < 1 + 2.0, first["duration"]  # the case's 1 s, and slack for a loaded machine
