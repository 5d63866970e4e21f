"""The wire format of the subprocess protocol ``gemma4-conformance-subprocess`` (docs/subprocess-protocol.md),
both ends: what the harness's client writes and reads, and what the reference server reads and writes.

* requests: ``request_to_json(request, out_dir)`` (client) and ``request_from_json(d, out_dir)`` (server);
  input arrays (embeddings, audio features and masks) travel as raw little-endian float64 files in
  ``out_dir`` (``read_input_array``);
* replies: logits travel as ARRAY files (``write_array`` on the server, ``read_array`` on the client,
  checked against ``expected_rows``); ``capabilities_from_json`` reads a hello reply's capabilities;
* the errors the client raises from ``run`` (``EngineFailure`` and its kinds), each a case's error.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from refimpl.errors import check_choice
from refimpl.safetensors_io import STORAGE, bf16_to_f32, read_header, write_safetensors

from .types import AudioInput, Capabilities, CaseTimeout, ImageInput, MtpRequest, MtpResponse, MtpRound, Piece, Request

PROTOCOL = "gemma4-conformance-subprocess"
VERSIONS = (1,)  # the protocol versions spoken (the client offers them in hello, the server answers one)
RAW_DTYPES = {"float64": np.dtype("<f8"), "float32": np.dtype("<f4"), "float16": np.dtype("<f2"),
              "bfloat16": np.dtype("<u2")}
ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
CAPABILITY_FIELDS = tuple(f.name for f in fields(Capabilities))  # what the harness reads from hello
# the capability fields of protocol version 1, frozen: a v1 engine must give each of them in hello. A
# field added to Capabilities later (image_prompts, audio_prompts, audio_tower, image_tower) is optional on the wire
# (absent: its default, i.e. not claimed), so that a new flag never breaks a v1 engine (docs/subprocess-protocol.md,
# Versioning). hidden_states likewise: the request's "hidden" flag and the reply's "hidden" / "decode_hidden"
# ARRAYs exist only between a client and an engine that claims it; traces too (the request's "trace" flag, the
# reply's "trace" / "decode_trace" maps of point name -> ARRAY).
V1_CAPABILITY_FIELDS = ("full_forward", "last_plain", "last_seq_id", "last_embeddings", "embedding_convention",
                        "interior_rows", "output_rows", "ubatch", "chunked_prefill", "multi_sequence", "decode",
                        "default_profile")


# ----------------------------------------------------------------------------------------------
# errors (a run() error becomes status "error" for that case, with "<Type>: <message>")


class EngineFailure(RuntimeError):
    """Base class of what the subprocess backend raises from run()."""


class EngineError(EngineFailure):
    """The engine answered ``ok: false``."""


class EngineCrash(EngineFailure):
    """The engine process died (or could not be restarted)."""


class EngineTimeout(EngineFailure, CaseTimeout):
    """The engine did not answer in time; its process group was killed."""


class ProtocolError(EngineFailure):
    """The engine broke the protocol (not JSON on stdout, a wrong id, a missing or malformed field)."""


class ArrayError(EngineFailure):
    """An ARRAY in a reply cannot be read, or does not have the shape the request defines."""


def clip_text(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[:n] + f"... ({len(text)} characters)"


# ----------------------------------------------------------------------------------------------
# requests (client -> server)


def _embeddings_json(embeddings: Any, out_dir: str | Path, name: str) -> dict[str, Any]:
    """Input embeddings written into out_dir as raw float64; returns their ARRAY reference."""
    emb = np.ascontiguousarray(embeddings, dtype="<f8")
    emb.tofile(Path(out_dir) / name)
    return {"path": name, "format": "raw", "dtype": "float64", "shape": list(emb.shape)}


def _audio_input_json(clip: Any, out_dir: str | Path, k: int) -> dict[str, Any]:
    """One audio clip's ``features`` [T, F] and frame ``mask`` [T] (1.0 = real frame, 0.0 = padding)
    written into out_dir as raw float64 (``audio<k>.features.f64``, ``audio<k>.mask.f64``)."""
    features = np.asarray(clip.features)
    mask = np.asarray(clip.mask)
    if features.ndim != 2 or mask.shape != features.shape[:1]:
        raise ValueError(f"audio_inputs[{k}]: features {features.shape} and mask {mask.shape} must be [T, F] and [T]")
    return {"features": _embeddings_json(features, out_dir, f"audio{k}.features.f64"),
            "mask": _embeddings_json(mask.astype(bool).astype("<f8"), out_dir, f"audio{k}.mask.f64")}


def _image_input_json(image: Any, out_dir: str | Path, k: int) -> dict[str, Any]:
    """One image's ``pixel_values`` [R, C] and ``positions`` [R, 2] written into out_dir as raw float64
    (``image<k>.pixel_values.f64``, ``image<k>.positions.f64``; positions are small integers, exact)."""
    pv, pos = np.asarray(image.pixel_values), np.asarray(image.positions)
    if pv.ndim != 2 or pos.shape != (pv.shape[0], 2):
        raise ValueError(f"image_inputs[{k}]: pixel_values {pv.shape} and positions {pos.shape} must be [R, C] and "
                         "[R, 2]")
    return {"pixel_values": _embeddings_json(pv, out_dir, f"image{k}.pixel_values.f64"),
            "positions": _embeddings_json(pos.astype("<f8"), out_dir, f"image{k}.positions.f64")}


def request_to_json(request: Request, out_dir: str | Path) -> dict[str, Any]:
    """The wire form of a Request (every field present); embeddings (the ``last`` request's and, for
    image and audio prompts, each piece's) are written to out_dir as raw float64 (``embeddings.f64``,
    ``piece<i>.embeddings.f64``), and so are the audio clips' features and masks
    (``audio<k>.features.f64``, ``audio<k>.mask.f64``)."""
    multi = request.kind == "multi"
    d: dict[str, Any] = {
        "kind": request.kind,
        "tokens": [int(t) for t in request.tokens],
        "entry": request.entry,
        "last_pos": int(request.last_pos),
        "seq_id": None if request.seq_id is None else int(request.seq_id),
        "pieces": [{"tokens": [int(t) for t in p.tokens], "rows": [int(r) for r in p.rows],
                    "embeddings": (None if p.embeddings is None
                                   else _embeddings_json(p.embeddings, out_dir, f"piece{i}.embeddings.f64"))}
                   for i, p in enumerate(request.pieces)],
        "ubatch": None if request.ubatch is None else int(request.ubatch),
        "sequences": [[int(t) for t in s] for s in request.sequences],
        "seq_ids": [int(s) for s in request.seq_ids],
        "decode": ([[int(t) for t in s] for s in request.decode] if multi
                   else [int(t) for t in request.decode]),
        "embeddings": None,
        "images": [[int(start), int(n)] for start, n in request.images],
        "audio": [[int(start), int(n)] for start, n in request.audio],
        "audio_inputs": [_audio_input_json(clip, out_dir, k) for k, clip in enumerate(request.audio_inputs)],
        "image_inputs": [_image_input_json(image, out_dir, k) for k, image in enumerate(request.image_inputs)],
        "videos": [[int(first), int(n)] for first, n in request.videos],
        "hidden": bool(request.hidden),
        "trace": bool(request.trace),
        "drafter": request.drafter,
        "mtp": _mtp_json(request.mtp),
        "mtp_batch": [_mtp_json(m) for m in request.mtp_batch],  # (after v1: batched MTP)
    }
    if request.embeddings is not None:
        d["embeddings"] = _embeddings_json(request.embeddings, out_dir, "embeddings.f64")
    return d


def read_input_array(ref: dict, out_dir: Path) -> np.ndarray:
    """An ARRAY the client wrote (the ``last`` request's or a piece's embeddings, an audio clip's features or
    mask): raw little-endian, C order."""
    if ref.get("format") != "raw":
        raise ValueError(f"only raw input arrays are supported, got format {ref.get('format')!r}")
    path = Path(out_dir) / ref["path"]  # an absolute path stays absolute
    x = np.fromfile(path, dtype=RAW_DTYPES[ref["dtype"]]).reshape(ref["shape"])
    if ref["dtype"] == "bfloat16":
        x = bf16_to_f32(x)
    return x.astype(np.float64)


def request_from_json(d: dict, out_dir: Path) -> Request:
    kind = d["kind"]
    decode = d.get("decode") or []
    if kind == "multi":
        decode = tuple(tuple(int(t) for t in seq) for seq in decode)
    else:
        decode = tuple(int(t) for t in decode)
    embeddings = read_input_array(d["embeddings"], out_dir) if d.get("embeddings") else None
    # image prompts (fields added after v1, absent from older clients): each piece's embeddings, and
    # the image blocks as [first position, soft tokens]
    pieces = tuple(Piece(tuple(int(t) for t in p["tokens"]), tuple(int(r) for r in p["rows"]),
                         embeddings=read_input_array(p["embeddings"], out_dir) if p.get("embeddings") else None)
                   for p in d.get("pieces") or ())
    images = tuple((int(start), int(n)) for start, n in d.get("images") or ())
    # audio prompts (likewise after v1): the audio blocks, and each clip's features and frame mask
    audio = tuple((int(start), int(n)) for start, n in d.get("audio") or ())
    audio_inputs = tuple(AudioInput(read_input_array(a["features"], out_dir), read_input_array(a["mask"], out_dir) != 0)
                         for a in d.get("audio_inputs") or ())
    videos = tuple((int(first), int(n)) for first, n in d.get("videos") or ())  # after v1: absent means none
    image_inputs = tuple(ImageInput(read_input_array(a["pixel_values"], out_dir),
                                    read_input_array(a["positions"], out_dir).astype(np.int64))
                         for a in d.get("image_inputs") or ())
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
        image_inputs=image_inputs,
        videos=videos,
        hidden=bool(d.get("hidden", False)),  # after v1: absent means not asked
        trace=bool(d.get("trace", False)),  # likewise
        drafter=d.get("drafter"),  # mtp requests (after v1)
        mtp=_mtp_request(d.get("mtp")),
        mtp_batch=tuple(_mtp_request(m) for m in d.get("mtp_batch") or ()),  # after v1
    )


def _mtp_json(m: MtpRequest | None) -> dict | None:
    if m is None:
        return None
    return {"mode": m.mode, "convention": m.convention, "num_drafts": int(m.num_drafts),
            "max_new_tokens": int(m.max_new_tokens),
            "rounds": [{"token": int(r.token), "drafts": [int(t) for t in r.drafts], "accepted": int(r.accepted)}
                       for r in m.rounds]}


def _mtp_request(d: Any) -> MtpRequest | None:
    if d is None:
        return None
    return MtpRequest(mode=d["mode"], convention=d["convention"], num_drafts=int(d["num_drafts"]),
                      max_new_tokens=int(d["max_new_tokens"]),
                      rounds=tuple(MtpRound(int(r["token"]), tuple(int(t) for t in r["drafts"]), int(r["accepted"]))
                                   for r in d.get("rounds") or ()))


def mtp_reply(out_dir: Path, mtp: MtpResponse, fmt: str, prefix: str = "") -> dict:
    """The reply's "mtp" object (server side): tokens as JSON, each round's logits as ARRAY files (their names
    after ``prefix``: a batched reply's sequence)."""
    def arrays(name: str, rows: list | None) -> list | None:
        return None if rows is None else [write_array(out_dir, f"{prefix}{name}.{r}", a, fmt)
                                          for r, a in enumerate(rows)]

    return {"output": [int(t) for t in mtp.output], "accepted": [int(a) for a in mtp.accepted],
            "drafts": [[int(t) for t in d] for d in mtp.drafts],
            "draft_logits": arrays("draft_logits", mtp.draft_logits),
            "verify_logits": arrays("verify_logits", mtp.verify_logits),
            "verify_hidden": arrays("verify_hidden", mtp.verify_hidden)}


# ----------------------------------------------------------------------------------------------
# replies (server -> client)


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
        path = f"{name}.safetensors"
        data = x.astype(np.float32) if dtype == "bfloat16" else x  # rounds exactly back to the same bf16
        write_safetensors(out_dir / path, {name: data}, dtype=ST_DTYPES[dtype])
        return {"path": path, "format": "safetensors", "tensor": name}
    path = f"{name}.bin"
    data = x.view(np.uint16) if dtype == "bfloat16" else x
    data.astype(RAW_DTYPES[dtype], copy=False).tofile(out_dir / path)
    return {"path": path, "format": "raw", "dtype": dtype, "shape": list(x.shape)}


def write_trace(out_dir: Path, name: str, trace: dict[str, Any], fmt: str) -> dict[str, dict]:
    """A trace map (point name -> [rows, ...]) as a map of ARRAY references, one file per point."""
    return {point: write_array(out_dir, f"{name}.{point}", value, fmt) for point, value in trace.items()}


def read_trace(refs: Any, out_dir: str | Path, where: str, rows: int) -> dict[str, np.ndarray]:
    """A reply's trace map (point name -> ARRAY), each array read and checked to have ``rows`` rows."""
    if not isinstance(refs, dict):
        raise ArrayError(f"{where}: expected an object of point name -> ARRAY, got {clip_text(repr(refs))}")
    return {str(point): read_array(ref, out_dir, f"{where}[{point!r}]", rows) for point, ref in refs.items()}


def jsonable(x: Any, depth: int = 0) -> Any:
    """A backend's ``executed`` record as plain JSON values (numpy arrays and scalars converted; anything
    else, or nesting deeper than 8, as its repr)."""
    if depth > 8:
        return repr(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v, depth + 1) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist(), depth + 1)
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    return repr(x)


