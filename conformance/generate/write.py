"""The files of a finished fixture set, written into the staging directory that ``generate_set`` then renames
into place: one ``base-<id>.safetensors`` per base (tokens, hidden states, summaries, the logits when stored, the
media inputs), ``cases.json``, the MTP file, and the manifest last, with the sha256 of the others."""

from __future__ import annotations

import datetime as _dt
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from refimpl.safetensors_io import write_safetensors

from .. import __version__ as CONFORMANCE_VERSION
from ..sets.case import Case
from ..sets.format import (
    AUDIO_LEAVES,
    CASES,
    IMAGE_LEAVES,
    MANIFEST,
    MTP_FILE,
    SCHEMA,
    SCHEMA_VERSION,
    base_file,
    sha256_file,
    versions,
    write_json,
)

__all__ = ["default_command", "write_set"]


def default_command() -> str:
    argv = [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]
    return shlex.join(argv)


def write_set(staged: Path, got: Any, results: Mapping[str, Any], set_cases: list[Case],
              plan: Any, cfg: Any, *, name: str, version: str, checks: list[dict], command: str | None,
              model_info: dict, store: str, vision_mask: str, mtp: Any = None, beyond: dict | None = None) -> None:
    """The set's files in ``staged``: one base-<id>.safetensors per base, cases.json and the manifest (written
    last, with the sha256 of the others). ``got``: the assembled bases, ``plan`` the run's plan, ``results`` the
    jobs' results (conformance/generate/run.py)."""
    media = {**{b: ("image", IMAGE_LEAVES, "images", s) for b, s in got.spans.items()},
             **{b: ("audio", AUDIO_LEAVES, "audio", s) for b, s in got.audio_spans.items()}}
    for b, ids in got.bases.items():
        tensors: dict[str, np.ndarray] = {"tokens": np.asarray(ids, dtype=np.int64), "hidden": got.hidden[b],
                                          **got.summaries[b]}
        if store == "logits":
            tensors["logits"] = got.logits[b]
        if b in got.margins:
            tensors["router_margin"] = got.margins[b]
        if b in media:
            kind, leaves, spans_leaf, spans = media[b]
            r = results[b]
            tensors["embeddings"] = r.array("embeddings")
            tensors[spans_leaf] = np.asarray(spans, dtype=np.int64)
            if b in got.videos:  # a video base: which of its vision blocks are each video's frames
                tensors["videos"] = np.asarray(got.videos[b], dtype=np.int64)
            for j in range(r.meta["n_media"]):
                for leaf in leaves:
                    a = r.array(f"media.{j}.{leaf}")
                    tensors[f"{kind}/{j}/{leaf}"] = np.asarray(a, dtype=np.uint8) if leaf == "mask" else a
        write_safetensors(staged / base_file(b), tensors, "F64", metadata={"schema": SCHEMA, "name": name, "base": b})
    write_json(staged / CASES, {"cases": [c.to_json() for c in set_cases]})
    if mtp is not None:
        write_safetensors(staged / MTP_FILE, mtp.tensors, "F64", metadata={"schema": SCHEMA, "name": name})
    recorded = versions()
    manifest = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "version": version,
        "storage": store,
        "provenance": {
            "generator": f"conformance.generate.generate_set (conformance {CONFORMANCE_VERSION})",
            "command": command if command is not None else default_command(),
            **{k: v for k, v in recorded.items() if k != "conformance_version"},
            "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
            "cross_checks": checks,
        },
        "model": model_info,
        "oracle": {"dtype": "float64", "embed_scale": "exact",
                   **({"vision_mask": vision_mask} if cfg.use_bidirectional_attention == "vision" else {}),
                   **({"beyond_context": beyond} if beyond is not None else {})},
        "config": {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                   "num_hidden_layers": cfg.num_hidden_layers, "sliding_window": cfg.sliding_window},
        "bases": got.info,
        **({"images": plan.vision.manifest(cfg.use_bidirectional_attention == "vision", vision_mask)}
           if plan.vision else {}),
        **({"audio": plan.audio.manifest()} if plan.audio else {}),
        **({"videos": plan.video.manifest(cfg.use_bidirectional_attention == "vision")} if plan.video else {}),
        **({"mtp": mtp.manifest} if mtp is not None else {}),
        "cases": len(set_cases),
        "files": {f: sha256_file(staged / f) for f in (CASES, *(base_file(b) for b in got.bases),
                                                       *((MTP_FILE,) if mtp is not None else ()))},
    }
    write_json(staged / MANIFEST, manifest)
