"""A loaded fixture set: its manifest, cases and stored tensors, and the checkpoint it was made from.

``FixtureSet`` objects come from ``conformance.sets.integrity.load_set``, which verifies the set first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from refimpl.safetensors_io import TensorStore
from refimpl.synth import write_checkpoint

from ..protocol.types import AudioInput
from .case import BaseMedia, Case
from .format import AUDIO_LEAVES, EXPECTED, IMAGE_LEAVES, SYNTHETIC_CHECKED, FixtureError, sha256_file, versions


@dataclass
class FixtureSet:
    path: Path
    manifest: dict
    cases: list[Case]
    warnings: list[str] = field(default_factory=list)  # e.g. a regenerated tokenizer that differs
    _tensors: dict | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def version(self) -> str:
        return self.manifest["version"]

    def _store(self) -> dict[str, np.ndarray]:
        if self._tensors is None:
            store = TensorStore(self.path / EXPECTED)  # memory-mapped views, nothing copied
            self._tensors = {n: store.raw(n) for n in store.names}
        return self._tensors

    def _by_base(self, leaf: str) -> dict[str, np.ndarray]:
        out = {}
        for n, a in self._store().items():
            parts = n.split("/")
            if len(parts) == 3 and parts[0] == "base" and parts[2] == leaf:
                out[parts[1]] = a
        return out

    def bases(self) -> dict[str, np.ndarray]:
        """Base id -> token ids (int64)."""
        return {b: np.asarray(a, dtype=np.int64) for b, a in self._by_base("tokens").items()}

    def base_logits(self) -> dict[str, np.ndarray]:
        """Base id -> [N, V] float64 logits (read-only memory maps)."""
        return self._by_base("logits")

    def router_margins(self) -> dict[str, np.ndarray]:
        """Base id -> [N] per-token router margin (min over layers); empty for dense models."""
        return self._by_base("router_margin")

    def image_blocks(self) -> dict[str, list[tuple[int, int]]]:
        """Image base id -> its image blocks [(first position, soft tokens), ...]; empty for text sets."""
        return {b: [(int(a), int(n)) for a, n in np.asarray(x)] for b, x in self._by_base("images").items()}

    def audio_blocks(self) -> dict[str, list[tuple[int, int]]]:
        """Audio base id -> its audio blocks [(first position, soft tokens), ...]."""
        return {b: [(int(a), int(n)) for a, n in np.asarray(x)] for b, x in self._by_base("audio").items()}

    def media(self, convention: str = "scaled") -> dict[str, BaseMedia]:
        """Image/audio base id -> ``BaseMedia``: the stored merged embeddings in ``convention`` ("scaled"
        as stored; "raw" divided by the exact sqrt(H), so a backend's own sqrt(H) restores the text rows
        and leaves the soft tokens as they were), the image and audio blocks, and each audio block's
        features and mask."""
        out = {}
        blocks, audio = self.image_blocks(), self.audio_blocks()
        for b, x in self._by_base("embeddings").items():
            x = np.asarray(x, dtype=np.float64)
            if convention == "raw":
                x = x / math.sqrt(x.shape[1])
            clips = tuple(AudioInput(np.asarray(c["features"], dtype=np.float64), np.asarray(c["mask"]).astype(bool))
                          for c in self.audio_inputs(b))
            out[b] = BaseMedia(embeddings=x, images=tuple(blocks.get(b, ())), audio=tuple(audio.get(b, ())),
                               audio_inputs=clips)
        return out

    def audio_inputs(self, base: str) -> list[dict[str, np.ndarray]]:
        """The stored clips of an audio base, in prompt order: dicts with waveform, features, mask and
        soft_tokens."""
        store, out = self._store(), []
        while f"audio/{base}/{len(out)}/waveform" in store:
            j = len(out)
            out.append({leaf: store[f"audio/{base}/{j}/{leaf}"] for leaf in AUDIO_LEAVES})
        return out

    def image_inputs(self, base: str) -> list[dict[str, np.ndarray]]:
        """The stored images of an image base, in prompt order: dicts with pixels, pixel_values,
        positions and soft_tokens."""
        store, out = self._store(), []
        while f"image/{base}/{len(out)}/pixels" in store:
            j = len(out)
            out.append({leaf: store[f"image/{base}/{j}/{leaf}"] for leaf in IMAGE_LEAVES})
        return out

    def model_dir(self, workdir: Path) -> Path:
        """The checkpoint: synthetic sets regenerate it under ``workdir`` (reused if already there) and
        check the sha256 of config.json and model.safetensors; external sets return the recorded path after
        checking every recorded file. FixtureError when the checkpoint does not match the set."""
        model = self.manifest["model"]
        if model["kind"] == "external":
            problems = self.checkpoint_problems()
            if problems:
                raise FixtureError(problems[0])
            return Path(model["path"])

        target = Path(workdir) / f"{model['preset']}-seed{model['seed']}-{model['dtype']}"
        if not (target.is_dir() and self._synthetic_matches(target)):
            write_checkpoint(model["preset"], model["seed"], target, dtype=model["dtype"], overwrite=True)
        bad = [n for n in SYNTHETIC_CHECKED if sha256_file(target / n) != model["sha256"][n]]
        if bad:
            rec = self.manifest.get("provenance", {})
            now = versions()
            recorded = ", ".join(f"{k.split('_')[0]} {rec.get(k, '?')}" for k in
                                 ("refimpl_version", "numpy_version", "python_version"))
            found = ", ".join(f"{k.split('_')[0]} {now[k]}" for k in ("refimpl_version", "numpy_version", "python_version"))
            raise FixtureError(
                f"{self.path}: the synthetic checkpoint could not be reproduced: {' and '.join(bad)} of preset "
                f"{model['preset']!r} seed {model['seed']} differ from the sha256 the set records. Recorded with "
                f"{recorded}; found {found}. Regenerate the set with this installation, or install the recorded "
                "versions.")
        tok = target / "tokenizer.model"
        want = model["sha256"].get("tokenizer.model")
        if want is not None and tok.is_file() and sha256_file(tok) != want:
            msg = (f"{self.path}: the regenerated tokenizer.model differs from the recorded one (sentencepiece "
                   "version?); cases are token ids, so grading is unaffected, only displayed pieces may differ")
            if msg not in self.warnings:
                self.warnings.append(msg)
        return target

    def checkpoint_problems(self) -> list[str]:
        """Every problem of an external set's checkpoint (empty when each file the set records is there
        with its recorded sha256, and for a synthetic set): a directory that is not there (none of its
        files checked), a file missing, unreadable or changed. Hashes every file on each call."""
        model = self.manifest["model"]
        if model["kind"] != "external":
            return []
        path, names = Path(model["path"]), list(model["sha256"])
        if not path.is_dir():
            return [f"{self.path}: external checkpoint {path} not found: its {len(names)} recorded file"
                    f"{'s' if len(names) != 1 else ''} ({', '.join(names)}) were not checked (the set records the "
                    "checkpoint by absolute path: restore it there, or regenerate the set)"]
        problems = []
        for n, want in model["sha256"].items():
            f = path / n
            if not f.is_file():
                problems.append(f"{self.path}: the set's model file {f} is missing (the checkpoint was changed, moved "
                                "or deleted; the set records it by absolute path)")
                continue
            try:
                got = sha256_file(f)
            except OSError as e:
                problems.append(f"{self.path}: the set's model file {f} cannot be read ({e.strerror or e})")
                continue
            if got != want:
                problems.append(f"{self.path}: the set's model file {f} changed: sha256 {got} but the set records "
                                f"{want}; regenerate the set for this checkpoint")
        return problems

    def _synthetic_matches(self, target: Path) -> bool:
        model = self.manifest["model"]
        try:
            return all(sha256_file(target / n) == model["sha256"][n] for n in SYNTHETIC_CHECKED)
        except OSError:
            return False


