"""The on-disk format of a fixture set: names, schema constants, digests, and the rule for checkpoint file names.

A set is a directory, or a single uncompressed ``.tar`` of one (docs/fixtures.md has the full format).
Schema version 2::

    <set>/manifest.json         schema, name, version, storage, provenance, model, oracle, bases, files (sha256)
    <set>/cases.json            {"cases": [Case.to_json(), ...]}
    <set>/base-<id>.safetensors one file per base: tokens [N] I64; the row summaries top_ids [N, k] I64,
                                top_logits [N, k] F64, lse [N] F64, margin [N] F64; hidden [N, H] F64 (the
                                residual stream before the final norm); storage "logits" also logits [N, V] F64;
                                router_margin [N] F64 (MoE models: min over layers per token); image and audio
                                bases also embeddings [N, H] F64 (the merged input embeddings), images or
                                audio [n, 2] I64 (first position, soft tokens), and per image j
                                image/<j>/{pixels [h, w, 3] U8, pixel_values [P, 3p^2] F64, positions [P, 2] I64,
                                soft_tokens [M, H] F64}; per clip j audio/<j>/{waveform, features, mask, soft_tokens}

    <set>/mtp.safetensors       sets with MTP cases (an assistant beside the checkpoint): per MTP base M<i>
                                <id>/tokens [n + m] I64 (the prompt, then plain greedy's m tokens),
                                <id>/prompt_hidden [n, H] (final-norm hidden states), <id>/verify_hidden
                                [R, H] (every round's verification rows), <id>/draft/<kv>/<position>
                                [S, H_a] (every draft step's final-normed drafter state under that
                                convention), all F64; the logits are rebuilt through the target's and the
                                drafter's heads (FixtureSet.mtp_rows)

Schema version 1 (still read): one ``expected.safetensors`` with the same tensors of every base under
``base/<id>/``, ``image/<id>/<j>/`` and ``audio/<id>/<j>/``, full logits and no summaries or hidden states.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np

import refimpl
from refimpl.gguf_io import is_gguf

from .. import __version__ as CONFORMANCE_VERSION

SCHEMA = "gemma4-conformance/fixtures"
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
CASES = "cases.json"
EXPECTED = "expected.safetensors"  # schema 1: every base in one file
SET_FILES = (CASES, EXPECTED)  # schema 1
STORAGES = ("hidden", "logits")  # schema 2: manifest "storage"; generate --store
MTP_FILE = "mtp.safetensors"  # the MTP bases' tokens and rows (schema 2, optional)
MTP_TENSOR_RE = re.compile(r"^(M\d+)/(tokens|prompt_hidden|verify_hidden|draft/[a-z-]+/[A-Za-z0-9-]+)$")
BASE_FILE_RE = re.compile(r"^base-([A-Za-z0-9][A-Za-z0-9_-]*)\.safetensors$")
SYNTHETIC_FILES = ("config.json", "model.safetensors", "tokenizer.model")
SYNTHETIC_CHECKED = ("config.json", "model.safetensors")
# an MTP assistant's files the manifest records (mtp.drafter)  # a tokenizer mismatch is only a warning
DRAFTER_FILES = ("config.json", "model.safetensors")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
SEMVER_RE = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


SHA_RE = re.compile(r"^[0-9a-f]{64}$")
IMAGE_LEAVES = ("pixels", "pixel_values", "positions", "soft_tokens")  # image/<base>/<j>/<leaf>
AUDIO_LEAVES = ("waveform", "features", "mask", "soft_tokens")  # audio/<base>/<j>/<leaf>
BASE_LEAVES = ("tokens", "logits", "hidden", "top_ids", "top_logits", "lse", "margin", "router_margin", "embeddings",
               "images", "audio", "videos")  # base/<base>/<leaf> (schema 1), <leaf> in base-<base>.safetensors (v2)
MEDIA_LEAVES = {("image", leaf) for leaf in IMAGE_LEAVES} | {("audio", leaf) for leaf in AUDIO_LEAVES}


def base_file(base: str) -> str:
    """The file of base ``base`` in a schema 2 set."""
    return f"base-{base}.safetensors"


class FixtureError(Exception):
    """An integrity or schema problem with a fixture set (exit code 3), or a set that cannot be made."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def versions() -> dict[str, str]:
    """The versions a set's numbers depend on, as its provenance records them."""
    return {"refimpl_version": refimpl.__version__, "numpy_version": np.__version__,
            "python_version": platform.python_version(), "conformance_version": CONFORMANCE_VERSION}


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=False, allow_nan=False) + "\n", encoding="utf-8")


_DRIVE_RE = re.compile(r"^[A-Za-z]:")


def checkpoint_name_problem(name: Any) -> str | None:
    """Why ``name`` (a file of a checkpoint: a key of the manifest's model.sha256, a shard of a
    safetensors index) is not a plain relative path inside the checkpoint directory, else None. Plain:
    a non-empty string of '/'-separated components, none empty, '.' or '..', no backslash, no NUL, not
    absolute, no drive letter; so that ``checkpoint / name`` never leaves the directory by its name
    (a symbolic link inside the checkpoint, e.g. a Hugging Face cache snapshot's, is followed as usual)."""
    if not isinstance(name, str):
        return "not a string"
    if not name:
        return "it is empty"
    if "\\" in name:
        return "it has a backslash"
    if "\0" in name:
        return "it has a NUL character"
    if name.startswith("/"):
        return "it is an absolute path"
    if _DRIVE_RE.match(name):
        return "it starts with a drive letter"
    parts = name.split("/")
    if ".." in parts:
        return "it has a '..' component"
    if any(p in ("", ".") for p in parts):
        return "it has an empty or '.' component"
    return None


def checkpoint_files(path: Path) -> tuple[Path, list[str]]:
    """(the directory holding a checkpoint's files, their names): a GGUF file is its own checkpoint, in the
    directory that holds it; a checkpoint directory holds ``model_files``."""
    path = Path(path)
    if path.is_file() and is_gguf(path):
        return path.parent, [path.name]
    return path, model_files(path)


def model_files(model_dir: Path) -> list[str]:
    """The files of a checkpoint the oracle reads (hashed for an external model, never copied)."""
    names = ["config.json"]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names.append(index.name)
        try:
            shards = sorted(set(read_json(index)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index}: not a valid safetensors index") from None
        for shard in shards:
            why = checkpoint_name_problem(shard)
            if why is not None:
                raise ValueError(f"{index}: shard {shard!r} is not a plain relative path inside the checkpoint ({why})")
        names += shards
    else:
        names.append("model.safetensors")
    for optional in ("generation_config.json", "tokenizer.model"):
        if (model_dir / optional).is_file():
            names.append(optional)
    for n in names:
        if not (model_dir / n).is_file():
            raise ValueError(f"{model_dir}: {n} is missing; a checkpoint directory needs config.json and its weights")
    return names


def hash_files(model_dir: Path, names: Iterable[str]) -> dict[str, str]:
    return {n: sha256_file(model_dir / n) for n in names}


