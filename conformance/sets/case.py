"""What a case is: the frozen ``Case`` record of a fixture set, the rows it returns (``row_groups``), and its
structural rules (``check_case``).

A fixture set stores a few **bases** (token sequences) with their full float64 oracle logits. Every
case is a view on bases: its prompt is a prefix ``base[:T]``, its decode tokens are ``base[T:T+d]``
(teacher forcing), and the expected logits of every row it returns are rows of the base's logits
(causality: row i of a prefix forward equals row i of the base forward). How a request is built for a
case at check time is ``conformance.check.requests``; how the matrix is made at generation time is
``conformance.generate.matrix``. See docs/fixtures.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

from ..protocol.types import ENTRIES, KINDS, MTP_MODES

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
VIDEO_PREFIX = "V"  # video bases V0, V1, ...: prompts with a video's frames (vision blocks; conformance.generate.video)
MEDIA_PREFIX = {"image": IMAGE_PREFIX, "audio": AUDIO_PREFIX, "video": VIDEO_PREFIX}
MEDIA_OPEN = {"image": "boi", "audio": "boa", "video": "boi"}  # the tag of the row before a block
MTP_PREFIX = "M"  # MTP bases M0, M1, ...: prompts with assisted-decoding rounds (mtp.safetensors)
_FIELD = object()


def mtp_rows(base: str, what: str, convention: str | None = None) -> str:
    """The name under which an MTP base's stored rows are graded: ``M0@prompt`` (the prompt's rows),
    ``M0@verify`` (every round's verification rows), ``M0@draft:<convention>`` (every draft step's logits)."""
    return f"{base}@{what}" + (f":{convention}" if convention else "")


@dataclass(frozen=True)
class MtpRoundCase:
    """One round of an MTP case, as the oracle ran it."""

    token: int  # the pending token
    drafts: tuple[int, ...]  # the drafts verified (forced in mode "rounds", the drafter's own in "generate")
    accepted: int  # how many the target accepted
    draft_argmax: tuple[int, ...]  # the drafter's argmax of each step
    draft_margins: tuple[float, ...]  # its top-1 minus top-2 logit at each step (ties are not graded)
    verify_margins: tuple[float, ...]  # the target's top-1 minus top-2 at each verification row

    def to_json(self) -> list:
        return [self.token, list(self.drafts), self.accepted, list(self.draft_argmax), list(self.draft_margins),
                list(self.verify_margins)]


@dataclass(frozen=True)
class MtpCase:
    """What an MTP case asks (``conformance.protocol.types.MtpRequest``) and what the oracle did."""

    mode: str  # "rounds" (white box, teacher-forced) | "generate" (black box, the engine's own loop)
    convention: str  # refimpl.mtp convention, "<kv>/<position>"
    num_drafts: int
    max_new_tokens: int
    rounds: tuple[MtpRoundCase, ...]
    output: tuple[int, ...]  # the generated tokens: plain greedy decoding
    # MTP after media: the image or audio base whose first ``length`` tokens are the prompt (its embeddings,
    # blocks and media inputs travel with the request)
    media: str | None = None

    def to_json(self) -> dict:
        return {"mode": self.mode, "convention": self.convention, "num_drafts": self.num_drafts,
                "max_new_tokens": self.max_new_tokens, "rounds": [r.to_json() for r in self.rounds],
                "output": list(self.output), **({"media": self.media} if self.media is not None else {})}

    @staticmethod
    def from_json(d: Any, where: str) -> "MtpCase":
        def bad(what: str):
            return ValueError(f"{where}: field 'mtp' {what}")

        if not isinstance(d, dict) or set(d) - {"media"} != {"mode", "convention", "num_drafts", "max_new_tokens",
                                                             "rounds", "output"}:
            raise bad("must be an object with mode, convention, num_drafts, max_new_tokens, rounds and output (and "
                      "optionally media)")
        if d.get("media") is not None and not isinstance(d["media"], str):
            raise bad(f"has media {d['media']!r}: the name of an image or audio base")
        if d["mode"] not in MTP_MODES or not isinstance(d["convention"], str):
            raise bad(f"has mode {d['mode']!r} (one of {', '.join(MTP_MODES)}) and convention {d['convention']!r}")

        def ints(v, what):
            if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise bad(f"{what} must be a list of integers, got {v!r}")
            return tuple(v)

        def nums(v, what):
            if not isinstance(v, list) or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in v):
                raise bad(f"{what} must be a list of numbers, got {v!r}")
            return tuple(float(t) for t in v)

        for key in ("num_drafts", "max_new_tokens"):
            if not isinstance(d[key], int) or isinstance(d[key], bool) or d[key] < 1:
                raise bad(f"{key} must be a positive integer, got {d[key]!r}")
        rounds = []
        for r in d["rounds"] if isinstance(d["rounds"], list) else [None]:
            if not (isinstance(r, list) and len(r) == 6 and isinstance(r[0], int) and isinstance(r[2], int)):
                raise bad(f"rounds must hold [token, drafts, accepted, draft_argmax, draft_margins, verify_margins], "
                          f"got {r!r}")
            rounds.append(MtpRoundCase(r[0], ints(r[1], "drafts"), r[2], ints(r[3], "draft_argmax"),
                                       nums(r[4], "draft_margins"), nums(r[5], "verify_margins")))
        return MtpCase(d["mode"], d["convention"], d["num_drafts"], d["max_new_tokens"], tuple(rounds),
                       ints(d["output"], "output"), d.get("media"))


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
    mtp: MtpCase | None = None  # kind "mtp": the assisted-decoding request and the oracle's rounds
    # batched MTP (kind "mtp", ``sequences`` its prompts, ``mtp`` None): one MtpCase per sequence, run concurrently
    mtp_batch: tuple[MtpCase, ...] = ()

    def to_json(self) -> dict:
        return {
            "id": self.id, "kind": self.kind, "base": self.base, "length": self.length, "entry": self.entry,
            "last_pos": self.last_pos, "seq_id": self.seq_id,
            "pieces": [[n, list(rows)] for n, rows in self.pieces], "ubatch": self.ubatch,
            "sequences": [list(s) for s in self.sequences], "decode_len": self.decode_len,
            "generation": self.generation, "features": list(self.features),
            "ties": [[label, margin] for label, margin in self.ties], "moe_min_margin": self.moe_min_margin,
            "golden_tokens": list(self.golden_tokens),
            **({"mtp": self.mtp.to_json()} if self.mtp is not None else {}),
            **({"mtp_batch": [m.to_json() for m in self.mtp_batch]} if self.mtp_batch else {}),
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
        if d.get("mtp") is not None:
            kw["mtp"] = MtpCase.from_json(d["mtp"], where)
        kw["mtp_batch"] = tuple(MtpCase.from_json(m, f"{where} (mtp_batch)") for m in lst("mtp_batch"))
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
    audio_inputs: tuple = ()  # conformance.protocol.AudioInput per audio block (features, mask)
    image_inputs: tuple = ()  # conformance.protocol.ImageInput per image block (pixel_values, positions)
    videos: tuple[tuple[int, int], ...] = ()  # (index in images of its first frame, frames) per video


def shared_prefix(a: Sequence[int], b: Sequence[int] | None) -> int:
    """How many leading tokens two bases share (0 when ``b`` is None): the rows up to there are the same prompt's
    in both (a generation base continues each model's own greedy choice, so two models' may part)."""
    if b is None:
        return 0
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def prompt_length(case: Case) -> int:
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

    T = prompt_length(case)
    if case.kind == "mtp" and case.mtp_batch:  # each sequence's groups, as its solo case's
        return [(f"seq {s} {name}", [RowSpec(f"seq {s} {r.label}", r.base, r.position) for r in rows])
                for s, solo in enumerate(solo_cases(case)) for name, rows in mtp_groups(solo)]
    if case.kind == "mtp":
        return mtp_groups(case)
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


def solo_cases(case: Case) -> list[Case]:
    """A batched MTP case as the solo MTP case of each of its sequences (what each is graded against)."""
    return [Case(id=f"{case.id}#seq{s}", kind="mtp", base=b, length=n, features=case.features, mtp=m)
            for s, ((b, n, _, _), m) in enumerate(zip(case.sequences, case.mtp_batch, strict=True))]


def mtp_groups(case: Case) -> list[tuple[str, list[RowSpec]]]:
    """An MTP case's rows: the prompt's last row, then per round (mode "rounds") its draft steps' logits and
    its verification rows, read from the base's stored MTP rows (``mtp_rows``)."""
    m = case.mtp
    groups = [("logits", [RowSpec("prompt last", mtp_rows(case.base, "prompt"), case.length - 1)])]
    if m is None or m.mode != "rounds":
        return groups
    drafts, verify = mtp_rows(case.base, "draft", m.convention), mtp_rows(case.base, "verify")
    d = v = 0
    for r, rnd in enumerate(m.rounds):
        k = len(rnd.drafts)
        groups.append((f"round {r} drafts", [RowSpec(f"round {r} draft {j}", drafts, d + j) for j in range(k)]))
        groups.append((f"round {r} verify", [RowSpec(f"round {r} verify {i}", verify, v + i) for i in range(k + 1)]))
        d, v = d + k, v + k + 1
    return groups


