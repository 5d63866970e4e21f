"""The numpy engine's MTP path, built the way llama.cpp's pull request builds it (gemma4-unified-and-mtp-spec.md
B6, B7): the drafter is a second graph over the target's cache, not a second model with its own.

* **One target path.** The prompt and every verification chunk go through the engine's ordinary prefill
  (``Engine.prefill``: rows pruned right before the first KV-shared layer to the output rows); the hidden
  state handed to the drafter is read off the LM head's input for the output rows only
  (``Engine.hidden_log``): the prompt's last row, then every row of a verification chunk, since which row
  the next round needs is known only after verification.
* **A shared cache.** The drafter's layers read the K/V of the target's last KV-owning layer of their type
  straight from the sequence's cache (``store_layer``), as stored: normed and rotated once, by the target.
  Rejected drafts are removed from the cache before the next round (``SequenceCache.truncate``); the
  sliding layers keep a few spare keys while drafting so that a rollback still leaves W - 1 behind.
* **The round loop** (``MtpDriver``): prefill, then per round k drafts at one query position, a verification
  batch of k + 1 output rows, acceptance, rollback, the next hidden row.
* **transformers' convention** needs what the target's last call saw, rejected drafts included: the driver
  keeps the store layers' entries right after each target call (``snapshot``), and cuts them by
  transformers' buffer rule (``refimpl.mtp.handed_over``) instead of reading the rolled-back cache.

Every step a bug can hide in is a method (``DraftModel``, ``MtpDriver``), so the self-test's MTP mutants
(``conformance/selftest/mutants.py``, spec E1) each replace one. Every convention of ``refimpl.mtp`` is served.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from refimpl import RefimplError
from refimpl.assistant import Drafter, centroid_head
from refimpl.config import FULL, SLIDING
from refimpl.model import LayerKV, rope_inv_freq
from refimpl.mtp import CONVENTIONS, TargetCall, handed_over, parse_convention
from refimpl.ops import linear, rope_cos_sin
from refimpl.schedule import apply_rope, attention, gelu_tanh, rms_norm

from ..protocol.types import MtpResponse, Request, Response

__all__ = ["CONVENTIONS_SERVED", "DraftModel", "MtpDriver", "MtpRoundResult", "load_draft_model", "serve_mtp"]

CONVENTIONS_SERVED = CONVENTIONS


class DraftModel:
    """The drafter's graph over the target engine's cache (``engine``: conformance.selftest.engine.Engine)."""

    def __init__(self, drafter: Drafter, engine):
        self.d, self.engine = drafter, engine
        self.cfg, self.acfg = drafter.cfg, drafter.acfg
        self.eps = drafter.cfg.rms_norm_eps
        self.inv_freq = {layer.index: rope_inv_freq(layer.rope, layer.head_dim) for layer in drafter.cfg.layers}
        self.dtype = engine.dtype
        self.media_tokens = 0  # soft tokens in the request's prompt (serve_mtp sets it)

    def w(self, name: str) -> np.ndarray:
        return self.d[name].astype(self.dtype, copy=False)

    # -- what the drafter reads of the target -------------------------------------------------

    def store_layer(self, layer_type: str) -> int:
        """The target layer whose K/V a drafter layer of ``layer_type`` reads: the last KV-owning one of that type."""
        return max(spec.index for spec in self.engine.cfg.layers if spec.owns_kv and spec.layer_type == layer_type)

    def keys(self, kv: LayerKV, layer_type: str) -> np.ndarray:
        """The keys as the drafter attends to them: the target's, already normed and rotated."""
        return kv.k

    def embedding(self, token: int) -> np.ndarray:
        """The target's scaled embedding of ``token`` [H_t] (the target engine's own input row)."""
        return self.engine.model.embed(np.array([int(token)]))[0]

    def position(self, P: int, j: int, rule: str) -> int:
        """The query position of draft step j of a round whose pending token is at P (P counts every position
        of the target's cache, a media prompt's soft tokens included)."""
        return P if rule == "P" else P - 1

    # -- one step -----------------------------------------------------------------------------

    def layer(self, i: int, z: np.ndarray, position: int, kv: LayerKV) -> np.ndarray:
        layer, p = self.cfg.layers[i], f"model.layers.{i}."
        N, D = self.cfg.num_attention_heads, layer.head_dim
        a = rms_norm(z, self.w(p + "input_layernorm.weight"), self.eps)
        q = linear(a, self.w(p + "self_attn.q_proj.weight")).reshape(1, N, D)
        cos, sin = rope_cos_sin(np.array([position]), self.inv_freq[i])
        q = apply_rope(rms_norm(q, self.w(p + "self_attn.q_norm.weight"), self.eps), cos.astype(self.dtype),
                       sin.astype(self.dtype))
        att = attention(q, self.keys(kv, layer.layer_type), kv.v, np.ones((1, kv.k.shape[0]), dtype=bool))
        z = z + rms_norm(linear(att.reshape(1, N * D), self.w(p + "self_attn.o_proj.weight")),
                         self.w(p + "post_attention_layernorm.weight"), self.eps)
        u = rms_norm(z, self.w(p + "pre_feedforward_layernorm.weight"), self.eps)
        m = linear(gelu_tanh(linear(u, self.w(p + "mlp.gate_proj.weight")))
                   * linear(u, self.w(p + "mlp.up_proj.weight")), self.w(p + "mlp.down_proj.weight"))
        z = z + rms_norm(m, self.w(p + "post_feedforward_layernorm.weight"), self.eps)
        return z * self.w(p + "layer_scalar")[0]

    def top_clusters(self) -> int:
        return self.acfg.centroid_intermediate_top_k

    def head(self, z_hat: np.ndarray) -> np.ndarray:
        """Logits [V] of the final-normed state [1, H_a]: the tied table, or the centroid-masked head."""
        if not self.acfg.use_ordered_embeddings:
            return linear(z_hat, self.w("model.embed_tokens.weight"))[0]
        logits, _ = centroid_head(z_hat, self.w("masked_embedding.centroids.weight"), self.d.ordering,
                                  lambda ids: self.d.store.rows("model.embed_tokens.weight", ids, self.dtype),
                                  self.top_clusters(), self.cfg.vocab_size)
        return logits[0]

    def next_hidden(self, z: np.ndarray, z_hat: np.ndarray, h: np.ndarray) -> np.ndarray:
        """The next step's hidden vector [H_t]: post_projection of the final-normed state."""
        return linear(z_hat, self.w("post_projection.weight"))[0]

    def step(self, token: int, h: np.ndarray, position: int, kv: dict[str, LayerKV]) -> tuple[np.ndarray, np.ndarray]:
        """(logits [V], next hidden [H_t]) of one draft step."""
        x = np.concatenate([self.embedding(token), np.asarray(h, dtype=self.dtype)])[None]
        z = linear(x, self.w("pre_projection.weight"))
        for layer in self.cfg.layers:
            z = self.layer(layer.index, z, position, kv[layer.layer_type])
        z_hat = rms_norm(z, self.w("model.norm.weight"), self.eps)
        return self.head(z_hat), self.next_hidden(z, z_hat, h)


