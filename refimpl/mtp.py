"""Greedy assisted decoding with an MTP drafter, round by round (gemma4-unified-and-mtp-spec.md B6, B7, C).

A run prefills the prompt on the target, takes the first token from its last row, then repeats rounds:

    P = position of the pending token t (the last one the target has not processed)
    h = the target's final-normed state of the last prompt row (round 1), else of the previous
        verification's row n (the last accepted token)
    k drafts: step j reads (token, h) at the one query position P; token <- its argmax (or the forced
        draft), h <- its h_next
    the target verifies [t, d_1 .. d_k] at P .. P+k; n = how many leading drafts equal its argmax;
        it appends d_1 .. d_n and the argmax of row n, then forgets the rejected positions

Greedy assisted decoding produces exactly the tokens of plain greedy decoding, whatever the drafter says.

Where engines differ (spec B7 and Part C) is a named **convention** ``"<kv>/<position>"``:

``kv``        which target keys the drafter's layers attend to (the store layers' K/V):
  ``target-cache`` (the default): the target's own cache for a query at P: full layers 0 .. P-1, sliding
                 layers the W - 1 keys P-W+1 .. P-1, rejected drafts removed first; llama.cpp.
  ``rotating``   rejected drafts removed, sliding layers the W keys P-W .. P-1 (a rotating cache of W
                 entries seen whole); mlx-vlm and mlxcel.
  ``transformers`` transformers 5.24 exactly: the previous target call's K/V truncated to the sequence
                 length L (after a rejection the full layers keep the entry at P, a rejected draft's), and
                 sliding layers the last W + 1 entries of that buffer (rejected drafts included once the
                 context passes W - 1).
``position``  the drafter's query position: ``P`` (transformers, llama.cpp: the default) or ``P-1``
              (mlx-vlm, mlxcel).

docs/refimpl.md ("MTP drafters") says why the default is ``target-cache/P``.

**After an image or audio prompt** (``inputs``: refimpl.multimodal.MultimodalInputs) the prompt is prefilled in
one call with its soft tokens (and vision blocks); positions are the 1-D token index over everything the target
has seen, soft tokens and markers included, so P, the drafter's query position and the keys handed over count
every soft token (spec B9). The drafter's own inputs are text: the pending token and its drafts are embedded as
text ids, and round 1 reads the target's state of the prompt's last row (the text after the last block). A
placeholder id (image, audio, video token) that is generated or drafted reaches the target as the pad id, as in
``refimpl.generate.greedy_generate_multimodal`` and transformers (its forward feeds any placeholder it gets no
features for so); the drafter embeds it as drafted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .arrays import to_host
from .assistant import Drafter
from .config import FULL, SLIDING
from .errors import InputError
from .model import Gemma4, KVCache, LayerKV
from .multimodal import MultimodalInputs

KV_CONVENTIONS = ("target-cache", "rotating", "transformers")
POSITION_CONVENTIONS = ("P", "P-1")
DEFAULT_CONVENTION = "target-cache/P"
CONVENTIONS = tuple(f"{kv}/{pos}" for kv in KV_CONVENTIONS for pos in POSITION_CONVENTIONS)


def parse_convention(convention: str) -> tuple[str, str]:
    """"<kv>/<position>" -> (kv, position); InputError naming the choices otherwise."""
    kv, _, pos = str(convention).partition("/")
    if kv not in KV_CONVENTIONS or pos not in POSITION_CONVENTIONS:
        raise InputError(f"MTP convention must be <kv>/<position> with kv one of {', '.join(KV_CONVENTIONS)} and "
                         f"position one of {', '.join(POSITION_CONVENTIONS)}, got {convention!r}")
    return kv, pos


@dataclass
class TargetCall:
    """What one target call (the prefill or a verification) leaves for the next round's drafter: the store
    layers' K/V of every position the cache held after it (rejected drafts included) and its span."""

    kv: dict[str, LayerKV]  # layer type -> K/V of every position 0 .. last
    first: int  # first position the call processed
    last: int  # last position the call processed
    prefill: bool


def handed_over(call: TargetCall, P: int, window: int, kv_rule: str) -> dict[str, LayerKV]:
    """The keys each drafter layer type attends to in a round whose pending token is at P (module doc)."""
    out = {}
    for kind, kv in call.kv.items():
        pos = kv.pos
        if kv_rule == "transformers":
            L = P + 1  # the sequence length
            if kind == FULL:
                keep = pos <= min(call.last, L - 1)  # the call's buffer 0 .. last, its first L entries
            else:
                a = 0 if call.prefill else max(0, call.first - window + 1)  # cached W - 1 entries + the chunk
                buffer = (pos >= a) & (pos <= min(call.last, a + L - 1))
                kept = np.flatnonzero(buffer)[-(window + 1):]  # the last W + 1 entries of the buffer
                keep = np.zeros_like(buffer)
                keep[kept] = True
        elif kind == FULL:
            keep = pos < P
        else:
            first = P - window + (1 if kv_rule == "target-cache" else 0)
            keep = (pos >= first) & (pos < P)
        out[kind] = LayerKV(to_host(kv.k)[keep], to_host(kv.v)[keep], pos[keep])  # (the drafter runs on the host)
    return out


