"""The numpy engine behind the backend protocol (registered as ``numpy-engine``): requests become batches.

A request's calls become :class:`~conformance.selftest.state.Batch` es on fresh caches (chunked prefill:
consecutive batches on the same caches; ``multi``: every sequence in one batch; decode: one token per batch),
its image and audio inputs become soft tokens written into the batch's embeddings, and the engine's rows
become the response (``conformance.selftest.engine`` describes the engine itself).

    conformance check --backend numpy-engine            # must pass every bundled case at exact-f64
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from refimpl import RefimplError
from refimpl.audio import load_audio_tower
from refimpl.config_fields import read_config_json
from refimpl.errors import check_choice
from refimpl.frontends import image_front_end
from refimpl.gguf_io import is_gguf
from refimpl.model import VISION_MASK_RULES, Gemma4
from refimpl.multimodal import MultimodalTokens, load_multimodal_tokens
from refimpl.unified import is_unified, load_unified_audio

from ..backends.refimpl_backend import all_capabilities, check_options
from ..protocol.serving import block_token_problem
from ..protocol.trace import trace_rows
from ..protocol.types import BackendError, Request, Response
from .engine import Engine
from .mtp import CONVENTIONS_SERVED, DraftModel, MtpDriver, load_draft_model, serve_mtp
from .state import PLAIN_SEQ, Batch, CacheSet

__all__ = ["NumpyEngineBackend"]


class NumpyEngineBackend:
    """The engine behind the backend protocol. Claims everything; float64 is exact (profile exact-f64).

    Options: ``dtype`` ("float64" or "float32"), ``embed_scale`` ("exact" or "bf16").
    Subclasses swap the engine (``engine_class``) or override a request hook (``last_row``,
    ``piece_rows``) to plant a bug: see ``conformance/selftest/mutants.py``.

    Image and audio prompts: ``last`` (entry ``embeddings``) and ``prefill`` (every piece with
    embeddings); the image and audio blocks of each call go into its batch (``Engine.batch(images=...,
    audio=...)``). Refused with a ValueError: media on ``full``/``multi`` or another ``last`` entry, with
    ``ubatch``, a block that straddles two pieces or holds other tokens than its placeholder.

    Audio: the backend claims ``audio_tower``. At ``open`` it loads the checkpoint's audio tower when
    config.json has an ``audio_config``; for every audio request it computes each clip's soft tokens
    itself from ``request.audio_inputs`` (``Engine.audio_soft_tokens``: the oracle's conformer), checks
    their count against the block and writes them into a copy of the given embeddings at the block's rows.
    The audio rows of the given embeddings are therefore **ignored**: they are only the harness's
    reference (a request whose rows are wrong gets the same answer), so the engine's own audio tower is
    what the audio cases grade. An audio request without one ``AudioInput`` per block is refused.
    """

    name = "numpy-engine"
    engine_class: type[Engine] = Engine
    draft_model_class: type[DraftModel] = DraftModel  # the MTP drafter's graph (conformance/selftest/mtp.py)
    driver_class: type[MtpDriver] = MtpDriver  # the MTP round loop

    def __init__(self, dtype: str = "float64", embed_scale: str = "exact", vision_mask: str = "sliding-clamped"):
        self.dtype, self.embed_scale = check_options("numpy-engine", dtype, embed_scale)
        self.vision_mask = check_choice("vision_mask", vision_mask, VISION_MASK_RULES, who="numpy-engine",
                                        error=ValueError)
        exact = self.dtype == "float64" and embed_scale == "exact"
        self.capabilities = all_capabilities("exact-f64" if exact else "fp32")  # audio_tower, image_tower included
        self.engine: Engine | None = None
        self.tokens: MultimodalTokens | None = None
        self._drafters: dict[str, DraftModel] = {}
        self.capabilities = replace(self.capabilities, mtp_conventions=",".join(CONVENTIONS_SERVED))

    # -- protocol -------------------------------------------------------------------------------

    def open(self, model_dir: Path) -> None:
        try:
            model = Gemma4(model_dir, dtype=self.dtype, embed_scale=self.embed_scale, vision_mask=self.vision_mask,
                           device="cpu")  # (a NumPy engine, whatever REFIMPL_DEVICE says)
            self.tokens = load_multimodal_tokens(model_dir)
            raw = {} if is_gguf(model_dir) else read_config_json(model_dir)[1]  # a GGUF: the text model only
            load_audio = load_unified_audio if is_unified(model_dir) else load_audio_tower
            audio = load_audio(model_dir, self.dtype) if raw.get("audio_config") is not None else None
            image = image_front_end(model_dir, self.dtype) if raw.get("vision_config") is not None else None
        except (RefimplError, OSError) as exc:
            raise BackendError(f"numpy-engine cannot open {model_dir}: {exc}") from exc
        self.engine = self.engine_class(model, audio, image)

    def close(self) -> None:
        self.engine = None
        self.tokens = None

    @property
    def image_token_id(self) -> int | None:
        return None if self.tokens is None else self.tokens.image_token_id

    @property
    def audio_token_id(self) -> int | None:
        return None if self.tokens is None else self.tokens.audio_token_id

    def run(self, request: Request) -> Response:
        if self.engine is None:
            raise RuntimeError("numpy-engine: run() called before open()")
        self.engine.log = []
        self.engine.hidden_log, self.engine.residual_log = [], []
        self.engine.trace_log = [] if request.trace else None
        self.engine.spare_keys = 0
        caches = self.engine.new_caches()  # fresh state per request
        if request.kind == "mtp":
            return self._mtp(request, caches)
        handler = {"full": self._full, "last": self._last, "prefill": self._prefill, "multi": self._multi}
        response = handler[request.kind](request, caches)
        if request.hidden:
            response.hidden, response.decode_hidden = self._head_rows(request, response, self.engine.hidden_log)
        if request.trace:
            points = trace_rows(self.engine.trace_log)
            split = {name: self._head_rows(request, response, [rows]) for name, rows in points.items()}
            response.trace = {name: got for name, (got, _) in split.items()}
            if request.kind == "multi" and request.decode:
                response.decode_trace = [{name: dec[i] for name, (_, dec) in split.items()}
                                         for i in range(len(request.decode))]
            elif request.decode:
                response.decode_trace = {name: dec for name, (_, dec) in split.items()}
        return response

    # -- MTP (conformance/selftest/mtp.py) ------------------------------------------------------

    def sequence_batch(self, caches: CacheSet, seq: Any, ids: Sequence[int], rows: Iterable[int]) -> Batch:
        """A text batch of one sequence with output ``rows`` (the MTP driver's prefill and verification)."""
        return self.one_sequence(caches, seq, ids, rows)

    def prompt_embeddings(self, request: Request) -> np.ndarray:
        """The input rows of a whole-prompt request with ``embeddings`` (``last``, or an MTP request after media):
        the given rows with each image and audio block's rows replaced by the engine's own soft tokens."""
        self._check_media_tokens(request.tokens, request.images, request.audio)
        x0 = np.asarray(request.embeddings)
        if request.images:
            x0 = self._with_soft_tokens(x0, request.images, self._image_soft_tokens(request))
        if request.audio:
            x0 = self._with_soft_tokens(x0, request.audio, self._audio_soft_tokens(request))
        return x0

    def prompt_batch(self, caches: CacheSet, request: Request, rows: Iterable[int]) -> Batch:
        """The MTP driver's prefill of the request's prompt with output ``rows``: a text batch, or after media
        the prompt's embeddings and blocks (one batch: a block never straddles two)."""
        if not self._media(request):
            return self.sequence_batch(caches, 0, request.tokens, rows)
        if request.embeddings is None:
            raise ValueError("numpy-engine: an MTP request after media needs the prompt's embeddings")
        return self.one_sequence(caches, 0, request.tokens, rows, self.prompt_embeddings(request), request.images,
                                 request.audio)

    def _mtp(self, request: Request, caches: CacheSet) -> Response:
        if request.drafter not in self._drafters or self._drafters[request.drafter].engine is not self.engine:
            self._drafters = {request.drafter: load_draft_model(self.draft_model_class, request.drafter, self.engine)}
        return serve_mtp(self, self._drafters[request.drafter], request, caches)

    def _head_rows(self, request: Request, response: Response, log: list[np.ndarray]) -> tuple[np.ndarray, Any]:
        """Rows logged at every LM-head call (``Engine.hidden_log``, or one trace point), in call order: the
        prefill's output rows, then one decode step after another (multi steps batch the live sequences),
        split as the response's (rows of ``logits``, rows of ``decode_logits``: None without decode, a list
        per sequence for multi)."""
        flat = np.concatenate(log) if log else np.empty((0, self.engine.cfg.hidden_size), dtype=self.dtype)
        R = np.asarray(response.logits).shape[0]
        got, rest = flat[:R], flat[R:]
        if request.kind == "multi" and request.decode:
            per_seq: list[list[np.ndarray]] = [[] for _ in request.decode]
            at = 0
            for j in range(max(len(d) for d in request.decode)):
                for i, d in enumerate(request.decode):
                    if j < len(d):
                        per_seq[i].append(rest[at:at + 1])
                        at += 1
            return got, [np.concatenate(h) if h else rest[:0] for h in per_seq]
        return got, (rest if request.decode else None)

    # -- request hooks (what a request adapter decides) -------------------------------------------

    def last_row(self, T: int, last_pos: int) -> int:
        """The row flagged as output on the last-logits entry points."""
        return last_pos

    def piece_rows(self, p: int, rows: Sequence[int]) -> list[int]:
        """The rows flagged as output in piece p of a prefill."""
        return [int(r) for r in rows]

    # -- request kinds --------------------------------------------------------------------------

    def one_sequence(self, caches: CacheSet, seq: Any, ids: Sequence[int], rows: Iterable[int],
                     x0: np.ndarray | None = None, images: Sequence[tuple[int, int]] = (),
                     audio: Sequence[tuple[int, int]] = ()) -> Batch:
        """One call's tokens of sequence ``seq`` as an engine batch: ``rows`` flagged as output, ``x0`` the input
        embeddings, ``images`` / ``audio`` the media blocks within ``ids`` (the request hook the video mutants
        replace: conformance/selftest/video_mutants.py)."""
        if len(ids) == 0:
            raise ValueError("numpy-engine: a call has no tokens")
        rows = list(rows)
        if any(not 0 <= r < len(ids) for r in rows):
            raise ValueError(f"numpy-engine: rows {rows} must lie within the {len(ids)} tokens of the call")
        output = np.zeros(len(ids), dtype=bool)
        output[rows] = True
        return self.engine.batch(caches, ids, [seq] * len(ids), output, x0, images, audio)

    @staticmethod
    def _media(request: Request) -> bool:
        return bool(request.images or request.audio)

    def _check_block_tokens(self, ids: Sequence[int], blocks: Sequence[tuple[int, int]], what: str,
                            token: int, frame: int | None = None) -> None:
        """Every block (start, n) within the call's ids, filled with its placeholder token (an image block
        that is a video frame: with the video token ``frame``)."""
        T = len(ids)
        for s, n in blocks:
            if n < 1 or s < 0 or s + n > T:
                raise ValueError(f"numpy-engine: {what} block ({s}, {n}) is outside the {T} tokens of the call")
            if (why := block_token_problem(ids, s, n, what, token, frame)) is not None:
                raise ValueError(f"numpy-engine: {why}")

    def _check_media_tokens(self, ids: Sequence[int], images: Sequence[tuple[int, int]],
                            audio: Sequence[tuple[int, int]]) -> None:
        frame = None if self.tokens is None else self.tokens.video_token_id
        self._check_block_tokens(ids, images, "image", self.image_token_id, frame)
        self._check_block_tokens(ids, audio, "audio", self.audio_token_id)

    def _piece_blocks(self, request: Request, blocks: Sequence[tuple[int, int]], what: str
                      ) -> list[list[tuple[int, int]]]:
        """The blocks of each prefill piece as (start, n) within the piece; a block must lie in one piece."""
        total = sum(len(p.tokens) for p in request.pieces)
        for s, n in blocks:
            if n < 1 or s < 0 or s + n > total:
                raise ValueError(f"numpy-engine: {what} block ({s}, {n}) is outside the {total} prompt tokens")
        out, lo = [], 0
        for p, piece in enumerate(request.pieces):
            hi = lo + len(piece.tokens)
            mine = [(s - lo, n) for s, n in blocks if lo <= s < hi]
            for s, n in mine:
                if s + n > len(piece.tokens):
                    raise ValueError(f"numpy-engine: the {what} block at position {s + lo} ({n} tokens) straddles "
                                     f"pieces {p} and {p + 1}; a block must lie in one piece")
            out.append(mine)
            lo = hi
        return out

    def _piece_media(self, request: Request) -> tuple[list[list[tuple[int, int]]], list[list[tuple[int, int]]]]:
        """(image blocks, audio blocks) of each prefill piece, within the piece. Media prompts run without
        micro-batches (a block is one forward)."""
        if self._media(request) and request.ubatch is not None:
            what = "image" if request.images else "audio"
            raise ValueError(f"numpy-engine: {what} prompts cannot be split into micro-batches (ubatch "
                             f"{request.ubatch}); an {what} block must run in one forward")
        images = self._piece_blocks(request, request.images, "image")
        audio = self._piece_blocks(request, request.audio, "audio")
        for piece, im, au in zip(request.pieces, images, audio, strict=True):
            self._check_media_tokens(piece.tokens, im, au)
        return images, audio

    def _audio_soft_tokens(self, request: Request) -> list[np.ndarray]:
        """Each audio block's soft tokens [M, H], computed by the engine's own audio tower from
        ``request.audio_inputs`` (one per block, in prompt order); M must equal the block's length."""
        if not request.audio:
            return []
        if len(request.audio_inputs) != len(request.audio):
            raise ValueError(f"numpy-engine: {len(request.audio)} audio block(s) but {len(request.audio_inputs)} "
                             "audio input(s); the engine computes the soft tokens itself from one AudioInput per block")
        out = []
        for j, ((s, n), clip) in enumerate(zip(request.audio, request.audio_inputs, strict=True)):
            soft = self.engine.audio_soft_tokens(np.asarray(clip.features), np.asarray(clip.mask))
            if soft.shape[0] != n:
                raise ValueError(f"numpy-engine: audio clip {j} gives {soft.shape[0]} soft tokens but its block at "
                                 f"position {s} holds {n} audio tokens")
            out.append(soft)
        return out

    def _image_soft_tokens(self, request: Request) -> list[np.ndarray]:
        """Each image block's soft tokens [M, H], computed by the engine's own tower or embedder from
        ``request.image_inputs`` (one per block, in prompt order). The rows of all images are concatenated
        and handed out to the blocks in order, as a scatter into the placeholder rows does."""
        if not request.images:
            return []
        if len(request.image_inputs) != len(request.images):
            raise ValueError(f"numpy-engine: {len(request.images)} image block(s) but {len(request.image_inputs)} "
                             "image input(s); the engine computes the soft tokens itself from one ImageInput per block")
        flat = np.concatenate([self.engine.image_soft_tokens(i.pixel_values, i.positions)
                               for i in request.image_inputs])
        need = sum(n for _, n in request.images)
        if flat.shape[0] < need:
            raise ValueError(f"numpy-engine: the images give {flat.shape[0]} soft tokens but the prompt's image blocks "
                             f"hold {need} image tokens")
        ends = np.cumsum([n for _, n in request.images])
        return [flat[e - n:e] for (_, n), e in zip(request.images, ends, strict=True)]

    @staticmethod
    def _with_soft_tokens(x0: np.ndarray, blocks: Sequence[tuple[int, int]], soft: Sequence[np.ndarray]) -> np.ndarray:
        """A copy of the call's embeddings with each audio (or image) block's rows replaced by its soft tokens."""
        x0 = np.array(x0, dtype=np.float64, copy=True)  # never write into the request's array
        for (s, n), e in zip(blocks, soft, strict=True):
            x0[s:s + n] = e
        return x0

    def _decode(self, caches: CacheSet, seq: Any, tokens: Sequence[int]) -> np.ndarray:
        """Teacher-forced decode: one batch of one output token per step."""
        out = [self.engine.prefill(caches, self.one_sequence(caches, seq, [int(t)], [0])) for t in tokens]
        return np.concatenate(out) if out else np.empty((0, self.engine.cfg.vocab_size), dtype=self.dtype)

    def _executed(self, path: str, n_prefill: int, **extra) -> dict[str, Any]:
        log = self.engine.log
        return {"path": path, "engine": "numpy-engine", "dtype": self.dtype, "embed_scale": self.embed_scale,
                "fresh_state": True, "prune_layer": self.engine.prune_layer,
                "ubatches": log[:n_prefill], "decode_ubatches": len(log) - n_prefill,
                "state_len_after_prefill": extra.pop("state_len"), **extra}

    @staticmethod
    def _media_record(request: Request) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if request.images:
            out["images"] = list(request.images)
            out["image_soft_tokens"] = "own vision tower or embedder (the embeddings' image rows are not read)"
        if request.audio:
            out["audio"] = list(request.audio)
            out["audio_soft_tokens"] = "own audio tower (the embeddings' audio rows are not read)"
        return out

    def _no_media(self, request: Request) -> None:
        if self._media(request):
            what = "image" if request.images else "audio"
            raise ValueError(f"numpy-engine: {what} prompts are served on 'last' (entry 'embeddings') and "
                             f"'prefill' only, not on {request.kind!r}")

    def _full(self, request: Request, caches: CacheSet) -> Response:
        self._no_media(request)
        T = len(request.tokens)
        logits = self.engine.prefill(caches, self.one_sequence(caches, 0, request.tokens, range(T)))
        n, state = len(self.engine.log), caches.get(0).length
        decode = self._decode(caches, 0, request.decode) if request.decode else None
        return Response(logits, decode, self._executed("full", n, state_len=state))

    def _last(self, request: Request, caches: CacheSet) -> Response:
        T = len(request.tokens)
        if not 0 <= request.last_pos < T:
            raise ValueError(f"numpy-engine: last_pos {request.last_pos} is outside the {T} tokens of the call")
        x0 = None
        if request.entry == "embeddings":
            if request.embeddings is None:
                raise ValueError("numpy-engine: entry 'embeddings' without embeddings")
            x0 = self.prompt_embeddings(request)
        elif self._media(request):
            what = "an image" if request.images else "an audio"
            raise ValueError(f"numpy-engine: {what} prompt needs entry 'embeddings', got {request.entry!r}")
        seq = PLAIN_SEQ if request.entry == "plain" else request.seq_id
        row = self.last_row(T, request.last_pos)
        batch = self.one_sequence(caches, seq, request.tokens, [row], x0, request.images, request.audio)
        logits = self.engine.prefill(caches, batch)
        n, state = len(self.engine.log), caches.get(seq).length
        decode = self._decode(caches, seq, request.decode) if request.decode else None
        return Response(logits, decode, self._executed(
            "last", n, state_len=state, entry=request.entry, seq_id=request.seq_id,
            last_pos=request.last_pos, output_row=row, **self._media_record(request)))

    def _prefill(self, request: Request, caches: CacheSet) -> Response:
        if not request.pieces:
            raise ValueError("numpy-engine: prefill request has no pieces")
        piece_images, piece_audio = self._piece_media(request)
        media = self._media(request)
        for p, piece in enumerate(request.pieces):  # checked before any soft token is computed
            if media and piece.embeddings is None:  # image / audio prompts: every piece carries its embeddings
                what = "an image" if request.images else "an audio"
                raise ValueError(f"numpy-engine: piece {p} of {what} prompt has no embeddings")
            if not media and piece.embeddings is not None:
                raise ValueError(f"numpy-engine: piece {p} carries embeddings but the request has no images or audio")
        soft = self._audio_soft_tokens(request)
        image_soft = self._image_soft_tokens(request)
        out, pieces, clip, image = [], [], 0, 0
        for p, piece in enumerate(request.pieces):
            rows = self.piece_rows(p, piece.rows)
            x0 = np.asarray(piece.embeddings) if media else None
            if piece_images[p]:
                x0 = self._with_soft_tokens(x0, piece_images[p], image_soft[image:image + len(piece_images[p])])
                image += len(piece_images[p])
            if piece_audio[p]:
                x0 = self._with_soft_tokens(x0, piece_audio[p], soft[clip:clip + len(piece_audio[p])])
                clip += len(piece_audio[p])
            batch = self.one_sequence(caches, 0, piece.tokens, rows, x0, piece_images[p], piece_audio[p])
            out.append(self.engine.prefill(caches, batch, request.ubatch))
            pieces.append({"tokens": len(piece.tokens), "rows": rows,
                           **({"images": piece_images[p]} if request.images else {}),
                           **({"audio": piece_audio[p]} if request.audio else {})})
        n, state = len(self.engine.log), caches.get(0).length
        logits = np.concatenate(out)
        decode = self._decode(caches, 0, request.decode) if request.decode else None
        return Response(logits, decode, self._executed("prefill", n, state_len=state, ubatch=request.ubatch,
                                                       pieces=pieces, **self._media_record(request)))

    def _multi(self, request: Request, caches: CacheSet) -> Response:
        """All sequences in ONE batch (tokens tagged with their sequence ids); decode steps batched too."""
        self._no_media(request)
        n = len(request.sequences)
        seq_ids = list(request.seq_ids) if request.seq_ids else list(range(n))
        if n == 0 or len(seq_ids) != n or len(set(seq_ids)) != n:
            raise ValueError(f"numpy-engine: multi request needs {n} distinct seq_ids, got {seq_ids}")
        if any(len(s) == 0 for s in request.sequences):
            raise ValueError("numpy-engine: a sequence has no tokens")
        ids = [int(t) for s in request.sequences for t in s]
        seq = [sid for sid, s in zip(seq_ids, request.sequences, strict=True) for _ in s]
        ends = np.cumsum([len(s) for s in request.sequences]) - 1
        output = np.zeros(len(ids), dtype=bool)
        output[ends] = True
        logits = self.engine.prefill(caches, self.engine.batch(caches, ids, seq, output))
        n_log, state = len(self.engine.log), [caches.get(s).length for s in seq_ids]
        decode_logits = None
        if request.decode:
            decode = [tuple(int(t) for t in d) for d in request.decode]
            if len(decode) != n:
                raise ValueError(f"numpy-engine: {n} sequences but {len(decode)} decode lists")
            V = self.engine.cfg.vocab_size
            decode_logits = [np.empty((len(d), V), dtype=self.dtype) for d in decode]
            for j in range(max(len(d) for d in decode)):  # one batch per step: one token per live sequence
                live = [i for i, d in enumerate(decode) if j < len(d)]
                step = self.engine.batch(caches, [decode[i][j] for i in live], [seq_ids[i] for i in live],
                                         [True] * len(live))
                for i, row in zip(live, self.engine.prefill(caches, step), strict=True):
                    decode_logits[i][j] = row
        return Response(logits, decode_logits, self._executed("multi", n_log, state_len=state,
                                                              seq_ids=seq_ids))