def expected_rows(request: Request) -> tuple[int, int | list[int] | None]:
    """(rows of ``logits``, rows of ``decode_logits``: an int, a list per sequence for multi, or None)."""
    if request.kind == "full":
        rows = len(request.tokens)
    elif request.kind == "mtp" and request.mtp_batch:
        rows = len(request.sequences)
    elif request.kind in ("last", "mtp"):
        rows = 1
    elif request.kind == "prefill":
        rows = sum(len(p.rows) for p in request.pieces)
    else:
        rows = len(request.sequences)
    if not request.decode:
        return rows, None
    if request.kind == "multi":
        return rows, [len(d) for d in request.decode]
    return rows, len(request.decode)


def read_array(ref: Any, out_dir: str | Path, where: str, rows: int | None = None,
               vocab: int | None = None) -> np.ndarray:
    """Read and check one ARRAY reference (ArrayError naming ``where``, the file and what was expected).

    ``rows`` / ``vocab``: the shape the request defines ([rows, vocab]); None = not checked.
    Raw float16/32/64 come back in their dtype, raw or safetensors bfloat16 as float32 (exact).
    """
    if not isinstance(ref, dict):
        raise ArrayError(f"{where}: expected an ARRAY object ({{\"path\", \"format\", ...}}), got "
                         f"{clip_text(repr(ref))}")
    path_s, fmt = ref.get("path"), ref.get("format")
    if not isinstance(path_s, str) or not path_s:
        raise ArrayError(f"{where}: the ARRAY has no 'path' string: {ref!r}")
    if fmt not in ("raw", "safetensors"):
        raise ArrayError(f"{where}: 'format' must be \"raw\" or \"safetensors\", got {fmt!r}")
    root = Path(out_dir).resolve()
    path = Path(path_s)
    if not path.is_absolute():
        path = (root / path).resolve()
        if root != path and root not in path.parents:
            raise ArrayError(f"{where}: relative path {path_s!r} points outside out_dir {root}")
    if not path.is_file():
        raise ArrayError(f"{where}: file {path} does not exist")
    size = path.stat().st_size
    if fmt == "raw":
        dtype_s, shape = ref.get("dtype"), ref.get("shape")
        check_choice("raw dtype", dtype_s, RAW_DTYPES, who=f"{where}: {path}", error=ArrayError)
        _check_shape(where, path, shape, rows, vocab)
        dt = RAW_DTYPES[dtype_s]
        need = math.prod(shape) * dt.itemsize
        if size != need:
            raise ArrayError(f"{where}: {path} has {size} bytes, but shape {list(shape)} of {dtype_s} needs "
                             f"exactly {need} bytes")
        x = np.fromfile(path, dtype=dt).reshape(shape)
        return bf16_to_f32(x) if dtype_s == "bfloat16" else x
    tensor = ref.get("tensor")
    if not isinstance(tensor, str) or not tensor:
        raise ArrayError(f"{where}: a safetensors ARRAY needs a 'tensor' name: {ref!r}")
    try:
        infos = read_header(path)
    except Exception as exc:  # noqa: BLE001 - WeightsError with the file's problem
        raise ArrayError(f"{where}: {exc}") from None
    if tensor not in infos:
        raise ArrayError(f"{where}: {path} has no tensor {tensor!r} (it holds: {', '.join(sorted(infos)) or 'none'})")
    info = infos[tensor]
    if info.dtype not in ST_DTYPES.values():
        raise ArrayError(f"{where}: {path}: tensor {tensor!r} is {info.dtype}; logits must be one of "
                         f"{', '.join(ST_DTYPES.values())}")
    _check_shape(where, f"{path} tensor {tensor!r}", list(info.shape), rows, vocab)
    with open(path, "rb") as f:
        f.seek(info.begin)
        blob = f.read(info.end - info.begin)
    x = np.frombuffer(blob, dtype=STORAGE[info.dtype]).reshape(info.shape).copy()
    return bf16_to_f32(x) if info.dtype == "BF16" else x