@dataclass
class MtpRound:
    """One round of assisted decoding."""

    position: int  # P: the pending token's position
    token: int  # the pending token (the first row verified)
    hidden_row: int  # position of the target row whose final-normed state fed the first draft step
    query_position: int  # the drafter's query position (P, or P - 1)
    keys: dict[str, tuple[int, ...]]  # layer type -> positions of the target keys the drafter attended to
    drafts: tuple[int, ...]  # the tokens verified after ``token`` (the drafter's, or the forced ones)
    draft_argmax: tuple[int, ...]  # the drafter's own argmax of each step
    draft_logits: np.ndarray  # [k, V]
    draft_states: np.ndarray  # [k, H_a] the drafter's final-normed states (its head's input)
    verify_logits: np.ndarray  # [k + 1, V] the target's rows for [token, d_1 .. d_k]
    verify_hidden: np.ndarray  # [k + 1, H_t] their final-normed states
    accepted: int  # n: leading drafts equal to the target's argmax
    appended: tuple[int, ...]  # d_1 .. d_n and the target's token after them (cut at the budget and EOS)


@dataclass
class MtpRun:
    """A whole assisted run: the prefill's last row and every round."""

    prompt: tuple[int, ...]
    convention: str
    num_drafts: int
    prefill_logits: np.ndarray  # [1, V] the prompt's last row
    prefill_hidden: np.ndarray  # [1, H_t] its final-normed state
    rounds: list[MtpRound] = field(default_factory=list)
    output: tuple[int, ...] = ()  # the generated tokens (after the prompt)


def _target_call(target: Gemma4, ids: Sequence[int], cache: KVCache, store: dict[str, int],
                 prefill: bool, inputs: MultimodalInputs | None = None) -> tuple[np.ndarray, np.ndarray, TargetCall]:
    """Run ``ids`` through the target's cache: (logits [T, V], final-normed states [T, H], the call's record).
    ``inputs``: a media prompt's ids, embeddings and vision blocks (then ``ids`` is not read)."""
    first = cache.length
    with np.errstate(over="ignore", invalid="ignore"):
        if inputs is None:
            x = target.hidden_states(ids, cache=cache)
        else:
            x = target.hidden_states(inputs.ids, cache=cache, embeddings=inputs.embeddings,
                                     vision_blocks=inputs.vision_blocks)
        y = target.final_norm(x)
        logits = target.logits_of(y)
    kv = {kind: cache.layers[i] for kind, i in store.items()}
    return logits, to_host(y), TargetCall(kv, first, cache.length - 1, prefill)  # (the drafter runs on the host)


class Assisted:
    """One assisted run in progress: the target's cache (keeping every key, so rejected drafts can be
    rolled back), the last target call, the pending token and the hidden state the next round starts
    from. ``start`` prefills the prompt; each ``round`` drafts, verifies and rolls back."""

    def __init__(self, target: Gemma4, drafter: Drafter, prompt: Sequence[int], convention: str = DEFAULT_CONVENTION,
                 inputs: MultimodalInputs | None = None):
        self.kv_rule, self.pos_rule = parse_convention(convention)
        self.target, self.drafter, self.convention = target, drafter, convention
        self.ids = target.check_ids(prompt)
        if inputs is not None and len(inputs.ids) != len(self.ids):
            raise InputError(f"the media prompt's inputs hold {len(inputs.ids)} positions, the prompt "
                             f"{len(self.ids)} tokens")
        self.store = drafter.store_layers(target.cfg)
        self.placeholders = () if inputs is None else inputs.placeholders
        self.pad = target.cfg.pad_token_id if target.cfg.pad_token_id is not None else 0
        self.cache = KVCache(keep_all=True)
        logits, y, self.call = _target_call(target, self.ids, self.cache, self.store, prefill=True, inputs=inputs)
        self.run = MtpRun(tuple(int(t) for t in self.ids), convention, 0, logits[-1:], y[-1:])
        self.token = int(np.argmax(logits[-1]))  # the pending token: the target's first
        self.h, self.h_row = y[-1], len(self.ids) - 1

    def round(self, k: int, forced: Sequence[int] | None = None, accept: int | None = None,
              token: int | None = None, eos: frozenset[int] = frozenset(), budget: int | None = None) -> MtpRound:
        """One round of ``k`` drafts (``forced``: the drafts to verify instead of the drafter's argmax chain).
        ``accept`` forces how many drafts are kept (teacher forcing: the round's ``accepted`` is still the
        target's own judgement) and ``token`` the pending token; ``budget`` cuts what is appended (tokens
        still to generate) and ``eos`` ends it at an end-of-sequence id."""
        target, drafter = self.target, self.drafter
        t = self.token if token is None else int(token)
        P = self.cache.length
        kv = handed_over(self.call, P, target.cfg.sliding_window, self.kv_rule)
        q_pos = P if self.pos_rule == "P" else P - 1
        drafts, argmax, steps, states = [], [], [], []
        tok, state = t, self.h
        for j in range(k):
            step = drafter.step(to_host(target.embed(np.array([tok])))[0], state, q_pos, kv)
            argmax.append(int(np.argmax(step.logits)))
            tok = int(forced[j]) if forced is not None else argmax[-1]
            drafts.append(tok)
            steps.append(step.logits)
            states.append(step.z_hat)
            state = step.h_next
        chunk = np.array([t] + drafts)  # (after media, a placeholder id reaches the target as the pad id)
        chunk = np.where(np.isin(chunk, self.placeholders), self.pad, chunk) if self.placeholders else chunk
        v_logits, v_hidden, self.call = _target_call(target, chunk, self.cache, self.store, prefill=False)
        sel = np.argmax(v_logits, axis=-1)
        n = 0
        while n < k and drafts[n] == sel[n]:
            n += 1
        kept = n if accept is None else int(accept)
        if not 0 <= kept <= k:
            raise InputError(f"a round of {k} drafts cannot accept {kept}")
        appended = list(drafts[:kept]) + [int(sel[kept])]
        appended = appended[:budget] if budget is not None else appended
        for i, a in enumerate(appended):
            if a in eos:
                appended = appended[:i + 1]
                break
        matches = len(appended) - 1
        self.cache.truncate(P + matches + 1)  # keep t and the accepted drafts
        rnd = MtpRound(
            position=P, token=t, hidden_row=self.h_row, query_position=q_pos,
            keys={kind: tuple(int(p) for p in kv[kind].pos) for kind in (SLIDING, FULL) if kind in kv},
            drafts=tuple(drafts), draft_argmax=tuple(argmax),
            draft_logits=np.array(steps).reshape(k, target.cfg.vocab_size),
            draft_states=np.array(states).reshape(k, drafter.cfg.hidden_size), verify_logits=v_logits,
            verify_hidden=v_hidden, accepted=n, appended=tuple(appended))
        self.run.rounds.append(rnd)
        self.token, self.h, self.h_row = appended[-1], v_hidden[matches], P + matches
        return rnd


