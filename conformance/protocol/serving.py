"""Request serving shared by the backends that drive one model through per-sequence caches.

:class:`CachedBackend` answers the four request kinds of the backend protocol
(``conformance.protocol``) the way a serving stack does, whatever the engine underneath:

* ``full``: one forward over every token, every row out.
* ``last``: one forward through a cache (a fresh one; keyed by ``seq_id`` for the ``seq_id`` and
  ``embeddings`` entries), only the ``last_pos`` row out.
* ``prefill``: every piece, and with ``ubatch`` every micro-batch of a piece (:func:`micro_batches`),
  is one forward that continues the same cache, with that forward's own output rows; a micro-batch
  with no output row still runs its forward, so its tokens enter the cache.
* ``multi``: one cache per sequence id, each sequence prefilled on its own, the last row of each out;
  decode steps are interleaved across the sequences, as a server batches them, and each sequence
  only ever reads and writes its own cache.
* decode (any kind): teacher-forced, one token per forward through the cache the prefill left.
* image and audio prompts (``request.images``, ``request.audio``): the ``last`` forward, or each
  prefill piece's forward, gets its embeddings and the blocks that fall in it (``images`` and
  ``audio``: ``(start, length)`` within the forward's tokens; ``audio_inputs``: the features of those
  audio blocks; ``image_inputs``, only for a backend that claims ``image_tower``: the patches and
  positions of those image blocks); a block that straddles two pieces, or media with ``ubatch``, are
  refused.

Every request starts from no state at all and leaves none behind. The requests are validated here
(errors name the backend: ``f"{who}: ..."``) and the shared part of each ``executed`` record is
built here (``pieces``, ``ubatches``, ``seq_ids``, ``state_len_after_prefill``, ``decode_steps``).

A subclass is the engine. It sets ``who`` (the name in error messages), sets ``model`` in ``open()``
(None while closed) and implements the hooks: :meth:`~CachedBackend._new_state`,
:meth:`~CachedBackend._state_len`, :meth:`~CachedBackend._forward` (logits of the requested rows plus
the engine's notes on that forward), ``vocab_size``, ``hidden_size``, ``out_dtype`` and
:meth:`~CachedBackend._executed`; optionally :meth:`~CachedBackend._forward_all` (the full forward)
and :meth:`~CachedBackend._notes` (engine-specific keys of a request's ``executed`` record).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Any, Callable

import numpy as np

from .trace import check_trace, trace_rows
from .types import Request, Response

__all__ = ["CachedBackend", "block_token_problem", "check_mtp_generate", "micro_batches"]


def micro_batches(T: int, rows: Sequence[int], ubatch: int | None) -> Iterator[tuple[int, int, list[int]]]:
    """Split a T-token piece into micro-batches of ``ubatch`` tokens (the whole piece when None).

    Yields ``(start, stop, local)`` per micro-batch: its token range ``[start, stop)`` within the
    piece and its output rows ``local``, the piece's ``rows`` that fall in the range, counted from
    ``start``. ``local`` may be empty.
    """
    size = ubatch or T
    for start in range(0, T, size):
        stop = min(start + size, T)
        yield start, stop, [r - start for r in rows if start <= r < stop]


def per_sequence(notes: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The notes of one forward per sequence as one list per key, in sequence order."""
    return {key: [n[key] for n in notes] for key in notes[0]} if notes else {}


