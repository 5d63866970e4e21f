"""A complete minimal engine for the gemma4-conformance subprocess protocol, version 1.

It claims the full forward, the plain last-logits entry point at the last row, and decode (by
re-running the forward over the longer prefix). Only load_model is engine-specific: the stand-in
here is the refimpl oracle in float32; replace it with your engine's loader.
"""
import json
import sys

import numpy as np


def load_model(model_dir):  # stand-in engine: returns forward(ids) -> logits [T, V]
    from refimpl import Gemma4

    model = Gemma4(model_dir, dtype="float32")
    return lambda ids: model.forward(ids, rows="all")


CAPS = dict(full_forward=True, last_plain=True, last_seq_id=False, last_embeddings=False,
            embedding_convention="scaled", interior_rows=False, output_rows=False, ubatch=False,
            chunked_prefill=False, multi_sequence=False, decode=True, default_profile="fp32")


def array(out_dir, name, x):  # write [R, V] as raw float32; return its ARRAY reference
    x = np.ascontiguousarray(x, dtype="<f4")
    x.tofile(f"{out_dir}/{name}.f32")
    return {"path": f"{name}.f32", "format": "raw", "dtype": "float32", "shape": list(x.shape)}


replies, sys.stdout = sys.stdout, sys.stderr  # only replies on stdout; prints go to stderr
forward = None
for line in sys.stdin:
    msg = json.loads(line)
    op, reply = msg.get("op"), {"id": msg.get("id"), "ok": True}
    try:
        if op == "hello":
            if 1 not in msg["versions"]:
                raise ValueError("this engine speaks protocol version 1 only")
            reply.update(protocol=msg["protocol"], version=1, name="minimal-engine", capabilities=CAPS,
                         engine={"example": True})
        elif op == "open":
            forward = load_model(msg["model_dir"])
        elif op == "run":
            req, out_dir = msg["request"], msg["out_dir"]
            tokens, decode, pos = req["tokens"], req["decode"], req["last_pos"]
            logits = forward(tokens)
            rows = logits if req["kind"] == "full" else logits[pos:pos + 1]
            reply.update(logits=array(out_dir, "logits", rows), decode_logits=None, executed={"path": "forward"})
            if decode:  # teacher forcing: step j sees tokens + decode[:j + 1]
                steps = [forward(tokens + decode[:j + 1])[-1] for j in range(len(decode))]
                reply["decode_logits"] = array(out_dir, "decode", np.stack(steps))
        elif op not in ("close", "shutdown"):
            raise ValueError(f"unknown op {op!r}")
    except Exception as exc:  # noqa: BLE001 - every failure is an ok:false reply; the engine keeps serving
        reply = {"id": msg.get("id"), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    replies.write(json.dumps(reply) + "\n")
    replies.flush()
    if op == "shutdown":
        break
