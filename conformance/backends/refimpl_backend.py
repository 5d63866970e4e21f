"""The ``refimpl`` oracle as a conformance backend.

It serves every request kind the way an engine would (micro-batches through a KV cache, only the
requested rows through the LM head, one cache per sequence id, decode one token at a time) but with
the exact float64 forward of ``refimpl.model.Gemma4``. Against the bundled fixture sets it must pass
every case with the ``exact-f64`` profile; it is the harness's own self-check.

``RefimplBackend(dtype="float32")`` (or ``RefimplFloat32Backend()``) runs every weight and
activation in float32, which makes it a stand-in for a float32 engine (default profile ``fp32``);
``embed_scale="bf16"`` uses sqrt(H) rounded to bfloat16 as some engines do.

    conformance check --backend refimpl
    conformance check --backend conformance.backends.refimpl_backend:RefimplFloat32Backend
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from conformance.backend import BackendError, Capabilities, Request, Response

__all__ = ["RefimplBackend", "RefimplFloat32Backend"]


def check_options(who: str, dtype: str, embed_scale: str) -> tuple[str, str]:
    """Validate the NumPy backends' options; returns (dtype name, embed_scale)."""
    dt = np.dtype(dtype)
    if dt not in (np.float64, np.float32):
        raise ValueError(f"{who}: dtype must be 'float64' or 'float32', got {dtype!r}")
    if embed_scale not in ("exact", "bf16"):
        raise ValueError(f"{who}: embed_scale must be 'exact' or 'bf16', got {embed_scale!r}")
    return dt.name, embed_scale


def all_capabilities(default_profile: str) -> Capabilities:
    """Every capability of the protocol, with scaled embeddings (the NumPy backends claim all)."""
    return Capabilities(
        full_forward=True, last_plain=True, last_seq_id=True, last_embeddings=True,
        embedding_convention="scaled", interior_rows=True, output_rows=True, ubatch=True,
        chunked_prefill=True, multi_sequence=True, decode=True, default_profile=default_profile,
    )