@dataclass
class MtpRoundResult:
    drafts: list[int]
    argmax: list[int]
    draft_logits: np.ndarray
    verify_logits: np.ndarray
    verify_hidden: np.ndarray
    accepted: int
    appended: list[int]


@dataclass
class Drafted:
    """A round's drafting, before its verification: the pending token's position P and the token, the drafts
    (forced or the drafter's), the drafter's own argmax and logits rows [k, V]."""

    P: int
    token: int
    drafts: list[int]
    argmax: list[int]
    rows: np.ndarray


@dataclass
class MtpDriver:
    """One request's assisted run on the engine: the prompt's prefill, then rounds (``round``)."""

    backend: object  # the NumpyEngineBackend (its batches and caches)
    draft: DraftModel
    caches: object
    convention: str
    spare: int  # extra sliding keys kept while drafting (the largest chunk), so a rollback leaves W - 1
    rounds: list[MtpRoundResult] = field(default_factory=list)
    placeholders: tuple[int, ...] = ()  # after media: ids a verification feeds the target as the pad id
    seq: int = 0  # the sequence whose cache it drives (a batched request has one driver per sequence)

    def __post_init__(self):
        self.kv_rule, self.pos_rule = parse_convention(self.convention)
        self.engine = self.backend.engine
        self.pad = self.engine.cfg.pad_token_id if self.engine.cfg.pad_token_id is not None else 0
        self.engine.spare_keys = self.spare
        self.cache = self.caches.get(self.seq)
        self.span = slice(None)  # its rows of the engine's last call (a batched call holds every sequence's)

    def prefill(self, request: Request) -> np.ndarray:
        """The request's prompt (text, or with its image and audio blocks) through the engine in one batch, its
        last row the output; logits [1, V]."""
        rows = self.prompt_rows(len(request.tokens), sorted(request.images + request.audio))
        logits = self.engine.prefill(self.caches, self.backend.prompt_batch(self.caches, request, rows))[-1:]
        self.start(logits)
        return logits

    def start(self, logits: np.ndarray) -> None:
        """After the prompt's prefill (its last row ``logits`` [1, V]): the first token and the state of round 1."""
        self.token = int(np.argmax(logits[-1]))
        self.remember(self.first_hidden(self.target_states()))
        self.snapshot(0, True)

    def remember(self, h: np.ndarray) -> None:
        """Keep the hidden state the next round's first draft step reads (this sequence's own)."""
        self.h = h

    def recall(self) -> np.ndarray:
        return self.h

    def prompt_rows(self, n: int, blocks: list[tuple[int, int]]) -> list[int]:
        """The prefill's output rows (the last of them is the prompt's answer): the last row only."""
        return [n - 1]

    def snapshot(self, first: int, prefill: bool) -> None:
        """The store layers' entries right after a target call (rejected drafts still in): transformers' view."""
        self.call = TargetCall({kind: self.cache.read(self.draft.store_layer(kind)) for kind in (SLIDING, FULL)},
                               first, self.cache.length - 1, prefill)

    def target_states(self) -> np.ndarray:
        """The rows the target's last call hands the drafter: its final-norm hidden states (the LM head's input)."""
        return self.engine.hidden_log[-1][self.span]

    def first_hidden(self, states: np.ndarray) -> np.ndarray:
        """The hidden vector of round 1: the prompt's last row."""
        return states[-1]

    def handed_over(self, P: int) -> dict[str, LayerKV]:
        """The keys of the target's store layers the drafter attends to in a round at P (the cache is clean:
        rejected drafts were removed)."""
        W, out = self.engine.cfg.sliding_window, {}
        if self.kv_rule == "transformers":
            return handed_over(self.call, P, W, "transformers")
        for kind in (SLIDING, FULL):
            kv = self.cache.read(self.draft.store_layer(kind))
            first = 0 if kind == FULL else P - W + (1 if self.kv_rule == "target-cache" else 0)
            keep = (kv.pos >= first) & (kv.pos < P)
            out[kind] = LayerKV(kv.k[keep], kv.v[keep], kv.pos[keep])
        return out

    def rollback(self, length: int) -> None:
        """The rejected drafts leave the target's cache (positions from ``length`` on)."""
        self.cache.truncate(length)

    def hidden_for_next(self, verify_hidden: np.ndarray, kept: int) -> np.ndarray:
        """The target row whose hidden state starts the next round: the last accepted token's (row ``kept``)."""
        return verify_hidden[kept]

    def draft_round(self, k: int, forced=None, token: int | None = None) -> Drafted:
        """A round's k draft steps at the convention's query position, from this sequence's state."""
        t = self.token if token is None else int(token)
        P = self.cache.length
        kv = self.handed_over(P)
        drafts, argmax, rows, tok, h = [], [], [], t, self.recall()
        for j in range(k):
            logits, h = self.draft.step(tok, h, self.draft.position(P, j, self.pos_rule), kv)
            argmax.append(int(np.argmax(logits)))
            tok = int(forced[j]) if forced is not None else argmax[-1]
            drafts.append(tok)
            rows.append(logits)
        return Drafted(P, t, drafts, argmax, np.array(rows).reshape(k, self.engine.cfg.vocab_size))

    def chunk(self, d: Drafted) -> list[int]:
        """The verification chunk [t, d_1 .. d_k] as the target gets it (a placeholder id after media: the pad id)."""
        return [self.pad if x in self.placeholders else x for x in [d.token] + d.drafts]

    def settle(self, d: Drafted, v_logits: np.ndarray, accept: int | None = None) -> MtpRoundResult:
        """Right after the target verified ``d`` (its rows ``v_logits``, this sequence's ``span`` of the call):
        the acceptance, the rollback and the next round's token and state."""
        self.snapshot(d.P, False)
        states = self.target_states()  # what the next round's drafter reads; the protocol's hidden rows
        sel = np.argmax(v_logits, axis=-1)
        n, k = 0, len(d.drafts)
        while n < k and d.drafts[n] == sel[n]:
            n += 1
        kept = n if accept is None else int(accept)
        appended = d.drafts[:kept] + [int(sel[kept])]
        self.rollback(d.P + kept + 1)
        self.token = appended[-1]
        self.remember(self.hidden_for_next(states, kept))
        result = MtpRoundResult(d.drafts, d.argmax, d.rows, v_logits, self.engine.hidden_log[-1][self.span], n,
                                appended)
        self.rounds.append(result)
        return result

    def round(self, k: int, forced=None, accept: int | None = None, token: int | None = None) -> MtpRoundResult:
        d = self.draft_round(k, forced, token)
        chunk = self.chunk(d)
        v_logits = self.engine.prefill(self.caches, self.backend.sequence_batch(self.caches, self.seq, chunk,
                                                                                 range(len(chunk))))
        return self.settle(d, v_logits, accept)