def check_multi(request: Request, who: str) -> tuple[tuple, tuple]:
    """A ``multi`` request's (seq_ids, decode lists), checked; seq_ids default to 0..n-1. ``who`` opens
    every error message (shared with backends that do not derive from CachedBackend)."""
    n = len(request.sequences)
    if n == 0:
        raise ValueError(f"{who}: multi request has no sequences")
    seq_ids = tuple(request.seq_ids) if request.seq_ids else tuple(range(n))
    if len(seq_ids) != n:
        raise ValueError(f"{who}: {n} sequences but {len(seq_ids)} seq_ids")
    if len(set(seq_ids)) != n:
        raise ValueError(f"{who}: seq_ids {list(seq_ids)} are not distinct")
    decode = tuple(tuple(d) for d in request.decode) if request.decode else ()
    if decode and len(decode) != n:
        raise ValueError(f"{who}: {n} sequences but {len(decode)} decode lists")
    for i, tokens in enumerate(request.sequences):
        if len(tokens) == 0:
            raise ValueError(f"{who}: sequence {i} has no tokens")
    return seq_ids, decode


def check_mtp_generate(request: Request, who: str, convention: str, how: str) -> None:
    """ValueError naming ``who`` unless ``request`` is an MTP request in mode ``generate`` under ``convention``
    with a drafter: what a backend that runs its engine's own assisted loop (``how``) serves."""
    spec = request.mtp
    if spec is None:
        raise ValueError(f"{who}: an mtp request needs its MtpRequest (request.mtp)")
    if spec.mode != "generate" or spec.convention != convention:
        raise ValueError(f"{who}: serves MTP requests in mode 'generate' with convention {convention} ({how}), got "
                         f"mode {spec.mode!r} with convention {spec.convention!r}")
    if not request.drafter:
        raise ValueError(f"{who}: an mtp request needs the drafter's directory (request.drafter)")


def block_token_problem(ids: Sequence[int], start: int, n: int, what: str, token: int,
                        frame: int | None = None) -> str | None:
    """Why the ``what`` block (start, n) of ``ids`` does not hold only its placeholder ``token`` (an image block may
    be a video frame instead, holding only the video token ``frame``); None when it does. The engines' own check of
    a media request, one message for all of them."""
    run = {int(t) for t in ids[start:start + n]}
    if not run or run == {token} or (frame is not None and run == {frame}):
        return None
    return (f"the {what} block ({start}, {n}) holds tokens other than the {what} token {token}"
            + (f" (a video frame's: the video token {frame})" if frame is not None else ""))


def padded_clips(audio_inputs: Sequence[Any], who: str) -> tuple[np.ndarray, np.ndarray]:
    """A forward's audio clips as a feature extractor batches them: features ``[n, T, F]`` (float64) padded
    at the end with zero frames to the longest clip, and the frame mask ``[n, T]`` (True at valid frames).
    ValueError naming ``who`` for a clip that is not ``[T, F]`` with a ``[T]`` mask (T >= 1), or clips of
    different feature widths."""
    feats, masks = [], []
    for k, clip in enumerate(audio_inputs):
        f, m = np.asarray(clip.features), np.asarray(clip.mask, dtype=bool)
        if f.ndim != 2 or m.shape != (f.shape[0],) or f.shape[0] < 1:
            raise ValueError(f"{who}: audio clip {k}: features {f.shape} and mask {m.shape} must be "
                             f"[T, F] and [T] (T >= 1)")
        feats.append(f)
        masks.append(m)
    widths = sorted({f.shape[1] for f in feats})
    if len(widths) != 1:
        raise ValueError(f"{who}: the audio clips have different feature widths {widths}")
    T = max(f.shape[0] for f in feats)
    x = np.zeros((len(feats), T, widths[0]), dtype=np.float64)
    mask = np.zeros((len(feats), T), dtype=bool)
    for b, (f, m) in enumerate(zip(feats, masks, strict=True)):
        x[b, :f.shape[0]], mask[b, :m.shape[0]] = f, m
    return x, mask


