"""The checks of an assembled set (``conformance.generate.run``): the oracle's own (the greedy continuation of
base G is the argmax of its rows; chunked prefill through the KV cache reproduces the full forward, each base
held to its bound) and another implementation's (``generate_set(cross_check=...)``), as the manifest's
cross-check entries. ``got`` is run's assembled set (bases, info, summaries, consistency, probes, spans)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from refimpl.audio_features import AudioFeatures
from refimpl.errors import check_choice
from refimpl.ggml_act import CONVENTIONS as ACTIVATION_CONVENTIONS
from refimpl.image import ProcessedImage

from ..sets.bounds import EVENT_FACTOR, EVENT_ULPS
from ..sets.case import GENERATION_BASE
from ..sets.format import FixtureError
from .bases import cross_entries
from .partial import JobResult


def check_activations(activations: str, model_dir: str | Path | None) -> None:
    """ValueError, one line, for an activation convention generate cannot use: unknown, or other than none for
    anything but a GGUF file given as the model."""
    check_choice("activations", activations, ACTIVATION_CONVENTIONS, error=ValueError)
    if activations != "none" and not (model_dir is not None and Path(model_dir).is_file()):
        raise ValueError(f"activations {activations} (ggml's CPU activation quantisation) applies to a GGUF file "
                         "given as the model only")


def oracle_checks(got, with_text: bool) -> list[dict]:
    """The oracle's own checks of the assembled set (a failed one is a FixtureError), as the manifest's
    cross-check entries: G's continuation is the greedy argmax of its own rows (so a tie cannot slip
    through), and chunked prefill through the KV cache reproduces the full forward."""
    if GENERATION_BASE in got.bases:
        prompt_len = got.info[GENERATION_BASE]["prompt_length"]
        g = got.bases[GENERATION_BASE]
        top1 = got.summaries[GENERATION_BASE]["top_ids"][:, 0]  # the argmax, ties to the lower id
        for pos in range(prompt_len - 1, len(g) - 1):
            if int(top1[pos]) != g[pos + 1]:
                raise FixtureError(f"base G: the greedy continuation at position {pos + 1} is not the argmax of "
                                   "the full forward (a tie between cached decode and the full forward)")
    over = {b: (seen, bound) for b, (seen, bound) in got.consistency.items() if not seen <= bound}
    if over:
        b, (seen, bound) = max(over.items(), key=lambda kv: kv[1][0] / kv[1][1])
        raise FixtureError(f"the oracle is not self-consistent on this checkpoint: chunked prefill through the KV "
                           f"cache differs from the full forward by {seen:.3g} on base {b} ({len(got.bases[b])} "
                           f"tokens), {seen / bound:.3g} x its float64 rounding bound {bound:.3g} "
                           + (f"(and over 10 x its rounding probe {got.probes[b]:.3g}, the checkpoint's own "
                              "amplification of a one-ulp input change; " if b in got.probes else "(")
                           + "conformance.sets.bounds, docs/profiles.md)"
                           + (f"; also base(s) {', '.join(sorted(set(over) - {b}))}" if len(over) > 1 else ""))
    media_bases = {**got.spans, **got.audio_spans}
    return [{"implementation": "refimpl KV cache (chunked prefill and single-token decode)",
             "agreement": got.worst,
             "bounds": {b: bound for b, (_, bound) in got.consistency.items()},
             **({"rounding_probes": dict(got.probes)} if got.probes else {}),
             **({"event_probes": dict(got.event_probes)} if got.event_probes else {}),
             "detail": f"max abs over every row of the {len(got.bases)} bases ({', '.join(got.bases)}) against the "
                       "full forward; " + ("each text base fed as pieces of 3, W+2, 1, 1 and W+5 tokens, "
                                           "then single-token decode of the rest" if with_text else "")
                       + ("; " if with_text and media_bases else "")
                       + ("each image or audio base cut before every opening marker (boi, boa) and after "
                          "every closing one, then single-token decode" if media_bases else "")
                       + "; each base held to the larger of 1e-9 and its float64 rounding bound (bounds; where the "
                         "difference exceeded the model's bound, 10 x the checkpoint's measured amplification of a "
                         "one-ulp input perturbation, rounding_probes; docs/profiles.md)"
                       + ("; event_probes: under the set's ggml-cpu convention, the largest logit change when the "
                          f"inputs move by {EVENT_ULPS} float32 ulps, what a float32 engine's one-unit roundings reach "
                          f"(graded at {EVENT_FACTOR:g} x it; docs/quantised.md)" if got.event_probes else "")}]


def cross_check_entries(cross_check, src: Path, got, results: Mapping[str, JobResult],
                 oracle: Mapping[str, np.ndarray]) -> list[dict]:
    """The entries of another implementation's check of the set (``cross_check``), given the bases, their
    logits (``oracle``: stored or rebuilt from the hidden states) and the preprocessed media of every image
    and audio base."""
    arrays = {b: np.asarray(ids, dtype=np.int64) for b, ids in got.bases.items()}
    extra: dict[str, Any] = {}
    if got.spans:
        extra["images"] = {b: [ProcessedImage(pixels=np.array(results[b].array(f"media.{j}.resized")),
                                              pixel_values=np.array(results[b].array(f"media.{j}.pixel_values")),
                                              positions=np.array(results[b].array(f"media.{j}.positions")),
                                              num_soft_tokens=results[b].meta["num_soft_tokens"][j])
                               for j in range(results[b].meta["n_media"])] for b in got.spans}
    if got.audio_spans:
        extra["audio"] = {b: [AudioFeatures(features=np.array(results[b].array(f"media.{j}.features")),
                                            mask=np.array(results[b].array(f"media.{j}.mask")))
                              for j in range(results[b].meta["n_media"])] for b in got.audio_spans}
    return cross_entries(cross_check(Path(src), arrays, oracle, **extra), "cross_check")