def load_draft_model(cls: type[DraftModel], path: str | None, engine) -> DraftModel:
    """The assistant at ``path`` as a ``cls`` graph over ``engine``'s caches (ValueError naming the problem)."""
    if not path:
        raise ValueError("numpy-engine: an mtp request needs the drafter's directory (request.drafter)")
    try:
        return cls(Drafter(path, dtype=engine.dtype), engine)
    except (RefimplError, OSError) as exc:
        raise ValueError(f"numpy-engine: cannot load the drafter {path}: {exc}") from exc


class Schedule:
    """One sequence's rounds: the given ones (mode ``rounds``) or its own greedy loop's (mode ``generate``), and
    the output so far."""

    def __init__(self, spec, first: int, eos: set[int]):
        self.spec, self.eos = spec, eos
        self.out = [int(spec.rounds[0].token)] if spec.mode == "rounds" and spec.rounds else [first]

    def next(self, done: int) -> tuple | None:
        """(k, forced drafts, accepted, token) of round ``done``, or None when the run is over."""
        spec = self.spec
        if spec.mode == "rounds":
            if done >= len(spec.rounds):
                return None
            r = spec.rounds[done]
            return len(r.drafts), r.drafts, r.accepted, r.token
        if len(self.out) >= spec.max_new_tokens or self.out[-1] in self.eos:
            return None
        return min(spec.num_drafts, spec.max_new_tokens - len(self.out) - 1), None, None, None

    def take(self, appended: list[int]) -> None:
        if self.spec.mode == "rounds":
            self.out += appended
            return
        appended = appended[:self.spec.max_new_tokens - len(self.out)]
        cut = next((i for i, t in enumerate(appended) if t in self.eos), None)
        self.out += appended if cut is None else appended[:cut + 1]

    def answer(self, rounds: list[MtpRoundResult], hidden: bool) -> MtpResponse:
        white = self.spec.mode == "rounds"
        return MtpResponse(output=tuple(self.out), accepted=[r.accepted for r in rounds],
                           drafts=[tuple(r.argmax if white else r.drafts) for r in rounds],
                           draft_logits=[r.draft_logits for r in rounds] if white else None,
                           verify_logits=[r.verify_logits for r in rounds] if white else None,
                           verify_hidden=[r.verify_hidden for r in rounds] if white and hidden else None)