class CachedBackend:
    """The backend protocol (``run``) on top of a few engine hooks; see the module docstring.

    Subclasses call ``super().__init__()``, implement ``open()`` / ``close()`` (``close`` sets
    ``model`` back to None) and the hooks below.
    """

    who = "backend"  # the backend's name in error messages, e.g. "refimpl backend"

    def __init__(self) -> None:
        self.model: Any = None
        self.drafters: dict[str, Any] = {}  # the drafter of the last MTP request, by directory (own_mtp_drafter)
        self._states: dict[Any, Any] = {}
        self._hidden: list[np.ndarray] | None = None  # the hidden rows of the request being served
        self._decode_hidden: list[np.ndarray] | None = None  # multi: each sequence's decode hidden rows
        self._trace: list[dict[str, np.ndarray]] | None = None  # the traces of the request being served, per forward
        self._decode_trace: list[dict[str, np.ndarray]] | None = None  # multi: each sequence's decode trace

    # -- protocol -------------------------------------------------------------------------------


    def own_mtp_drafter(self, request: Request, convention: str, how: str, load: Callable[[str], Any]) -> Any:
        """The drafter of an MTP request served by the engine's own assisted loop (``how``), once the backend is
        open and the request is one it serves (``check_mtp_generate``): loaded by ``load(directory)`` and kept
        until a request names another."""
        if self.model is None:
            raise RuntimeError(f"{self.who}: run() called before open()")
        check_mtp_generate(request, self.who, convention, how)
        if request.drafter not in self.drafters:
            self.drafters = {request.drafter: load(request.drafter)}
        return self.drafters[request.drafter]
    def run(self, request: Request) -> Response:
        if self.model is None:
            raise RuntimeError(f"{self.who}: run() called before open()")
        self._states = {}  # fresh state per request: nothing survives from an earlier one
        self._hidden = [] if request.hidden and self.capabilities.hidden_states else None
        self._trace = [] if request.trace and getattr(self.capabilities, "traces", False) else None
        try:
            handler = {"full": self._full, "last": self._last, "prefill": self._prefill,
                       "multi": self._multi}[request.kind]
            return handler(request)
        finally:
            self._states = {}
            self._hidden = self._trace = None

    # -- engine hooks ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """V, the number of logits per row; by default that of ``self.text_config`` (the checkpoint's text config,
        refimpl's or the engine's own, which a backend that holds one sets at open)."""
        return self._text_size("vocab_size")

    @property
    def hidden_size(self) -> int:
        """H, the width of the input embeddings the ``embeddings`` entry takes; by default that of
        ``self.text_config``."""
        return self._text_size("hidden_size")

    def _text_size(self, name: str) -> int:
        cfg = getattr(self, "text_config", None)
        if cfg is None:
            raise NotImplementedError(f"{type(self).__name__} holds no text_config: it must define {name}")
        return int(getattr(cfg, name))

    @property
    def out_dtype(self) -> Any:
        """The NumPy dtype of the logits this backend returns (for the arrays built here)."""
        raise NotImplementedError

    def _new_state(self) -> Any:
        """An empty cache for one sequence."""
        raise NotImplementedError

    def _state_len(self, state: Any) -> int:
        """How many tokens ``state`` holds."""
        raise NotImplementedError

    def _forward(self, tokens: Sequence[int], rows: list[int], state: Any,
                 embeddings: np.ndarray | None = None,
                 images: Sequence[tuple[int, int]] = (), audio: Sequence[tuple[int, int]] = (),
                 audio_inputs: Sequence[Any] = ()) -> tuple[np.ndarray, dict[str, Any]]:
        """One forward of ``tokens`` continuing ``state`` (every token enters it, whatever ``rows``).
        A backend that claims ``image_tower`` also gets ``image_inputs`` (``ImageInput`` per image block;
        empty when the request carries none, e.g. one built by hand: then the given rows are all there is).

        ``rows`` are positions within ``tokens`` (increasing; may be empty); ``embeddings`` [T, H],
        when given, replace the token lookups. ``images``: the image blocks of this forward as
        ``(start, length)`` within ``tokens`` (their embeddings rows are soft tokens; see
        ``conformance.protocol``); ``audio`` likewise for audio blocks, with ``audio_inputs`` their
        ``AudioInput`` (features, mask) in order; only ever non-empty together with ``embeddings``. Returns (the logits
        of ``rows``, ``[len(rows), V]``,
        the engine's notes on this forward for the ``executed`` record: a dict, often empty).
        """
        raise NotImplementedError

    def _forward_all(self, tokens: Sequence[int], state: Any) -> tuple[np.ndarray, dict[str, Any]]:
        """The ``full`` request's forward: every row of ``tokens``."""
        return self._forward(tokens, list(range(len(tokens))), state)

    # A backend that claims ``hidden_states`` returns (logits, notes, hidden [len(rows), H]) from
    # ``_forward`` and ``_forward_all``: the final-norm hidden state of each returned row. One that claims
    # ``traces`` reads ``self._trace is not None`` (the request asks for traces) and then returns a fourth
    # element: its trace of the forward's rows, point name -> [len(rows), ...] (conformance.protocol.trace).

    def _forward_rows(self, out: tuple) -> tuple[np.ndarray, dict[str, Any]]:
        """A forward's (logits, notes); its hidden rows, when it gave them, go to ``self._hidden``, its trace
        to ``self._trace``."""
        if self._hidden is not None:
            if len(out) < 3 or out[2] is None:
                raise ValueError(f"{self.who}: claims hidden_states, but a forward returned no hidden states")
            self._hidden.append(np.asarray(out[2]))
        if self._trace is not None:
            rows = np.asarray(out[0]).shape[0]
            self._trace.append(check_trace(out[3] if len(out) > 3 and out[3] is not None else {}, rows, "trace"))
        return out[0], out[1]

    def _take_trace(self) -> dict[str, np.ndarray] | None:
        """The traces collected since the last take as one map (None when not asked)."""
        if self._trace is None:
            return None
        got, self._trace[:] = self._trace[:], []
        return trace_rows(got)

    def _decode_hidden_of(self, decode: np.ndarray | None) -> np.ndarray | None:
        """The decode steps' hidden rows (collected by ``_decode``), when asked and decoded."""
        return None if decode is None else self._take_hidden(decode.shape[0])

    def _decode_trace_of(self, decode: np.ndarray | None) -> dict[str, np.ndarray] | None:
        """The decode steps' trace (collected by ``_decode``), when asked and decoded."""
        return None if decode is None else self._take_trace()

    def _take_hidden(self, rows: int) -> np.ndarray | None:
        """The hidden rows collected since the last take, as one [rows, H] array (None when not asked)."""
        if self._hidden is None:
            return None
        got, self._hidden[:] = self._hidden[:], []
        out = np.concatenate(got) if got else np.empty((0, self.hidden_size), dtype=self.out_dtype)
        if out.shape[0] != rows:
            raise ValueError(f"{self.who}: {out.shape[0]} hidden rows for {rows} returned rows")
        return out

    def _executed(self, path: str, **extra) -> dict[str, Any]:
        """The ``executed`` record of a request served along ``path`` ("full", "last", ...)."""
        raise NotImplementedError

    def _notes(self, request: Request) -> dict[str, Any]:
        """Engine-specific keys of ``request``'s ``executed`` record (none by default)."""
        return {}

    # -- state and validation -------------------------------------------------------------------

    def _state(self, key: Any) -> Any:
        """The cache of ``key`` (None, or ``("seq", seq_id)``), made on first use."""
        if key not in self._states:
            self._states[key] = self._new_state()
        return self._states[key]

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        if len(tokens) == 0:
            raise ValueError(f"{self.who}: {what} has no tokens")

    def _check_last(self, request: Request) -> None:
        T = len(request.tokens)
        self._check_tokens(request.tokens, "last request")
        if not 0 <= request.last_pos < T:
            raise ValueError(f"{self.who}: last_pos {request.last_pos} is outside the {T} tokens of the call")

    def _embeddings(self, request: Request) -> np.ndarray | None:
        """A ``last`` request's input embeddings as an array ``[T, H]`` (None for the other entries)."""
        if request.entry != "embeddings":
            if request.images or request.audio:
                raise ValueError(f"{self.who}: an image or audio prompt needs entry 'embeddings', got "
                                 f"{request.entry!r}")
            return None
        if request.embeddings is None:
            raise ValueError(f"{self.who}: entry 'embeddings' without embeddings")
        return self._checked_embeddings(request.embeddings, len(request.tokens), "embeddings")

    def _checked_embeddings(self, embeddings: Any, T: int, what: str) -> np.ndarray:
        embeddings = np.asarray(embeddings)
        expected = (T, self.hidden_size)
        if embeddings.shape != expected:
            raise ValueError(f"{self.who}: {what} have shape {embeddings.shape}, expected {expected}")
        return embeddings

    def _piece_blocks(self, request: Request, spans: Sequence[tuple[int, int]],
                      what: str) -> list[list[tuple[int, int, int]]]:
        """The ``what`` blocks of each prefill piece as ``(start within the piece, length, block index)``;
        checked: every block inside one piece, no ``ubatch``."""
        if not spans:
            return [[] for _ in request.pieces]
        if request.ubatch is not None:
            raise ValueError(f"{self.who}: {what} prompts cannot be split into micro-batches (ubatch "
                             f"{request.ubatch}); an {what} block must run in one forward")
        out, lo = [], 0  # lo: the piece's first position in the prompt
        for a, piece in enumerate(request.pieces):
            hi = lo + len(piece.tokens)
            out.append([(s - lo, n, k) for k, (s, n) in enumerate(spans) if lo <= s < hi])
            for s, n, _ in out[-1]:
                if s + n > len(piece.tokens):
                    raise ValueError(f"{self.who}: the {what} block at position {s + lo} ({n} tokens) straddles "
                                     f"pieces {a} and {a + 1}; a block must lie in one piece")
            lo = hi
        return out

    def _check_blocks(self, request: Request, T: int) -> None:
        for what, spans in (("image", request.images), ("audio", request.audio)):
            for s, n in spans:
                if n < 1 or s < 0 or s + n > T:
                    raise ValueError(f"{self.who}: {what} block ({s}, {n}) is outside the {T} prompt tokens")
        if request.audio and len(request.audio_inputs) != len(request.audio):
            raise ValueError(f"{self.who}: {len(request.audio)} audio blocks but {len(request.audio_inputs)} "
                             "audio_inputs")
        if request.images and self.capabilities.image_tower and request.image_inputs and \
                len(request.image_inputs) != len(request.images):
            raise ValueError(f"{self.who}: {len(request.images)} image blocks but {len(request.image_inputs)} "
                             "image_inputs")

    def _media_kwargs(self, images, audio, audio_inputs, image_inputs=()) -> dict[str, Any]:
        """The ``_forward`` keywords of a forward's media blocks (none for text); ``image_inputs`` only
        for a backend that claims ``image_tower``."""
        out: dict[str, Any] = {}
        if images:
            out["images"] = tuple(images)
            if self.capabilities.image_tower:
                out["image_inputs"] = tuple(image_inputs)
        if audio:
            out["audio"], out["audio_inputs"] = tuple(audio), tuple(audio_inputs)
        return out

    def _check_prefill(self, request: Request) -> None:
        if not request.pieces:
            raise ValueError(f"{self.who}: prefill request has no pieces")
        if request.ubatch is not None and request.ubatch < 1:
            raise ValueError(f"{self.who}: ubatch must be >= 1, got {request.ubatch}")

    def _piece_rows(self, p: int, tokens: Sequence[int], rows: Sequence[int]) -> list[int]:
        """Piece ``p``'s output rows as ints, checked: increasing, within the piece's tokens."""
        T = len(tokens)
        self._check_tokens(tokens, f"piece {p}")
        rows = [int(r) for r in rows]
        if any(not 0 <= r < T for r in rows) or any(b <= a for a, b in pairwise(rows)):
            raise ValueError(f"{self.who}: piece {p} rows {rows} must be increasing within [0, {T})")
        return rows

    def _check_multi(self, request: Request) -> tuple[tuple, tuple]:
        """A ``multi`` request's (seq_ids, decode lists), checked; seq_ids default to 0..n-1."""
        return check_multi(request, self.who)

    # -- decode ---------------------------------------------------------------------------------

    def _decode_step(self, state: Any, token: int) -> np.ndarray:
        """One teacher-forced decode step: the logits row [V] after feeding ``token`` to ``state``."""
        return self._forward_rows(self._forward([int(token)], [0], state))[0][0]

    def _decode(self, state: Any, tokens: Sequence[int]) -> np.ndarray | None:
        """Teacher-forced decode of ``tokens``, one per forward: ``[len(tokens), V]``; None for none."""
        if not tokens:
            return None
        out = np.empty((len(tokens), self.vocab_size), dtype=self.out_dtype)
        for j, tok in enumerate(tokens):
            out[j] = self._decode_step(state, tok)
        return out

    def _decode_interleaved(self, states: list[Any], decode: tuple[tuple, ...]) -> list[np.ndarray]:
        """Decode steps interleaved across sequences (step j of every sequence, then step j + 1), as a
        server batches them; sequence i only ever reads and writes ``states[i]``."""
        out = [np.empty((len(d), self.vocab_size), dtype=self.out_dtype) for d in decode]
        hidden: list[list[np.ndarray]] = [[] for _ in decode]
        traces: list[list[dict[str, np.ndarray]]] = [[] for _ in decode]
        for j in range(max(len(d) for d in decode)):
            for i, d in enumerate(decode):
                if j < len(d):
                    out[i][j] = self._decode_step(states[i], d[j])
                    if self._hidden is not None:
                        hidden[i].append(self._take_hidden(1))
                    if self._trace is not None:
                        traces[i].append(self._take_trace())
        if self._hidden is not None:
            self._decode_hidden = [np.concatenate(h) if h else np.empty((0, self.hidden_size), dtype=self.out_dtype)
                                   for h in hidden]
        if self._trace is not None:
            self._decode_trace = [trace_rows(t) for t in traces]
        return out

    # -- request kinds --------------------------------------------------------------------------

    def _full(self, request: Request) -> Response:
        self._check_tokens(request.tokens, "full request")
        state = self._state(None)
        logits, notes = self._forward_rows(self._forward_all(request.tokens, state))
        hidden, trace = self._take_hidden(len(request.tokens)), self._take_trace()
        state_len = self._state_len(state)
        decode = self._decode(state, request.decode)
        return Response(logits, decode, self._executed(
            "full", **notes, **self._notes(request), state_len_after_prefill=state_len,
            decode_steps=len(request.decode)), hidden=hidden, decode_hidden=self._decode_hidden_of(decode),
            trace=trace, decode_trace=self._decode_trace_of(decode))

    def _last(self, request: Request) -> Response:
        self._check_last(request)
        embeddings = self._embeddings(request)
        self._check_blocks(request, len(request.tokens))
        state = self._state(None if request.entry == "plain" else ("seq", request.seq_id))
        extra = self._media_kwargs(request.images, request.audio, request.audio_inputs, request.image_inputs)
        logits, notes = self._forward_rows(self._forward(request.tokens, [request.last_pos], state,
                                                         embeddings=embeddings, **extra))
        hidden, trace = self._take_hidden(1), self._take_trace()
        state_len = self._state_len(state)
        decode = self._decode(state, request.decode)
        return Response(logits, decode, self._executed(
            "last", entry=request.entry, seq_id=request.seq_id, last_pos=request.last_pos, **notes,
            **self._notes(request), state_len_after_prefill=state_len, decode_steps=len(request.decode)),
            hidden=hidden, decode_hidden=self._decode_hidden_of(decode), trace=trace,
            decode_trace=self._decode_trace_of(decode))

    def _prefill(self, request: Request) -> Response:
        self._check_prefill(request)
        self._check_blocks(request, sum(len(p.tokens) for p in request.pieces))
        piece_images = self._piece_blocks(request, request.images, "image")
        piece_audio = self._piece_blocks(request, request.audio, "audio")
        media = bool(request.images or request.audio)
        state = self._state(None)
        out: list[np.ndarray] = []
        pieces_done = []
        for p, piece in enumerate(request.pieces):
            rows = self._piece_rows(p, piece.tokens, piece.rows)
            extra = {}
            if media:  # image and audio prompts: every piece carries its embeddings
                if piece.embeddings is None:
                    raise ValueError(f"{self.who}: piece {p} of an image or audio prompt has no embeddings (every "
                                     "piece carries its rows of the merged input embeddings)")
                extra["embeddings"] = self._checked_embeddings(piece.embeddings, len(piece.tokens),
                                                               f"piece {p} embeddings")
                extra.update(self._media_kwargs(
                    [(s, n) for s, n, _ in piece_images[p]], [(s, n) for s, n, _ in piece_audio[p]],
                    [request.audio_inputs[k] for _, _, k in piece_audio[p]],
                    [request.image_inputs[k] for _, _, k in piece_images[p]] if request.image_inputs else ()))
            elif piece.embeddings is not None:
                raise ValueError(f"{self.who}: piece {p} carries embeddings but the request has no images or audio")
            ubatches = []
            for start, stop, local in micro_batches(len(piece.tokens), rows, request.ubatch):
                logits, notes = self._forward_rows(self._forward(piece.tokens[start:stop], local, state, **extra))
                out.append(logits)
                ubatches.append({"tokens": stop - start, "outputs": len(local), **notes})
            pieces_done.append({"tokens": len(piece.tokens), "rows": rows, "ubatches": ubatches})
        logits = np.concatenate(out) if out else np.empty((0, self.vocab_size), dtype=self.out_dtype)
        hidden, trace = self._take_hidden(logits.shape[0]), self._take_trace()
        state_len = self._state_len(state)
        decode = self._decode(state, request.decode)
        return Response(logits, decode, self._executed(
            "prefill", ubatch=request.ubatch, pieces=pieces_done,
            ubatches=[u["tokens"] for piece in pieces_done for u in piece["ubatches"]],
            **self._notes(request), state_len_after_prefill=state_len, decode_steps=len(request.decode)),
            hidden=hidden, decode_hidden=self._decode_hidden_of(decode), trace=trace,
            decode_trace=self._decode_trace_of(decode))

    def _multi(self, request: Request) -> Response:
        seq_ids, decode = self._check_multi(request)
        states, rows, notes = [], [], []
        for sid, tokens in zip(seq_ids, request.sequences, strict=True):
            state = self._state(("seq", sid))  # one cache per sequence id
            logits, forward_notes = self._forward_rows(self._forward(tokens, [len(tokens) - 1], state))
            states.append(state)
            rows.append(logits)
            notes.append(forward_notes)
        hidden, trace = self._take_hidden(len(rows)), self._take_trace()
        state_lens = [self._state_len(s) for s in states]
        self._decode_hidden = self._decode_trace = None
        decode_logits = self._decode_interleaved(states, decode) if decode else None
        return Response(np.concatenate(rows), decode_logits, self._executed(
            "multi", seq_ids=list(seq_ids), **per_sequence(notes), **self._notes(request),
            state_len_after_prefill=state_lens, decode_steps=[len(d) for d in decode] if decode else 0),
            hidden=hidden, decode_hidden=self._decode_hidden, trace=trace, decode_trace=self._decode_trace)
