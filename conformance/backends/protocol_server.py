"""The reference server of the subprocess protocol (docs/subprocess-protocol.md): it serves any Python
backend over stdin/stdout, so the harness's ``subprocess`` backend can drive it like a foreign engine.

    python -m conformance.backends.protocol_server --backend NAME|module:attr \\
        [--backend-option KEY=VALUE ...] [--format raw|safetensors]

It is also the reference an engine author reads to implement the protocol in another language: read
one JSON object per line on stdin, answer one JSON object per line on stdout (the same "id", "ok"
true or false), write logits as files into the request's "out_dir", log only to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from conformance.backend import AudioInput, Piece, Request
from conformance.registry import parse_option as registry_parse_option

PROTOCOL = "gemma4-conformance-subprocess"
VERSION = 1
RAW_DTYPES = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}
ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}


# ----------------------------------------------------------------------------------------------
# JSON <-> Request / Response


def read_raw(ref: dict, out_dir: Path) -> np.ndarray:
    """An ARRAY the client wrote (the ``last`` request's or a piece's embeddings, an audio clip's features or
    mask): raw little-endian, C order."""
    if ref.get("format") != "raw":
        raise ValueError(f"only raw input arrays are supported, got format {ref.get('format')!r}")
    path = Path(out_dir) / ref["path"]  # an absolute path stays absolute
    x = np.fromfile(path, dtype=RAW_DTYPES[ref["dtype"]]).reshape(ref["shape"])
    if ref["dtype"] == "bfloat16":
        x = (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float64)


def request_from_json(d: dict, out_dir: Path) -> Request:
    kind = d["kind"]
    decode = d.get("decode") or []
    if kind == "multi":
        decode = tuple(tuple(int(t) for t in seq) for seq in decode)
    else:
        decode = tuple(int(t) for t in decode)
    embeddings = read_raw(d["embeddings"], out_dir) if d.get("embeddings") else None
    # image prompts (fields added after v1, absent from older clients): each piece's embeddings, and
    # the image blocks as [first position, soft tokens]
    pieces = tuple(Piece(tuple(int(t) for t in p["tokens"]), tuple(int(r) for r in p["rows"]),
                         embeddings=read_raw(p["embeddings"], out_dir) if p.get("embeddings") else None)
                   for p in d.get("pieces") or ())
    images = tuple((int(start), int(n)) for start, n in d.get("images") or ())
    # audio prompts (likewise after v1): the audio blocks, and each clip's features and frame mask
    audio = tuple((int(start), int(n)) for start, n in d.get("audio") or ())
    audio_inputs = tuple(AudioInput(read_raw(a["features"], out_dir), read_raw(a["mask"], out_dir) != 0)
                         for a in d.get("audio_inputs") or ())
    return Request(
        kind=kind,
        tokens=tuple(int(t) for t in d.get("tokens") or ()),
        entry=d.get("entry") or "plain",
        last_pos=int(d.get("last_pos", -1)),
        seq_id=d.get("seq_id"),
        embeddings=embeddings,
        pieces=pieces,
        ubatch=d.get("ubatch"),
        sequences=tuple(tuple(int(t) for t in s) for s in d.get("sequences") or ()),
        seq_ids=tuple(int(s) for s in d.get("seq_ids") or ()),
        decode=decode,
        images=images,
        audio=audio,
        audio_inputs=audio_inputs,
    )


def write_array(out_dir: Path, name: str, x: Any, fmt: str) -> dict:
    """Write one [rows, V] logits array into out_dir; returns its ARRAY reference (a relative path).

    The dtype is kept (float64, float32, float16, bfloat16 from ml_dtypes); anything else is float64.
    """
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D [rows, V] array, got shape {list(x.shape)}")
    dtype = x.dtype.name if x.dtype.name in RAW_DTYPES else "float64"
    x = np.ascontiguousarray(x if dtype == x.dtype.name else x.astype(np.float64))
    if fmt == "safetensors":
        from refimpl.safetensors_io import write_safetensors

        path = f"{name}.safetensors"
        data = x.astype(np.float32) if dtype == "bfloat16" else x  # rounds exactly back to the same bf16
        write_safetensors(out_dir / path, {name: data}, dtype=ST_DTYPES[dtype])
        return {"path": path, "format": "safetensors", "tensor": name}
    path = f"{name}.bin"
    data = x.view(np.uint16) if dtype == "bfloat16" else x
    data.astype(RAW_DTYPES[dtype], copy=False).tofile(out_dir / path)
    return {"path": path, "format": "raw", "dtype": dtype, "shape": list(x.shape)}


def jsonable(x: Any) -> Any:
    """The backend's ``executed`` record as plain JSON values."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    return repr(x)


