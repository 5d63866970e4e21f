"""``verify_set(path, recompute=True)``: a set checked again against the oracle. Every base's logits are
recomputed (bound: ``recompute_bound``, float64 rounding of the base), image and audio bases through their whole
chain (preprocessing or feature extraction, tower, merge), and every case's ties re-derived."""

from __future__ import annotations

import contextlib
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from refimpl.model import Gemma4
from refimpl.multimodal import multimodal_inputs
from refimpl.synth import write_checkpoint

from ..sets.bounds import decoder_units, logit_scale, probe_bound, recorded_probes, tensor_bound
from ..sets.fixture_set import FixtureSet
from ..sets.format import CASES, EXPECTED, FixtureError
from ..sets.head import summaries_of
from ..sets.integrity import checked_set
from .bases import base_rows_of
from .matrix import annotate
from .media import AudioSide, VisionSide

# verify_set(recompute=True): stored logits, soft tokens, embeddings and features vs a fresh oracle run, each
# held to the larger of this floor (the miniatures' fixed bound) and its float64 rounding bound (recompute_bound)
RECOMPUTE_BOUND = 1e-9


def recompute_bound(units: float, values) -> float:
    """How far a fresh float64 evaluation may be from the stored one (another machine's BLAS and NumPy
    loops): the larger of RECOMPUTE_BOUND and ``conformance.sets.bounds.tensor_bound`` for a computation of
    ``units`` rounding units (its path sum), the scale of the stored ``values`` and their rows
    (docs/profiles.md)."""
    values = np.asarray(values)
    return max(RECOMPUTE_BOUND, tensor_bound(units, logit_scale(values), values.shape[0] if values.ndim > 1 else 1))


