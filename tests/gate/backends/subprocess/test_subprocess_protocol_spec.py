"""The subprocess protocol as docs/subprocess-protocol.md specifies it, checked on the wire.

The spec's own example engine ("A complete minimal engine", extracted from the document's fenced code
block at test time, so the document and this test cannot drift) runs through ``conformance check
--backend subprocess`` behind a recorder (tests/subprocess_fakes/recorder.py) that logs every message;
the conversation must be hello, open, run..., close, shutdown, with every field the document's tables
call required, and the engine must exit by itself with code 0. Then one test per clarification of the
document: the shutdown sequence, the required and optional hello fields, and the decode steps of a
multi request.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conformance.backends.subprocess.client import SubprocessBackend
from conformance.check import materialise
from conformance.cli import main as cli_main
from conformance.protocol import BackendError, Request
from conformance.protocol.wire import PROTOCOL, ProtocolError
from conformance.registry import load_backend
from conformance.sets import bundled_set, load_set

ROOT = Path(__file__).resolve().parents[4]
FAKES = Path(__file__).resolve().parents[3] / "subprocess_fakes"
SPEC = ROOT / "docs" / "subprocess-protocol.md"


def fake(mode: str, *args) -> list[str]:
    return [sys.executable, str(FAKES / "fake_engine.py"), mode, *map(str, args)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return materialise(load_set(bundled_set("e2b-mini")), tmp_path_factory.mktemp("e2b"))


@pytest.fixture
def backends():
    made = []
    yield made
    for b in made:
        b.shutdown(grace=0)


def make(backends, command, **kw) -> SubprocessBackend:
    b = SubprocessBackend(command, **kw)
    backends.append(b)
    return b


# ----------------------------------------------------------------------------------------------
# the document, read at test time


def section(title: str) -> str:
    """The text of the document's section (any level) ``title``, up to the next heading of its level or above."""
    text = SPEC.read_text(encoding="utf-8")
    m = re.search(rf"^(#+) {re.escape(title)}\n", text, re.M)
    assert m, f"docs/subprocess-protocol.md has no section {title!r}"
    level = len(m.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, m.end())
    return text[m.end():end.start() if end else len(text)]


def spec_engine() -> str:
    """The source of the document's "A complete minimal engine" (its fenced python block)."""
    blocks = re.findall(r"^```python\n(.*?)^```$", section("A complete minimal engine"), re.S | re.M)
    assert len(blocks) == 1, "the minimal engine's section must hold exactly one python block"
    return blocks[0]


def field_table(title: str, header: str) -> dict[str, str]:
    """The document's table in section ``title`` whose header row starts with ``header``: field name -> its
    second column (required / optional ...)."""
    lines = section(title).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(f"| {header}")]
    assert len(starts) == 1, f"section {title!r} has {len(starts)} tables headed {header!r}"
    rows = {}
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.fullmatch(r"`(\w+)`( \(.*\))?", cells[0])
        assert name, f"a row of {title!r} / {header!r} without a field name: {line}"
        rows[name.group(1)] = cells[1]
    return rows


def required(table: dict[str, str]) -> set[str]:
    """The fields the table calls required without a condition."""
    return {k for k, v in table.items() if v == "required"}


# what the document says each message carries
REPLY_ALWAYS = required(field_table("Required and optional fields", "reply field"))  # id, ok
REQUESTS = {"hello": required(field_table("hello", "request field")),
            "open": required(field_table("open", "request field")),
            "run": required(field_table("run", "request field")),
            "close": set(), "shutdown": set()}
HELLO_REPLY = field_table("hello", "reply field")
RUN_REPLY = field_table("The reply", "field (`ok: true`)")


def test_the_documents_tables_say_what_the_client_checks():
    from conformance.backends.subprocess.client import HELLO_REQUIRED

    assert REPLY_ALWAYS == {"id", "ok"}
    assert REQUESTS["hello"] == {"protocol", "versions"} and REQUESTS["open"] == {"model_dir"}
    assert REQUESTS["run"] == {"request", "out_dir"}
    assert required(HELLO_REPLY) == set(HELLO_REQUIRED) == {"protocol", "version", "capabilities"}
    assert HELLO_REPLY["name"] == HELLO_REPLY["engine"] == "optional"
    assert required(RUN_REPLY) == {"logits"}
    assert RUN_REPLY["decode_logits"].startswith("required when the request has decode steps")