def _check_mtp_case(case: Case, where: str) -> list[str]:
    m = case.mtp
    if case.mtp_batch:
        if m is not None or len(case.mtp_batch) != len(case.sequences) or len(case.sequences) < 2 or \
                len({(x.mode, x.convention) for x in case.mtp_batch}) != 1:
            return [f"{where}: a batched mtp case needs one 'mtp_batch' entry per sequence (at least 2, one mode and "
                    "convention) and no 'mtp'"]
        return [p for solo in solo_cases(case) for p in _check_mtp_case(solo, where)]
    if m is None:
        return [f"{where}: an mtp case needs its 'mtp' field"]
    out = []
    if not case.base.startswith(MTP_PREFIX):
        out.append(f"{where}: an mtp case must be on an MTP base ({MTP_PREFIX}0, {MTP_PREFIX}1, ...), not {case.base}")
    for r, rnd in enumerate(m.rounds):
        k = len(rnd.drafts)
        if k > m.num_drafts or not 0 <= rnd.accepted <= k or len(rnd.draft_argmax) != k or \
                len(rnd.draft_margins) != k or len(rnd.verify_margins) != k + 1:
            out.append(f"{where}: round {r} has {k} drafts (at most {m.num_drafts}), accepted {rnd.accepted}, and "
                       f"{len(rnd.draft_argmax)} argmax, {len(rnd.draft_margins)} draft and {len(rnd.verify_margins)} "
                       "verify margins")
    if not 1 <= len(m.output) <= m.max_new_tokens:
        out.append(f"{where}: {len(m.output)} output tokens for max_new_tokens {m.max_new_tokens}")
    return out