def verify_set(path: str | Path, *, recompute: bool = False, workdir: str | Path | None = None,
               model: str | Path | None = None, rehash: bool = False, notes: list[str] | None = None) -> list[str]:
    """Every problem of a set (empty list = ok): those of ``conformance.sets.integrity.checked_set`` (an
    external set's checkpoint in ``model`` or else at its recorded path; ``rehash`` reads every checkpoint
    file again), and with ``recompute`` the model is materialised
    (synthetic: regenerated under ``workdir`` or a temporary directory) and every base's logits are
    recomputed with the oracle (bound ``recompute_bound``), and every case's ties are re-derived. What is
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
            model_dir = fs.model_dir(wd, model=model, write=write_checkpoint)

            model = Gemma4(model_dir, vision_mask=fs.manifest.get("oracle", {}).get("vision_mask", "sliding-clamped"),
                           activations=(fs.manifest["model"].get("quantisation") or {}).get("activations", "none"))
        except Exception as e:  # noqa: BLE001 - any load failure is this set's problem line
            return [str(e) if isinstance(e, FixtureError) else f"{path}: the model cannot be loaded: {e}"]
        try:
            # a set stored as hidden states: rebuilt, checked against its summaries
            stored = fs.oracle_logits(model, wd)
            for b in stored:
                stored[b]
        except FixtureError as e:
            return [str(e)]
        fresh: dict[str, np.ndarray] = {}
        margins: dict[str, np.ndarray] = {}
        blocks, audio_blocks = fs.image_blocks(), fs.audio_blocks()
        probes = recorded_probes(fs.manifest)  # checkpoints that amplify rounding beyond the first-order model
        for b, ids in fs.bases().items():
            inputs, tower = None, 0
            if b in blocks or b in audio_blocks:
                recompute = recompute_image_inputs if b in blocks else recompute_audio_inputs
                inputs, chain, tower = recompute(model, fs, b, model_dir)
                problems += [f"{Path(path) / EXPECTED}: base {b}: {msg}" for msg in chain]
            _, fresh[b], m = base_rows_of(model, [int(t) for t in ids], inputs)
            if m is not None:
                margins[b] = m
            ref = np.asarray(stored[b])
            diff = float(np.max(np.abs(fresh[b] - ref))) if fresh[b].shape == ref.shape else math.inf
            bound = recompute_bound(decoder_units(model.cfg, len(ids)) + tower, ref)
            if b in probes:
                bound = max(bound, probe_bound(probes[b]))
            if not diff <= bound:
                problems.append(f"{Path(path) / EXPECTED}: base {b}: the oracle now gives logits that differ by "
                                f"{diff:.3g} from the stored ones (bound {bound:.3g})")
        if not problems:
            top2 = {b: summaries_of(z)["margin"] for b, z in fresh.items()}
            for c in fs.cases:
                again = annotate(c, top2, margins or None)
                if [t[0] for t in again.ties] != [t[0] for t in c.ties]:
                    problems.append(f"{Path(path) / CASES}: case {c.id}: recorded ties {[t[0] for t in c.ties]}, "
                                    f"recomputed {[t[0] for t in again.ties]}")
    return problems


def recompute_image_inputs(model, fs: FixtureSet, b: str, model_dir: Path) -> tuple[Any, list[str], int]:
    """The oracle's inputs for image base ``b`` recomputed from its stored images (preprocessing, vision
    tower, merge), every step that differs from what the set stores (soft tokens and merged embeddings
    beyond ``recompute_bound`` of the tower), and the tower's rounding units (the largest image's)."""
    vision = VisionSide(model_dir)
    problems, soft, units = [], [], 0
    for j, img in enumerate(fs.image_inputs(b)):
        processed, st = vision.soft_tokens((np.asarray(img["pixels"]),))
        units = max(units, vision.units(processed))
        if processed.pixel_values.shape != img["pixel_values"].shape or \
                not np.array_equal(processed.pixel_values, img["pixel_values"]) or \
                not np.array_equal(processed.positions, img["positions"]):
            problems.append(f"image {j}: preprocessing the stored image no longer gives the stored patches")
        elif not (diff := float(np.max(np.abs(st - img["soft_tokens"])))) <= recompute_bound(units, img["soft_tokens"]):
            problems.append(f"image {j}: the vision tower now gives soft tokens that differ by {diff:.3g} "
                            f"(bound {recompute_bound(units, img['soft_tokens']):.3g})")
        soft.append(st)
    inputs = multimodal_inputs(model, fs.bases()[b], soft, vision.tokens)
    stored = fs.media()[b].embeddings
    if inputs.embeddings.shape != stored.shape or \
            not float(np.max(np.abs(inputs.embeddings - stored))) <= recompute_bound(units, stored):
        problems.append("the merged input embeddings differ from the stored ones")
    return inputs, problems, units


def recompute_audio_inputs(model, fs: FixtureSet, b: str, model_dir: Path) -> tuple[Any, list[str], int]:
    """The oracle's inputs for audio base ``b`` recomputed from its stored waveforms (features, audio
    tower, merge), every step that differs from what the set stores (features, soft tokens and merged
    embeddings beyond their ``recompute_bound``), and the rounding units of features and tower (the
    longest clip's)."""
    audio = AudioSide(model_dir)
    problems, soft, units = [], [], 0
    fft = audio.feature_units()
    for j, clip in enumerate(fs.audio_inputs(b)):
        feats, st = audio.soft_tokens((np.asarray(clip["waveform"], dtype=np.float64), audio.sampling_rate))
        units = max(units, audio.units(feats))
        if feats.features.shape != clip["features"].shape or \
                not float(np.max(np.abs(feats.features - clip["features"]))) <= recompute_bound(fft, clip["features"]) \
                or not np.array_equal(feats.mask, np.asarray(clip["mask"]).astype(bool)):
            problems.append(f"audio {j}: feature extraction of the stored waveform no longer gives the stored features")
        elif st.shape != clip["soft_tokens"].shape or \
                not float(np.max(np.abs(st - clip["soft_tokens"]))) <= recompute_bound(units, clip["soft_tokens"]):
            problems.append(f"audio {j}: the audio tower now gives other soft tokens "
                            f"(bound {recompute_bound(units, clip['soft_tokens']):.3g})")
        soft.append(st)
    inputs = multimodal_inputs(model, fs.bases()[b], [], audio.tokens, audio_soft_tokens=soft)
    stored = fs.media()[b].embeddings
    if inputs.embeddings.shape != stored.shape or \
            not float(np.max(np.abs(inputs.embeddings - stored))) <= recompute_bound(units, stored):
        problems.append("the merged input embeddings differ from the stored ones")
    return inputs, problems, units


