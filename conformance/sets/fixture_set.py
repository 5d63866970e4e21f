"""A loaded fixture set: its manifest, cases and stored tensors, and the checkpoint it was made from.

``FixtureSet`` objects come from ``conformance.sets.integrity.load_set``, which verifies the set first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from refimpl.safetensors_io import TensorStore

from ..protocol.types import AudioInput, ImageInput
from .case import BaseMedia, Case, mtp_rows
from .checkpoint import checkpoint_problems, find_checkpoint
from .format import (
    AUDIO_LEAVES,
    BASE_FILE_RE,
    EXPECTED,
    IMAGE_LEAVES,
    MTP_FILE,
    SYNTHETIC_CHECKED,
    FixtureError,
    sha256_file,
    versions,
)
from .head import SUMMARY_LEAVES, RebuiltLogits, summaries_of


@dataclass
class FixtureSet:
    path: Path
    manifest: dict
    cases: list[Case]
    warnings: list[str] = field(default_factory=list)  # e.g. a regenerated tokenizer that differs
    _tensors: dict | None = field(default=None, repr=False)
    _summaries: dict | None = field(default=None, repr=False)
    _mtp: dict | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def version(self) -> str:
        return self.manifest["version"]

    @property
    def schema_version(self) -> int:
        return int(self.manifest["schema_version"])

    @property
    def storage(self) -> str:
        """"logits" (full float64 logits stored: schema 1, or generate --store logits) or "hidden" (hidden
        states and row summaries; the logits are rebuilt through the checkpoint's head)."""
        return self.manifest.get("storage", "logits")

    @property
    def activations(self) -> str:
        """The activation convention the set was made under (its manifest's model.quantisation.activations;
        "none": float64 activations)."""
        return (self.manifest.get("model", {}).get("quantisation") or {}).get("activations", "none")

    def base_files(self) -> dict[str, str]:
        """Base id -> its file in the set (schema 2; empty for schema 1, whose bases share expected.safetensors)."""
        out = {}
        for f in self.manifest["files"]:
            m = BASE_FILE_RE.match(f)
            if m:
                out[m.group(1)] = f
        return out

    def _store(self) -> dict[str, np.ndarray]:
        """Every stored tensor by its schema 1 name (base/<id>/<leaf>, image/<id>/<j>/<leaf>, audio/...):
        read-only memory-mapped views, nothing copied."""
        if self._tensors is None:
            tensors: dict[str, np.ndarray] = {}
            if self.schema_version == 1:
                store = TensorStore(self.path / EXPECTED)
                tensors = {n: store.raw(n) for n in store.names}
            for b, f in self.base_files().items():
                store = TensorStore(self.path / f)
                for n in store.names:
                    kind = n.split("/")[0]
                    tensors[f"{kind}/{b}/{n[len(kind) + 1:]}" if kind in ("image", "audio") and "/" in n
                            else f"base/{b}/{n}"] = store.raw(n)
            self._tensors = tensors
        return self._tensors

    def stored(self, leaf: str) -> dict[str, np.ndarray]:
        """Base id -> its stored tensor ``leaf`` (tokens, logits, hidden, top_ids, ...), for the bases that have it."""
        out = {}
        for n, a in self._store().items():
            parts = n.split("/")
            if len(parts) == 3 and parts[0] == "base" and parts[2] == leaf:
                out[parts[1]] = a
        return out

    def bases(self) -> dict[str, np.ndarray]:
        """Base id -> token ids (int64); the MTP bases (M0, ...: prompt and plain greedy output) too."""
        out = {b: np.asarray(a, dtype=np.int64) for b, a in self.stored("tokens").items()}
        out.update({b: np.asarray(t[f"{b}/tokens"], dtype=np.int64) for b, t in self._mtp_bases().items()})
        return out

    def _mtp_bases(self) -> dict[str, dict[str, np.ndarray]]:
        """MTP base id -> its tensors in mtp.safetensors (names "<id>/<leaf>"; memory-mapped, nothing copied)."""
        if self._mtp is None:
            self._mtp = {}
            if MTP_FILE in self.manifest.get("files", {}):
                store = TensorStore(self.path / MTP_FILE)
                for n in store.names:
                    self._mtp.setdefault(n.split("/", 1)[0], {})[n] = store.raw(n)
        return self._mtp

    def mtp_rows(self, model, drafter) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The MTP bases' rows under their grading names (``case.mtp_rows``): (logits, hidden). ``M0@prompt``
        and ``M0@verify`` logits are rebuilt from their stored final-norm hidden states through the target's
        head (``model``: refimpl.model.Gemma4), ``M0@draft:<kv>/<position>`` from the stored drafter states
        through the drafter's head (``drafter``: refimpl.assistant.Drafter); the hidden rows are the stored
        ones. Empty for a set without MTP cases."""
        logits, hidden = {}, {}
        for b, tensors in self._mtp_bases().items():
            for name, a in tensors.items():
                leaf = name[len(b) + 1:]
                a = np.asarray(a, dtype=np.float64)
                if leaf in ("prompt_hidden", "verify_hidden"):
                    key = mtp_rows(b, leaf.split("_")[0])
                    hidden[key], logits[key] = a, model.logits_of(a)
                elif leaf.startswith("draft/"):
                    logits[mtp_rows(b, "draft", leaf[len("draft/"):])] = drafter.head(a)[0] if len(a) else \
                        np.empty((0, model.cfg.vocab_size))
        return logits, hidden

    def has_mtp(self) -> bool:
        return MTP_FILE in self.manifest.get("files", {})

    def base_logits(self) -> dict[str, np.ndarray]:
        """Base id -> the stored [N, V] float64 logits (read-only memory maps). A set stored as hidden
        states stores none: ``oracle_logits`` rebuilds them through the checkpoint's head."""
        if self.storage != "logits":
            raise FixtureError(f"{self.path}: the set stores hidden states, not logits; its logits are rebuilt "
                               "through the checkpoint's head (FixtureSet.oracle_logits)")
        return self.stored("logits")

    def hidden_states(self) -> dict[str, np.ndarray]:
        """Base id -> [N, H] float64 residual stream before the final norm (schema 2; empty for schema 1)."""
        return self.stored("hidden")

    def summaries(self) -> dict[str, dict[str, np.ndarray]]:
        """Base id -> its rows' summary (conformance.sets.head.row_summary: top_ids, top_logits, lse,
        margin): stored, or for a schema 1 set computed from its logits once."""
        if self._summaries is None:
            stored = {leaf: self.stored(leaf) for leaf in SUMMARY_LEAVES}
            out = {}
            for b in self.stored("tokens"):  # the bases of base files (an MTP base's rows are states: mtp_rows)
                if all(b in stored[leaf] for leaf in SUMMARY_LEAVES):
                    out[b] = {leaf: stored[leaf][b] for leaf in SUMMARY_LEAVES}
                else:
                    out[b] = summaries_of(self.stored("logits")[b])
            self._summaries = out
        return self._summaries

    def oracle_logits(self, model, workdir: Path):
        """Base id -> the oracle's [N, V] float64 logits: the stored ones, or for a set stored as hidden
        states a ``RebuiltLogits`` mapping over ``model`` (refimpl.model.Gemma4 of the set's checkpoint)
        that rebuilds each base on first access under ``workdir`` (FixtureError when the checkpoint's head
        does not reproduce the stored row summaries)."""
        if self.storage == "logits":
            return self.base_logits()
        return RebuiltLogits(model, self.hidden_states(), self.summaries(), workdir, str(self.path))

    def router_margins(self) -> dict[str, np.ndarray]:
        """Base id -> [N] per-token router margin (min over layers); empty for dense models."""
        return self.stored("router_margin")

    def image_blocks(self) -> dict[str, list[tuple[int, int]]]:
        """Image base id -> its image blocks [(first position, soft tokens), ...]; empty for text sets."""
        return {b: [(int(a), int(n)) for a, n in np.asarray(x)] for b, x in self.stored("images").items()}

    def video_groups(self) -> dict[str, list[tuple[int, int]]]:
        """Video base id -> (index of its first frame among the base's image blocks, frames) per video."""
        return {b: [(int(a), int(n)) for a, n in np.asarray(x)] for b, x in self.stored("videos").items()}

    def audio_blocks(self) -> dict[str, list[tuple[int, int]]]:
        """Audio base id -> its audio blocks [(first position, soft tokens), ...]."""
        return {b: [(int(a), int(n)) for a, n in np.asarray(x)] for b, x in self.stored("audio").items()}

    def media(self, convention: str = "scaled") -> dict[str, BaseMedia]:
        """Image/audio base id -> ``BaseMedia``: the stored merged embeddings in ``convention`` ("scaled"
        as stored; "raw" divided by the exact sqrt(H), so a backend's own sqrt(H) restores the text rows
        and leaves the soft tokens as they were), the image and audio blocks, and each audio block's
        features and mask."""
        out = {}
        blocks, audio, videos = self.image_blocks(), self.audio_blocks(), self.video_groups()
        for b, x in self.stored("embeddings").items():
            x = np.asarray(x, dtype=np.float64)
            if convention == "raw":
                x = x / math.sqrt(x.shape[1])
            clips = tuple(AudioInput(np.asarray(c["features"], dtype=np.float64), np.asarray(c["mask"]).astype(bool))
                          for c in self.audio_inputs(b))
            images = tuple(ImageInput(np.asarray(i["pixel_values"], dtype=np.float64),
                                      np.asarray(i["positions"]).astype(np.int64)) for i in self.image_inputs(b))
            out[b] = BaseMedia(embeddings=x, images=tuple(blocks.get(b, ())), audio=tuple(audio.get(b, ())),
                               audio_inputs=clips, image_inputs=images, videos=tuple(videos.get(b, ())))
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

    def drafter_dir(self, model_dir: Path, *, drafter: str | Path | None = None, rehash: bool = False) -> Path | None:
        """The assistant checkpoint of a set with MTP cases (None for other sets), FixtureError when it does
        not match the sha256 the manifest records (``mtp.drafter``): ``drafter`` when given (``--drafter``),
        else the recorded path, relative to the checkpoint directory ``model_dir`` (a synthetic preset writes
        its assistant there) or absolute."""
        rec = (self.manifest.get("mtp") or {}).get("drafter")
        if rec is None:
            return None
        if drafter is None:
            drafter = Path(rec["path"]) if Path(rec["path"]).is_absolute() else Path(model_dir) / rec["path"]
        return find_checkpoint({"sha256": rec["sha256"], "path": str(drafter)}, drafter, where=f"{self.path} (drafter)",
                               rehash=rehash)

    @property
    def model_record(self) -> dict:
        """The manifest's ``model`` record, its ``path`` made absolute: a relative path is inside the set's own
        directory (a set that ships its checkpoint, e.g. the bundled MLX quantised set's ``checkpoint``)."""
        rec = dict(self.manifest["model"])
        path = rec.get("path")
        if isinstance(path, str) and path and not Path(path).is_absolute():
            rec["path"] = str(Path(self.path) / path)
        return rec

    def model_dir(self, workdir: Path, *, model: str | Path | None = None, rehash: bool = False,
                  write: Callable[..., Any] | None = None) -> Path:
        """The checkpoint, FixtureError when it does not match the set. External sets: ``model`` (a
        directory from anywhere, ``--model``) or else the recorded path, once every file the set records
        has its recorded size and sha256 (``conformance.sets.checkpoint``; digests cached, ``rehash``
        reads every file again). Synthetic sets: ``model`` when given and its config.json and
        model.safetensors have the recorded sha256, else the one under ``workdir`` when it matches, else
        regenerated there by the caller's ``write(preset, seed, target, dtype=..., overwrite=True)``
        (``refimpl.synth.write_checkpoint``: the set's format only records the recipe and the digests;
        ``conformance.check.materialise`` passes it) and checked the same way."""
        rec = self.model_record
        if rec["kind"] == "external":
            return find_checkpoint(rec, model, where=str(self.path), rehash=rehash)
        if model is not None:
            checked = {"sha256": {n: rec["sha256"][n] for n in SYNTHETIC_CHECKED}}
            target = find_checkpoint(checked, model, where=str(self.path), rehash=rehash)
            self._tokenizer_warning(target, "given")
            return target

        target = Path(workdir) / f"{rec['preset']}-seed{rec['seed']}-{rec['dtype']}"
        if not (target.is_dir() and self._synthetic_matches(target)):
            if write is None:
                raise FixtureError(f"{self.path}: the synthetic checkpoint (preset {rec['preset']!r} seed "
                                   f"{rec['seed']}) is not under {workdir}, and no writer was given to regenerate "
                                   "it (conformance.check.materialise regenerates it)")
            write(rec["preset"], rec["seed"], target, dtype=rec["dtype"], overwrite=True)
        bad = [n for n in SYNTHETIC_CHECKED if sha256_file(target / n) != rec["sha256"][n]]
        if bad:
            prov = self.manifest.get("provenance", {})
            now = versions()
            recorded = ", ".join(f"{k.split('_')[0]} {prov.get(k, '?')}" for k in
                                 ("refimpl_version", "numpy_version", "python_version"))
            found = ", ".join(f"{k.split('_')[0]} "
                              f"{now[k]}" for k in ("refimpl_version", "numpy_version", "python_version"))
            raise FixtureError(
                f"{self.path}: the synthetic checkpoint could not be reproduced: {' and '.join(bad)} of preset "
                f"{rec['preset']!r} seed {rec['seed']} differ from the sha256 the set records. Recorded with "
                f"{recorded}; found {found}. Regenerate the set with this installation, or install the recorded "
                "versions.")
        self._tokenizer_warning(target, "regenerated")
        return target

    def _tokenizer_warning(self, target: Path, what: str) -> None:
        """A warning (not an error) when the checkpoint's tokenizer.model differs from the recorded one."""
        tok = target / "tokenizer.model"
        want = self.manifest["model"]["sha256"].get("tokenizer.model")
        if want is not None and tok.is_file() and sha256_file(tok) != want:
            msg = (f"{self.path}: the {what} tokenizer.model differs from the recorded one (sentencepiece "
                   "version?); cases are token ids, so grading is unaffected, only displayed pieces may differ")
            if msg not in self.warnings:
                self.warnings.append(msg)

    def checkpoint_problems(self, *, model: str | Path | None = None, rehash: bool = False) -> list[str]:
        """Every problem of the set's checkpoint, empty when it matches (``conformance.sets.checkpoint.
        checkpoint_problems``): for an external set, of ``model`` or else the recorded path (a directory
        that is not there is a problem: none of its files were checked); for a synthetic set, of
        ``model``'s config.json and model.safetensors when given, else none (the checkpoint is
        regenerated by ``model_dir``)."""
        rec = self.model_record
        if rec["kind"] != "external":
            if model is None:
                return []
            rec = {"sha256": {n: rec["sha256"][n] for n in SYNTHETIC_CHECKED}}
        return checkpoint_problems(rec, model, where=str(self.path), rehash=rehash)

    def _synthetic_matches(self, target: Path) -> bool:
        model = self.manifest["model"]
        try:
            return all(sha256_file(target / n) == model["sha256"][n] for n in SYNTHETIC_CHECKED)
        except OSError:
            return False


