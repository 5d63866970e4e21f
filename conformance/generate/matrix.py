"""The case matrix, made at generation time: which requests a set holds for a model (``generate_cases`` for
the text bases, ``generate_image_cases`` for the image or audio bases), the model's feature tags, and the
oracle's annotations of each case (``annotate``: ties and the MoE router margin). What a case is lives in
``conformance.sets.case``; docs/fixtures.md lists the matrix."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Sequence

import numpy as np

from ..protocol.types import ENTRIES
from ..sets.case import (
    DECODE_STEPS,
    GENERATION_BASE,
    GENERATION_STEPS,
    MEDIA_OPEN,
    MEDIA_PREFIX,
    MIN_RANDOM_BASE,
    PROMPT_CONTINUATION,
    PROMPT_PREFIX,
    RANDOM_BASES,
    TIE_MARGIN,
    UBATCH,
    Case,
    check_case,
    prompt_length,
    row_groups,
)


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


class _TextMatrix:
    """The text case matrix being built: every case added is tagged (entry, lengths against the window, decode,
    generation, the model's features) and checked against the bases' lengths."""

    def __init__(self, set_name: str, cfg, bases: Mapping[str, Sequence[int]]):
        self.p, self.bases, self.W = f"{set_name}/", bases, cfg.sliding_window
        self.model = model_features(cfg)
        self.lengths = {b: len(t) for b, t in bases.items()}
        self.seq = _SeqIds()
        self.cases: list[Case] = []
        self.k = 0  # the random base of the next prefill case: A, B, C in turn

    def add(self, case: Case, extra: Sequence[str] = ()) -> None:
        T = prompt_length(case)
        tags = [case.kind] + ([case.entry] if case.kind == "last" else []) + list(extra)
        if case.kind != "multi":
            tags += _length_tags(T, self.W)
        if case.decode_len > 0 or any(d > 0 for *_, d in case.sequences):
            tags.append("decode")
        if case.generation:
            tags.append("generation")
        case = replace(case, features=_unique(tags + list(self.model)))
        problems = check_case(case, self.lengths)
        if problems:
            raise ValueError(problems[0])
        self.cases.append(case)

    def last(self, base: str, T: int, pos: int, entry: str, extra=(), generation=False, decode=DECODE_STEPS) -> None:
        sid = self.seq.next() if entry != "plain" else None
        tags = list(extra) + (["interior"] if pos < T - 1 else [])
        gen = "/generation" if generation else ""
        golden = tuple(int(t) for t in self.bases[base][T:T + decode + 1]) if generation else ()
        self.add(Case(f"{self.p}last/{entry}/{base}/T{T}/pos{pos}{gen}", "last", base, T, entry=entry, last_pos=pos,
                      seq_id=sid, decode_len=decode, generation=generation, golden_tokens=golden), tags)

    def prefill(self, base: str | None, pieces, ubatch, label: str, extra=()) -> None:
        """A prefill case; on the next random base in turn when ``base`` is None."""
        if base is None:
            base = RANDOM_BASES[self.k % 3]
            self.k += 1
        pieces = tuple((n, tuple(rows)) for n, rows in pieces)
        T = sum(n for n, _ in pieces)
        ub = f"/ub{ubatch}" if ubatch else ""
        self.add(Case(f"{self.p}prefill/{base}/T{T}/{label}{ub}", "prefill", base, T, pieces=pieces, ubatch=ubatch,
                      decode_len=DECODE_STEPS), list(extra) + _prefill_tags(pieces, ubatch, self.W))

    def full_and_last(self) -> None:
        """1. the full forward; 2. the three last-logits entry points, one base each, at the last and a middle row."""
        W = self.W
        for base, T in (("A", W + 1), ("B", 2 * W + 3)):
            self.add(Case(f"{self.p}full/{base}/T{T}", "full", base, T, decode_len=DECODE_STEPS))
        entry_base = {"plain": "A", "seq_id": "B", "embeddings": "C"}
        for T in dict.fromkeys((W - 1, W, W + 1, 2 * W + 3)):
            if T < 1:
                continue
            for pos in dict.fromkeys((T - 1, T // 2)):
                for entry in ENTRIES:
                    self.last(entry_base[entry], T, pos, entry)

    def output_rows(self) -> None:
        """3. output-row prefill: output sets at 2W+3, with and without micro-batches, other micro-batch sizes,
        lengths around the micro-batch size, and no output row in the first call."""
        W, U = self.W, UBATCH
        T = 2 * W + 3
        sets = [("last", (T - 1,)), ("middle", (T // 2,)), ("first", (0,)), ("middle+last", (T // 2, T - 1)),
                ("all", tuple(range(T)))]
        for label, rows in sets:
            for ubatch in (None, U):
                self.prefill(None, [(T, sorted(set(rows)))], ubatch, f"rows-{label}")
        for ubatch in (1, W + 1):  # one token per micro-batch, and micro-batches wider than the window
            self.prefill(None, [(T, sorted({T // 2, T - 1}))], ubatch, "rows-middle+last")
        for T in dict.fromkeys((U - 1, U, U + 1, 2 * U + 1)):
            if T >= 1:
                self.prefill(None, [(T, sorted({T // 2, T - 1}))], U, "rows-middle+last")
        for ubatch in (None, U):
            self.prefill(None, [(2 * W + 1, ()), (3, (2,))], ubatch, f"none-then-last-{2 * W + 1}+3")

    def chunks_and_packs(self) -> None:
        """4. chunked prefill, the last row of every piece; 5. multi-sequence packs."""
        W = self.W
        plans = [(W + 3, W + 2), (3, W + 4, 5), (1, 1, 2 * W), (W, W, 3)]
        for plan in dict.fromkeys(tuple(n for n in plan if n > 0) for plan in plans):
            if len(plan) >= 2:
                self.prefill(None, [(n, (n - 1,)) for n in plan], None, "chunks-" + "+".join(map(str, plan)))
        packs = [[("A", W + 1)], [("B", W - 1), ("C", 2 * W + 3)], [("A", 3), ("B", W), ("C", W + 5)]]
        for pack in packs:
            pack = [(b, n) for b, n in pack if n > 0]
            seqs = tuple((b, n, self.seq.next(), DECODE_STEPS) for b, n in pack)
            tags = [t for _, n, _, _ in seqs for t in _length_tags(n, W)]
            self.add(Case(f"{self.p}multi/" + "+".join(f"{b}-T{n}" for b, n, _, _ in seqs), "multi", seqs[0][0],
                          seqs[0][1], sequences=seqs), ["multi"] + tags)

    def generation_and_prompts(self) -> None:
        """6. teacher-forced greedy generation on G; 7. the user prompts P0, P1, ..."""
        if GENERATION_BASE in self.bases:
            T = self.lengths[GENERATION_BASE] - GENERATION_STEPS
            if T < 1:
                raise ValueError(f"base {GENERATION_BASE} must hold a prompt and {GENERATION_STEPS} generated tokens")
            self.last(GENERATION_BASE, T, T - 1, "plain", generation=True, decode=GENERATION_STEPS - 1)
        for base in _prompt_bases(self.bases):
            T = self.lengths[base] - PROMPT_CONTINUATION
            if T < 1:
                raise ValueError(f"base {base} must hold a prompt and {PROMPT_CONTINUATION} generated tokens")
            d = min(DECODE_STEPS, self.lengths[base] - T)
            for pos in dict.fromkeys((T - 1, T // 2)):
                self.last(base, T, pos, "plain", extra=["prompt"], decode=d)
            rows = sorted({T // 2, T - 1})
            self.add(Case(f"{self.p}prefill/{base}/T{T}/rows-middle+last", "prefill", base, T,
                          pieces=((T, tuple(rows)),), decode_len=d), ["prompt"] + _prefill_tags(((T, rows),), None,
                                                                                                self.W))
            if T >= 2:
                plan = (T // 2, T - T // 2)
                pieces = tuple((n, (n - 1,)) for n in plan)
                self.add(Case(f"{self.p}prefill/{base}/T{T}/chunks-{plan[0]}+{plan[1]}", "prefill", base, T,
                              pieces=pieces, decode_len=d), ["prompt"] + _prefill_tags(pieces, None, self.W))


def generate_cases(set_name: str, cfg, bases: Mapping[str, Sequence[int]]) -> list[Case]:
    """The case matrix for one model (docs/fixtures.md lists it).

    ``bases`` must hold A, B, C (random, at least ``random_base_length(cfg)`` tokens), optionally G
    (a prompt followed by GENERATION_STEPS greedy tokens) and P0, P1, ... (user prompts, each followed by
    PROMPT_CONTINUATION greedy tokens). ``ties`` and ``moe_min_margin`` are left empty: they need the
    oracle's logits and are filled by ``annotate``.
    """
    lengths = {b: len(t) for b, t in bases.items()}
    for b in RANDOM_BASES:
        if b not in lengths:
            raise ValueError(f"base {b} is missing")
        if lengths[b] < random_base_length(cfg):
            raise ValueError(f"base {b} has {lengths[b]} tokens; the matrix needs {random_base_length(cfg)}")
    m = _TextMatrix(set_name, cfg, bases)
    m.full_and_last()
    m.output_rows()
    m.chunks_and_packs()
    m.generation_and_prompts()
    ids = [c.id for c in m.cases]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"duplicate case id {dup}")
    return m.cases


def media_bases(bases: Mapping[str, Sequence[int]], kind: str = "image") -> list[str]:
    prefix = MEDIA_PREFIX[kind]
    ids = [b for b in bases if b.startswith(prefix) and b[len(prefix):].isdigit()]
    return sorted(ids, key=lambda b: int(b[len(prefix):]))


class _MediaMatrix:
    """The image (audio) case matrix being built, one media base at a time (``generate_image_cases``)."""

    def __init__(self, set_name: str, cfg, bases: Mapping[str, Sequence[int]],
                 images: Mapping[str, Sequence[tuple[int, int]]], kind: str):
        self.p, self.W, self.kind, self.images = f"{set_name}/", cfg.sliding_window, kind, images
        self.model = model_features(cfg)
        self.bidirectional = kind in ("image", "video") and \
            getattr(cfg, "use_bidirectional_attention", None) == "vision"  # a video's frames are vision blocks
        self.lengths = {b: len(t) for b, t in bases.items()}
        self.seq = _SeqIds()
        self.cases: list[Case] = []
        self.inside, self.after = f"inside-{kind}", f"after-{kind}"

    def add(self, case: Case, extra: Sequence[str]) -> None:
        tags = [case.kind] + ([case.entry] if case.kind == "last" else ["embeddings"]) + [self.kind] + list(extra)
        if self.bidirectional:
            tags.append("vision-blocks")
        if case.decode_len > 0:
            tags.append("decode")
        case = replace(case, features=_unique(tags + list(self.model)))
        problems = check_case(case, self.lengths, {b: self.images[b] for b in self.images})
        if problems:
            raise ValueError(problems[0])
        self.cases.append(case)

    def row_tags(self, blocks: list[tuple[int, int]], r: int, T: int) -> list[str]:
        """Where row ``r`` sits: at a block's opening token, inside a block, right after one; interior."""
        tags = []
        for a, n in blocks:
            if r == a - 1:
                tags.append(MEDIA_OPEN[self.kind])
            elif a <= r < a + n:
                tags.append(self.inside)
            elif r == a + n:
                tags.append(self.after)
        if r < T - 1:
            tags.append("interior")
        return tags

    def last(self, base: str, blocks: list[tuple[int, int]], T: int, pos: int) -> None:
        self.add(Case(f"{self.p}last/embeddings/{base}/T{T}/pos{pos}", "last", base, T, entry="embeddings",
                      last_pos=pos, seq_id=self.seq.next(), decode_len=DECODE_STEPS), self.row_tags(blocks, pos, T))

    def prefill(self, base: str, pieces, label: str, extra=()) -> None:
        pieces = tuple((k, tuple(rows)) for k, rows in pieces)
        T = sum(k for k, _ in pieces)
        self.add(Case(f"{self.p}prefill/{base}/T{T}/{label}", "prefill", base, T, entry="embeddings", pieces=pieces,
                      decode_len=DECODE_STEPS), list(extra) + _prefill_tags(pieces, None, self.W))

    def base_cases(self, base: str) -> None:
        """Every case of one media base: the embeddings entry, output-row prefill, chunks at block boundaries."""
        kind, D = self.kind, DECODE_STEPS
        blocks = [(int(a), int(n)) for a, n in self.images[base]]
        if not blocks:
            raise ValueError(f"{kind} base {base} has no {kind} block")
        T_full = self.lengths[base] - D
        first, last_block = blocks[0], blocks[-1]
        if T_full <= last_block[0] + last_block[1] + 1:
            raise ValueError(f"{kind} base {base} needs text after its last {kind} block and {D} decode tokens")
        # 1. the embeddings entry, the prompt ending right after the first block, then the full prompt
        a, n = first
        T_eoi = a + n + 1
        for pos in dict.fromkeys((T_eoi - 1, a - 1, a, a + n // 2, a + n - 1)):
            self.last(base, blocks, T_eoi, pos)
        a, n = last_block
        for pos in dict.fromkeys((T_full - 1, a + n + 1, a + n, a + n // 2, a)):
            self.last(base, blocks, T_full, pos)
        # 2. output-row prefill: inside and right after every block, and the last row; every row
        rows = sorted({r for a, n in blocks for r in (a, a + n // 2, a + n - 1, a + n)} | {T_full - 1})
        self.prefill(base, [(T_full, rows)], f"rows-{kind}+last", [self.inside, self.after])
        self.prefill(base, [(T_full, range(T_full))], "rows-all", [self.inside, self.after])
        # 3. chunks split at block boundaries (right after an eoi, right before a boi), and no output row
        #    in the first call
        a, n = first
        cut = a + n + 1
        self.prefill(base, [(cut, (cut - 1,)), (T_full - cut, (T_full - cut - 1,))], f"chunks-{cut}+{T_full - cut}",
                     [self.after])
        self.prefill(base, [(cut, ()), (T_full - cut, (T_full - cut - 1,))], f"none-then-last-{cut}+{T_full - cut}")
        a, n = last_block
        cut = a - 1  # the boi starts the second piece
        if cut > 0:
            self.prefill(base, [(cut, (cut - 1,)), (T_full - cut, (0, n // 2 + 1, T_full - cut - 1))],
                         f"chunks-{cut}+{T_full - cut}", [self.inside])


def generate_image_cases(set_name: str, cfg, bases: Mapping[str, Sequence[int]],
                         images: Mapping[str, Sequence[tuple[int, int]]], kind: str = "image") -> list[Case]:
    """The image matrix (docs/fixtures.md): for every image base ``I<k>`` (a prompt of text and image
    blocks ``boi + image x M + eoi``, then at least DECODE_STEPS text tokens), with ``images[I<k>]``
    its blocks ``(first position, M)``; with ``kind="audio"`` the same matrix over the audio bases
    ``S<k>`` (blocks ``boa + audio x M + eoa``; tags ``audio``, ``inside-audio``, ``after-audio``, ``boa``); with
    ``kind="video"`` over the video bases ``V<k>``, whose blocks are a video's frames (``boi + video x M + eoi``,
    each after its timestamp's text; tags ``video``, ``inside-video``, ``after-video``, ``boi``):

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
    m = _MediaMatrix(set_name, cfg, bases, images, kind)
    for base in media_bases(bases, kind):
        m.base_cases(base)
    ids = [c.id for c in m.cases]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"duplicate case id {dup}")
    return m.cases



def _consumed(case: Case) -> list[tuple[str, int]]:
    """(base, number of leading tokens) the case feeds: its prompt plus its decode tokens."""
    if case.kind == "multi":
        return [(b, n + d) for b, n, _, d in case.sequences]
    return [(case.base, prompt_length(case) + case.decode_len)]


def annotate(case: Case, top2_margins: Mapping[str, np.ndarray],
             router_margins: Mapping[str, np.ndarray] | None = None) -> Case:
    """The case with ``ties`` (rows whose oracle top-1 minus top-2 logit, ``top2_margins[base][row]`` (the
    row summaries' ``margin``), is < TIE_MARGIN) and ``moe_min_margin`` (the smallest per-token router
    margin over the tokens the case feeds; None without router margins)."""
    ties = []
    for _, rows in row_groups(case):
        for r in rows:
            m = float(top2_margins[r.base][r.position])
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