# ----------------------------------------------------------------------------------------------
# the spec's engine through `conformance check`, every message recorded


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_spec_engine_speaks_the_protocol_as_documented(tmp_path, capsys):
    engine = tmp_path / "minimal_engine.py"
    engine.write_text(spec_engine())
    log = tmp_path / "protocol.jsonl"
    command = shlex.join([sys.executable, str(FAKES / "recorder.py"), str(log), sys.executable, str(engine)])
    report = tmp_path / "report.json"
    # -k T9: full/A/T9 and last/plain/A/T9/pos8 run (both with decode steps); six cases are not claimed
    code = cli_main(["check", "--backend", "subprocess", "--backend-option", f"command={command}",
                     "--backend-option", "env=" + json.dumps({"PYTHONPATH": str(ROOT)}),
                     "--fixtures", str(ROOT / "fixtures" / "e2b-mini"), "-k", "T9", "--json", str(report), "-q"])
    assert code == 0, capsys.readouterr()
    cases = {c["id"].split("/", 1)[1]: c["status"] for c in json.loads(report.read_text())["cases"]}
    assert cases["full/A/T9"] == cases["last/plain/A/T9/pos8"] == "pass"
    assert sorted(cases.values()).count("pass") == 2

    # the whole conversation is in the log as soon as the run is over (not only at interpreter exit)
    entries = read_log(log)
    assert entries[-1] == {"exit": 0}  # the engine exited by itself with code 0: it was not killed
    messages = [e for e in entries if "to" in e]
    assert all("msg" in e for e in messages), "a line on the wire that is not JSON"
    requests = [e["msg"] for e in messages if e["to"] == "engine"]
    replies = [e["msg"] for e in messages if e["to"] == "harness"]
    ops = [r["op"] for r in requests]
    assert ops == ["hello", "open", "run", "run", "close", "shutdown"]
    # one request at a time: each request is answered before the next one is written
    assert [e["to"] for e in messages] == ["engine", "harness"] * len(requests)
    assert [r["id"] for r in requests] == list(range(len(requests)))
    for req, rep in zip(requests, replies, strict=True):
        assert REQUESTS[req["op"]] <= set(req), f"{req['op']} request lacks {REQUESTS[req['op']] - set(req)}"
        assert REPLY_ALWAYS <= set(rep) and rep["id"] == req["id"] and rep["ok"] is True
    hello = requests[0]
    assert hello["protocol"] == PROTOCOL and 1 in hello["versions"]
    assert required(HELLO_REPLY) <= set(replies[0])
    assert os.path.isabs(requests[1]["model_dir"])
    for req, rep in zip(requests[2:4], replies[2:4], strict=True):
        request_fields = set(field_table("The request object", "field"))
        assert request_fields <= set(req["request"]), "the harness sends every field of the request object"
        assert req["request"]["decode"], "both cases have decode steps"
        assert {"logits", "decode_logits"} <= set(rep)
    assert os.path.isabs(requests[2]["out_dir"])


# ----------------------------------------------------------------------------------------------
# clarification: the shutdown sequence


def test_an_engine_that_exits_on_shutdown_is_not_killed(tmp_path):
    engine = tmp_path / "minimal_engine.py"
    engine.write_text(spec_engine())
    b = SubprocessBackend([sys.executable, str(engine)], env={"PYTHONPATH": str(ROOT)})
    proc = b._proc.proc
    t = time.perf_counter()
    assert b.shutdown() == "exited with code 0 after shutdown"
    assert time.perf_counter() - t < 3
    assert proc.returncode == 0  # its own exit status: not SIGKILL
    assert b.shutdown() is None  # nothing left to end


def test_an_engine_that_ignores_shutdown_is_killed_after_the_grace(tmp_path):
    # the option as --backend-option gives it
    b = load_backend("subprocess", command=shlex.join(fake("ignore-shutdown")), shutdown_grace=1)
    assert b.shutdown_grace == 1.0
    proc = b._proc.proc
    t = time.perf_counter()
    how = b.shutdown()
    took = time.perf_counter() - t
    assert how == "was killed after a grace of 1 s (it did not exit after shutdown)"
    assert proc.returncode == -9
    assert 1 <= took < 4
    with pytest.raises(BackendError, match=r"shutdown_grace must be a finite number of seconds, 0 or more, got -1"):
        SubprocessBackend(fake("ignore-shutdown"), shutdown_grace=-1)


def test_the_end_of_a_run_and_garbage_collection_send_shutdown(tmp_path):
    """Dropping the backend (what `conformance check` does when its run is over) ends the engine with the
    shutdown sequence, not with a kill."""
    import gc

    log = tmp_path / "protocol.jsonl"
    engine = tmp_path / "minimal_engine.py"
    engine.write_text(spec_engine())
    b = SubprocessBackend([sys.executable, str(FAKES / "recorder.py"), str(log), sys.executable, str(engine)])
    proc = b._proc.proc
    del b
    gc.collect()
    assert proc.returncode == 0
    entries = read_log(log)
    assert [e["msg"].get("op") for e in entries if e.get("to") == "engine"] == ["hello", "shutdown"]
    assert entries[-1] == {"exit": 0}


# ----------------------------------------------------------------------------------------------
# clarification: required and optional hello fields


