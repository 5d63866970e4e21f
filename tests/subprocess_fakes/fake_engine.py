"""Misbehaving engines for tests/gate/backends/subprocess/test_subprocess_backend.py:
``python fake_engine.py MODE [N] [MARKER]``.

Modes that serve the refimpl oracle through ``conformance.backends.subprocess.server.serve`` and misbehave once:
  abort-run N MARKER   os.abort() on the Nth run (only if MARKER does not exist; it is created first)
  exit-run N MARKER    exit with code 3 on the Nth run (same rule)
  hang-run N MARKER    sleep for an hour on the Nth run (same rule)
  garbage-run N MARKER print a non-JSON line on stdout on the Nth run (same rule)
  abort-open [0 MARKER] os.abort() on every open (with MARKER: on the first one only)
  abort-run-worker N MARKER  at start, a worker child in the engine's process group that inherits
                       stdout and sleeps 40 s (a multi-process engine); os.abort() on the Nth run
  hang-run-escape N MARKER   on the Nth run, a helper that leaves the process group
                       (start_new_session) holding stdout and stderr, sleeping 40 s (its pid goes to
                       MARKER.helper); then sleep for an hour
  abort-run-escape N MARKER  the same helper, then os.abort()
Hand-written protocol loops that are broken from the start:
  exit-at-start        write to stderr, exit with code 3
  garbage              a log line on stdout before the hello reply
  bad-version          hello answers version 2
  bad-protocol         hello answers another protocol name
  missing-caps         hello without capabilities.decode
  refuse-open          open answers ok:false
  wrong-size           run answers a logits file one float short
  wrong-shape          run answers logits of one row too many
  escape-path          run answers a path outside out_dir
  fail-run             run answers ok:false
  slow-open N          open takes N milliseconds
  v1-record 0 LOG      a v1 engine that knows nothing of image prompts (no image_prompts in hello,
                       request fields it does not know ignored); appends every run request to LOG
  spawn-worker 0 PIDS  at start, a worker child in the process group; "ENGINE_PID WORKER_PID" goes to
                       PIDS; then serves like the modes above (a well-behaved engine)
  bare-hello           hello gives the required fields only (protocol, version, capabilities): no name,
                       no engine
  no-protocol, no-version, no-capabilities   hello without that required field
  bad-name             hello's name is a number
  fail-run-bare        run answers ok:false without an error
  ignore-shutdown      a v1 engine that ignores shutdown (ok:false, unknown op) and end of input: it
                       sleeps until it is killed
  multi-FORM 0 LOG     claims multi_sequence and decode; answers multi requests with zero logits, appending
                       each request's "decode" to LOG; decode_logits by FORM: canonical (null without
                       steps, else one ARRAY per sequence), empty-list ([] without steps), per-seq (one
                       [0, V] ARRAY per sequence without steps), nulls (null per sequence without steps;
                       with steps, null for a sequence without any), bad (without steps one ARRAY, not a
                       list; with steps null for every sequence)
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODE = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 0
MARKER = Path(sys.argv[3]) if len(sys.argv) > 3 else None

CAPS = {"full_forward": True, "last_plain": True, "last_seq_id": False, "last_embeddings": False,
        "embedding_convention": "scaled", "interior_rows": False, "output_rows": False, "ubatch": False,
        "chunked_prefill": False, "multi_sequence": False, "decode": False, "default_profile": "fp32"}


def sleeper(**kw) -> subprocess.Popen:
    """A child that inherits stdin, stdout and stderr and sleeps 40 s."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(40)"], **kw)


def once() -> bool:
    """True the first time (in any process of this test): creates MARKER."""
    if MARKER is None or MARKER.exists():
        return False
    MARKER.write_text("done")
    return True


class Misbehaving:
    def __init__(self):
        from conformance.backends.refimpl_backend import RefimplBackend

        self.inner = RefimplBackend()
        self.name, self.capabilities = "fake-" + MODE, self.inner.capabilities
        self.runs = 0

    def open(self, model_dir):
        if MODE == "abort-open" and (MARKER is None or once()):
            sys.stderr.write("fake engine: GGML_ASSERT(n_tokens > 0) failed\n")
            sys.stderr.flush()
            os.abort()
        self.inner.open(model_dir)

    def run(self, request):
        self.runs += 1
        if self.runs == N and once():
            sys.stderr.write(f"fake engine: misbehaving ({MODE}) on run {N}\n")
            sys.stderr.flush()
            if MODE in ("hang-run-escape", "abort-run-escape"):
                helper = sleeper(start_new_session=True)
                Path(str(MARKER) + ".helper").write_text(str(helper.pid))
            if MODE in ("abort-run", "abort-run-worker", "abort-run-escape"):
                os.abort()
            if MODE == "exit-run":
                os._exit(3)
            if MODE in ("hang-run", "hang-run-escape"):
                time.sleep(3600)
            if MODE == "garbage-run":
                sys.__stdout__.write("llama_model_load: loading tensors\n")  # the reply stream
                sys.__stdout__.flush()
        return self.inner.run(request)

    def close(self):
        self.inner.close()


