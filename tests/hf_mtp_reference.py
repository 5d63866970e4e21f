"""transformers 5.24's own assisted generation with a Gemma 4 assistant, in float64, as an independent
reference for ``refimpl.mtp``: ``hf_assisted_run`` runs ``generate(assistant_model=...)`` and records every
drafter call (its position, the K/V lengths it was handed, its logits and its h_next) through a forward hook.

The float32 spots of transformers are patched as for the target (``hf_reference.float64_exact`` for the
Gemma 4 text classes the drafter is built of, ``hf_unified_reference.unified_float64_exact`` for Unified);
the drafter's own modules (``pre_projection``, ``post_projection``, the masked embedder) compute in the
weights' dtype, and its RoPE and embedding buffers are recomputed in float64 like the target's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from hf_reference import float64_exact, load_hf_causal_lm, recompute_float64_buffers
from hf_unified_reference import load_hf_unified, unified_float64_exact
from transformers import Gemma4AssistantForCausalLM, Gemma4UnifiedAssistantForCausalLM

from refimpl.assistant import load_assistant_config
from refimpl.config import load_config


@dataclass
class DrafterCall:
    position: int
    kv_lengths: dict[str, int]
    logits: np.ndarray  # [V]
    h_next: np.ndarray  # [H_t]


@dataclass
class HFAssistedRun:
    output: tuple[int, ...]  # generated tokens
    calls: list[DrafterCall] = field(default_factory=list)


def load_pair(target_dir: str | Path, drafter_dir: str | Path, target=None):
    """(target, drafter) as float64 eager transformers models with float64 buffers (``target``: one already
    loaded, a Gemma4ForConditionalGeneration with its vision tower, say)."""
    cfg = load_config(target_dir)
    if target is None:
        target = load_hf_unified(target_dir) if cfg.family == "gemma4_unified" else load_hf_causal_lm(target_dir)
    cls = (Gemma4UnifiedAssistantForCausalLM if load_assistant_config(drafter_dir).family == "gemma4_unified_assistant"
           else Gemma4AssistantForCausalLM)
    drafter, info = cls.from_pretrained(str(drafter_dir), dtype=torch.float64, attn_implementation="eager",
                                        output_loading_info=True)
    missing = set(info["missing_keys"]) - {"lm_head.weight"}
    if missing or info["mismatched_keys"] or info["unexpected_keys"]:
        raise RuntimeError(f"transformers did not load every drafter weight of {drafter_dir}: missing "
                           f"{sorted(missing)}, unexpected {info['unexpected_keys']}")
    drafter.eval()
    recompute_float64_buffers(drafter)
    return target, drafter


def hf_assisted_run(target, drafter, prompt: Sequence[int], max_new_tokens: int, num_drafts: int,
                    exact=contextlib.nullcontext, **media) -> HFAssistedRun:
    """Greedy ``generate(assistant_model=drafter)`` in float64; every drafter call recorded. ``media``: a media
    prompt's inputs as the processor hands them to ``generate`` (pixel_values, image_position_ids,
    input_features, mm_token_type_ids, ...); ``exact``: a context patching a tower's float32 spots besides."""
    run = HFAssistedRun(output=())

    def hook(module, args, kwargs, out):
        kv = kwargs["shared_kv_states"]
        run.calls.append(DrafterCall(
            position=int(kwargs["position_ids"][0, -1]),
            kv_lengths={kind: int(v[0].shape[2]) for kind, v in kv.items()},
            logits=out.logits[0, -1].detach().numpy().astype(np.float64),
            h_next=out.last_hidden_state[0, -1].detach().numpy().astype(np.float64)))

    drafter.generation_config.num_assistant_tokens = num_drafts
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    handle = drafter.register_forward_hook(hook, with_kwargs=True)
    ids = torch.tensor([list(map(int, prompt))], dtype=torch.long)
    try:
        with exact(), float64_exact(), unified_float64_exact(), torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                  do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, **media)
    finally:
        handle.remove()
    run.output = tuple(int(t) for t in out[0, len(prompt):])
    return run

