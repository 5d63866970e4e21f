"""A ``run`` reply of the subprocess protocol read into a ``Response``, checked as the run reply table of
docs/subprocess-protocol.md says: which fields are required for which request, the decode fields of every
kind (``multi`` included, with and without steps), hidden states, traces and MTP answers."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...protocol.types import Request, Response
from ...protocol.wire import ProtocolError, clip_text, expected_rows, mtp_from_reply, read_array, read_trace

__all__ = ["response_from_reply"]


def _decode_arrays(refs: Any, decode_rows: int | list[int] | None, n_seq: int, field: str, read,
                   empty=None) -> Any:
    """A run reply's decode field (``decode_logits``, ``decode_hidden``, ``decode_trace``) as the run reply table
    says; ``read(ref, where, rows)`` reads one entry, ``decode_rows`` is ``expected_rows``' second value.

    * No decode steps (``decode_rows`` None; for ``multi``, ``"decode": []``): null or absent; a ``multi`` reply
      may also give ``[]`` or one entry per sequence, each null or ``[0, ...]`` (read, checked, dropped). None.
    * Steps, not ``multi``: one entry with ``decode_rows`` rows (null is an error).
    * Steps, ``multi``: a list of one entry per sequence, in order; a sequence without steps has ``[0, ...]``
      or null (then ``empty()``, or None without ``empty``), one with steps may not be null."""
    if decode_rows is None:
        if refs is None or (n_seq and isinstance(refs, list) and not refs):
            return None
        if n_seq and isinstance(refs, list) and len(refs) == n_seq:
            for i, ref in enumerate(refs):
                if ref is not None:
                    read(ref, f"run reply {field!r}[{i}]", 0)
            return None
        raise ProtocolError(f"the run reply's {field!r} must be null: the request has no decode steps, got "
                            f"{clip_text(repr(refs))}")
    if isinstance(decode_rows, int):
        if refs is None:
            raise ProtocolError(f"the run reply's {field!r} is null, but the request has {decode_rows} decode steps")
        return read(refs, f"run reply {field!r}", decode_rows)
    if not isinstance(refs, list) or len(refs) != len(decode_rows):
        raise ProtocolError(f"the run reply's {field!r} must be a list of {len(decode_rows)} entries (one per "
                            f"sequence of the multi request), got {clip_text(repr(refs))}")
    out = []
    for i, (ref, n) in enumerate(zip(refs, decode_rows, strict=True)):
        if ref is None:
            if n:
                raise ProtocolError(f"the run reply's {field!r}[{i}] is null, but sequence {i} of the multi request "
                                    f"has {n} decode steps")
            out.append(None if empty is None else empty())
        else:
            out.append(read(ref, f"run reply {field!r}[{i}]", n))
    return out


def response_from_reply(reply: dict, request: Request, out_dir: str, vocab: int | None) -> Response:
    """The run reply, checked as the run reply table says: ``logits`` required; ``decode_logits`` required
    when the request has decode steps (else absent or null; ``_decode_arrays``); ``executed`` optional;
    ``hidden`` / ``decode_hidden``, ``trace`` / ``decode_trace`` and ``mtp`` as the request asks."""
    rows, decode_rows = expected_rows(request)
    if "logits" not in reply:
        raise ProtocolError("the run reply lacks the required field 'logits'")
    logits = read_array(reply["logits"], out_dir, "run reply 'logits'", rows, vocab)
    vocab = vocab if vocab is not None else logits.shape[1]
    if decode_rows is not None and "decode_logits" not in reply:
        raise ProtocolError("the run reply lacks the required field 'decode_logits' (the request has decode "
                            "steps)")
    decode = _decode_arrays(reply.get("decode_logits"), decode_rows, len(request.sequences), "decode_logits",
                            lambda ref, where, n: read_array(ref, out_dir, where, n, vocab),
                            empty=lambda: np.empty((0, vocab), dtype=logits.dtype))
    executed = reply.get("executed", {})
    if executed is None:
        executed = {}
    if not isinstance(executed, dict):
        raise ProtocolError(f"the run reply's 'executed' must be an object, got {clip_text(repr(executed))}")
    hidden, decode_hidden = _hidden(reply, request, out_dir, rows, decode_rows)
    trace, decode_trace = _trace(reply, request, out_dir, rows, decode_rows)
    mtp, batch = None, None
    if request.kind == "mtp" and request.mtp_batch:  # batched: one "mtp" object per sequence
        answers = reply.get("mtp_batch")
        if not isinstance(answers, list) or len(answers) != len(request.mtp_batch):
            raise ProtocolError(f"the run reply of a batched mtp request needs 'mtp_batch', one 'mtp' object per "
                                f"sequence ({len(request.mtp_batch)}), got {clip_text(repr(answers))}")
        batch = [mtp_from_reply(a, Request(kind="mtp", mtp=m), out_dir, vocab)
                 for a, m in zip(answers, request.mtp_batch, strict=True)]
    elif request.kind == "mtp":
        if "mtp" not in reply:
            raise ProtocolError("the run reply lacks the required field 'mtp' (the request is an mtp request)")
        mtp = mtp_from_reply(reply.get("mtp"), request, out_dir, vocab)
    return Response(logits, decode, executed, hidden=hidden, decode_hidden=decode_hidden, mtp=mtp, trace=trace,
                    decode_trace=decode_trace, mtp_batch=batch)

def _trace(reply: dict, request: Request, out_dir: str, rows: int, decode_rows) -> tuple[Any, Any]:
    """The reply's traces (an engine that claims traces, asked with the request's "trace" flag): "trace" a
    map of point name -> ARRAY [rows, ...], "decode_trace" one such map (a list of them for multi); (None,
    None) when not asked. An engine may serve any subset of the points, none included."""
    if not request.trace or reply.get("trace") is None:
        return None, None
    trace = read_trace(reply["trace"], out_dir, "run reply 'trace'", rows)
    dt = reply.get("decode_trace")
    if decode_rows is None or dt is None:
        return trace, None
    return trace, _decode_arrays(dt, decode_rows, len(request.sequences), "decode_trace",
                                 lambda ref, where, n: read_trace(ref, out_dir, where, n), empty=dict)

def _hidden(reply: dict, request: Request, out_dir: str, rows: int, decode_rows) -> tuple[Any, Any]:
    """The reply's hidden rows (an engine that claims hidden_states, asked with the request's "hidden"
    flag): "hidden" [rows, H] and "decode_hidden" like "decode_logits"; (None, None) when not asked."""
    if not request.hidden:
        return None, None
    if reply.get("hidden") is None:
        raise ProtocolError("the run reply lacks the required field 'hidden' (the request asks for hidden states)")
    hidden = read_array(reply["hidden"], out_dir, "run reply 'hidden'", rows)
    if decode_rows is None:  # no decode steps: a decode_hidden is ignored
        return hidden, None
    if reply.get("decode_hidden") is None:
        raise ProtocolError("the run reply lacks the required field 'decode_hidden' (the request asks for hidden "
                            "states and has decode steps)")
    return hidden, _decode_arrays(reply.get("decode_hidden"), decode_rows, len(request.sequences), "decode_hidden",
                                  lambda ref, where, n: read_array(ref, out_dir, where, n),
                                  empty=lambda: np.empty((0, hidden.shape[1]), dtype=hidden.dtype))
