"""The oracle's work on one base: its greedy continuation, its full float64 logits (and MoE router margins),
and the check that chunked prefill through the KV cache reproduces the full forward."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from refimpl.arrays import to_host
from refimpl.generate import greedy_generate
from refimpl.model import KVCache, Trace

from ..sets.bounds import EVENT_ULPS, FLOAT32_UNIT, UNIT_ROUNDOFF
from ..sets.format import FixtureError


def ordinary_ids(tokenizer, vocab: int) -> np.ndarray:
    """Token ids for random bases: no control, unknown, unused, byte or <marker> pieces (an engine may
    treat image or turn markers specially). Without a tokenizer: every id from 5 (after pad, eos, bos,
    unk, mask)."""
    if tokenizer is None:
        return np.arange(min(5, vocab - 1), vocab)
    sp = tokenizer.sp
    keep = []
    for i in range(min(vocab, sp.GetPieceSize())):
        if sp.IsControl(i) or sp.IsUnknown(i) or sp.IsUnused(i) or sp.IsByte(i):
            continue
        piece = sp.IdToPiece(i)
        if len(piece) > 2 and piece.startswith("<") and piece.endswith(">"):
            continue
        keep.append(i)
    if len(keep) < 16:
        raise FixtureError("the tokenizer has fewer than 16 ordinary pieces; cannot draw random bases")
    return np.asarray(keep, dtype=np.int64)


def bos_id(cfg, tokenizer) -> int:
    if tokenizer is not None:
        return int(tokenizer.bos_id)
    return int(cfg.bos_token_id if cfg.bos_token_id is not None else 2)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t in greedy_generate(model, prompt, n, stop_ids=()).tokens]


def base_rows_of(model, ids: list[int], inputs=None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A base's float64 hidden states [N, H] (the residual stream before the final norm), its full logits
    [N, V] (the head of those hidden states, as ``model.forward`` computes them) and its per-token router
    margin (min over layers) for MoE. ``inputs`` (refimpl.multimodal.MultimodalInputs) for an image or
    audio base."""
    trace = Trace()
    with np.errstate(over="ignore", invalid="ignore"):  # a non-finite result is refused (NonFiniteError)
        if inputs is None:
            hidden = model.hidden_states(ids, trace=trace)
        else:
            hidden = model.hidden_states(inputs.ids, embeddings=inputs.embeddings, vision_blocks=inputs.vision_blocks,
                                         trace=trace)
        logits = model.head(hidden)
    margins = [v for k, v in trace.tensors.items() if k.endswith(".router.margin")]
    margin = np.min(np.stack(margins), axis=0) if margins else None
    return (np.ascontiguousarray(to_host(hidden), dtype=np.float64), np.ascontiguousarray(logits, dtype=np.float64),
            margin)


def consistency_plan(n: int, window: int) -> list[int]:
    """Piece lengths for the internal consistency check: a short piece, one longer than the window,
    single tokens, a longer piece, and decode steps at the end."""
    plan, left = [], n
    for size in (3, window + 2, 1, 1, window + 5):
        if left <= 3:
            break
        take = min(size, left - 3)
        plan.append(take)
        left -= take
    return plan + [1] * left


def text_consistency(model, ids: list[int], full: np.ndarray) -> float:
    """Max |chunked prefill + single-token decode through the KV cache - full forward| over every row."""
    cache, worst, at = KVCache(), 0.0, 0
    for size in consistency_plan(len(ids), model.cfg.sliding_window):
        piece = model.forward(ids[at:at + size], rows="all", cache=cache)  # compared piece by piece: no 2 GB copy
        d = float(np.max(np.abs(piece - full[at:at + size])))
        worst = d if (d > worst or d != d) else worst  # a NaN stays (it fails the bound)
        at += size
    return worst


def moved_embeddings(x: np.ndarray, unit: float, seed: int = 0) -> np.ndarray:
    """``x`` with every value moved by one unit roundoff ``unit``: x (1 + unit r), r = +-1 drawn from ``numpy
    default_rng(seed)``, at least one float64 ulp (``rounding_probe``'s move)."""
    r = np.random.default_rng(seed).choice([-1.0, 1.0], size=x.shape)
    moved = x * (1.0 + unit * r)
    return np.where(moved == x, np.nextafter(x, r * np.inf), moved)


def rounding_probe(model, ids: list[int], full: np.ndarray, inputs=None, seed: int = 0,
                   unit: float = UNIT_ROUNDOFF) -> float:
    """How much this checkpoint amplifies a rounding-level perturbation over the whole network: max |logits -
    ``full``| when every input embedding value is moved by one unit roundoff ``unit`` (x (1 + unit r), r = +-1
    drawn from ``numpy default_rng(seed)``; at least one float64 ulp). ``full``: the base's logits from the same
    inputs; ``inputs`` (refimpl.multimodal.MultimodalInputs) for an image or audio base. At float64's unit a
    correct oracle's chunked-vs-full difference is of the same order (docs/profiles.md, "Rounding bounds");
    ``conformance.sets.bounds.probe_bound`` turns it into a bound. At float32's unit under a ggml-cpu
    convention it is the event probe (``event_probe``). One more full forward."""
    x = to_host(model.embed(np.asarray(ids, dtype=np.int64))) if inputs is None else np.asarray(inputs.embeddings)
    moved = moved_embeddings(x, unit, seed)
    with np.errstate(over="ignore", invalid="ignore"):
        if inputs is None:
            got = model.forward(ids, rows="all", embeddings=moved)
        else:
            got = model.forward(inputs.ids, rows="all", embeddings=moved, vision_blocks=inputs.vision_blocks)
    return float(np.max(np.abs(got - full)))


def event_probe(model, ids: list[int], full: np.ndarray, inputs=None, seed: int = 0) -> float:
    """Under a ggml-cpu activation convention, how far the rounding events of a float32 engine move this base's
    logits: ``rounding_probe`` at EVENT_ULPS float32 unit roundoffs. The convention's forward rounds values to
    fp16 and to 8-bit activation codes; a float32 engine computes each value a few float32 ulps away from the
    float64 one, so wherever a value lies that close to a half-way point the two round it one unit apart (a
    "one-unit event"). Moving every input by EVENT_ULPS float32 ulps sets off such events at about the same
    rate, each by the same one unit, so this forward's distance from ``full`` is what a correct engine's
    events reach on this base (measured against llama.cpp at the published widths: docs/quantised.md,
    "One-unit events"); ``conformance.sets.bounds.event_bound`` turns it into a bound."""
    return rounding_probe(model, ids, full, inputs, seed, unit=EVENT_ULPS * FLOAT32_UNIT)


def cross_entries(result: Any, who: str) -> list[dict]:
    if result is None:
        return []
    entries = [result] if isinstance(result, dict) else list(result)
    out = []
    for e in entries:
        if not (isinstance(e, dict) and isinstance(e.get("implementation"), str)
                and isinstance(e.get("agreement"), (int, float)) and not isinstance(e.get("agreement"), bool)):
            raise FixtureError(f"{who} must return {{'implementation': str, 'agreement': float, 'detail': str}} "
                               f"(or a list of them, or None); got {e!r}")
        agreement = float(e["agreement"])
        if not math.isfinite(agreement):
            raise FixtureError(f"{who}: agreement must be finite, got {agreement}")
        out.append({"implementation": e["implementation"], "agreement": agreement, "detail": str(e.get("detail", ""))})
    return out