# ----------------------------------------------------------------------------------------------
# the ops


def handle(backend: Any, msg: dict, fmt: str) -> dict:
    """Answer one request message (without "id" and "ok"); raise on failure."""
    op = msg.get("op")
    if op == "hello":
        if msg.get("protocol") != PROTOCOL or VERSION not in (msg.get("versions") or []):
            raise ValueError(f"this server speaks {PROTOCOL} version {VERSION}; the client offered "
                             f"{msg.get('protocol')!r} versions {msg.get('versions')!r}")
        shipped = getattr(backend, "expectations_file", None)
        return {"protocol": PROTOCOL, "version": VERSION, "name": backend.name,
                "capabilities": backend.capabilities.to_dict(),
                "engine": {"server": "conformance.backends.protocol_server", "format": fmt,
                           "backend": f"{type(backend).__module__}:{type(backend).__qualname__}",
                           "python": sys.version.split()[0], "pid": os.getpid(),
                           "expectations_file": None if shipped is None else str(shipped)}}
    if op == "open":
        backend.open(Path(msg["model_dir"]))
        return {}
    if op == "run":
        out_dir = Path(msg["out_dir"])
        request = request_from_json(msg["request"], out_dir)
        response = backend.run(request)
        reply = {"logits": write_array(out_dir, "logits", response.logits, fmt), "decode_logits": None,
                 "executed": jsonable(response.executed or {})}
        dl = response.decode_logits
        if dl is not None and request.kind == "multi":  # one ARRAY per sequence
            reply["decode_logits"] = [write_array(out_dir, f"decode_logits.{i}", a, fmt) for i, a in enumerate(dl)]
        elif dl is not None:
            reply["decode_logits"] = write_array(out_dir, "decode_logits", dl, fmt)
        return reply
    if op == "close":
        backend.close()
        return {}
    if op == "shutdown":
        return {}
    raise ValueError(f"unknown op {op!r}")


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
            sys.stderr.write(f"protocol_server: {op} failed:\n{''.join(tb[-2:])}")
            sys.stderr.flush()
            reply = {"id": mid, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
        stdout.flush()
        if op == "shutdown":
            break
    return 0


# ----------------------------------------------------------------------------------------------
# command line


def parse_option(text: str) -> tuple[str, Any]:
    """KEY=VALUE as the conformance CLI reads it: VALUE is a JSON number, true/false or null, else a string."""
    try:
        return registry_parse_option(text)
    except ValueError as e:
        raise SystemExit(f"protocol_server: --backend-option {e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.backends.protocol_server",
                                     description="Serve a Python backend over the subprocess protocol.")
    parser.add_argument("--backend", required=True, help="a registered name or module:attr")
    parser.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--backend-options-json", metavar="OBJECT", default="{}",
                        help="the backend's options as one JSON object (merged under --backend-option)")
    parser.add_argument("--format", choices=("raw", "safetensors"), default="raw",
                        help="how logits files are written (default raw)")
    args = parser.parse_args(argv)

    # Keep the real stdout for replies only; file descriptor 1 (and sys.stdout) now go to stderr, so
    # nothing printed by the backend or a C library it loads can corrupt the reply stream.
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from conformance.backend import BackendError
    from conformance.registry import load_backend

    try:
        options = json.loads(args.backend_options_json)
        if not isinstance(options, dict):
            raise ValueError(f"got {type(options).__name__}")
    except ValueError as exc:
        sys.stderr.write(f"protocol_server: error: --backend-options-json must be a JSON object ({exc})\n")
        return 2
    options.update(parse_option(o) for o in args.backend_option)
    try:
        backend = load_backend(args.backend, **options)
    except BackendError as exc:
        sys.stderr.write(f"protocol_server: error: {exc}\n")
        return 2
    return serve(backend, sys.stdin, replies, format=args.format)


if __name__ == "__main__":
    sys.exit(main())
