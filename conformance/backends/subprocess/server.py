"""The reference server of the subprocess protocol (docs/subprocess-protocol.md): it serves any Python
backend over stdin/stdout, so the harness's ``subprocess`` backend can drive it like a foreign engine.

    python -m conformance.serve --backend NAME|module:attr [--backend-option KEY=VALUE ...] [--format raw|safetensors]

It is also the reference an engine author reads to implement the protocol in another language: read
one JSON object per line on stdin, answer one JSON object per line on stdout (the same "id", "ok"
true or false), write logits as files into the request's "out_dir", log only to stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

from ...protocol.wire import (
    PROTOCOL,
    VERSIONS,
    EngineError,
    jsonable,
    mtp_reply,
    request_from_json,
    write_array,
    write_trace,
)


def handle(backend: Any, msg: dict, fmt: str) -> dict:
    """Answer one request message (without "id" and "ok"); raise on failure."""
    op = msg.get("op")
    if op == "hello":
        if msg.get("protocol") != PROTOCOL or VERSIONS[-1] not in (msg.get("versions") or []):
            raise ValueError(f"this server speaks {PROTOCOL} version {VERSIONS[-1]}; the client offered "
                             f"{msg.get('protocol')!r} versions {msg.get('versions')!r}")
        shipped = getattr(backend, "expectations_file", None)
        return {"protocol": PROTOCOL, "version": VERSIONS[-1], "name": backend.name,
                "capabilities": backend.capabilities.to_dict(),
                "engine": {"server": "conformance.serve", "format": fmt,
                           "backend": f"{type(backend).__module__}:{type(backend).__qualname__}",
                           "python": sys.version.split()[0], "pid": os.getpid(),
                           "expectations_file": None if shipped is None else str(shipped)}}
    if op == "open":
        backend.open(Path(msg["model_dir"]))
        return {}
    if op == "run":
        out_dir = Path(msg["out_dir"])
        request = request_from_json(msg["request"], out_dir)
        if request.kind == "multi" and not any(request.decode):
            # "decode": [] and a list of empty lists alike mean no decode steps (docs/subprocess-protocol.md)
            request = dataclasses.replace(request, decode=())
        response = backend.run(request)
        reply = {"logits": write_array(out_dir, "logits", response.logits, fmt), "decode_logits": None,
                 "executed": jsonable(response.executed or {})}
        dl = response.decode_logits if request.decode else None  # no steps: null, whatever the backend gave
        if dl is not None and request.kind == "multi":  # one ARRAY per sequence
            reply["decode_logits"] = [write_array(out_dir, f"decode_logits.{i}", a, fmt) for i, a in enumerate(dl)]
        elif dl is not None:
            reply["decode_logits"] = write_array(out_dir, "decode_logits", dl, fmt)
        if response.mtp is not None:
            reply["mtp"] = mtp_reply(out_dir, response.mtp, fmt)
        if response.mtp_batch is not None:  # batched MTP: one "mtp" object per sequence
            reply["mtp_batch"] = [mtp_reply(out_dir, m, fmt, f"seq{s}.") for s, m in enumerate(response.mtp_batch)]
        if request.hidden and response.hidden is not None:  # hidden_states: the same rows' final-norm states
            reply["hidden"] = write_array(out_dir, "hidden", response.hidden, fmt)
            dh = response.decode_hidden if request.decode else None
            reply["decode_hidden"] = (None if dh is None else
                                      [write_array(out_dir, f"decode_hidden.{i}", a, fmt) for i, a in enumerate(dh)]
                                      if request.kind == "multi" else write_array(out_dir, "decode_hidden", dh, fmt))
        if request.trace and response.trace is not None:  # traces: point name -> the same rows' values
            reply["trace"] = write_trace(out_dir, "trace", response.trace, fmt)
            dt = response.decode_trace if request.decode else None
            reply["decode_trace"] = (None if dt is None else
                                     [write_trace(out_dir, f"decode_trace.{i}", t, fmt) for i, t in enumerate(dt)]
                                     if request.kind == "multi" else write_trace(out_dir, "decode_trace", dt, fmt))
        return reply
    if op == "close":
        backend.close()
        return {}
    if op == "shutdown":
        return {}
    raise ValueError(f"unknown op {op!r}")


def _error_text(exc: BaseException) -> str:
    """The ``error`` of an ``ok: false`` reply: ``"<Type>: <message>"``. An EngineError (the backend is itself a
    subprocess client, e.g. llama-cpp under ``conformance check --isolate``, whose engine answered ``ok: false``)
    passes its engine's own message on as it is, so that the client does not wrap it a second time."""
    inner = getattr(exc, "engine_error", None) if isinstance(exc, EngineError) else None
    return inner if isinstance(inner, str) else f"{type(exc).__name__}: {exc}"


def serve(backend: Any, stdin: TextIO, stdout: TextIO, format: str = "raw") -> int:
    """Answer requests from ``stdin`` until ``shutdown`` or end of input; returns the exit code (0).

    Only replies go to ``stdout``; while the backend works, ``sys.stdout`` points to stderr.
    """
    for line in stdin:
        if not line.strip():
            continue
        mid, op = None, None
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ValueError("a request must be a JSON object")
            mid, op = msg.get("id"), msg.get("op")
            with contextlib.redirect_stdout(sys.stderr):
                reply = {"id": mid, "ok": True, **handle(backend, msg, format)}
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure (SystemExit too) is an ok:false reply
            tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
            sys.stderr.write(f"conformance.serve: {op} failed:\n{''.join(tb[-2:])}")
            sys.stderr.flush()
            reply = {"id": mid, "ok": False, "error": _error_text(exc)}
        stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
        stdout.flush()
        if op == "shutdown":
            break
    return 0