def _checked(backend, draft: DraftModel, spec) -> None:
    """ValueError for a convention the engine does not serve or a drafter that does not fit the target."""
    if spec is None or spec.convention not in CONVENTIONS_SERVED:
        raise ValueError(f"numpy-engine: MTP convention {None if spec is None else spec.convention!r} is not "
                         f"one of {', '.join(CONVENTIONS_SERVED)}")
    try:  # the drafter fits the target: a KV-owning layer of each type, the same head dims and KV heads
        draft.d.store_layers(backend.engine.cfg)
    except RefimplError as exc:
        raise ValueError(f"numpy-engine: {exc}") from exc


def serve_mtp(backend, draft: DraftModel, request: Request, caches) -> Response:
    """An MTP request on the numpy engine (``backend``: its NumpyEngineBackend): the rounds given (mode
    ``rounds``) or its own greedy assisted loop (mode ``generate``); a batched one through ``serve_mtp_batch``."""
    if request.mtp_batch:
        return serve_mtp_batch(backend, draft, request, caches)
    spec, engine = request.mtp, backend.engine
    _checked(backend, draft, spec)
    media = bool(request.images or request.audio)
    driver = backend.driver_class(backend, draft, caches, spec.convention, spare=spec.num_drafts + 1,
                                  placeholders=tuple(backend.tokens.placeholders) if media else ())
    draft.media_tokens = sum(n for _, n in request.images + request.audio)  # (what the position mutant leaves out)
    logits = driver.prefill(request)
    prompt_hidden = engine.hidden_log[-1][-1:]
    plan = Schedule(spec, driver.token, set(engine.cfg.eos_token_ids))
    while (step := plan.next(len(driver.rounds))) is not None:
        k, forced, accept, token = step
        plan.take(driver.round(k, forced, accept=accept, token=token).appended)
    return Response(logits, None, {"path": "mtp", "engine": "numpy-engine", "mode": spec.mode,
                                   "convention": spec.convention, "rounds": len(driver.rounds),
                                   "verify_ubatches": len(engine.log) - 1},
                    hidden=prompt_hidden if request.hidden else None, mtp=plan.answer(driver.rounds, request.hidden))