def _check_shape(where: str, what: Any, shape: Any, rows: int | None, vocab: int | None) -> None:
    if not (isinstance(shape, list) and len(shape) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise ArrayError(f"{where}: {what}: shape must be [rows, V] (two non-negative integers), got {shape!r}")
    want_r = "rows" if rows is None else rows
    want_v = "V" if vocab is None else vocab
    if (rows is not None and shape[0] != rows) or (vocab is not None and shape[1] != vocab):
        raise ArrayError(f"{where}: {what} has shape {shape}, but the request defines [{want_r}, {want_v}]")


def mtp_from_reply(d: Any, request: Request, out_dir: str | Path, vocab: int | None) -> MtpResponse:
    """The reply's "mtp" object (client side), every round's arrays checked against the request
    (ProtocolError / ArrayError naming the field)."""
    if not isinstance(d, dict):
        raise ProtocolError(f"the run reply of an mtp request needs an 'mtp' object, got {clip_text(repr(d))}")
    for key in ("output", "accepted", "drafts"):
        v = d.get(key)
        if not isinstance(v, list):
            raise ProtocolError(f"the run reply's mtp.{key} must be a list, got {clip_text(repr(v))}")
    try:
        output = tuple(int(t) for t in d["output"])
        accepted = [int(a) for a in d["accepted"]]
        drafts = [tuple(int(t) for t in x) for x in d["drafts"]]
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"the run reply's mtp tokens must be integers ({exc})") from None
    ks = [len(r.drafts) for r in request.mtp.rounds] if request.mtp.mode == "rounds" else None

    def rounds(key: str, extra: int, width: int | None) -> list[np.ndarray] | None:
        refs = d.get(key)
        if refs is None:
            return None
        if not isinstance(refs, list) or (ks is not None and len(refs) != len(ks)):
            raise ProtocolError(f"the run reply's mtp.{key} must be a list of one ARRAY per round "
                                f"({len(ks) if ks else 'the rounds run'}), got {clip_text(repr(refs))}")
        return [read_array(ref, out_dir, f"run reply 'mtp.{key}'[{r}]", None if ks is None else ks[r] + extra, width)
                for r, ref in enumerate(refs)]

    return MtpResponse(output=output, accepted=accepted, drafts=drafts, draft_logits=rounds("draft_logits", 0, vocab),
                       verify_logits=rounds("verify_logits", 1, vocab), verify_hidden=rounds("verify_hidden", 1, None))


