"""Greedy generation through the KV cache (text, image or audio prompts), and teacher-forced scoring of a given
continuation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .errors import InputError
from .model import Gemma4, KVCache
from .multimodal import MultimodalInputs, MultimodalTokens, multimodal_inputs


@dataclass
class Generation:
    tokens: list[int]  # the new tokens, including the stop token if one was produced
    stopped: bool  # True when a stop id ended the generation before max_new_tokens
    margins: list[float]  # top-1 minus top-2 logit of each step (near-ties are small)


def greedy_generate(model: Gemma4, prompt: Sequence[int], max_new_tokens: int,
                    stop_ids: Sequence[int] | None = None,
                    on_token: Callable[[int], None] | None = None) -> Generation:
    """Prefill the prompt, then decode one token at a time, taking the argmax (lowest id on ties).

    Stops after ``max_new_tokens`` or on a stop id (default: the checkpoint's eos ids).
    """
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if max_new_tokens == 0:
        return Generation([], False, [])
    cache = KVCache()
    logits = model.forward(prompt, rows="last", cache=cache)[0]
    return _decode_greedily(model, cache, logits, max_new_tokens, stop_ids, on_token)


def greedy_generate_multimodal(model: Gemma4, ids: Sequence[int] | np.ndarray, soft_tokens: Sequence[np.ndarray],
                               tokens: MultimodalTokens, max_new_tokens: int,
                               stop_ids: Sequence[int] | None = None,
                               on_token: Callable[[int], None] | None = None, *,
                               audio_soft_tokens: Sequence[np.ndarray] = (),
                               video_soft_tokens: Sequence[np.ndarray] = ()) -> Generation:
    """``greedy_generate`` after an image and/or audio prompt.

    ``ids`` is the expanded prompt (``boi + image_token x M_i + eoi`` for image i, e.g. from
    ``refimpl.multimodal.expand_image_placeholders``) and ``soft_tokens`` the [M_i, H] soft tokens of
    each image in prompt order (``refimpl.vision.vision_tower``). The whole prompt, images included, is
    prefilled in one cached call (an image block is never split: on bidirectional checkpoints its
    tokens see each other), built by ``multimodal_inputs`` (pad-row PLE, unscaled soft tokens, vision
    block ids); the new tokens are then decoded as text through the cache. Audio clips work the same
    way: ``ids`` holds ``boa + audio_token x A_j + eoa`` for clip j and ``audio_soft_tokens`` their
    [A_j, H] soft tokens in prompt order (``refimpl.audio.audio_tower``); they are causal. Video frames likewise
    (``video_soft_tokens``, one [N, H] a frame; refimpl.video). A generated placeholder id (image, video or audio
    token) is fed back as ``pad_token_id``, as transformers' forward does with any placeholder it gets no features
    for. Inputs are checked even when ``max_new_tokens`` is 0.
    """
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    m = multimodal_inputs(model, ids, soft_tokens, tokens, audio_soft_tokens=audio_soft_tokens,
                          video_soft_tokens=video_soft_tokens)
    return greedy_generate_inputs(model, m, max_new_tokens, stop_ids, on_token)


def greedy_generate_inputs(model: Gemma4, inputs: MultimodalInputs, max_new_tokens: int,
                           stop_ids: Sequence[int] | None = None,
                           on_token: Callable[[int], None] | None = None) -> Generation:
    """``greedy_generate_multimodal`` from the prompt's merged inputs (``multimodal_inputs``): one cached prefill,
    then text decode, a generated placeholder id (``inputs.placeholders``) fed back as ``pad_token_id``."""
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if max_new_tokens == 0:
        return Generation([], False, [])
    cache = KVCache()
    logits = model.forward(inputs.ids, rows="last", cache=cache, embeddings=inputs.embeddings,
                           vision_blocks=inputs.vision_blocks)[0]
    pad = model.cfg.pad_token_id if model.cfg.pad_token_id is not None else 0
    placeholders = set(inputs.placeholders)
    return _decode_greedily(model, cache, logits, max_new_tokens, stop_ids, on_token,
                            feed=lambda t: pad if t in placeholders else t)


def _decode_greedily(model: Gemma4, cache: KVCache, logits: np.ndarray, max_new_tokens: int,
                     stop_ids: Sequence[int] | None, on_token: Callable[[int], None] | None,
                     feed: Callable[[int], int] = int) -> Generation:
    """The decode loop after a prefill whose last-row logits are ``logits`` [V] (max_new_tokens >= 1);
    ``feed(token)`` is the id passed to the next step."""
    stop = set(model.cfg.eos_token_ids if stop_ids is None else stop_ids)
    tokens: list[int] = []
    margins: list[float] = []
    while True:
        top2 = np.sort(logits)[-2:]
        token = int(np.argmax(logits))
        tokens.append(token)
        margins.append(float(top2[1] - top2[0]))
        if on_token is not None:
            on_token(token)
        if token in stop:
            return Generation(tokens, True, margins)
        if len(tokens) == max_new_tokens:
            return Generation(tokens, False, margins)
        logits = model.forward([feed(token)], rows="last", cache=cache)[0]


@dataclass
class Scored:
    logits: np.ndarray  # [C, V]: row j predicts continuation[j]
    logprobs: np.ndarray  # [C]: log p(continuation[j] | prompt, continuation[:j])
    ranks: np.ndarray  # [C]: 0 when continuation[j] is the argmax
    greedy: np.ndarray  # [C]: the model's own argmax at each step


def score_continuation(model: Gemma4, prompt: Sequence[int], continuation: Sequence[int]) -> Scored:
    """Teacher forcing: one forward over prompt + continuation, reading the rows that predict each
    continuation token, so an early disagreement does not change the later steps' inputs."""
    prompt, continuation = list(prompt), list(continuation)
    if not prompt or not continuation:
        raise InputError("teacher-forced scoring needs a non-empty prompt and continuation")
    model.check_ids(continuation)  # the last token is never fed to the model, but it is scored
    rows = list(range(len(prompt) - 1, len(prompt) + len(continuation) - 1))
    logits = model.forward(prompt + continuation[:-1], rows=rows)
    target = np.asarray(continuation)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logz = np.log(np.sum(np.exp(shifted), axis=-1))
    logprobs = shifted[np.arange(len(target)), target] - logz
    chosen = logits[np.arange(len(target)), target]
    ranks = np.sum(logits > chosen[:, None], axis=-1)
    return Scored(logits, logprobs, ranks, np.argmax(logits, axis=-1))