def assisted_greedy(target: Gemma4, drafter: Drafter, prompt: Sequence[int], max_new_tokens: int,
                    num_drafts: int, convention: str = DEFAULT_CONVENTION,
                    forced: Sequence[Sequence[int]] | None = None, stop_at_eos: bool = True,
                    inputs: MultimodalInputs | None = None) -> MtpRun:
    """Greedy assisted decoding of ``max_new_tokens`` tokens (fewer at an end-of-sequence id), recording
    every round (``MtpRun``). Round r drafts k = min(num_drafts, budget - 1) tokens, as transformers does.

    ``forced`` (teacher forcing): round r verifies ``forced[r]`` instead of the drafter's argmax chain, and
    each draft step reads the forced previous draft; the drafter's logits are still those of its own steps.
    Rounds past the end of ``forced`` draft on their own. The output is plain greedy decoding either way.

    ``inputs`` (refimpl.multimodal.MultimodalInputs of ``prompt``): an image or audio prompt, prefilled in one
    call with its soft tokens and vision blocks; positions count every soft token (P is the cache's length)."""
    if max_new_tokens < 1 or num_drafts < 1:
        raise InputError(f"max_new_tokens and num_drafts must be >= 1, got {max_new_tokens} and {num_drafts}")
    a = Assisted(target, drafter, prompt, convention, inputs=inputs)
    a.run.num_drafts = num_drafts
    eos = frozenset(target.cfg.eos_token_ids) if stop_at_eos else frozenset()
    out = [a.token]
    while len(out) < max_new_tokens and a.token not in eos:
        budget = max_new_tokens - len(out)  # tokens still to generate
        r = len(a.run.rounds)
        force = forced[r] if forced is not None and r < len(forced) else None
        k = min(num_drafts, budget - 1) if force is None else len(force)
        if force is not None and k > budget - 1:
            raise InputError(f"round {r}: {k} forced drafts, but only {budget - 1} fit the budget")
        out += a.round(k, force, eos=eos, budget=budget).appended
    a.run.output = tuple(out)
    return a.run


def run_rounds(target: Gemma4, drafter: Drafter, prompt: Sequence[int],
               rounds: Sequence[tuple[int, Sequence[int], int]], convention: str = DEFAULT_CONVENTION,
               inputs: MultimodalInputs | None = None) -> MtpRun:
    """Teacher-forced rounds, exactly as given: each ``(token, drafts, accepted)`` is the pending token, the
    drafts to verify and how many of them to keep (what an MTP case of the gate prescribes). Each recorded
    round's ``accepted`` is the target's own judgement of those drafts; the output is the first round's token
    and what every round appends (its kept drafts and the target's token after them). ``inputs``: as in
    ``assisted_greedy``."""
    a = Assisted(target, drafter, prompt, convention, inputs=inputs)
    out = [int(rounds[0][0])] if rounds else [a.token]
    for token, drafts, accepted in rounds:
        out += a.round(len(drafts), drafts, accept=accepted, token=token).appended
    a.run.output = tuple(out)
    return a.run