def capabilities_from_json(raw: Any) -> Capabilities:
    """Capabilities from a hello reply: every field of V1_CAPABILITY_FIELDS required; a field added
    after v1 takes its Capabilities default when absent; unknown fields ignored."""
    required = V1_CAPABILITY_FIELDS
    if not isinstance(raw, dict):
        raise ValueError(f"'capabilities' must be an object with the fields {', '.join(required)}, "
                         f"got {clip_text(repr(raw))}")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"'capabilities' lacks {', '.join(missing)} (a v1 engine gives every field: "
                         f"{', '.join(required)})")
    values = {}
    for f in fields(Capabilities):
        k = f.name
        if k not in raw:
            continue  # a field newer than the engine's protocol: its default (not claimed)
        v = raw[k]
        if isinstance(f.default, str):
            if not isinstance(v, str):
                raise ValueError(f"capabilities.{k} must be a string, got {v!r}")
        elif isinstance(f.default, bool) and not isinstance(v, bool):
            raise ValueError(f"capabilities.{k} must be true or false, got {v!r}")
        if k == "top_logprobs" and v:  # (rows as top-k logprobs, Response.logprobs)
            raise ValueError("capabilities.top_logprobs must be false over this protocol, whose replies carry logits "
                             "rows")
        values[k] = v
    if values.get("embedding_convention", "scaled") not in ("scaled", "raw"):
        raise ValueError(f"capabilities.embedding_convention must be \"scaled\" or \"raw\", "
                         f"got {values['embedding_convention']!r}")
    return Capabilities(**values)


