"""``verify_set(path, recompute=True)``: a set checked again against the oracle. Every base's logits are
recomputed (bound RECOMPUTE_BOUND), image and audio bases through their whole chain (preprocessing or
feature extraction, tower, merge), and every case's ties re-derived."""

from __future__ import annotations

import contextlib
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from refimpl.model import Gemma4
from refimpl.multimodal import multimodal_inputs

from ..sets.fixture_set import FixtureSet
from ..sets.format import CASES, EXPECTED, FixtureError
from ..sets.integrity import checked_set
from ..sets.head import summaries_of
from .bases import base_rows_of
from .matrix import annotate
from .media import AudioSide, VisionSide

RECOMPUTE_BOUND = 1e-9  # verify_set(recompute=True): stored logits vs a fresh oracle run


def verify_set(path: str | Path, *, recompute: bool = False, workdir: str | Path | None = None,
               model: str | Path | None = None, rehash: bool = False, notes: list[str] | None = None) -> list[str]:
    """Every problem of a set (empty list = ok): those of ``conformance.sets.integrity.checked_set`` (an
    external set's checkpoint in ``model`` or else at its recorded path; ``rehash`` reads every checkpoint
    file again), and with ``recompute`` the model is materialised
    (synthetic: regenerated under ``workdir`` or a temporary directory) and every base's logits are
    recomputed with the oracle (bound RECOMPUTE_BOUND), and every case's ties are re-derived. What is
    not a problem but worth saying (a checkpoint that was not checked) is appended to ``notes``. Never
    raises for content problems."""
    problems, fs = checked_set(path, model=model, rehash=rehash)
    if notes is not None and fs is not None:
        notes += [w for w in fs.warnings if w not in notes]
    if problems or not recompute:
        return problems
    if fs.manifest["model"]["kind"] != "external":
        model = None  # --model is for external sets; a synthetic one is regenerated
    with contextlib.ExitStack() as stack:
        wd = Path(workdir) if workdir is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        try:
            model_dir = fs.model_dir(wd, model=model)

            model = Gemma4(model_dir)
        except Exception as e:  # noqa: BLE001
            return [str(e) if isinstance(e, FixtureError) else f"{path}: the model cannot be loaded: {e}"]
        try:
            stored = fs.oracle_logits(model, wd)  # a set stored as hidden states: rebuilt, checked against its summaries
            for b in stored:
                stored[b]
        except FixtureError as e:
            return [str(e)]
        fresh: dict[str, np.ndarray] = {}
        margins: dict[str, np.ndarray] = {}
        blocks, audio_blocks = fs.image_blocks(), fs.audio_blocks()
        for b, ids in fs.bases().items():
            inputs = None
            if b in blocks or b in audio_blocks:
                recompute = recompute_image_inputs if b in blocks else recompute_audio_inputs
                inputs, chain = recompute(model, fs, b, model_dir)
                problems += [f"{Path(path) / EXPECTED}: base {b}: {msg}" for msg in chain]
            _, fresh[b], m = base_rows_of(model, [int(t) for t in ids], inputs)
            if m is not None:
                margins[b] = m
            diff = float(np.max(np.abs(fresh[b] - stored[b]))) if fresh[b].shape == stored[b].shape else math.inf
            if diff > RECOMPUTE_BOUND:
                problems.append(f"{Path(path) / EXPECTED}: base {b}: the oracle now gives logits that differ by "
                                f"{diff:.3g} from the stored ones (bound {RECOMPUTE_BOUND})")
        if not problems:
            top2 = {b: summaries_of(z)["margin"] for b, z in fresh.items()}
            for c in fs.cases:
                again = annotate(c, top2, margins or None)
                if [t[0] for t in again.ties] != [t[0] for t in c.ties]:
                    problems.append(f"{Path(path) / CASES}: case {c.id}: recorded ties {[t[0] for t in c.ties]}, "
                                    f"recomputed {[t[0] for t in again.ties]}")
    return problems


def recompute_image_inputs(model, fs: FixtureSet, b: str, model_dir: Path) -> tuple[Any, list[str]]:
    """The oracle's inputs for image base ``b`` recomputed from its stored images (preprocessing, vision
    tower, merge), and every step that differs from what the set stores."""
    vision = VisionSide(model_dir)
    problems, soft = [], []
    for j, img in enumerate(fs.image_inputs(b)):
        processed, st = vision.soft_tokens((np.asarray(img["pixels"]),))
        if processed.pixel_values.shape != img["pixel_values"].shape or \
                not np.array_equal(processed.pixel_values, img["pixel_values"]) or \
                not np.array_equal(processed.positions, img["positions"]):
            problems.append(f"image {j}: preprocessing the stored image no longer gives the stored patches")
        elif float(np.max(np.abs(st - img["soft_tokens"]))) > RECOMPUTE_BOUND:
            problems.append(f"image {j}: the vision tower now gives soft tokens that differ by "
                            f"{float(np.max(np.abs(st - img['soft_tokens']))):.3g} (bound {RECOMPUTE_BOUND})")
        soft.append(st)
    inputs = multimodal_inputs(model, fs.bases()[b], soft, vision.tokens)
    stored = fs.media()[b].embeddings
    if inputs.embeddings.shape != stored.shape or float(np.max(np.abs(inputs.embeddings - stored))) > RECOMPUTE_BOUND:
        problems.append("the merged input embeddings differ from the stored ones")
    return inputs, problems


def recompute_audio_inputs(model, fs: FixtureSet, b: str, model_dir: Path) -> tuple[Any, list[str]]:
    """The oracle's inputs for audio base ``b`` recomputed from its stored waveforms (features, audio
    tower, merge), and every step that differs from what the set stores."""
    audio = AudioSide(model_dir)
    problems, soft = [], []
    for j, clip in enumerate(fs.audio_inputs(b)):
        feats, st = audio.soft_tokens((np.asarray(clip["waveform"], dtype=np.float64), audio.settings.sampling_rate))
        if feats.features.shape != clip["features"].shape or \
                float(np.max(np.abs(feats.features - clip["features"]))) > RECOMPUTE_BOUND or \
                not np.array_equal(feats.mask, np.asarray(clip["mask"]).astype(bool)):
            problems.append(f"audio {j}: feature extraction of the stored waveform no longer gives the stored features")
        elif st.shape != clip["soft_tokens"].shape or float(np.max(np.abs(st - clip["soft_tokens"]))) > RECOMPUTE_BOUND:
            problems.append(f"audio {j}: the audio tower now gives other soft tokens (bound {RECOMPUTE_BOUND})")
        soft.append(st)
    inputs = multimodal_inputs(model, fs.bases()[b], [], audio.tokens, audio_soft_tokens=soft)
    stored = fs.media()[b].embeddings
    if inputs.embeddings.shape != stored.shape or float(np.max(np.abs(inputs.embeddings - stored))) > RECOMPUTE_BOUND:
        problems.append("the merged input embeddings differ from the stored ones")
    return inputs, problems