def reply(msg, **fields):
    sys.stdout.write(json.dumps({"id": msg["id"], **fields}) + "\n")
    sys.stdout.flush()


def hand_written():
    if MODE == "exit-at-start":
        sys.stderr.write("fatal: no CUDA device found\n")
        sys.exit(3)
    if MODE == "garbage":
        print("Loading engine v0.1 ...", flush=True)
    if MODE == "spawn-worker":
        MARKER.write_text(f"{os.getpid()} {sleeper().pid}")
    vocab = None
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "hello":
            caps = dict(CAPS)
            if MODE == "missing-caps":
                del caps["decode"]
            if MODE.startswith("multi-"):
                caps.update(multi_sequence=True, decode=True)
            fields = dict(protocol="other-protocol" if MODE == "bad-protocol" else msg["protocol"],
                          version=2 if MODE == "bad-version" else 1, name=7 if MODE == "bad-name" else "fake",
                          capabilities=caps, engine={})
            if MODE == "bare-hello":
                del fields["name"], fields["engine"]
            if MODE.startswith("no-"):
                del fields[MODE[3:]]
            reply(msg, ok=True, **fields)
        elif op == "open":
            if MODE == "refuse-open":
                reply(msg, ok=False, error="unsupported architecture gemma4")
                continue
            if MODE == "slow-open":
                time.sleep(N / 1000)
            cfg = json.loads((Path(msg["model_dir"]) / "config.json").read_text())
            vocab = cfg.get("text_config", cfg)["vocab_size"]
            reply(msg, ok=True)
        elif op == "run":
            if MODE == "fail-run":
                reply(msg, ok=False, error="RuntimeError: out of memory")
                continue
            if MODE == "fail-run-bare":
                reply(msg, ok=False)
                continue
            req = msg["request"]
            if MODE.startswith("multi-"):
                reply(msg, ok=True, **multi_reply(req, Path(msg["out_dir"]), vocab, MODE[6:]))
                continue
            if MODE == "v1-record":
                with open(MARKER, "a") as log:
                    log.write(json.dumps(req) + "\n")
            rows = len(req["tokens"]) if req["kind"] == "full" else 1
            if MODE == "wrong-shape":
                rows += 1
            out = Path(msg["out_dir"])
            n = rows * vocab - (1 if MODE == "wrong-size" else 0)
            path = "../elsewhere.bin" if MODE == "escape-path" else "logits.bin"
            (out / "logits.bin").write_bytes(b"\0" * (4 * n))
            reply(msg, ok=True, logits={"path": path, "format": "raw", "dtype": "float32",
                                        "shape": [rows, vocab]}, decode_logits=None, executed={})
        elif op == "shutdown" and MODE == "ignore-shutdown":
            reply(msg, ok=False, error="unknown op 'shutdown'")
        else:
            reply(msg, ok=True)
            if op == "shutdown":
                return
    if MODE == "ignore-shutdown":  # nor does it exit at end of input
        time.sleep(3600)


def multi_reply(req, out: Path, vocab: int, form: str) -> dict:
    """A multi request's reply (zero logits) with decode_logits in the given form; the request's "decode" is
    appended to MARKER."""
    with open(MARKER, "a") as log:
        log.write(json.dumps(req["decode"]) + "\n")

    def array(name: str, rows: int) -> dict:
        (out / name).write_bytes(b"\0" * (4 * rows * vocab))
        return {"path": name, "format": "raw", "dtype": "float32", "shape": [rows, vocab]}

    n = len(req["sequences"])
    decode = req["decode"]
    if not decode:  # no decode steps
        dl = {"canonical": None, "empty-list": [], "per-seq": [array(f"d{i}.bin", 0) for i in range(n)],
              "nulls": [None] * n, "bad": array("d.bin", 0)}[form]
    elif form == "bad":
        dl = [None] * n
    else:
        dl = [None if form == "nulls" and not steps else array(f"d{i}.bin", len(steps))
              for i, steps in enumerate(decode)]
    return {"logits": array("logits.bin", n), "decode_logits": dl, "executed": {}}


if __name__ == "__main__":
    if MODE in ("abort-run", "exit-run", "hang-run", "garbage-run", "abort-open", "abort-run-worker",
                "hang-run-escape", "abort-run-escape"):
        from conformance.backends.subprocess.server import serve

        if MODE == "abort-run-worker":
            worker = sleeper()  # a multi-process engine: the worker keeps stdout open after an abort
        serve(Misbehaving(), sys.stdin, sys.stdout)
    else:
        hand_written()