def _check_image_case(case: Case, blocks: Sequence[tuple[int, int]], where: str) -> list[str]:
    """A case on an image or audio base: embeddings entry, no cut block, no micro-batches, text decode
    tokens."""
    kind = "an audio" if case.base.startswith(AUDIO_PREFIX) else "an image"
    if case.kind not in ("last", "prefill") or case.entry != "embeddings":
        return [f"{where}: a case on {kind} base must be a 'last' or 'prefill' case with entry 'embeddings'"]
    if case.ubatch is not None:
        return [f"{where}: {kind} case cannot split its prompt into micro-batches (ubatch)"]
    out = []
    T = prompt_length(case)
    cuts = [T] + list(np.cumsum([n for n, _ in case.pieces])[:-1]) if case.kind == "prefill" else [T]
    for a, n in blocks:
        if any(a < c < a + n for c in cuts):
            out.append(f"{where}: the {kind[kind.index(' ') + 1:]} block at {a} ({n} tokens) is cut by the prompt's "
                       "end or a piece boundary")
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
    if case.kind == "mtp" or case.mtp is not None or case.mtp_batch:
        if case.kind != "mtp":
            return [f"{where}: field 'mtp' on a {case.kind} case"]
        out += _check_mtp_case(case, where)
        if case.mtp_batch:
            return out + [p for solo in solo_cases(case) if not out
                          for p in check_case(solo, base_lengths, base_images)]
        media = case.mtp.media if case.mtp else None
        if media is not None and (media not in base_lengths or case.length > base_lengths[media]):
            out.append(f"{where}: its prompt is the first {case.length} tokens of media base {media!r}, which the set "
                       f"does not have" + (f" (it has {base_lengths[media]} tokens)" if media in base_lengths else ""))
        if case.base not in base_lengths:
            out.append(f"{where}: base {case.base!r} is not in the set")
        elif case.length + len(case.mtp.output if case.mtp else ()) > base_lengths[case.base] or case.length < 1:
            out.append(f"{where}: the prompt ({case.length}) and output need more tokens than base {case.base} has "
                       f"({base_lengths[case.base]})")
        return out
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

    T = prompt_length(case)
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


