"""A set's manifest checked against the format (conformance/sets/format.py): the schema and its version, the
name and version, the files and their digests' form, the model it was made from (a preset, an external
checkpoint, a quantised one: its format, types and activation convention), the oracle's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from refimpl.errors import choice_message
from refimpl.ggml_act import CONVENTIONS as ACTIVATION_CONVENTIONS
from refimpl.ggml_blocks import TYPES
from refimpl.mlx_quant import BITS as MLX_BITS
from refimpl.mlx_quant import FLOAT_MODES as MLX_FLOAT_MODES
from refimpl.mlx_quant import GROUP_SIZES as MLX_GROUP_SIZES
from refimpl.presets import PRESETS

from .format import (
    BASE_FILE_RE,
    CASES,
    MANIFEST,
    MTP_FILE,
    NAME_RE,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA,
    SCHEMA_VERSION,
    SEMVER_RE,
    SET_FILES,
    SHA_RE,
    STORAGES,
    SYNTHETIC_CHECKED,
    checkpoint_name_problem,
)

QUANTISATION_FORMATS = ("mlx-affine", "gguf")  # quantised checkpoints a set can be made from
GGML_TYPES = {t.name for t in TYPES.values()}
ACTIVATIONS = ACTIVATION_CONVENTIONS  # none, or ggml's CPU activation quantisation on a kernel path (GGUF only)


def quantisation_problems(rec: Any, where: str) -> list[str]:
    """The problems of a manifest's ``model.quantisation`` (absent for an unquantised checkpoint)."""
    if rec is None:
        return []
    if not isinstance(rec, dict):
        return [f"{where}: model.quantisation must be an object, got {type(rec).__name__}"]
    for key, choices in (("format", QUANTISATION_FORMATS), ("activations", ACTIVATIONS)):
        if rec.get(key) not in choices:
            return [choice_message(f"model.quantisation.{key}", rec.get(key), choices, who=where)]
    if rec["activations"] != "none" and rec["format"] != "gguf":
        return [f"{where}: model.quantisation.activations {rec['activations']} applies to a gguf checkpoint only"]
    tensors = rec.get("tensors")
    if rec["format"] == "gguf":
        if not (isinstance(tensors, dict) and all(isinstance(k, str) and isinstance(v, dict) and v.get("type") in
                                                  GGML_TYPES for k, v in tensors.items())):
            return [f"{where}: model.quantisation.tensors must map the file's tensor names to their ggml types"]
        return []
    if not (isinstance(tensors, dict) and all(isinstance(k, str) and _mlx_entry(v) for k, v in tensors.items())):
        return [f"{where}: model.quantisation.tensors must map module paths to their type, bits and group_size"]
    return []


def _mlx_entry(v: Any) -> bool:
    """Whether a manifest's entry for an MLX-quantised module is one the oracle decodes: affine at one of its widths
    and group sizes, or a floating-point mode at its own."""
    if not isinstance(v, dict):
        return False
    if v.get("type") == "affine":
        return v.get("bits") in MLX_BITS and v.get("group_size") in MLX_GROUP_SIZES
    mode = MLX_FLOAT_MODES.get(v.get("type"))
    return mode is not None and (v.get("bits"), v.get("group_size")) == mode[:2]


