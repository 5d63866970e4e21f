"""The openai backend against a server whose rows are the oracle's (oracle_server.py), in each dialect it reads:
every claimed case passes at exact-f64 (every row read at its place: a row one place off fails, the ``shift``
server); what each dialect can be graded on is probed and claimed accordingly; concurrency and prefix order
change nothing in the grades; bad options and an unreachable server are one line, exit 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from oracle_server import OracleServer

from conformance.backends.openai.backend import OpenAIBackend
from conformance.check.profiles import PROFILES
from conformance.check.runner import load_sets, run
from conformance.cli import main
from conformance.protocol import BackendError
from refimpl.model import Gemma4
from refimpl.synth import write_checkpoint

REPO = Path(__file__).resolve().parents[4]
SET = REPO / "fixtures" / "e2b-mini"
# the plain last rows, interior rows, every row, chunked prefill and several sequences; decode on each
SELECT = r"last/plain/A/T(7|19)/|full/A/|prefill/A/T21/chunks|prefill/C/T19/rows-middle$|multi/A-T3"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    manifest = json.loads((SET / "manifest.json").read_text())["model"]
    return Gemma4(write_checkpoint(manifest["preset"], manifest["seed"], tmp_path_factory.mktemp("m") / "ckpt"))


@pytest.fixture(scope="module")
def e2b_set():
    return load_sets([SET])[0]


def _grade(url: str, e2b_set, tmp_path, concurrency=None, **options):
    tmp_path.mkdir(parents=True, exist_ok=True)
    backend = OpenAIBackend(url=url, **options)
    try:
        result = run(backend, [e2b_set], PROFILES["exact-f64"], select=SELECT, workdir=tmp_path,
                     concurrency=concurrency)
    finally:
        backend.close()
    return backend, {c.id.split("/", 1)[1]: c for c in result.cases}


@pytest.mark.parametrize("dialect", ["content", "vllm", "echo"])
def test_every_claimed_case_passes_at_exact_f64(dialect, model, e2b_set, tmp_path):
    server = OracleServer(model, dialect)
    try:
        backend, cases = _grade(server.url, e2b_set, tmp_path)
    finally:
        server.close()
    claimed = {k: c for k, c in cases.items() if c.status != "not-claimed"}
    assert {c.status for c in claimed.values()} == {"pass"}, {k: c.message for k, c in claimed.items()
                                                              if c.status != "pass"}
    rows_claimed = dialect != "content"  # llama-server returns no prompt logprobs
    assert backend.probed.prompt_rows == {"content": None, "vllm": "prompt_logprobs", "echo": "echo"}[dialect]
    assert backend.capabilities.interior_rows is rows_claimed and backend.capabilities.full_forward is rows_claimed
    assert ("full/A/T9" in claimed) is rows_claimed and ("last/plain/A/T7/pos3" in claimed) is rows_claimed
    for must in ("last/plain/A/T7/pos6", "last/plain/A/T19/pos18", "prefill/A/T21/chunks-11+10",
                 "multi/A-T3+B-T8+C-T13"):
        assert claimed[must].status == "pass"
    decode = claimed["last/plain/A/T7/pos6"]
    assert decode.executed["decode_forced"] + decode.executed["decode_generated"] == 3


def test_a_row_one_place_off_fails(model, e2b_set, tmp_path):
    server = OracleServer(model, "shift")
    try:
        _, cases = _grade(server.url, e2b_set, tmp_path)
    finally:
        server.close()
    case = cases["last/plain/A/T7/pos6"]
    assert case.status == "fail" and case.check in ("logprob", "top1", "topk"), case.message


def test_concurrency_and_prefix_order_change_no_grade(model, e2b_set, tmp_path):
    server = OracleServer(model, "vllm")
    try:
        _, alone = _grade(server.url, e2b_set, tmp_path / "a")
        _, together = _grade(server.url, e2b_set, tmp_path / "b", concurrency=4)
        _, given = _grade(server.url, e2b_set, tmp_path / "c", concurrency=3, order="given")
    finally:
        server.close()
    assert {k: c.status for k, c in alone.items()} == {k: c.status for k, c in together.items()} == \
        {k: c.status for k, c in given.items()}
    assert sum(c.status == "pass" for c in together.values()) >= 8


@pytest.mark.parametrize("options, message", [
    ({"url": "127.0.0.1:8080"}, "url must be the server's address, http://HOST:PORT/v1, got '127.0.0.1:8080'"),
    ({"url": "http://127.0.0.1:9/v1", "top_k": 0}, "top_k must be an integer in [1, 1000], got 0"),
    ({"url": "http://127.0.0.1:9/v1", "order": "random"}, "order must be one of prefix, given, got 'random'"),
    ({"url": "http://127.0.0.1:9/v1"}, "GET http://127.0.0.1:9/v1/models: cannot reach the server ("),
])
def test_bad_options_and_no_server_are_one_line(options, message):
    with pytest.raises(BackendError) as e:
        OpenAIBackend(**options)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_model_the_server_does_not_serve(model):
    server = OracleServer(model, "content")
    try:
        with pytest.raises(BackendError, match=r"does not serve 'gemma' \(it serves: oracle\)"):
            OpenAIBackend(url=server.url, model="gemma")
    finally:
        server.close()


def test_cli_exit_4_when_the_server_is_down(tmp_path, capsys):
    code = main(["check", "--backend", "openai", "--backend-option", "url=http://127.0.0.1:9/v1", "--fixtures",
                 str(SET), "--json", str(tmp_path / "r.json")])
    assert code == 4
    assert "cannot reach the server" in capsys.readouterr().err
    assert json.loads((tmp_path / "r.json").read_text())["aborted"]["reason"] == "backend"


def test_concurrency_needs_a_backend_that_prefetches(tmp_path, capsys):
    code = main(["check", "--backend", "refimpl", "--fixtures", str(SET), "--concurrency", "4", "-k", "full"])
    assert code == 4
    assert "--concurrency: backend 'refimpl' takes one request at a time" in capsys.readouterr().err


def test_the_api_key_comes_from_the_environment_only(model, monkeypatch):
    """The key named by api_key_env reaches the server as a bearer token; without the variable none is sent."""
    server = OracleServer(model, "content")
    try:
        monkeypatch.setenv("MY_KEY", "s3cret")
        OpenAIBackend(url=server.url, api_key_env="MY_KEY")  # its probe posts completions
        with_key = server.auth
        monkeypatch.delenv("MY_KEY")
        OpenAIBackend(url=server.url, api_key_env="MY_KEY")
    finally:
        server.close()
    assert with_key == "Bearer s3cret" and server.auth is None


@pytest.mark.parametrize("command", [["explain", "-k", "last/plain/A/T7/pos6"],
                                     ["loss", "--reference", str(SET)]])
def test_explain_and_loss_refuse_a_top_k_backend(command, model, tmp_path, capsys):
    """explain and loss compare whole logits rows: a backend answering top-k logprobs is refused, exit 4 (never a
    comparison of nothing reported as within)."""
    server = OracleServer(model, "content")
    try:
        code = main([command[0], "--backend", "openai", "--backend-option", f"url={server.url}", "--fixtures", str(SET),
                     *command[1:]])
    finally:
        server.close()
    assert code == 4
    assert (f"backend 'openai' answers top-k logprobs, not logits (capability top_logprobs): {command[0]} compares "
            "whole logits rows; conformance check grades its rows") in capsys.readouterr().err