def test_a_hello_without_the_optional_fields_works(model_dir, backends):
    b = make(backends, fake("bare-hello"))
    assert b.name == Path(sys.executable).name  # no name in hello: the program's file name
    assert b.engine == {}
    b.open(model_dir)
    assert b.run(Request(kind="full", tokens=(2, 3, 4))).logits.shape[0] == 3
    assert make(backends, fake("bare-hello"), name="my-engine").name == "my-engine"
    assert make(backends, fake("bare-hello"), name="").name == Path(sys.executable).name  # name= : not given
    assert make(backends, fake("fail-run"), name="").name == "fake"  # the engine's name when it gives one


@pytest.mark.parametrize("mode, line", [
    ("no-protocol", "the hello reply lacks the required field 'protocol'"),
    ("no-version", "the hello reply lacks the required field 'version'"),
    ("no-capabilities", "the hello reply lacks the required field 'capabilities'"),
    ("missing-caps", "the hello reply's 'capabilities' lacks decode (a v1 engine gives every field: "),
    ("bad-name", "the hello reply's 'name' must be a string, got 7"),
])
def test_a_hello_without_a_required_field_fails_with_one_line(mode, line):
    with pytest.raises(BackendError) as info:
        SubprocessBackend(fake(mode), name="given")  # the name option does not make any of them optional
    first = str(info.value).splitlines()[0]  # the engine's stderr may follow on the next lines
    assert first.startswith("subprocess backend: the engine command [")
    assert first.endswith(f"]: {line}") if mode != "missing-caps" else f"]: {line}" in first


def test_an_error_reply_without_its_error_names_the_message_and_the_field(model_dir, backends):
    b = make(backends, fake("fail-run-bare"))
    b.open(model_dir)
    with pytest.raises(ProtocolError) as info:
        b.run(Request(kind="full", tokens=(2, 3)))
    assert str(info.value) == "the run reply (ok: false) lacks the required field 'error'"
    assert b._alive()  # the engine keeps serving


# ----------------------------------------------------------------------------------------------
# clarification: decode steps of a multi request


MULTI = dict(kind="multi", sequences=((2, 5, 6), (2, 7)), seq_ids=(1, 2))


@pytest.mark.parametrize("form", ["canonical", "empty-list", "per-seq", "nulls"])
def test_a_multi_request_without_decode_steps(form, model_dir, tmp_path, backends):
    log = tmp_path / "decode.jsonl"
    b = make(backends, fake(f"multi-{form}", 0, log))
    b.open(model_dir)
    for decode in ((), ((), ())):  # no steps, said either way by the caller
        got = b.run(Request(**MULTI, decode=decode))
        assert got.logits.shape[0] == 2 and got.decode_logits is None
    got = b.run(Request(**MULTI, decode=((8,), ())))
    assert [d.shape[0] for d in got.decode_logits] == [1, 0]
    assert got.decode_logits[1].shape[1] == got.logits.shape[1]
    # on the wire: "decode": [] whenever no sequence has a step, one list per sequence otherwise
    assert read_log(log) == [[], [], [[8], []]]


def test_a_multi_reply_with_the_wrong_decode_form_is_a_one_line_error(model_dir, tmp_path, backends):
    b = make(backends, fake("multi-bad", 0, tmp_path / "decode.jsonl"))
    b.open(model_dir)
    with pytest.raises(ProtocolError, match=r"^the run reply's 'decode_logits' must be null: the request has no "
                                            r"decode steps, got \{'path'"):
        b.run(Request(**MULTI, decode=()))
    with pytest.raises(ProtocolError) as info:
        b.run(Request(**MULTI, decode=((8,), ())))
    assert str(info.value) == ("the run reply's 'decode_logits'[0] is null, but sequence 0 of the multi request "
                               "has 1 decode steps")


def test_the_reference_server_answers_null_for_a_multi_request_without_steps(model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lines = [{"id": 0, "op": "hello", "protocol": PROTOCOL, "versions": [1]},
             {"id": 1, "op": "open", "model_dir": str(model_dir)}]
    for i, decode in enumerate(([], [[], []], [[8], []])):
        lines.append({"id": 2 + i, "op": "run", "out_dir": str(out),
                      "request": {"kind": "multi", "sequences": [[2, 5, 6], [2, 7]], "seq_ids": [1, 2],
                                  "decode": decode}})
    lines.append({"id": 5, "op": "shutdown"})
    proc = subprocess.run([sys.executable, "-m", "conformance.serve", "--backend", "refimpl"],
                          input="".join(json.dumps(line) + "\n" for line in lines), capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["ok"] for r in replies] == [True] * 6, replies
    assert replies[2]["decode_logits"] is None and replies[3]["decode_logits"] is None
    assert [a["shape"][0] for a in replies[4]["decode_logits"]] == [1, 0]
    assert np.fromfile(out / "logits.bin", "<f8").size == 2 * replies[4]["logits"]["shape"][1]