def serve_mtp_batch(backend, draft: DraftModel, request: Request, caches) -> Response:
    """A batched MTP request (spec M15): the prompts prefilled in one multi-sequence batch, then round by round
    every live sequence drafts from its own state and the verification chunks of all go through the target in
    one batch (tokens tagged with their sequences), each sequence's rows then settling its own round."""
    engine, n = backend.engine, len(request.sequences)
    seq_ids = list(request.seq_ids) if request.seq_ids else list(range(n))
    if len(request.mtp_batch) != n or len(set(seq_ids)) != n or any(len(p) == 0 for p in request.sequences):
        raise ValueError(f"numpy-engine: a batched MTP request needs one MtpRequest and one distinct seq_id per "
                         f"non-empty sequence ({n} sequences, {len(request.mtp_batch)} requests, seq_ids {seq_ids})")
    for spec in request.mtp_batch:
        _checked(backend, draft, spec)
    spare = max(spec.num_drafts for spec in request.mtp_batch) + 1
    drivers = [backend.driver_class(backend, draft, caches, spec.convention, spare=spare, seq=sid)
               for spec, sid in zip(request.mtp_batch, seq_ids, strict=True)]
    ids = [int(t) for p in request.sequences for t in p]
    tags = [sid for sid, p in zip(seq_ids, request.sequences, strict=True) for _ in p]
    output = np.zeros(len(ids), dtype=bool)
    output[np.cumsum([len(p) for p in request.sequences]) - 1] = True
    logits = engine.prefill(caches, engine.batch(caches, ids, tags, output))  # [n, V]: each prompt's last row
    prompt_hidden = engine.hidden_log[-1]
    for s, d in enumerate(drivers):
        d.span = slice(s, s + 1)
        d.start(logits[s:s + 1])
    eos = set(engine.cfg.eos_token_ids)
    plans = [Schedule(spec, d.token, eos) for spec, d in zip(request.mtp_batch, drivers, strict=True)]
    calls = 0
    while live := [(s, step) for s in range(n) if (step := plans[s].next(len(drivers[s].rounds))) is not None]:
        drafted = {s: drivers[s].draft_round(k, forced, token) for s, (k, forced, _, token) in live}
        chunks = {s: drivers[s].chunk(drafted[s]) for s, _ in live}
        tokens = [t for s, _ in live for t in chunks[s]]
        v = engine.prefill(caches, engine.batch(caches, tokens, [seq_ids[s] for s, _ in live for _ in chunks[s]],
                                                [True] * len(tokens)))
        calls, at = calls + 1, 0
        for s, (_, _, accept, _) in live:
            drivers[s].span = slice(at, at + len(chunks[s]))
            plans[s].take(drivers[s].settle(drafted[s], v[drivers[s].span], accept).appended)
            at += len(chunks[s])
    spec = request.mtp_batch[0]
    return Response(logits, None, {"path": "mtp-batch", "engine": "numpy-engine", "mode": spec.mode,
                                   "convention": spec.convention, "seq_ids": seq_ids, "verify_calls": calls,
                                   "accepted": [[r.accepted for r in d.rounds] for d in drivers]},
                    hidden=prompt_hidden if request.hidden else None,
                    mtp_batch=[p.answer(d.rounds, request.hidden) for p, d in zip(plans, drivers, strict=True)])