class RefimplBackend:
    """The exact NumPy oracle behind the backend protocol (``conformance.backend.Backend``).

    Options: ``dtype`` ("float64" or "float32"), ``embed_scale`` ("exact" or "bf16"),
    ``default_profile`` (default: "exact-f64" for float64, "fp32" for float32).
    """

    def __init__(self, dtype: str = "float64", embed_scale: str = "exact", default_profile: str | None = None):
        self.dtype, self.embed_scale = check_options("refimpl backend", dtype, embed_scale)
        name = "refimpl" if self.dtype == "float64" else "refimpl-float32"
        self.name = name if embed_scale == "exact" else f"{name}-bf16-scale"
        if default_profile is None:
            default_profile = "exact-f64" if self.dtype == "float64" and embed_scale == "exact" else "fp32"
        self.capabilities = all_capabilities(default_profile)
        self.model = None
        self._states: dict[Any, Any] = {}

    # -- protocol -------------------------------------------------------------------------------

    def open(self, model_dir: Path) -> None:
        from refimpl import Gemma4, RefimplError

        try:
            self.model = Gemma4(model_dir, dtype=self.dtype, embed_scale=self.embed_scale)
        except (RefimplError, OSError) as exc:
            raise BackendError(f"refimpl backend cannot open {model_dir}: {exc}") from exc

    def close(self) -> None:
        self.model = None
        self._states = {}

    def run(self, request: Request) -> Response:
        if self.model is None:
            raise RuntimeError("refimpl backend: run() called before open()")
        self._states = {}  # fresh state per request: nothing survives from an earlier one
        try:
            handler = {"full": self._full, "last": self._last, "prefill": self._prefill,
                       "multi": self._multi}[request.kind]
            return handler(request)
        finally:
            self._states = {}

    # -- helpers --------------------------------------------------------------------------------

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """Input embeddings in this backend's convention ("scaled"): E[ids] * sqrt(H), float64."""
        if self.model is None:
            raise RuntimeError("refimpl backend: embed() called before open()")
        return np.asarray(self.model.embed(self.model.check_ids(ids)), dtype=np.float64)

    def _state(self, key: Any):
        from refimpl import KVCache

        if key not in self._states:
            self._states[key] = KVCache()
        return self._states[key]

    def _forward(self, tokens: Sequence[int], rows: list[int], cache, embeddings=None) -> np.ndarray:
        return self.model.forward(np.asarray(tokens, dtype=np.int64), rows=rows, cache=cache,
                                  embeddings=embeddings)

    def _decode(self, cache, tokens: Sequence[int]) -> np.ndarray:
        """Teacher-forced decode: one token per call through the cache, the (only) row each time."""
        V = self.model.cfg.vocab_size
        out = np.empty((len(tokens), V), dtype=self.model.dtype)
        for j, tok in enumerate(tokens):
            out[j] = self._forward([int(tok)], [0], cache)[0]
        return out

    def _executed(self, path: str, **extra) -> dict[str, Any]:
        return {"path": path, "dtype": self.dtype, "embed_scale": self.embed_scale, "fresh_state": True, **extra}

    @staticmethod
    def _check_tokens(tokens: Sequence[int], what: str) -> None:
        if len(tokens) == 0:
            raise ValueError(f"refimpl backend: {what} has no tokens")

    # -- request kinds --------------------------------------------------------------------------

    def _full(self, request: Request) -> Response:
        self._check_tokens(request.tokens, "full request")
        cache = self._state(None)
        logits = self._forward(request.tokens, list(range(len(request.tokens))), cache)
        decode = self._decode(cache, request.decode) if request.decode else None
        return Response(logits, decode, self._executed(
            "full", rows=len(request.tokens), state_len_after_prefill=len(request.tokens),
            decode_steps=len(request.decode)))

    def _last(self, request: Request) -> Response:
        T = len(request.tokens)
        self._check_tokens(request.tokens, "last request")
        if not 0 <= request.last_pos < T:
            raise ValueError(f"refimpl backend: last_pos {request.last_pos} is outside the {T} tokens of the call")
        embeddings = None
        if request.entry == "embeddings":
            if request.embeddings is None:
                raise ValueError("refimpl backend: entry 'embeddings' without embeddings")
            embeddings = np.asarray(request.embeddings)
        key = None if request.entry == "plain" else ("seq", request.seq_id)
        cache = self._state(key)
        logits = self._forward(request.tokens, [request.last_pos], cache, embeddings=embeddings)
        decode = self._decode(cache, request.decode) if request.decode else None
        return Response(logits, decode, self._executed(
            "last", entry=request.entry, seq_id=request.seq_id, last_pos=request.last_pos,
            single_row_head=True, state_len_after_prefill=cache.length - len(request.decode),
            decode_steps=len(request.decode)))

    def _prefill(self, request: Request) -> Response:
        if not request.pieces:
            raise ValueError("refimpl backend: prefill request has no pieces")
        if request.ubatch is not None and request.ubatch < 1:
            raise ValueError(f"refimpl backend: ubatch must be >= 1, got {request.ubatch}")
        cache = self._state(None)
        out: list[np.ndarray] = []
        pieces_done = []
        for p, piece in enumerate(request.pieces):
            T = len(piece.tokens)
            self._check_tokens(piece.tokens, f"piece {p}")
            rows = [int(r) for r in piece.rows]
            if any(not 0 <= r < T for r in rows) or any(b <= a for a, b in zip(rows, rows[1:])):
                raise ValueError(f"refimpl backend: piece {p} rows {rows} must be increasing within [0, {T})")
            size = request.ubatch or T
            ubatches = []
            for start in range(0, T, size):
                stop = min(start + size, T)
                local = [r - start for r in rows if start <= r < stop]
                # a micro-batch with no output row still writes K/V for all its tokens (rows=[])
                out.append(self._forward(piece.tokens[start:stop], local, cache))
                ubatches.append({"tokens": stop - start, "outputs": len(local)})
            pieces_done.append({"tokens": T, "rows": rows, "ubatches": ubatches})
        V = self.model.cfg.vocab_size
        logits = np.concatenate(out) if out else np.empty((0, V), dtype=self.model.dtype)
        state_len = cache.length
        decode = self._decode(cache, request.decode) if request.decode else None
        return Response(logits, decode, self._executed(
            "prefill", ubatch=request.ubatch, pieces=pieces_done,
            ubatches=[u["tokens"] for piece in pieces_done for u in piece["ubatches"]],
            state_len_after_prefill=state_len, decode_steps=len(request.decode)))

    def _multi(self, request: Request) -> Response:
        n = len(request.sequences)
        if n == 0:
            raise ValueError("refimpl backend: multi request has no sequences")
        seq_ids = tuple(request.seq_ids) if request.seq_ids else tuple(range(n))
        if len(seq_ids) != n:
            raise ValueError(f"refimpl backend: {n} sequences but {len(seq_ids)} seq_ids")
        if len(set(seq_ids)) != n:
            raise ValueError(f"refimpl backend: seq_ids {list(seq_ids)} are not distinct")
        decode = tuple(tuple(d) for d in request.decode) if request.decode else ()
        if decode and len(decode) != n:
            raise ValueError(f"refimpl backend: {n} sequences but {len(decode)} decode lists")
        caches = []
        rows = []
        for i, (sid, tokens) in enumerate(zip(seq_ids, request.sequences)):
            self._check_tokens(tokens, f"sequence {i}")
            cache = self._state(("seq", sid))
            rows.append(self._forward(tokens, [len(tokens) - 1], cache))
            caches.append(cache)
        logits = np.concatenate(rows)
        state_lens = [c.length for c in caches]
        decode_logits = None
        if decode:
            # decode steps interleaved across the sequences, as a server batches them; each
            # sequence only ever reads its own cache
            V = self.model.cfg.vocab_size
            decode_logits = [np.empty((len(d), V), dtype=self.model.dtype) for d in decode]
            for j in range(max(len(d) for d in decode)):
                for i, d in enumerate(decode):
                    if j < len(d):
                        decode_logits[i][j] = self._forward([int(d[j])], [0], caches[i])[0]
        return Response(logits, decode_logits, self._executed(
            "multi", seq_ids=list(seq_ids), state_len_after_prefill=state_lens,
            decode_steps=[len(d) for d in decode] if decode else 0))


class RefimplFloat32Backend(RefimplBackend):
    """The oracle run in float32 throughout: a stand-in for a float32 engine (profile ``fp32``)."""

    def __init__(self, embed_scale: str = "exact", default_profile: str | None = None):
        super().__init__(dtype="float32", embed_scale=embed_scale, default_profile=default_profile)
