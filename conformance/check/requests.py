"""How a request is built for a case at check time (``build_request``), how the response is split into the
case's row groups (``response_groups``), and the input embeddings of the ``embeddings`` entry point in the
backend's convention (``Embedder``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from refimpl.arrays import to_host
from refimpl.model import Gemma4

from ..protocol.types import MtpRequest, MtpRound, Piece, Request, Response
from ..sets.case import BaseMedia, Case, prompt_length, row_groups, solo_cases


def _ids(x) -> tuple[int, ...]:
    return tuple(int(t) for t in x)


def _images_within(images: Sequence[tuple[int, int]], T: int) -> tuple[tuple[int, int], ...]:
    """The image blocks that start within the first T positions (a case never cuts one)."""
    return tuple((int(s), int(n)) for s, n in images if s < T)


def _videos_within(videos: Sequence[tuple[int, int]], n_blocks: int) -> tuple[tuple[int, int], ...]:
    """The videos whose first frame is among the first ``n_blocks`` vision blocks, each with the frames of it
    that are (a prompt may end between two frames of a video, never inside one)."""
    return tuple((int(first), min(int(n), n_blocks - int(first))) for first, n in videos if first < n_blocks)


def build_request(case: Case, bases: Mapping[str, np.ndarray], embed: Callable[[np.ndarray], np.ndarray],
                  media: Mapping[str, BaseMedia] | None = None, drafter: Path | None = None) -> Request:
    """The backend request. bases maps base id -> token ids (np int64). embed(ids) -> [T, H] float64
    embeddings in the backend's convention (scaled or raw); only called for entry 'embeddings' on text
    bases. ``media`` maps each image base to its ``BaseMedia`` (embeddings already in the backend's
    convention): a case on an image base sends those rows and the image blocks it contains."""
    m = (media or {}).get(case.base) if case.kind != "multi" else None
    if case.kind == "mtp" and case.mtp_batch:  # batched: each sequence's prompt and MtpRequest, as its solo case's
        solos = [build_request(solo, bases, embed, media, drafter) for solo in solo_cases(case)]
        return Request(kind="mtp", sequences=tuple(r.tokens for r in solos),
                       seq_ids=tuple(int(sid) for _, _, sid, _ in case.sequences), drafter=solos[0].drafter,
                       mtp_batch=tuple(r.mtp for r in solos))
    if case.kind == "mtp":
        spec = case.mtp
        rounds = tuple(MtpRound(r.token, r.drafts, r.accepted) for r in spec.rounds) if spec.mode == "rounds" else ()
        T, m = case.length, (media or {}).get(spec.media) if spec.media is not None else None
        if spec.media is not None and m is None:
            raise ValueError(f"case {case.id}: its prompt is media base {spec.media!r}, which has no media")
        media_fields = {}
        if m is not None:
            images, audio = _images_within(m.images, T), _images_within(m.audio, T)
            media_fields = dict(embeddings=np.asarray(m.embeddings[:T], dtype=np.float64), images=images, audio=audio,
                                image_inputs=tuple(m.image_inputs[:len(images)]),
                                audio_inputs=tuple(m.audio_inputs[:len(audio)]))
        return Request(kind="mtp", tokens=_ids(bases[case.base][:T]), drafter=None if drafter is None else str(drafter),
                       mtp=MtpRequest(spec.mode, spec.convention, spec.num_drafts, spec.max_new_tokens, rounds),
                       **media_fields)
    if case.kind == "multi":
        return Request(
            kind="multi",
            sequences=tuple(_ids(bases[b][:n]) for b, n, _, _ in case.sequences),
            seq_ids=tuple(int(sid) for _, _, sid, _ in case.sequences),
            decode=tuple(_ids(bases[b][n:n + d]) for b, n, _, d in case.sequences)
            if any(d > 0 for *_, d in case.sequences) else (),
        )
    base = bases[case.base]
    T = prompt_length(case)
    decode = _ids(base[T:T + case.decode_len])
    if case.kind == "full":
        return Request(kind="full", tokens=_ids(base[:T]), decode=decode)
    images = _images_within(m.images, T) if m is not None else ()
    audio = _images_within(m.audio, T) if m is not None else ()
    audio_inputs = tuple(m.audio_inputs[:len(audio)]) if m is not None else ()
    image_inputs = tuple(m.image_inputs[:len(images)]) if m is not None else ()
    videos = _videos_within(m.videos, len(images)) if m is not None else ()
    if case.kind == "last":
        tokens = _ids(base[:T])
        embeddings = None
        if m is not None:
            embeddings = np.asarray(m.embeddings[:T], dtype=np.float64)
        elif case.entry == "embeddings":
            embeddings = np.asarray(embed(np.asarray(tokens, dtype=np.int64)), dtype=np.float64)
        return Request(kind="last", tokens=tokens, entry=case.entry, last_pos=case.last_pos, seq_id=case.seq_id,
                       embeddings=embeddings, decode=decode, images=images, audio=audio, audio_inputs=audio_inputs,
                       image_inputs=image_inputs, videos=videos)
    if case.kind == "prefill":
        pieces, offset = [], 0
        for n, rows in case.pieces:
            rows_embeddings = None if m is None else np.asarray(m.embeddings[offset:offset + n], dtype=np.float64)
            pieces.append(Piece(tokens=_ids(base[offset:offset + n]), rows=tuple(int(r) for r in rows),
                                embeddings=rows_embeddings))
            offset += n
        return Request(kind="prefill", pieces=tuple(pieces), ubatch=case.ubatch, decode=decode, images=images,
                       audio=audio, audio_inputs=audio_inputs, image_inputs=image_inputs, videos=videos)
    raise ValueError(f"case {case.id}: unknown kind {case.kind!r}")


def topk_groups(case: Case, response: Response) -> list:
    """A top-k logprobs answer split like ``response_groups``: the logits group's rows, then the decode group(s)
    (``TopLogprobs`` each, or None where the response has none)."""
    groups = row_groups(case)
    out: list = [response.logprobs]
    dl = response.decode_logprobs
    if case.kind == "multi":
        out += [dl[s] if isinstance(dl, (list, tuple)) and s < len(dl) else None for s in range(len(groups) - 1)]
    elif len(groups) > 1:
        out.append(dl)
    return out


def sequence_response(response: Response, s: int) -> Response:
    """Sequence ``s``'s answer to a batched MTP request, as a solo MTP response: its row of ``logits`` (and of
    ``hidden``) and its ``mtp_batch`` entry (None where the response has none)."""
    logits, hidden, answers = _array(response.logits), _array(response.hidden), response.mtp_batch
    return Response(logits[s:s + 1] if logits is not None and logits.ndim == 2 and s < len(logits) else None,
                    hidden=hidden[s:s + 1] if hidden is not None and hidden.ndim == 2 and s < len(hidden) else None,
                    mtp=answers[s] if isinstance(answers, (list, tuple)) and s < len(answers) else None)


def _array(x) -> np.ndarray | None:
    return None if x is None else np.asarray(x)


def response_groups(case: Case, response: Response) -> list[np.ndarray | None]:
    """Split a Response into arrays matching row_groups(case) (logits, then decode group(s)).

    Shapes are not checked here (the grader does); a missing group is None.
    """
    groups = row_groups(case)
    if case.kind == "mtp" and case.mtp_batch:  # each sequence's groups from its row of logits and its answer
        return [g for s, solo in enumerate(solo_cases(case)) for g in response_groups(solo, sequence_response(
            response, s))]
    out: list[np.ndarray | None] = [_array(response.logits)]
    if case.kind == "mtp":  # then each round's draft logits and verification logits
        mtp = response.mtp
        for g in range(len(groups) - 1):
            rows = None if mtp is None else (mtp.draft_logits if g % 2 == 0 else mtp.verify_logits)
            out.append(None if rows is None or g // 2 >= len(rows) else _array(rows[g // 2]))
        return out
    if len(groups) == 1:
        return out
    dl = response.decode_logits
    if case.kind != "multi":
        out.append(_array(dl))
        return out
    n = len(groups) - 1
    for s in range(n):
        if dl is None:
            out.append(None)
        elif isinstance(dl, np.ndarray) and dl.ndim == 3:
            out.append(dl[s] if s < dl.shape[0] else None)
        elif isinstance(dl, (list, tuple)):
            out.append(_array(dl[s]) if s < len(dl) else None)
        else:
            out.append(None)
    return out


def trace_groups(case: Case, response: Response) -> list[dict | None]:
    """Split a Response's traces (``trace``, ``decode_trace``) like ``response_groups`` splits its logits: the
    trace map of the returned rows, then of each decode group; a missing group is None. MTP cases carry none."""
    if case.kind == "mtp":
        return [None] * len(row_groups(case))
    n_decode = len(row_groups(case)) - 1
    dt = response.decode_trace
    if case.kind != "multi":
        return [response.trace] + ([dt if isinstance(dt, dict) else None] * n_decode)
    return [response.trace] + [dt[s] if isinstance(dt, (list, tuple)) and s < len(dt) else None
                               for s in range(n_decode)]


class Embedder:
    """Input embeddings for the 'embeddings' entry, in the backend's convention, from the set's oracle
    (``oracle()``, built on first use): scaled, ``Gemma4.embed`` (E[ids] * sqrt(H), the exact float64 sqrt);
    raw, E[ids]."""

    def __init__(self, oracle: Callable[[], Gemma4], convention: str):
        self.oracle = oracle
        self.convention = convention

    def __call__(self, ids) -> np.ndarray:
        model, ids = self.oracle(), np.asarray(ids, dtype=np.int64)
        if self.convention == "scaled":
            return np.asarray(to_host(model.embed(ids)), dtype=np.float64)
        return np.asarray(to_host(model.weights.rows("embed_tokens.weight", ids)), dtype=np.float64)


def without_decode(case: Case) -> Case:
    """The same case with its decode steps removed (for backends that do not claim decode)."""
    return replace(
        case, decode_len=0, sequences=tuple((b, n, sid, 0) for b, n, sid, _ in case.sequences),
        golden_tokens=tuple(case.golden_tokens[:1]),
    )


