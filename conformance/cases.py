"""The case matrix: which requests the harness sends, and which base rows grade each answer.

A fixture set stores a few **bases** (token sequences) with their full float64 oracle logits. Every
case is a view on bases: its prompt is a prefix ``base[:T]``, its decode tokens are ``base[T:T+d]``
(teacher forcing), and the expected logits of every row it returns are rows of the base's logits
(causality: row i of a prefix forward equals row i of the base forward). See docs/fixtures.md for the
matrix and docs/harness-contract.md for the interfaces.

Public API:

``Case``, ``RowSpec``            the frozen records (``Case.to_json`` / ``Case.from_json``)
``BaseMedia``                    an image base's merged input embeddings and image blocks
``row_groups(case)``             the rows a backend must return, grouped as the response is
``build_request(case, bases, embed, media)``   the ``conformance.backend.Request`` for a case
``response_groups(case, response)``     the ``Response`` split to match ``row_groups``
``generate_cases(set_name, cfg, bases)`` the text matrix for one model
``generate_image_cases(set_name, cfg, bases, images, kind)`` the image (or audio) matrix (bases I0, I1 / S0, S1)
``annotate(case, base_logits, router_margins)``  fill ``ties`` and ``moe_min_margin`` from the oracle
``check_case(case, base_lengths)`` structural problems of a case (empty list = fine)
``model_features(cfg)``          the model feature tags of a config
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .backend import ENTRIES, KINDS, Piece, Request, Response

DECODE_STEPS = 3  # teacher-forced decode steps after every prefill
UBATCH = 5  # the micro-batch size U of the ubatch cases
GENERATION_STEPS = 8  # greedy continuation tokens at the end of base G (the golden tokens)
PROMPT_CONTINUATION = 3  # greedy continuation tokens appended to every user prompt base P<i>
TIE_MARGIN = 2.0  # rows whose oracle top-1 minus top-2 logit is below this are recorded as ties
MIN_RANDOM_BASE = 48  # length of the random bases A, B, C (at least; see random_base_length)
RANDOM_BASES = ("A", "B", "C")
GENERATION_BASE = "G"
PROMPT_PREFIX = "P"
IMAGE_PREFIX = "I"  # image bases I0, I1, ...: prompts with image blocks (see generate_image_cases)
AUDIO_PREFIX = "S"  # audio (sound) bases S0, S1, ...: prompts with audio blocks
MEDIA_PREFIX = {"image": IMAGE_PREFIX, "audio": AUDIO_PREFIX}
MEDIA_OPEN = {"image": "boi", "audio": "boa"}  # the tag of the row before a block


# ----------------------------------------------------------------------------------------------
# records

_FIELD = object()


@dataclass(frozen=True)
class Case:
    id: str  # "<set>/<kind>/<detail>", unique, stable, used by -k and reports
    kind: str  # full | last | prefill | multi
    base: str  # base id (multi: the first sequence's base)
    length: int  # T, prompt length (multi: the first sequence's length; see sequences)
    entry: str = "plain"  # last: plain | seq_id | embeddings
    last_pos: int = -1  # last
    seq_id: int | None = None
    pieces: tuple[tuple[int, tuple[int, ...]], ...] = ()  # prefill: (piece_len, rows within piece)
    ubatch: int | None = None
    sequences: tuple[tuple[str, int, int, int], ...] = ()  # multi: (base, length, seq_id, decode_len)
    decode_len: int = 0  # single-sequence kinds
    generation: bool = False  # teacher-forced greedy case: golden tokens are base[T:T+d+1]
    features: tuple[str, ...] = ()
    ties: tuple[tuple[str, float], ...] = ()  # (row label, oracle top-2 margin) for rows with margin < 2.0
    moe_min_margin: float | None = None  # smallest router margin over the case's tokens (MoE models)
    # generation cases: the golden tokens base[T:T+d+1], one per returned row (an addition to the contract:
    # row_groups(case) has no bases, so the case carries them)
    golden_tokens: tuple[int, ...] = ()

    def to_json(self) -> dict:
        return {
            "id": self.id, "kind": self.kind, "base": self.base, "length": self.length, "entry": self.entry,
            "last_pos": self.last_pos, "seq_id": self.seq_id,
            "pieces": [[n, list(rows)] for n, rows in self.pieces], "ubatch": self.ubatch,
            "sequences": [list(s) for s in self.sequences], "decode_len": self.decode_len,
            "generation": self.generation, "features": list(self.features),
            "ties": [[label, margin] for label, margin in self.ties], "moe_min_margin": self.moe_min_margin,
            "golden_tokens": list(self.golden_tokens),
        }

    @staticmethod
    def from_json(d: dict) -> "Case":
        """Strict parse: unknown keys, missing keys and wrong types raise ValueError naming the field."""
        if not isinstance(d, dict):
            raise ValueError(f"a case must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(Case)}
        unknown = sorted(set(d) - known)
        where = f"case {d.get('id')!r}" if isinstance(d.get("id"), str) else "case"
        if unknown:
            raise ValueError(f"{where}: unknown field '{unknown[0]}'")
        for key in ("id", "kind", "base", "length"):
            if key not in d:
                raise ValueError(f"{where}: required field '{key}' is missing")

        def s(key):
            v = d[key]
            if not isinstance(v, str):
                raise ValueError(f"{where}: field '{key}' must be a string, got {v!r}")
            return v

        def i(key, v: Any = _FIELD, none=False):
            v = d.get(key) if v is _FIELD else v
            if none and v is None:
                return None
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{where}: field '{key}' must hold integers, got {v!r}")
            return v

        def lst(key):
            v = d.get(key, [])
            if not isinstance(v, list):
                raise ValueError(f"{where}: field '{key}' must be a list, got {v!r}")
            return v

        kw: dict[str, Any] = {"id": s("id"), "kind": s("kind"), "base": s("base"), "length": i("length")}
        if "entry" in d:
            kw["entry"] = s("entry")
        if "last_pos" in d:
            kw["last_pos"] = i("last_pos")
        if "seq_id" in d:
            kw["seq_id"] = i("seq_id", none=True)
        if "ubatch" in d:
            kw["ubatch"] = i("ubatch", none=True)
        if "decode_len" in d:
            kw["decode_len"] = i("decode_len")
        if "generation" in d:
            if not isinstance(d["generation"], bool):
                raise ValueError(f"{where}: field 'generation' must be true or false")
            kw["generation"] = d["generation"]
        pieces = []
        for p in lst("pieces"):
            if not (isinstance(p, list) and len(p) == 2 and isinstance(p[1], list)):
                raise ValueError(f"{where}: field 'pieces' must hold [piece_len, [rows...]] pairs, got {p!r}")
            pieces.append((i("pieces", p[0]), tuple(i("pieces", r) for r in p[1])))
        kw["pieces"] = tuple(pieces)
        seqs = []
        for q in lst("sequences"):
            if not (isinstance(q, list) and len(q) == 4 and isinstance(q[0], str)):
                raise ValueError(f"{where}: field 'sequences' must hold [base, length, seq_id, decode_len], got {q!r}")
            seqs.append((q[0], i("sequences", q[1]), i("sequences", q[2]), i("sequences", q[3])))
        kw["sequences"] = tuple(seqs)
        feats = lst("features")
        if not all(isinstance(f, str) for f in feats):
            raise ValueError(f"{where}: field 'features' must be a list of strings")
        kw["features"] = tuple(feats)
        ties = []
        for t in lst("ties"):
            if not (isinstance(t, list) and len(t) == 2 and isinstance(t[0], str)
                    and isinstance(t[1], (int, float)) and not isinstance(t[1], bool)):
                raise ValueError(f"{where}: field 'ties' must hold [row label, margin] pairs, got {t!r}")
            ties.append((t[0], float(t[1])))
        kw["ties"] = tuple(ties)
        m = d.get("moe_min_margin")
        if m is not None and (not isinstance(m, (int, float)) or isinstance(m, bool)):
            raise ValueError(f"{where}: field 'moe_min_margin' must be a number or null, got {m!r}")
        kw["moe_min_margin"] = None if m is None else float(m)
        kw["golden_tokens"] = tuple(i("golden_tokens", t) for t in lst("golden_tokens"))
        return Case(**kw)


@dataclass(frozen=True)
class RowSpec:
    label: str  # "row 9", "piece 1 row 3", "decode 2", "seq 1 last", "seq 1 decode 0"
    base: str
    position: int  # absolute position in the base whose logits are expected
    golden_token: int | None = None  # generation cases: the golden next token (base[position + 1])


@dataclass(frozen=True)
class BaseMedia:
    """What an image base adds to its token ids: the input embeddings every request on it sends."""

    embeddings: np.ndarray  # [N, H] in the backend's convention: E[id] * sqrt(H) at text rows, soft tokens
    #                         (unscaled) at image/audio rows ("scaled"); all divided by sqrt(H) for "raw"
    images: tuple[tuple[int, int], ...] = ()  # (first position, soft-token count) of each image block
    audio: tuple[tuple[int, int], ...] = ()  # (first position, soft-token count) of each audio block
    audio_inputs: tuple = ()  # conformance.backend.AudioInput per audio block (features, mask)


# ----------------------------------------------------------------------------------------------
# rows, requests, responses


def _prompt_length(case: Case) -> int:
    if case.kind == "prefill":
        return sum(n for n, _ in case.pieces)
    return case.length


def row_groups(case: Case) -> list[tuple[str, list[RowSpec]]]:
    """The rows a backend must return, in order, as groups: ("logits", [...]) then ("decode", [...])
    (multi: ("decode seq 0", [...]), ("decode seq 1", [...]), ...). A decode group is present only when
    the case has decode steps (multi: one group per sequence when any sequence decodes).

    Generation cases: row j (counting over all groups) gets ``golden_token = case.golden_tokens[j]``,
    which is ``base[position + 1]``.
    """
    counter = iter(case.golden_tokens if case.generation else ())

    def spec(label: str, base: str, position: int) -> RowSpec:
        return RowSpec(label, base, position, next(counter, None))

    if case.kind == "multi":
        groups = [("logits", [spec(f"seq {s} last", b, n - 1) for s, (b, n, _, _) in enumerate(case.sequences)])]
        if any(d > 0 for _, _, _, d in case.sequences):
            for s, (b, n, _, d) in enumerate(case.sequences):
                groups.append((f"decode seq {s}", [spec(f"seq {s} decode {j}", b, n + j) for j in range(d)]))
        return groups

    T = _prompt_length(case)
    if case.kind == "full":
        rows = [spec(f"row {i}", case.base, i) for i in range(T)]
    elif case.kind == "last":
        rows = [spec(f"row {case.last_pos}", case.base, case.last_pos)]
    elif case.kind == "prefill":
        rows, offset = [], 0
        several = len(case.pieces) > 1
        for k, (n, piece_rows) in enumerate(case.pieces):
            for r in piece_rows:
                rows.append(spec(f"piece {k} row {r}" if several else f"row {r}", case.base, offset + r))
            offset += n
    else:
        raise ValueError(f"case {case.id}: unknown kind {case.kind!r}")
    groups = [("logits", rows)]
    if case.decode_len > 0:
        groups.append(("decode", [spec(f"decode {j}", case.base, T + j) for j in range(case.decode_len)]))
    return groups


def _ids(x) -> tuple[int, ...]:
    return tuple(int(t) for t in x)


def _images_within(images: Sequence[tuple[int, int]], T: int) -> tuple[tuple[int, int], ...]:
    """The image blocks that start within the first T positions (a case never cuts one)."""
    return tuple((int(s), int(n)) for s, n in images if s < T)


def build_request(case: Case, bases: Mapping[str, np.ndarray], embed: Callable[[np.ndarray], np.ndarray],
                  media: Mapping[str, BaseMedia] | None = None) -> Request:
    """The backend request. bases maps base id -> token ids (np int64). embed(ids) -> [T, H] float64
    embeddings in the backend's convention (scaled or raw); only called for entry 'embeddings' on text
    bases. ``media`` maps each image base to its ``BaseMedia`` (embeddings already in the backend's
    convention): a case on an image base sends those rows and the image blocks it contains."""
    m = (media or {}).get(case.base) if case.kind != "multi" else None
    if case.kind == "multi":
        return Request(
            kind="multi",
            sequences=tuple(_ids(bases[b][:n]) for b, n, _, _ in case.sequences),
            seq_ids=tuple(int(sid) for _, _, sid, _ in case.sequences),
            decode=tuple(_ids(bases[b][n:n + d]) for b, n, _, d in case.sequences)
            if any(d > 0 for *_, d in case.sequences) else (),
        )
    base = bases[case.base]
    T = _prompt_length(case)
    decode = _ids(base[T:T + case.decode_len])
    if case.kind == "full":
        return Request(kind="full", tokens=_ids(base[:T]), decode=decode)
    images = _images_within(m.images, T) if m is not None else ()
    audio = _images_within(m.audio, T) if m is not None else ()
    audio_inputs = tuple(m.audio_inputs[:len(audio)]) if m is not None else ()
    if case.kind == "last":
        tokens = _ids(base[:T])
        embeddings = None
        if m is not None:
            embeddings = np.asarray(m.embeddings[:T], dtype=np.float64)
        elif case.entry == "embeddings":
            embeddings = np.asarray(embed(np.asarray(tokens, dtype=np.int64)), dtype=np.float64)
        return Request(kind="last", tokens=tokens, entry=case.entry, last_pos=case.last_pos, seq_id=case.seq_id,
                       embeddings=embeddings, decode=decode, images=images, audio=audio, audio_inputs=audio_inputs)
    if case.kind == "prefill":
        pieces, offset = [], 0
        for n, rows in case.pieces:
            rows_embeddings = None if m is None else np.asarray(m.embeddings[offset:offset + n], dtype=np.float64)
            pieces.append(Piece(tokens=_ids(base[offset:offset + n]), rows=tuple(int(r) for r in rows),
                                embeddings=rows_embeddings))
            offset += n
        return Request(kind="prefill", pieces=tuple(pieces), ubatch=case.ubatch, decode=decode, images=images,
                       audio=audio, audio_inputs=audio_inputs)
    raise ValueError(f"case {case.id}: unknown kind {case.kind!r}")


def _array(x) -> np.ndarray | None:
    return None if x is None else np.asarray(x)


def response_groups(case: Case, response: Response) -> list[np.ndarray | None]:
    """Split a Response into arrays matching row_groups(case) (logits, then decode group(s)).

    Shapes are not checked here (the grader does); a missing group is None.
    """
    groups = row_groups(case)
    out: list[np.ndarray | None] = [_array(response.logits)]
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


# ----------------------------------------------------------------------------------------------
# the matrix


def model_features(cfg) -> tuple[str, ...]:
    """Model feature tags of a ``refimpl.config.TextConfig``."""
    tags = []
    if cfg.has_ple:
        tags.append("ple")
    if cfg.num_kv_shared_layers > 0:
        tags.append("kv-shared")
        if cfg.use_double_wide_mlp:
            tags.append("double-wide")
    if cfg.enable_moe_block:
        tags.append("moe")
    if any(layer.k_eq_v for layer in cfg.layers):
        tags.append("k=v")
    if cfg.final_logit_softcapping is not None:
        tags.append("softcap")
    heads = cfg.num_attention_heads
    kv = {layer.num_kv_heads for layer in cfg.layers}
    if any(1 < k < heads for k in kv):
        tags.append("gqa")
    if 1 in kv and heads > 1:
        tags.append("mqa")
    if not cfg.tie_word_embeddings:
        tags.append("untied")
    return tuple(tags)


def random_base_length(cfg) -> int:
    """Length of the random bases A, B, C: the longest prompt plus decode of the matrix fits."""
    W = cfg.sliding_window
    need = max(2 * W + 5, 2 * W + 4, W + 12, 2 * W + 3, 2 * UBATCH + 1) + DECODE_STEPS
    return max(MIN_RANDOM_BASE, need)


def _length_tags(T: int, W: int) -> list[str]:
    return {W - 1: ["window-1"], W: ["window"], W + 1: ["window+1"], 2 * W + 3: ["2window+3"]}.get(T, [])


def _unique(tags) -> tuple[str, ...]:
    return tuple(dict.fromkeys(tags))


def _prefill_tags(pieces, ubatch, W) -> list[str]:
    tags = []
    if ubatch is not None:
        tags.append("ubatch")
    empty_micro = False
    for n, rows in pieces:
        step = ubatch or n
        for start in range(0, n, step):
            if not any(start <= r < start + step for r in rows):
                empty_micro = True
        if any(r < n - 1 for r in rows):
            tags.append("interior")
        if len(rows) > 1:
            tags.append("multi-row")
        if not rows:
            tags.append("no-output-piece")
    if empty_micro:
        tags.append("no-output-ubatch")
    if len(pieces) > 1:
        tags.append("chunked")
        if any(n > W for n, _ in pieces):
            tags.append("chunk>window")
    return tags


class _SeqIds:
    """Non-zero, varied, small sequence ids (small so adapters with a slot limit can use them directly)."""

    POOL = (3, 1, 6, 2, 7, 5, 4)

    def __init__(self):
        self.k = 0

    def next(self) -> int:
        v = self.POOL[self.k % len(self.POOL)]
        self.k += 1
        return v


def _prompt_bases(bases: Mapping[str, Sequence[int]]) -> list[str]:
    ids = [b for b in bases if b.startswith(PROMPT_PREFIX) and b[len(PROMPT_PREFIX):].isdigit()]
    return sorted(ids, key=lambda b: int(b[len(PROMPT_PREFIX):]))


def generate_cases(set_name: str, cfg, bases: Mapping[str, Sequence[int]]) -> list[Case]:
    """The case matrix for one model (docs/fixtures.md lists it).

    ``bases`` must hold A, B, C (random, at least ``random_base_length(cfg)`` tokens), optionally G
    (a prompt followed by GENERATION_STEPS greedy tokens) and P0, P1, ... (user prompts, each followed by
    PROMPT_CONTINUATION greedy tokens). ``ties`` and ``moe_min_margin`` are left empty: they need the
    oracle's logits and are filled by ``annotate``.
    """
    W, U, D = cfg.sliding_window, UBATCH, DECODE_STEPS
    model = model_features(cfg)
    lengths = {b: len(t) for b, t in bases.items()}
    for b in RANDOM_BASES:
        if b not in lengths:
            raise ValueError(f"base {b} is missing")
        if lengths[b] < random_base_length(cfg):
            raise ValueError(f"base {b} has {lengths[b]} tokens; the matrix needs {random_base_length(cfg)}")
    seq = _SeqIds()
    cases: list[Case] = []
    p = f"{set_name}/"

    def add(case: Case, extra: Sequence[str] = ()) -> None:
        T = _prompt_length(case)
        tags = [case.kind] + ([case.entry] if case.kind == "last" else []) + list(extra)
        if case.kind != "multi":
            tags += _length_tags(T, W)
        if case.decode_len > 0 or any(d > 0 for *_, d in case.sequences):
            tags.append("decode")
        if case.generation:
            tags.append("generation")
        case = replace(case, features=_unique(tags + list(model)))
        problems = check_case(case, lengths)
        if problems:
            raise ValueError(problems[0])
        cases.append(case)

    def last(base: str, T: int, pos: int, entry: str, extra=(), generation=False, decode=D) -> None:
        sid = seq.next() if entry != "plain" else None
        tags = list(extra) + (["interior"] if pos < T - 1 else [])
        gen = "/generation" if generation else ""
        golden = tuple(int(t) for t in bases[base][T:T + decode + 1]) if generation else ()
        add(Case(f"{p}last/{entry}/{base}/T{T}/pos{pos}{gen}", "last", base, T, entry=entry, last_pos=pos,
                 seq_id=sid, decode_len=decode, generation=generation, golden_tokens=golden), tags)

    def prefill(base: str, pieces, ubatch, label: str, extra=()) -> None:
        pieces = tuple((n, tuple(rows)) for n, rows in pieces)
        T = sum(n for n, _ in pieces)
        ub = f"/ub{ubatch}" if ubatch else ""
        add(Case(f"{p}prefill/{base}/T{T}/{label}{ub}", "prefill", base, T, pieces=pieces, ubatch=ubatch,
                 decode_len=D), list(extra) + _prefill_tags(pieces, ubatch, W))

    # 1. full forward
    for base, T in (("A", W + 1), ("B", 2 * W + 3)):
        add(Case(f"{p}full/{base}/T{T}", "full", base, T, decode_len=D))

    # 2. the three last-logits entry points, one base each, at the last and a middle row
    entry_base = {"plain": "A", "seq_id": "B", "embeddings": "C"}
    for T in dict.fromkeys((W - 1, W, W + 1, 2 * W + 3)):
        if T < 1:
            continue
        for pos in dict.fromkeys((T - 1, T // 2)):
            for entry in ENTRIES:
                last(entry_base[entry], T, pos, entry)

    # 3. output-row prefill: output sets at 2W+3, with and without micro-batches
    T = 2 * W + 3
    sets = [("last", (T - 1,)), ("middle", (T // 2,)), ("first", (0,)), ("middle+last", (T // 2, T - 1)),
            ("all", tuple(range(T)))]
    k = 0
    for label, rows in sets:
        for ubatch in (None, U):
            prefill(RANDOM_BASES[k % 3], [(T, sorted(set(rows)))], ubatch, f"rows-{label}")
            k += 1
    # other micro-batch sizes: one token per micro-batch, and micro-batches wider than the window
    for ubatch in (1, W + 1):
        prefill(RANDOM_BASES[k % 3], [(T, sorted({T // 2, T - 1}))], ubatch, "rows-middle+last")
        k += 1
    # lengths around the micro-batch size
    for T in dict.fromkeys((U - 1, U, U + 1, 2 * U + 1)):
        if T < 1:
            continue
        prefill(RANDOM_BASES[k % 3], [(T, sorted({T // 2, T - 1}))], U, "rows-middle+last")
        k += 1
    # no output row in the first call, the last row in the next
    for ubatch in (None, U):
        prefill(RANDOM_BASES[k % 3], [(2 * W + 1, ()), (3, (2,))], ubatch, f"none-then-last-{2 * W + 1}+3")
        k += 1

    # 4. chunked prefill, the last row of every piece
    plans = [(W + 3, W + 2), (3, W + 4, 5), (1, 1, 2 * W), (W, W, 3)]
    for plan in dict.fromkeys(tuple(n for n in plan if n > 0) for plan in plans):
        if len(plan) < 2:
            continue
        prefill(RANDOM_BASES[k % 3], [(n, (n - 1,)) for n in plan], None, "chunks-" + "+".join(map(str, plan)))
        k += 1

    # 5. multi-sequence packs
    packs = [[("A", W + 1)], [("B", W - 1), ("C", 2 * W + 3)], [("A", 3), ("B", W), ("C", W + 5)]]
    for pack in packs:
        pack = [(b, n) for b, n in pack if n > 0]
        seqs = tuple((b, n, seq.next(), D) for b, n in pack)
        tags = [t for _, n, _, _ in seqs for t in _length_tags(n, W)]
        add(Case(f"{p}multi/" + "+".join(f"{b}-T{n}" for b, n, _, _ in seqs), "multi", seqs[0][0], seqs[0][1],
                 sequences=seqs), ["multi"] + tags)

    # 6. teacher-forced greedy generation on G
    if GENERATION_BASE in bases:
        T = lengths[GENERATION_BASE] - GENERATION_STEPS
        if T < 1:
            raise ValueError(f"base {GENERATION_BASE} must hold a prompt and {GENERATION_STEPS} generated tokens")
        last(GENERATION_BASE, T, T - 1, "plain", generation=True, decode=GENERATION_STEPS - 1)

    # 7. user prompts
    for base in _prompt_bases(bases):
        T = lengths[base] - PROMPT_CONTINUATION
        if T < 1:
            raise ValueError(f"base {base} must hold a prompt and {PROMPT_CONTINUATION} generated tokens")
        d = min(D, lengths[base] - T)
        for pos in dict.fromkeys((T - 1, T // 2)):
            last(base, T, pos, "plain", extra=["prompt"], decode=d)
        rows = sorted({T // 2, T - 1})
        add(Case(f"{p}prefill/{base}/T{T}/rows-middle+last", "prefill", base, T, pieces=((T, tuple(rows)),),
                 decode_len=d), ["prompt"] + _prefill_tags(((T, rows),), None, W))
        if T >= 2:
            plan = (T // 2, T - T // 2)
            pieces = tuple((n, (n - 1,)) for n in plan)
            add(Case(f"{p}prefill/{base}/T{T}/chunks-{plan[0]}+{plan[1]}", "prefill", base, T, pieces=pieces,
                     decode_len=d), ["prompt"] + _prefill_tags(pieces, None, W))

    ids = [c.id for c in cases]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"duplicate case id {dup}")
    return cases


def media_bases(bases: Mapping[str, Sequence[int]], kind: str = "image") -> list[str]:
    prefix = MEDIA_PREFIX[kind]
    ids = [b for b in bases if b.startswith(prefix) and b[len(prefix):].isdigit()]
    return sorted(ids, key=lambda b: int(b[len(prefix):]))


def generate_image_cases(set_name: str, cfg, bases: Mapping[str, Sequence[int]],
                         images: Mapping[str, Sequence[tuple[int, int]]], kind: str = "image") -> list[Case]:
    """The image matrix (docs/fixtures.md): for every image base ``I<k>`` (a prompt of text and image
    blocks ``boi + image x M + eoi``, then at least DECODE_STEPS text tokens), with ``images[I<k>]``
    its blocks ``(first position, M)``; with ``kind="audio"`` the same matrix over the audio bases
    ``S<k>`` (blocks ``boa + audio x M + eoa``; tags ``audio``, ``inside-audio``, ``after-audio``, ``boa``):

    * the embeddings entry (with a sequence id) at two prompt lengths, the block's eoi (the prompt
      ends right after the image) and the full prompt, at the last row and at interior rows: boi, the
      first, middle and last image token, eoi, the first text token after it;
    * output-row prefill of the full prompt: rows inside and right after every block plus the last,
      and every row;
    * chunked prefill split right after a block's eoi and right before a boi (never inside a block),
      and "no output row, then the last" split after the first block.

    Every case decodes DECODE_STEPS text tokens after its prompt. Prompts never cut a block, so
    every row's expected logits are the base's (the bidirectional block is whole in both).
    """
    W, D = cfg.sliding_window, DECODE_STEPS
    model = model_features(cfg)
    bidirectional = kind == "image" and getattr(cfg, "use_bidirectional_attention", None) == "vision"
    lengths = {b: len(t) for b, t in bases.items()}
    seq = _SeqIds()
    cases: list[Case] = []
    p = f"{set_name}/"

    def add(case: Case, extra: Sequence[str]) -> None:
        tags = [case.kind] + ([case.entry] if case.kind == "last" else ["embeddings"]) + [kind] + list(extra)
        if bidirectional:
            tags.append("vision-blocks")
        if case.decode_len > 0:
            tags.append("decode")
        case = replace(case, features=_unique(tags + list(model)))
        problems = check_case(case, lengths, {b: images[b] for b in images})
        if problems:
            raise ValueError(problems[0])
        cases.append(case)

    inside, after = f"inside-{kind}", f"after-{kind}"
    for base in media_bases(bases, kind):
        blocks = [(int(a), int(n)) for a, n in images[base]]
        if not blocks:
            raise ValueError(f"{kind} base {base} has no {kind} block")
        N = lengths[base]
        T_full = N - D
        first, last_block = blocks[0], blocks[-1]
        if T_full <= last_block[0] + last_block[1] + 1:
            raise ValueError(f"{kind} base {base} needs text after its last {kind} block and {D} decode tokens")

        def row_tags(r: int, T: int) -> list[str]:
            tags = []
            for a, n in blocks:
                if r == a - 1:
                    tags.append(MEDIA_OPEN[kind])
                elif a <= r < a + n:
                    tags.append(inside)
                elif r == a + n:
                    tags.append(after)
            if r < T - 1:
                tags.append("interior")
            return tags

        def last(T: int, pos: int) -> None:
            add(Case(f"{p}last/embeddings/{base}/T{T}/pos{pos}", "last", base, T, entry="embeddings", last_pos=pos,
                     seq_id=seq.next(), decode_len=D), row_tags(pos, T))

        # 1. the embeddings entry, the prompt ending right after the first block, then the full prompt
        a, n = first
        T_eoi = a + n + 1
        for pos in dict.fromkeys((T_eoi - 1, a - 1, a, a + n // 2, a + n - 1)):
            last(T_eoi, pos)
        a, n = last_block
        for pos in dict.fromkeys((T_full - 1, a + n + 1, a + n, a + n // 2, a)):
            last(T_full, pos)

        def prefill(pieces, label: str, extra=()) -> None:
            pieces = tuple((k, tuple(rows)) for k, rows in pieces)
            T = sum(k for k, _ in pieces)
            add(Case(f"{p}prefill/{base}/T{T}/{label}", "prefill", base, T, entry="embeddings", pieces=pieces,
                     decode_len=D), list(extra) + _prefill_tags(pieces, None, W))

        # 2. output-row prefill: inside and right after every block, and the last row; every row
        rows = sorted({r for a, n in blocks for r in (a, a + n // 2, a + n - 1, a + n)} | {T_full - 1})
        prefill([(T_full, rows)], f"rows-{kind}+last", [inside, after])
        prefill([(T_full, range(T_full))], "rows-all", [inside, after])

        # 3. chunks split at block boundaries (right after an eoi, right before a boi), and no output row
        #    in the first call
        a, n = first
        cut = a + n + 1
        prefill([(cut, (cut - 1,)), (T_full - cut, (T_full - cut - 1,))], f"chunks-{cut}+{T_full - cut}",
                [after])
        prefill([(cut, ()), (T_full - cut, (T_full - cut - 1,))], f"none-then-last-{cut}+{T_full - cut}")
        a, n = last_block
        cut = a - 1  # the boi starts the second piece
        if cut > 0:
            prefill([(cut, (cut - 1,)), (T_full - cut, (0, n // 2 + 1, T_full - cut - 1))],
                    f"chunks-{cut}+{T_full - cut}", [inside])

    ids = [c.id for c in cases]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"duplicate case id {dup}")
    return cases


# ----------------------------------------------------------------------------------------------
# oracle annotations and structural checks


def top2_margin(row: np.ndarray) -> float:
    """Top-1 minus top-2 logit of one row."""
    top = np.partition(np.asarray(row, dtype=np.float64), -2)[-2:]
    return float(top[1] - top[0])


def _consumed(case: Case) -> list[tuple[str, int]]:
    """(base, number of leading tokens) the case feeds: its prompt plus its decode tokens."""
    if case.kind == "multi":
        return [(b, n + d) for b, n, _, d in case.sequences]
    return [(case.base, _prompt_length(case) + case.decode_len)]


def annotate(case: Case, base_logits: Mapping[str, np.ndarray],
             router_margins: Mapping[str, np.ndarray] | None = None) -> Case:
    """The case with ``ties`` (rows whose oracle top-2 margin < TIE_MARGIN) and ``moe_min_margin`` (the
    smallest per-token router margin over the tokens the case feeds; None without router margins)."""
    ties = []
    for _, rows in row_groups(case):
        for r in rows:
            m = top2_margin(base_logits[r.base][r.position])
            if m < TIE_MARGIN:
                ties.append((r.label, m))
    moe = None
    if router_margins:
        vals = [float(np.min(router_margins[b][:n])) for b, n in _consumed(case) if b in router_margins and n > 0]
        if vals:
            moe = min(vals)
            if not math.isfinite(moe):
                moe = None  # top_k == num_experts: every expert is always chosen
    return replace(case, ties=tuple(ties), moe_min_margin=moe)


def _check_image_case(case: Case, blocks: Sequence[tuple[int, int]], where: str) -> list[str]:
    """A case on an image or audio base: embeddings entry, no cut block, no micro-batches, text decode
    tokens."""
    kind = "an audio" if case.base.startswith(AUDIO_PREFIX) else "an image"
    if case.kind not in ("last", "prefill") or case.entry != "embeddings":
        return [f"{where}: a case on {kind} base must be a 'last' or 'prefill' case with entry 'embeddings'"]
    if case.ubatch is not None:
        return [f"{where}: {kind} case cannot split its prompt into micro-batches (ubatch)"]
    out = []
    T = _prompt_length(case)
    cuts = [T] + list(np.cumsum([n for n, _ in case.pieces])[:-1]) if case.kind == "prefill" else [T]
    for a, n in blocks:
        if any(a < c < a + n for c in cuts):
            out.append(f"{where}: the {kind[kind.index(' ') + 1:]} block at {a} ({n} tokens) is cut by the prompt's end "
                       "or a piece boundary")
        if T <= a < T + case.decode_len:
            out.append(f"{where}: its decode tokens run into the {kind[kind.index(' ') + 1:]} block at {a}; decode "
                       "tokens must be text")
    return out


def check_case(case: Case, base_lengths: Mapping[str, int],
               base_images: Mapping[str, Sequence[tuple[int, int]]] | None = None) -> list[str]:
    """Structural problems of a case against the bases' lengths and image blocks (empty list = fine)."""
    where = f"case {case.id}"
    out: list[str] = []
    blocks = (base_images or {}).get(case.base)
    if blocks is not None:
        out += _check_image_case(case, blocks, where)
    if case.kind not in KINDS:
        return [f"{where}: unknown kind {case.kind!r}"]
    if case.entry not in ENTRIES:
        out.append(f"{where}: unknown entry point {case.entry!r}")
    if case.ubatch is not None and case.ubatch < 1:
        out.append(f"{where}: ubatch must be positive, got {case.ubatch}")
    if case.decode_len < 0:
        out.append(f"{where}: decode_len must be >= 0, got {case.decode_len}")

    def fits(base: str, n: int, what: str) -> None:
        if base not in base_lengths:
            out.append(f"{where}: base {base!r} is not in the set")
        elif n > base_lengths[base]:
            out.append(f"{where}: {what} needs {n} tokens of base {base}, which has {base_lengths[base]}")

    if case.kind == "multi":
        if not case.sequences:
            out.append(f"{where}: a multi case needs sequences")
        sids = [sid for _, _, sid, _ in case.sequences]
        if len(set(sids)) != len(sids):
            out.append(f"{where}: sequence ids must be distinct, got {sids}")
        for s, (b, n, _, d) in enumerate(case.sequences):
            if n < 1 or d < 0:
                out.append(f"{where}: sequence {s} has length {n} and decode {d}")
            fits(b, n + d + (1 if case.generation else 0), f"sequence {s}")
        return out

    T = _prompt_length(case)
    if T < 1:
        out.append(f"{where}: the prompt is empty")
    if case.kind == "last" and not 0 <= case.last_pos < T:
        out.append(f"{where}: last_pos {case.last_pos} is outside the {T} prompt tokens")
    if case.kind == "last" and case.entry != "plain" and case.seq_id is None:
        out.append(f"{where}: entry {case.entry} needs a seq_id")
    if case.kind == "prefill":
        if not case.pieces:
            out.append(f"{where}: a prefill case needs pieces")
        for k, (n, rows) in enumerate(case.pieces):
            if n < 1:
                out.append(f"{where}: piece {k} is empty")
            if list(rows) != sorted(set(rows)) or any(not 0 <= r < n for r in rows):
                out.append(f"{where}: piece {k} rows {list(rows)} must be increasing and within its {n} tokens")
        if case.length != T:
            out.append(f"{where}: length {case.length} is not the sum of the piece lengths ({T})")
    fits(case.base, T + case.decode_len + (1 if case.generation else 0), "the case")
    if case.generation:
        n_rows = sum(len(rows) for _, rows in row_groups(case))
        if case.kind != "last" or case.last_pos != T - 1:
            out.append(f"{where}: a generation case must be a last case at its last row")
        elif len(case.golden_tokens) != n_rows:
            out.append(f"{where}: {len(case.golden_tokens)} golden tokens for {n_rows} rows")
    elif case.golden_tokens:
        out.append(f"{where}: golden tokens on a case that is not a generation case")
    return out
