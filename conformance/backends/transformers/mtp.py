"""MTP with transformers' own assisted generation: ``generate(assistant_model=drafter)`` with a Gemma 4
assistant (``Gemma4AssistantForCausalLM`` / ``Gemma4UnifiedAssistantForCausalLM``), transformers'
``SinglePositionMultiTokenCandidateGenerator``. The gate's MTP requests in mode ``generate`` (black box): the
backend reports the output and, per round, the drafts and the acceptance, read off a forward hook on the
drafter (every drafter call: its query position and logits; the calls of one round share one position).

transformers' conventions are the ``transformers/P`` of ``refimpl.mtp``: the previous target call's K/V cut to
the sequence length, the last W + 1 sliding entries, the query at P. A round with no draft (the budget's
last token: k = min(num_assistant_tokens, budget - 1) = 0) makes no drafter call; it is recorded as a round
without drafts, as the oracle records it.
"""

from __future__ import annotations

import json
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
from transformers import Gemma4AssistantForCausalLM, Gemma4UnifiedAssistantForCausalLM

from ...protocol.types import BackendError, MtpResponse, Request

__all__ = ["CONVENTION", "assisted_generate", "load_assistant"]

CONVENTION = "transformers/P"
ASSISTANT_CLASSES = {"gemma4_assistant": Gemma4AssistantForCausalLM,
                     "gemma4_unified_assistant": Gemma4UnifiedAssistantForCausalLM}


def load_assistant(path: str | Path, dtype: torch.dtype, attn_implementation: str, device: torch.device):
    """The assistant checkpoint at ``path`` (safetensors only), every weight loaded (lm_head is tied)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BackendError(f"transformers backend: cannot read the drafter's config.json in {path}: {exc}") from exc
    cls = ASSISTANT_CLASSES.get(raw.get("model_type"))
    if cls is None:
        raise BackendError(f"transformers backend: {path} is not a Gemma 4 assistant (model_type "
                           f"{raw.get('model_type')!r}; expected one of {', '.join(ASSISTANT_CLASSES)})")
    model, info = cls.from_pretrained(str(path), dtype=dtype, attn_implementation=attn_implementation,
                                      use_safetensors=True, output_loading_info=True)
    missing = set(info["missing_keys"]) - {"lm_head.weight"}
    if missing or info["mismatched_keys"] or info["unexpected_keys"]:
        raise BackendError(f"transformers backend: the drafter {path} did not load whole: missing {sorted(missing)}, "
                           f"unexpected {info['unexpected_keys']}")
    return model.to(device).eval()


def assisted_generate(target, drafter, request: Request, pad_token_id: int,
                      media: dict | None = None) -> tuple[MtpResponse, dict[str, Any]]:
    """Greedy ``generate(assistant_model=drafter)`` for the request; the MTP answer and notes for ``executed``.

    The rounds are read off two forward hooks: the target's calls (the prefill, then one verification chunk
    of k + 1 tokens a round) and the drafter's (k a round, at the round's position P). A round's acceptance
    follows from the next round's P (P grows by the accepted drafts and the target's token), the last
    round's from the output's length. ``media``: after an image or audio prompt, what ``generate`` takes besides
    the ids (the backend's ``_generate_media``)."""
    spec = request.mtp
    calls: list[tuple[int, int]] = []  # (query position, argmax) of every drafter call
    chunks: list[int] = []  # tokens of every target call

    def on_drafter(module, args, kwargs, out):
        calls.append((int(kwargs["position_ids"][0, -1]), int(out.logits[0, -1].argmax())))

    def on_target(module, args, kwargs):
        x = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        chunks.append(int(x.shape[1]))

    drafter.generation_config.num_assistant_tokens = spec.num_drafts
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    ids = torch.tensor([list(map(int, request.tokens))], dtype=torch.long, device=target.device)
    handles = [drafter.register_forward_hook(on_drafter, with_kwargs=True),
               target.register_forward_pre_hook(on_target, with_kwargs=True)]
    try:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                              max_new_tokens=spec.max_new_tokens, pad_token_id=pad_token_id, **(media or {}))
    finally:
        for h in handles:
            h.remove()
    n = len(request.tokens)
    output = tuple(int(t) for t in out[0, n:])
    sizes = chunks[1:]  # after the prefill: one call a round, k + 1 tokens
    firsts = list(accumulate((size - 1 for size in sizes), initial=0))  # each round's first drafter call
    drafts = [tuple(t for _, t in calls[a:a + size - 1]) for a, size in zip(firsts, sizes, strict=False)]
    # P of a round: its drafter calls' position; a round without drafts (the budget's last token) is the last one
    positions = [calls[a][0] if size > 1 else n + len(output) - 2 for a, size in zip(firsts, sizes, strict=False)]
    ends = positions[1:] + [n + len(output) - 1]  # P of the round after each (the last: past the output)
    accepted = [end - start - 1 for start, end in zip(positions, ends, strict=True)]
    if firsts[-1] != len(calls) or (positions and positions[0] != n) or any(
            p != start for a, size, start in zip(firsts, sizes, positions, strict=False)
            for p, _ in calls[a:a + size - 1]):
        raise RuntimeError("transformers backend: the drafter calls do not line up with the target's verification "
                           f"chunks (calls at {[p for p, _ in calls]}, chunks of {sizes})")
    return MtpResponse(output=output, accepted=accepted, drafts=drafts), {
        "mtp": "generate(assistant_model=...): SinglePositionMultiTokenCandidateGenerator",
        "drafter": type(drafter).__name__, "drafter_calls": len(calls), "positions": positions,
        "verification_chunks": sizes}
