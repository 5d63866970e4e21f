"""MTP with mlx-vlm's own assisted decoding: ``mlx_vlm.generate.generate_step(draft_model=drafter,
draft_kind="mtp", temperature=0)`` with a Gemma 4 assistant loaded by ``mlx_vlm.speculative.drafters.load_drafter``
(``Gemma4AssistantDraftModel``, for ``gemma4_assistant`` and ``gemma4_unified_assistant`` checkpoints); its
rounds are ``mlx_vlm.speculative.mtp._mtp_rounds``. The gate's MTP requests in mode ``generate`` (black box):
the backend reports the output and, per round, the drafts (the tokens every ``draft_block`` call returns: one
call a round) and the acceptance (``accept_lens``, the drafter's own record of every round, written by
``mlx_vlm.speculative.common._record_speculative_round``).

What mlx-vlm 0.7.10 does, read off its source and reproduced step by step by ``refimpl.mtp`` with these keys
(tests/gate/backends/mlx/test_mlx_vlm_backend.py: every drafter state within 1e-4):

* **query position** ``P-1``: ``_mtp_rounds`` binds the drafter with ``set_shared_kv(kv, kv_offset,
  position=_mtp_draft_position(kv_offset))``, ``_mtp_draft_position(n) = n - 1``, ``kv_offset`` the target
  cache's length P (the pending token's position).
* **keys**: full layers 0 .. P-1 (rejected drafts cut off by ``_slice_shared_kv_after_reject``). Sliding
  layers: the keys handed over within ``|q - k| < W`` (``gemma4_assistant.masks.bidirectional_swa_mask``),
  the local query ``masks._local_window_offset(P - 1, number of keys)``, key i taken as the i-th key handed
  over. While those keys start at position 0 that is P-W .. P-1, ``rotating/P-1``: the declared convention,
  which every round of a prompt up to W follows. Two places depart from it. The first round after a prompt
  longer than W: ``generate_step`` feeds the prompt's last token alone, so the prefill hands over the
  ``RotatingKVCache._update_in_place`` buffer (W slots, rotated: slot 0 holds P-1), and the mask, reading
  slots as positions, drops slot 0: keys P-W .. P-2. Later rounds of such a prompt: the verification hands
  over the ``BufferedRotatingKVCache`` of ``_buffer_mtp_target_cache`` (temporal order from P0 - W, P0 the
  prompt length), the local query is clamped to the number of keys (one past the last), and the window keeps
  P-W+1 .. P-1, target-cache's W - 1 keys, queried at P-1.
* **drafts a round**: ``bs - 1`` with ``bs = _mtp_next_block_size(..., max_tokens - emitted + 1)``, i.e.
  min(num_drafts, budget), one more than the protocol's min(num_drafts, budget - 1) in the rounds where the
  budget ends; a round without drafts never happens (``bs <= 1`` ends the loop).

The run stops at an end-of-sequence id of the target, as ``mlx_vlm.generate.stream_generate`` does. A
``gemma4_text`` target (``Gemma4ForCausalLM``) cannot run it: its ``LanguageModel`` returns no hidden states
nor shared K/V, and ``run_speculative_rounds`` fails reading ``hidden_states[-1]`` (a one-line RuntimeError).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_vlm.generate import generate_step
from mlx_vlm.speculative.drafters import load_drafter

from ...protocol.types import BackendError, MtpResponse, Request

__all__ = ["ASSISTANT_TYPES", "CONVENTION", "assisted_generate", "load_assistant"]

CONVENTION = "rotating/P-1"
ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")


def load_assistant(path: str | Path, dtype: str):
    """The assistant checkpoint at ``path`` through mlx-vlm's drafter loader, its weights cast to ``dtype``."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BackendError(f"mlx-vlm backend: cannot read the drafter's config.json in {path}: {exc}") from exc
    if raw.get("model_type") not in ASSISTANT_TYPES:
        raise BackendError(f"mlx-vlm backend: {path} is not a Gemma 4 assistant (model_type "
                           f"{raw.get('model_type')!r}; expected one of {', '.join(ASSISTANT_TYPES)})")
    try:
        drafter, _ = load_drafter(str(path), kind="mtp")
    except Exception as exc:  # whatever mlx-vlm raises, name the loader and the directory
        raise BackendError(f"mlx-vlm backend: mlx_vlm.speculative.drafters.load_drafter cannot load {path}: "
                           f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc
    target = getattr(mx, dtype)
    drafter.update(tree_map(lambda v: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v,
                            drafter.parameters()))
    mx.eval(drafter.parameters())
    return drafter


def _recorded_rounds(drafter, run) -> list[tuple[int, ...]]:
    """Run ``run()`` with the drafter's ``draft_block`` wrapped; the tokens every call drafted (one call a round)."""
    calls: list[tuple[int, ...]] = []
    inner = drafter.draft_block

    def draft_block(*args, **kwargs):
        tokens = inner(*args, **kwargs)
        calls.append(tuple(int(t) for t in tokens.reshape(-1).tolist()))
        return tokens

    drafter.draft_block = draft_block
    try:
        run()
    finally:
        del drafter.draft_block
    return calls


def assisted_generate(model, drafter, request: Request, eos: set[int]) -> tuple[MtpResponse, dict[str, Any]]:
    """Greedy ``generate_step(draft_model=drafter, draft_kind="mtp")`` for the request, stopping at an id of
    ``eos``; the MTP answer and notes for ``executed``."""
    spec = request.mtp
    output: list[int] = []

    def run():
        steps = generate_step(mx.array([list(map(int, request.tokens))], dtype=mx.int32), model, None, None,
                              max_tokens=spec.max_new_tokens, temperature=0.0, draft_model=drafter,
                              draft_kind="mtp", draft_block_size=spec.num_drafts + 1)
        for token, _ in steps:
            output.append(int(token))
            if output[-1] in eos:
                break
        steps.close()

    try:
        drafts = _recorded_rounds(drafter, run)
    except Exception as exc:  # mlx-vlm's loop failing on this target: one line, named
        raise RuntimeError(f"mlx-vlm backend: mlx-vlm's MTP loop (generate_step, draft_kind='mtp') fails on "
                           f"{type(model).__module__}.{type(model).__name__}: {type(exc).__name__}: "
                           f"{' '.join(str(exc).split())}") from exc
    accepted = [int(a) for a in drafter.accept_lens]
    if len(accepted) != len(drafts) or list(drafter.draft_lens) != [len(d) for d in drafts]:
        raise RuntimeError(f"mlx-vlm backend: the drafter's draft_block calls ({[len(d) for d in drafts]} tokens) "
                           f"do not line up with its round record (draft_lens {list(drafter.draft_lens)}, "
                           f"accept_lens {accepted})")
    return MtpResponse(output=tuple(output), accepted=accepted, drafts=drafts), {
        "mtp": (f"mlx_vlm.generate.generate_step(draft_model=..., draft_kind='mtp', draft_block_size="
                f"{spec.num_drafts + 1}, temperature=0): mlx_vlm.speculative.mtp._mtp_rounds"),
        "drafter": f"{type(drafter).__module__}.{type(drafter).__name__}", "rounds": len(drafts),
        "drafts_per_round": [len(d) for d in drafts]}