def check_manifest(m: Any, where: str) -> list[str]:
    if not isinstance(m, dict):
        return [f"{where}: must be a JSON object"]
    out = []
    if m.get("schema") != SCHEMA:
        return [f"{where}: schema is {m.get('schema')!r}, expected {SCHEMA!r} (not a conformance fixture set)"]
    sv = m.get("schema_version")
    if not isinstance(sv, int) or isinstance(sv, bool):
        return [f"{where}: schema_version must be an integer, got {sv!r}"]
    if sv > SCHEMA_VERSION:
        return [f"{where}: schema_version {sv} is newer than this harness reads ({SCHEMA_VERSION}); upgrade "
                "gemma4-conformance"]
    if sv not in READABLE_SCHEMA_VERSIONS:
        return [f"{where}: schema_version {sv} is not supported (this harness reads "
                f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))})"]
    if sv >= 2 and m.get("storage") not in STORAGES:
        out.append(choice_message("storage", m.get("storage"), STORAGES, who=where))
    if not isinstance(m.get("name"), str) or not NAME_RE.match(m["name"]):
        out.append(f"{where}: name {m.get('name')!r} is missing or not a valid set name")
    if not isinstance(m.get("version"), str) or not SEMVER_RE.match(m["version"]):
        out.append(f"{where}: version {m.get('version')!r} is not a semantic version (MAJOR.MINOR.PATCH)")
    if not isinstance(m.get("provenance"), dict):
        out.append(f"{where}: provenance is missing")
    elif not isinstance(m["provenance"].get("cross_checks", []), list):
        out.append(f"{where}: provenance.cross_checks must be a list")
    oracle = m.get("oracle")
    if not isinstance(oracle, dict) or oracle.get("dtype") != "float64":
        out.append(f"{where}: oracle.dtype must be float64, got {oracle!r}")
    model = m.get("model")
    if not isinstance(model, dict) or model.get("kind") not in ("synthetic", "external"):
        out.append(f"{where}: model.kind must be 'synthetic' or 'external'")
    else:
        hashes = model.get("sha256")
        unsafe = [(k, checkpoint_name_problem(k)) for k in hashes] if isinstance(hashes, dict) else []
        unsafe = [(k, why) for k, why in unsafe if why is not None]
        if not (isinstance(hashes, dict) and all(isinstance(k, str) and isinstance(v, str) and SHA_RE.match(v)
                                                 for k, v in hashes.items())):
            out.append(f"{where}: model.sha256 must map file names to sha256 hex digests")
        elif unsafe:
            out += [f"{where}: model.sha256 names {k!r}, which is not a plain relative path inside the checkpoint "
                    f"({why})" for k, why in unsafe]
        elif model["kind"] == "synthetic":
            if model.get("preset") not in PRESETS:
                out.append(f"{where}: model.preset {model.get('preset')!r} is not a preset of this refimpl "
                           f"({', '.join(PRESETS)})")
            if not isinstance(model.get("seed"), int) or isinstance(model.get("seed"), bool) or model["seed"] < 0:
                out.append(f"{where}: model.seed must be a non-negative integer")
            if model.get("dtype") not in ("f32", "bf16"):
                out.append(f"{where}: model.dtype must be f32 or bf16")
            missing = [n for n in SYNTHETIC_CHECKED if n not in hashes]
            if missing:
                out.append(f"{where}: model.sha256 lacks {missing[0]}")
        else:
            sizes = model.get("size")  # optional: sets made before it was recorded have none
            if not isinstance(model.get("path"), str):
                out.append(f"{where}: model.path must be a string (where the checkpoint was made from)")
            elif "config.json" not in hashes and not (len(hashes) == 1 and next(iter(hashes)).endswith(".gguf")):
                out.append(f"{where}: model.sha256 lacks config.json")
            elif sizes is not None and not (isinstance(sizes, dict) and set(sizes) == set(hashes) and all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sizes.values())):
                out.append(f"{where}: model.size must map the files of model.sha256 to their sizes in bytes")
            out += quantisation_problems(model.get("quantisation"), where)
    files = m.get("files")
    if not isinstance(files, dict):
        out.append(f"{where}: files must map file names to sha256 digests")
    else:
        for f in (SET_FILES if sv == 1 else (CASES,)):
            if f not in files:
                out.append(f"{where}: files lacks {f}")
        if sv >= 2 and not any(isinstance(f, str) and (BASE_FILE_RE.match(f) or f == MTP_FILE) for f in files):
            out.append(f"{where}: files lists no base file (base-<id>.safetensors)")
        for f, h in files.items():
            if not isinstance(f, str) or Path(f).name != f or f in (".", "..", MANIFEST) or \
                    (sv >= 2 and f not in (CASES, MTP_FILE) and not BASE_FILE_RE.match(f)):
                out.append(f"{where}: files entry {f!r} is not a file name of the set")
            elif not isinstance(h, str) or not SHA_RE.match(h):
                out.append(f"{where}: files[{f!r}] is not a sha256 hex digest")
    return out
