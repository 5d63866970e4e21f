"""MTP requests on llama.cpp: a Gemma 4 assistant (drafter) sharing the target's KV cache, driven from Python.

What llama.cpp has, and where it lives:

* **The drafter model.** The vendored converter turns ``gemma4_assistant`` and ``gemma4_unified_assistant``
  checkpoints into the GGUF architecture ``gemma4-assistant`` (``conversion/gemma.py``,
  ``Gemma4AssistantModel``); it **drops the centroid head** (``masked_embedding.*``), so llama.cpp drafts
  with the dense tied head over the whole vocabulary (gemma4-unified-and-mtp-spec.md B3, a documented
  divergence: on ``use_ordered_embeddings`` drafters its draft logits and argmax differ from the oracle's,
  its output does not). Its graph is ``src/models/gemma4-assistant.cpp``.
* **The shared cache.** A context of type ``LLAMA_CONTEXT_TYPE_MTP`` on the drafter model with
  ``llama_context_params.ctx_other`` = the target's context builds its KV cache over the target's
  (``llama-model.cpp``: sliding layers read the target's layer ``n_layer - 2``, full layers ``n_layer - 1``,
  through the target's reuse map; ``llama-kv-cache.cpp``: the cells are the target's, and the drafter
  writes none). Both fields are in ``llama.h`` and in llama-cpp-python's ``llama_context_params``.
  Creating that context **resets the shared cells** (its constructor resizes them), so it is created right
  after the target's context, before the prompt, as ``common/speculative.cpp`` does at startup.
* **The step.** One token a step through the extended batch (``llama_batch_ext_add_token``,
  ``_set_pos``, ``_set_embd_token`` with the hidden vector, ``_set_output_logits``, ``llama_process``),
  all bound by llama-cpp-python. The hidden vectors come from the staging API (``ext``): the target keeps
  every token's final-norm state (``llama_set_embeddings_nextn(target, true, false)``), the drafter its
  ``post_projection`` output for its output row (``(drafter, true, true)``); the drafter's logits are
  ``llama_get_logits_ith``.
* **Not reachable:** the loop itself. ``common_speculative`` (``common/speculative.cpp``, type ``draft-mtp``)
  and the server's verification (``tools/server/server-context.cpp``) are compiled into ``libcommon`` and
  the server, not into the ``libllama`` llama-cpp-python ships. This module ports that loop for one
  sequence, step for step, onto the library's functions.

The loop (``draft-mtp`` with ``is_mem_shared``, greedy): the prompt is one target batch; the pending token t
is the argmax of its last row and h that row's final-norm state. A round at P (t's position) drafts
k = ``get_n_draft_max`` = min(``n_max``, tokens still to generate - 1) tokens, every step at the one
position P ("with shared memory (e.g. Gemma4 assistants) we use the same position for all draft tokens"):
step 0 reads (t, h), step j (its draft j - 1, its h_next); llama.cpp's draft sampler is top-k 10 and takes
the top candidate, i.e. the argmax (``p_min`` 0 and ``n_min`` 0, llama.cpp's defaults: no draft is cut).
The target verifies ``[t, d_1 .. d_k]`` at P .. P + k in one batch (a round with k = 0 is the plain decode
of t), accepts the n leading drafts equal to its argmax, appends them and the argmax of row n, removes
the rest from its cache (``llama_memory_seq_rm(mem, 0, P + n + 1, -1)``: the server's
``seq_rm(slot.id, pos_next, -1)``), and the next h is row n of the verification (``accept``: row
``min(n_accepted, rows - 1)``). The drafter then queries at the next P the target's cache with the target's
causal and sliding masks: full layers 0 .. P - 1, sliding layers P - W + 1 .. P - 1 (the cache holds no
entry at P): convention ``target-cache/P`` (spec B7; measured: every draft step within 1e-5 of the oracle's
drafter on the dense-head synthetic pair, beyond the window and after rejections). The run stops at a token
the vocabulary marks end-of-generation (``llama_vocab_is_eog``, the server's stop), or at the budget.

Mode ``rounds`` runs the same steps teacher-forced: the request's token, drafts and acceptance instead of
the drafter's and the target's choices; every step's drafter logits and every verification row are
answered.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

import numpy as np

from ...protocol.types import BackendError, MtpResponse, Request, Response

# the engine (``engine.LlamaCppEngine``) and its request contexts (``context.LlamaContext``) are passed in: engine
# imports this module, so the annotations below name them without importing them
__all__ = ["ASSISTANT_TYPES", "CONVENTION", "DraftContext", "run_mtp"]

CONVENTION = "target-cache/P"
ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
LLAMA_CONTEXT_TYPE_MTP = 1
LLAMA_PROCESS_TYPE_DECODE = 1
WHO = "llama-cpp backend"


def check_assistant(path: Path) -> dict:
    """The drafter directory's config.json, when it is a Gemma 4 assistant; BackendError otherwise."""
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BackendError(f"{WHO}: cannot read the drafter's config.json in {path}: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("model_type") not in ASSISTANT_TYPES:
        got = raw.get("model_type") if isinstance(raw, dict) else None
        raise BackendError(f"{WHO}: {path} is not a Gemma 4 assistant (model_type {got!r}; expected one of "
                           f"{', '.join(ASSISTANT_TYPES)})")
    return raw


class DraftContext:
    """The drafter's context over the target's (``LLAMA_CONTEXT_TYPE_MTP``, ``ctx_other``), and its batch.

    Create it before the target's first decode: its KV cache takes over the target's cells and resets them."""

    def __init__(self, engine: Any, model, target: Any):
        L, o = engine.L, engine.options
        self.e, self.L, self.target = engine, L, target
        p = L.llama_context_default_params()
        p.n_ctx = L.llama_n_ctx(target.ctx)  # as common_speculative_init_result: the target's size
        p.n_batch = p.n_ubatch = L.llama_n_batch(target.ctx)
        p.n_seq_max = 1
        p.n_threads = p.n_threads_batch = o["threads"]
        p.type_k = p.type_v = target.type_kv  # the target's: the drafter's layers are views of its cache
        p.flash_attn_type = 1 if o["flash_attn"] else 0
        p.swa_full = o["swa_full"]
        p.kv_unified = o["kv_unified"]
        p.no_perf = True
        p.ctx_type = LLAMA_CONTEXT_TYPE_MTP
        p.ctx_other = target.ctx
        self.ctx = L.llama_init_from_model(model, p)
        if not self.ctx:
            raise RuntimeError(f"{WHO}: llama_init_from_model(drafter, ctx_type=MTP, ctx_other=target) failed: "
                               f"{engine._log_tail()}")
        self.batch = None
        try:
            if engine.ext.llama_get_ctx_other(self.ctx) != target.ctx:
                raise RuntimeError(f"{WHO}: the drafter's context does not share the target's memory "
                                   f"(llama_get_ctx_other)")
            engine.ext.llama_set_embeddings_nextn(self.ctx, True, True)
            self.batch = L.llama_batch_ext_init(self.ctx)
            if not self.batch:
                raise RuntimeError(f"{WHO}: llama_batch_ext_init(drafter) failed: {engine._log_tail()}")
        except Exception:
            self.close()
            raise
        self.H = int(L.llama_model_n_embd_out(model))
        self.steps: list[int] = []  # the query position of every step

    def close(self) -> None:
        if self.batch:
            self.L.llama_batch_ext_free(self.batch)
            self.batch = None
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def step(self, token: int, h: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """One drafter step: (token, h) at ``pos``; its logits [V] and h_next [H] (the next step's h)."""
        L, b = self.L, self.batch
        L.llama_batch_ext_clear(b)
        idx = L.llama_batch_ext_add_token(b, 0, int(token))
        if idx < 0:
            raise RuntimeError(f"{WHO}: llama_batch_ext_add_token({token}) returned {idx}")
        hv = np.ascontiguousarray(h, dtype=np.float32)
        embd = L.llama_embd(hv.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, hv.shape[0])
        p = L.llama_pos(int(pos))
        if not (L.llama_batch_ext_set_pos(b, idx, ctypes.byref(p)) and L.llama_batch_ext_set_embd_token(b, idx, embd)
                and L.llama_batch_ext_set_output_logits(b, idx, True)):
            raise RuntimeError(f"{WHO}: cannot fill the drafter's batch (token {token}, position {pos}, h width "
                               f"{hv.shape[0]}): {self.e._log_tail()}")
        rc = L.llama_process(self.ctx, LLAMA_PROCESS_TYPE_DECODE, b)
        self.steps.append(int(pos))
        if rc != 0:
            raise RuntimeError(f"{WHO}: llama_process(drafter) returned {rc} at position {pos}: {self.e._log_tail()}")
        logits = L.llama_get_logits_ith(self.ctx, idx)
        h_next = self.e.ext.llama_get_embeddings_nextn_ith(self.ctx, idx)
        if not logits or not h_next:
            raise RuntimeError(f"{WHO}: the drafter step at position {pos} left no logits or h_next: "
                               f"{self.e._log_tail()}")
        return (np.ctypeslib.as_array(logits, shape=(self.e.n_vocab,)).copy(),
                np.ctypeslib.as_array(h_next, shape=(self.H,)).copy())


def _sizes(request: Request) -> tuple[int, int]:
    """(positions the run may reach, the largest target batch) for the request's context."""
    spec, T = request.mtp, len(request.tokens)
    if spec.mode == "rounds":
        k_max = max((len(r.drafts) for r in spec.rounds), default=0)
        return T + sum(len(r.drafts) + 1 for r in spec.rounds) + 1, max(T, k_max + 1)
    return T + spec.max_new_tokens + spec.num_drafts + 1, max(T, spec.num_drafts + 1)


def _check(engine: Any, request: Request) -> None:
    spec = request.mtp
    if spec is None:
        raise ValueError(f"{WHO}: an mtp request needs its MtpRequest (request.mtp)")
    if spec.convention != CONVENTION:
        raise ValueError(f"{WHO}: MTP convention {spec.convention!r} is not claimed (llama.cpp follows {CONVENTION})")
    if not request.tokens:
        raise ValueError(f"{WHO}: mtp request has no tokens")
    if spec.mode == "generate" and (spec.max_new_tokens < 1 or spec.num_drafts < 1):
        raise ValueError(f"{WHO}: max_new_tokens and num_drafts must be >= 1, got {spec.max_new_tokens} and "
                         f"{spec.num_drafts}")
    if spec.mode == "rounds" and not spec.rounds:
        raise ValueError(f"{WHO}: an mtp request in mode 'rounds' has no rounds")


class _Run:
    """One assisted run: the target's context ``c`` (hidden rows on), the drafter's ``d``, the position P."""

    def __init__(self, engine: Any, c: Any, d: DraftContext, prompt):
        self.e, self.c, self.d = engine, c, d
        self.prefill = c.decode_tokens(prompt, 0, 0, [len(prompt) - 1])
        self.prefill_hidden = c.take_hidden()
        self.h = self.prefill_hidden[0]
        self.P = len(prompt)
        self.rounds: list[dict[str, Any]] = []

    def draft(self, token: int, k: int, forced=None) -> tuple[list[int], np.ndarray]:
        """k steps at P from (token, h): the drafter's argmax per step and its logits [k, V]; a step reads the
        forced previous draft when ``forced`` is given, else its own."""
        argmax, logits, h, tok = [], [], self.h, int(token)
        for j in range(k):
            lg, h = self.d.step(tok, h, self.P)
            argmax.append(int(np.argmax(lg)))
            logits.append(lg)
            tok = int(forced[j]) if forced is not None else argmax[-1]
        return argmax, np.array(logits, dtype=np.float32).reshape(k, self.e.n_vocab)

    def verify(self, token: int, drafts, keep: int | None = None) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The target's rows of [token, *drafts] at P ..; (logits [k+1, V], hidden [k+1, H], its own n, kept).
        Keeps ``token`` and the first ``keep`` drafts (default n) in the cache and moves P past them."""
        k = len(drafts)
        logits = self.c.decode_tokens([int(token), *map(int, drafts)], 0, self.P, range(k + 1))
        hidden = self.c.take_hidden()
        sel = np.argmax(logits, axis=-1)
        n = 0
        while n < k and int(drafts[n]) == int(sel[n]):
            n += 1
        kept = n if keep is None else int(keep)
        if not 0 <= kept <= k:
            raise ValueError(f"{WHO}: a round of {k} drafts cannot accept {kept}")
        L = self.e.L
        if not L.llama_memory_seq_rm(L.llama_get_memory(self.c.ctx), 0, self.P + kept + 1, -1):
            raise RuntimeError(f"{WHO}: llama_memory_seq_rm(0, {self.P + kept + 1}, -1) failed")
        self.rounds.append({"P": self.P, "k": k, "accepted": n, "kept": kept})
        self.h, self.P = hidden[kept], self.P + kept + 1
        return logits, hidden, n, kept


def _rounds(run: _Run, request: Request, white: dict[str, list]) -> MtpResponse:
    """Mode "rounds": the request's rounds, teacher-forced."""
    rounds = request.mtp.rounds
    output, accepted, drafts = [int(rounds[0].token)], [], []
    for r in rounds:
        argmax, dl = run.draft(r.token, len(r.drafts), r.drafts)
        vl, vh, n, kept = run.verify(r.token, r.drafts, r.accepted)
        output += [int(t) for t in r.drafts[:kept]] + [int(np.argmax(vl[kept]))]
        accepted.append(n)
        drafts.append(tuple(argmax))
        white["draft_logits"].append(dl)
        white["verify_logits"].append(vl)
        white["verify_hidden"].append(vh)
    return MtpResponse(output=tuple(output), accepted=accepted, drafts=drafts, **white)


def _generate(run: _Run, request: Request) -> MtpResponse:
    """Mode "generate": llama.cpp's greedy draft-mtp loop (module doc) for max_new_tokens."""
    spec, L = request.mtp, run.e.L
    vocab = L.llama_model_get_vocab(run.e.model)
    token = int(np.argmax(run.prefill[0]))
    output, accepted, drafts = [token], [], []
    while len(output) < spec.max_new_tokens and not L.llama_vocab_is_eog(vocab, token):
        budget = spec.max_new_tokens - len(output)
        k = min(spec.num_drafts, budget - 1)  # get_n_draft_max: min(n_max, n_remaining - 1)
        own, _ = run.draft(token, k)
        vl, _, n, _ = run.verify(token, own)
        appended = own[:n] + [int(np.argmax(vl[n]))]
        for i, t in enumerate(appended):  # process_token: the run ends at an end-of-generation token
            if L.llama_vocab_is_eog(vocab, t):
                appended = appended[:i + 1]
                break
        output += appended[:budget]
        accepted.append(n)
        drafts.append(tuple(own))
        token = output[-1]
    return MtpResponse(output=tuple(output), accepted=accepted, drafts=drafts)


def run_mtp(engine: Any, request: Request) -> Response:
    """An MTP request (module doc): a fresh target context and a drafter context over it, the prompt, the rounds."""
    _check(engine, request)
    spec = request.mtp
    dmodel = engine.drafter_model(request.drafter)
    positions, n_batch = _sizes(request)
    with engine._new_context(1, positions, n_batch, None, hidden=True) as c, \
            DraftContext(engine, dmodel, c) as d:
        if d.H != engine.n_embd:
            raise ValueError(f"{WHO}: the drafter takes hidden states of width {d.H}, the target's are "
                             f"{engine.n_embd} (backbone_hidden_size)")
        run = _Run(engine, c, d, request.tokens)
        white = {"draft_logits": [], "verify_logits": [], "verify_hidden": []}
        mtp = _rounds(run, request, white) if spec.mode == "rounds" else _generate(run, request)
        if spec.mode == "rounds" and not request.hidden:
            mtp.verify_hidden = None
        executed = engine._executed(
            "mtp", c, mode=spec.mode, convention=CONVENTION, drafter=engine.drafter_info(request.drafter),
            drafter_context={"ctx_type": "LLAMA_CONTEXT_TYPE_MTP", "ctx_other": "the target's context",
                             "n_ctx": int(engine.L.llama_n_ctx(d.ctx)), "steps": len(d.steps)},
            rounds=len(run.rounds), positions=[r["P"] for r in run.rounds],
            drafts_per_round=[r["k"] for r in run.rounds], kept=[r["kept"] for r in run.rounds],
            draft_positions=sorted(set(d.steps)),
            loop=("common/speculative.cpp draft-mtp (is_mem_shared) and the server's verification, ported to "
                  "Python over libllama: one query position P a round, seq_rm(P + n + 1, -1), h = row n"))
        return Response(run.prefill, None, executed,
                        hidden=run.prefill_hidden if request.hidden else None, mtp=mtp)
