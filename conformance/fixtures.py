"""Fixture sets: golden float64 oracle logits for a case matrix, with an integrity-checked manifest.

A set is a directory (docs/fixtures.md has the full format)::

    <set>/manifest.json         schema, name, version, provenance, model, oracle, bases, files (sha256)
    <set>/cases.json            {"cases": [Case.to_json(), ...]}
    <set>/expected.safetensors  base/<id>/tokens [N] I64, base/<id>/logits [N, V] F64,
                                base/<id>/router_margin [N] F64 (MoE models: min over layers per token)
                                image bases I<k> also: base/<id>/embeddings [N, H] F64 (the merged input
                                embeddings), base/<id>/images [n, 2] I64 (first position, soft tokens),
                                and per image j: image/<id>/<j>/pixels [h, w, 3] U8 (the image),
                                .../pixel_values [P, 3p^2] F64, .../positions [P, 2] I64, .../soft_tokens [M, H] F64

Public API::

    generate_set(out, *, model_dir=None, preset=None, seed=0, prompts=None, name=None, version="1.0.0",
                 progress=None, cross_check=None, command=None, cases="auto", images=None) -> Path
    load_set(path) -> FixtureSet          # verifies schema and every sha256 first (FixtureError)
    verify_set(path, *, recompute=False, workdir=None) -> list[str]   # problems; never raises for content
    bundled_sets() -> list[Path]          # the sets shipped in the package, one per synthetic preset
    load_prompts(path) -> list[dict]      # a prompts JSONL file, validated (PromptError with the line)
    bundled_set(name) -> Path
    FixtureSet.bases() / base_logits() / router_margins() / image_blocks() / media(convention) /
               image_inputs() / model_dir(workdir) / warnings
    FixtureError (integrity/schema: exit 3), PromptError (a ValueError: a usage error)
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib.resources
import json
import math
import os
import platform
import re
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from . import __version__ as CONFORMANCE_VERSION
from .cases import (
    DECODE_STEPS, GENERATION_BASE, GENERATION_STEPS, PROMPT_CONTINUATION, PROMPT_PREFIX, RANDOM_BASES,
    BaseMedia, Case, annotate, check_case, generate_cases, generate_image_cases, random_base_length,
)

SCHEMA = "gemma4-conformance/fixtures"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
CASES = "cases.json"
EXPECTED = "expected.safetensors"
SET_FILES = (CASES, EXPECTED)
SYNTHETIC_FILES = ("config.json", "model.safetensors", "tokenizer.model")
SYNTHETIC_CHECKED = ("config.json", "model.safetensors")  # a tokenizer mismatch is only a warning
CONSISTENCY_BOUND = 1e-9  # chunked prefill + decode vs full forward inside the oracle (float64)
RECOMPUTE_BOUND = 1e-9  # verify_set(recompute=True): stored logits vs a fresh oracle run
CHAT_PROMPT = "What does the sliding window attention cache keep?"  # base G when the model has a tokenizer
G_RANDOM_PROMPT = 16  # base G prompt length when the model has no tokenizer
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
SEMVER_RE = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
SHA_RE = re.compile(r"^[0-9a-f]{64}$")
CASE_KINDS = ("auto", "text", "images", "audio", "all")  # generate_set(cases=...); auto = all
# the synthetic images of an image set (h, w): upscaled by the resize rule, downscaled, and a square
SYNTHETIC_IMAGE_SIZES = ((50, 70), (200, 120), (36, 36))
IMAGE_LEAVES = ("pixels", "pixel_values", "positions", "soft_tokens")  # image/<base>/<j>/<leaf>
AUDIO_LEAVES = ("waveform", "features", "mask", "soft_tokens")  # audio/<base>/<j>/<leaf>
BASE_LEAVES = ("tokens", "logits", "router_margin", "embeddings", "images", "audio")  # base/<base>/<leaf>
MEDIA_LEAVES = {("image", leaf) for leaf in IMAGE_LEAVES} | {("audio", leaf) for leaf in AUDIO_LEAVES}
IMAGE_TEXT = {"I0": (4, 6), "I1": (3, 3, 5)}  # text tokens before, between and after the image blocks
AUDIO_TEXT = {"S0": (4, 6), "S1": (3, 3, 5)}  # the same for the audio blocks
SYNTHETIC_AUDIO_SECONDS = (0.5, 0.8, 0.3)  # the synthetic clips (16 kHz): 13, 20 and 8 soft tokens

Progress = Callable[[int, int, str], None]
# cross_check(model_dir, bases, base_logits) -> {"implementation", "agreement", "detail"} | [...] | None
# (None: the check could not run, e.g. its packages are missing, and nothing is recorded)
CrossCheck = Callable[[Path, Mapping[str, np.ndarray], Mapping[str, np.ndarray]], Any]


class FixtureError(Exception):
    """An integrity or schema problem with a fixture set (exit code 3), or a set that cannot be made."""


class PromptError(ValueError):
    """A bad prompts file or prompt entry (a usage error, not an integrity one); names the file and line."""


# ----------------------------------------------------------------------------------------------
# small helpers


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _versions() -> dict[str, str]:
    import refimpl

    return {"refimpl_version": refimpl.__version__, "numpy_version": np.__version__,
            "python_version": platform.python_version(), "conformance_version": CONFORMANCE_VERSION}


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, obj: Any) -> None:
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


def _model_files(model_dir: Path) -> list[str]:
    """The files of a checkpoint the oracle reads (hashed for an external model, never copied)."""
    names = ["config.json"]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names.append(index.name)
        try:
            shards = sorted(set(_read_json(index)["weight_map"].values()))
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


def _hash_files(model_dir: Path, names: Iterable[str]) -> dict[str, str]:
    return {n: sha256_file(model_dir / n) for n in names}


# ----------------------------------------------------------------------------------------------
# prompts


_PROMPT_KEYS = {"text", "messages", "tokens"}
_PROMPT_OPTIONAL = {"id", "chat"}


def _check_prompt(entry: Any, where: str) -> dict:
    """One prompt entry -> {"kind": text|messages|tokens, "value": ..., "id": str|None, "chat": bool}."""
    if isinstance(entry, str):
        entry = {"text": entry}
    elif isinstance(entry, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in entry):
        entry = {"tokens": list(entry)}
    if not isinstance(entry, dict):
        raise PromptError(f"{where}: a prompt must be a JSON object with one of 'text', 'messages', 'tokens'")
    kinds = sorted(_PROMPT_KEYS & set(entry))
    unknown = sorted(set(entry) - _PROMPT_KEYS - _PROMPT_OPTIONAL)
    if unknown:
        raise PromptError(f"{where}: unknown key '{unknown[0]}' (allowed: text, messages, tokens, id, chat)")
    if len(kinds) != 1:
        raise PromptError(f"{where}: a prompt needs exactly one of 'text', 'messages', 'tokens'"
                          + (f" (got {', '.join(kinds)})" if kinds else ""))
    kind = kinds[0]
    value = entry[kind]
    pid = entry.get("id")
    if pid is not None and not isinstance(pid, str):
        raise PromptError(f"{where}: 'id' must be a string")
    chat = entry.get("chat", False)
    if not isinstance(chat, bool):
        raise PromptError(f"{where}: 'chat' must be true or false")
    if chat and kind != "text":
        raise PromptError(f"{where}: 'chat' only applies to 'text' (use 'messages' for a conversation)")
    if kind == "text":
        if not isinstance(value, str) or not value:
            raise PromptError(f"{where}: 'text' must be a non-empty string")
    elif kind == "messages":
        if not isinstance(value, list) or not value:
            raise PromptError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        for n, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise PromptError(f"{where}: message {n} must be an object with string 'role' and 'content'")
    else:
        if (not isinstance(value, list) or not value
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
            raise PromptError(f"{where}: 'tokens' must be a non-empty list of non-negative integers")
    return {"kind": kind, "value": value, "id": pid, "chat": chat, "where": where}


def load_prompts(path: str | Path) -> list[dict]:
    """Read a prompts JSONL file: one JSON object per line (blank lines are skipped), each with exactly
    one of ``text`` (raw text; ``"chat": true`` renders it as one user turn), ``messages`` (a chat
    conversation) or ``tokens`` (ids used as given), and an optional ``id``. PromptError names the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"{path}: cannot be read ({e})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(entry, dict):
            raise PromptError(f"{where}: a prompt must be a JSON object with one of 'text', 'messages', 'tokens'")
        out.append(_check_prompt(entry, where))
    if not out:
        raise PromptError(f"{path}: holds no prompt")
    return out


def _prompt_entries(prompts) -> list[dict]:
    if prompts is None:
        return []
    if isinstance(prompts, (str, Path)):
        return load_prompts(prompts)
    return [_check_prompt(p, f"prompt {n}") for n, p in enumerate(prompts)]


def _encode_prompt(p: dict, tokenizer, vocab: int) -> list[int]:
    where = p["where"]
    if p["kind"] == "tokens":
        ids = list(p["value"])
    else:
        if tokenizer is None:
            raise PromptError(f"{where}: the model directory has no tokenizer.model, so only 'tokens' prompts work")
        try:
            if p["kind"] == "messages":
                ids = tokenizer.encode_chat(p["value"])
            elif p["chat"]:
                ids = tokenizer.encode_chat([{"role": "user", "content": p["value"]}])
            else:
                ids = tokenizer.encode(p["value"])
        except Exception as e:  # noqa: BLE001 - TokenizerError and friends: report with the line
            raise PromptError(f"{where}: {e}") from None
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise PromptError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return ids


# ----------------------------------------------------------------------------------------------
# bases


def _ordinary_ids(tokenizer, vocab: int) -> np.ndarray:
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


def _bos(cfg, tokenizer) -> int:
    if tokenizer is not None:
        return int(tokenizer.bos_id)
    return int(cfg.bos_token_id if cfg.bos_token_id is not None else 2)


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    from refimpl.generate import greedy_generate

    return [int(t) for t in greedy_generate(model, prompt, n, stop_ids=()).tokens]


# ----------------------------------------------------------------------------------------------
# image bases


def has_vision_tower(model_dir: str | Path) -> bool:
    """Whether config.json declares a vision tower (a Gemma4ForConditionalGeneration with vision_config)."""
    try:
        raw = _read_json(Path(model_dir) / "config.json")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # the oracle's own loader reports a bad config.json
    return isinstance(raw, dict) and isinstance(raw.get("vision_config"), dict)


def synthetic_image(seed: int, k: int, height: int, width: int) -> np.ndarray:
    """A deterministic RGB test image [height, width, 3] uint8: colour gradients, four discs and noise,
    so that resizing, patches and pooling all see structure."""
    rng = np.random.default_rng([seed, 100 + k])
    y, x = np.mgrid[0:height, 0:width] / max(height, width)  # [h, w] each, in [0, 1)
    img = np.stack([x, y, 1.0 - (x + y) / 2.0], axis=-1) * rng.uniform(0.4, 1.0, 3)  # [h, w, 3]
    for cy, cx, r in rng.uniform(0.0, 1.0, (4, 3)):
        img[(y - cy) ** 2 + (x - cx) ** 2 < (0.05 + 0.2 * r) ** 2] = rng.uniform(0.0, 1.0, 3)
    img = img + rng.normal(0.0, 0.05, img.shape)
    return np.round(np.clip(img, 0.0, 1.0) * 255.0).astype(np.uint8)


@dataclass
class ImageBase:
    """One image base: the prompt ids (placeholders in), the oracle's inputs and every intermediate."""

    ids: list[int]  # [N] prompt ids: text, boi, image_token_id x M, eoi, ...
    inputs: Any  # refimpl.multimodal.MultimodalInputs: llm ids, merged embeddings [N, H], vision blocks
    spans: list[tuple[int, int]]  # (first position, M) of each image block
    originals: list[np.ndarray]  # the images, uint8 [h, w, 3]
    processed: list[Any]  # refimpl.image.ProcessedImage per image (resized pixels, pixel_values, positions)
    soft: list[np.ndarray]  # soft tokens [M, H] per image
    info: dict  # the manifest's description


class _Vision:
    """The image side of a checkpoint: vision tower, image processor settings, placeholder ids."""

    def __init__(self, model_dir: Path):
        from refimpl.image import load_image_processor_settings
        from refimpl.multimodal import load_multimodal_tokens
        from refimpl.vision import load_vision_tower

        self.weights, self.cfg = load_vision_tower(model_dir)
        self.settings = load_image_processor_settings(model_dir, self.cfg)
        self.tokens = load_multimodal_tokens(model_dir, ["image"])

    def soft_tokens(self, image: np.ndarray) -> tuple[Any, np.ndarray]:
        """(ProcessedImage, soft tokens [M, H]) of one uint8 image."""
        from refimpl.image import preprocess_image
        from refimpl.vision import vision_tower

        st = self.settings
        processed = preprocess_image(image, st.patch_size, st.pooling_kernel_size, st.max_soft_tokens)
        return processed, vision_tower(processed.pixel_values, processed.positions, self.weights, self.cfg)

    def manifest(self, bidirectional: bool) -> dict:
        t, st = self.tokens, self.settings
        return {"token_ids": {"image_token_id": t.image_token_id, "boi_token_id": t.boi_token_id,
                              "eoi_token_id": t.eoi_token_id},
                "processor": {"patch_size": st.patch_size, "pooling_kernel_size": st.pooling_kernel_size,
                              "max_soft_tokens": st.max_soft_tokens},
                "vision_blocks": bidirectional}


def _image_sources(images, seed: int) -> list[tuple[np.ndarray, dict]]:
    """(uint8 image, manifest description) for each image: the given files or arrays, else synthetic ones."""
    if images is None:
        return [(synthetic_image(seed, k, h, w), {"source": "synthetic", "rng": f"numpy default_rng([{seed}, {100 + k}])"})
                for k, (h, w) in enumerate(SYNTHETIC_IMAGE_SIZES)]
    from refimpl.image import read_image

    out = []
    for k, item in enumerate(images):
        if isinstance(item, (str, Path)):
            out.append((read_image(item), {"source": "file", "name": Path(item).name, "sha256": sha256_file(Path(item))}))
        else:
            arr = np.asarray(item)
            if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
                raise ValueError(f"image {k} must be a file path or a uint8 array [h, w, 3], got {arr.dtype} "
                                 f"{list(arr.shape)}")
            out.append((arr, {"source": "array"}))
    if not out:
        raise ValueError("images is an empty list; give at least one image (or none for the synthetic ones)")
    return out


def _text_pool(pool: np.ndarray, t) -> np.ndarray:
    """The ordinary ids of ``pool`` minus every multimodal placeholder and marker of ``t``
    (refimpl.multimodal.MultimodalTokens)."""
    return pool[~np.isin(pool, (t.image_token_id, t.boi_token_id, t.eoi_token_id, t.video_token_id,
                                t.audio_token_id, t.boa_token_id, t.eoa_token_id))]


def _media_order(b_index: int, n_blocks: int, n_sources: int) -> list[int]:
    """Which source fills each block of media base ``b_index``: base 0 the first, base 1 the next ones
    (wrapping around)."""
    return [(b_index + j) % n_sources if b_index else 0 for j in range(n_blocks)]


def _media_prompt(rng: np.random.Generator, pool: np.ndarray, bos: int, texts: tuple[int, ...],
                  blocks: list[tuple[int, int, int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """``bos``, then ``texts[0]`` random ids, block 0, ``texts[1]`` ids, block 1, ..., the last text run and
    DECODE_STEPS more ids. A block (open id, placeholder id, close id, M) is ``open + placeholder x M +
    close``. Returns the ids and the blocks' (first position, M)."""
    ids, spans = [bos], []
    for j, n_text in enumerate(texts):
        ids += [int(x) for x in rng.choice(pool, n_text + (DECODE_STEPS if j == len(texts) - 1 else 0))]
        if j < len(blocks):
            open_id, token, close_id, M = blocks[j]
            spans.append((len(ids) + 1, M))
            ids += [open_id] + [token] * M + [close_id]
    return ids, spans


def _make_image_base(model, vision: _Vision, pool: np.ndarray, bos: int, seed: int,
                     sources: Mapping[int, tuple[np.ndarray, dict]], b_index: int,
                     done: dict[int, tuple[Any, np.ndarray]] | None = None, n_sources: int | None = None) -> ImageBase:
    """Image base number ``b_index`` of IMAGE_TEXT (one fixture-generation job). I0: text + one image +
    text; I1: text + image + text + image + text; each followed by DECODE_STEPS text tokens (teacher-forced
    decode after the prompt). ``sources`` maps
    a source index to (image, description) and needs at least the indices the base uses; ``n_sources``
    is the number of sources in all (default ``len(sources)``); ``done`` caches soft tokens by index."""
    from refimpl.multimodal import multimodal_inputs

    base, texts = list(IMAGE_TEXT.items())[b_index]
    t = vision.tokens
    pool = _text_pool(pool, t)
    done = {} if done is None else done
    which = _media_order(b_index, len(texts) - 1, len(sources) if n_sources is None else n_sources)
    for k in which:
        if k not in done:
            done[k] = vision.soft_tokens(sources[k][0])
    processed, soft = [done[k][0] for k in which], [done[k][1] for k in which]
    ids, spans = _media_prompt(np.random.default_rng([seed, 10 + b_index]), pool, bos, texts,
                               [(t.boi_token_id, t.image_token_id, t.eoi_token_id, st.shape[0]) for st in soft])
    described = [{**sources[k][1], "index": k, "size": list(sources[k][0].shape[:2]),
                  "resized": list(pr.pixels.shape[:2]), "soft_tokens": M, "start": a}
                 for k, pr, (a, M) in zip(which, processed, spans)]
    info = {"source": "images", "length": len(ids), "rng": f"numpy default_rng([{seed}, {10 + b_index}])",
            "text": list(texts), "images": described}
    return ImageBase(ids, multimodal_inputs(model, ids, soft, t), spans,
                     [sources[k][0] for k in which], processed, soft, info)


def _image_consistency(model, base: "ImageBase | AudioBase", full: np.ndarray) -> float:
    """Max |prefill through the KV cache - full forward| for an image or audio base fed in pieces cut
    before every block's opening marker and after its closing one (never inside a block), then the
    decode tokens one at a time."""
    from refimpl.model import KVCache

    m, N = base.inputs, len(base.ids)
    cuts = {a - 1 for a, _ in base.spans} | {a + n + 1 for a, n in base.spans} | set(range(N - DECODE_STEPS, N))
    bounds = [0] + sorted(c for c in cuts if 0 < c < N) + [N]
    cache, rows = KVCache(), []
    for a, b in zip(bounds, bounds[1:]):
        blocks = None if m.vision_blocks is None else m.vision_blocks[a:b]
        rows.append(model.forward(m.ids[a:b], rows="all", cache=cache, embeddings=m.embeddings[a:b],
                                  vision_blocks=blocks))
    return float(np.max(np.abs(np.concatenate(rows) - full)))


def has_audio_tower(model_dir: str | Path) -> bool:
    """Whether config.json declares an audio tower (an ``audio_config``)."""
    try:
        raw = _read_json(Path(model_dir) / "config.json")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("audio_config"), dict)


def synthetic_waveform(seed: int, k: int, seconds: float, rate: int = 16_000) -> np.ndarray:
    """A deterministic test clip [n] float64 in [-1, 1]: a rising chirp, two harmonics, a pause and noise,
    so the mel bins, the valid-frame mask and the tower's local attention all see structure."""
    rng = np.random.default_rng([seed, 200 + k])
    t = np.arange(int(round(seconds * rate))) / rate  # [n] seconds
    f0 = rng.uniform(150.0, 400.0) + rng.uniform(200.0, 1200.0) * t / max(seconds, 1e-9)
    phase = 2.0 * np.pi * np.cumsum(f0) / rate
    wave = 0.3 * np.sin(phase) + 0.15 * np.sin(2.0 * phase) + 0.08 * np.sin(3.0 * phase + rng.uniform(0, np.pi))
    wave[(t > 0.4 * seconds) & (t < 0.5 * seconds)] *= 0.05  # a near-silent gap
    return np.clip(wave + rng.normal(0.0, 0.02, t.shape), -1.0, 1.0)


@dataclass
class AudioBase:
    """One audio base: the prompt ids (placeholders in), the oracle's inputs and every intermediate."""

    ids: list[int]  # [N] prompt ids: text, boa, audio_token_id x M, eoa, ...
    inputs: Any  # refimpl.multimodal.MultimodalInputs
    spans: list[tuple[int, int]]  # (first position, M) of each audio block
    waveforms: list[np.ndarray]  # [n] float64 per clip
    features: list[Any]  # refimpl.audio_features.AudioFeatures per clip (features [T, F], mask [T])
    soft: list[np.ndarray]  # soft tokens [M, H] per clip
    info: dict


class _Audio:
    """The audio side of a checkpoint: audio tower, feature extractor settings, placeholder ids."""

    def __init__(self, model_dir: Path):
        from refimpl.audio import load_audio_tower
        from refimpl.audio_features import load_audio_feature_settings
        from refimpl.multimodal import load_multimodal_tokens

        self.weights, self.cfg = load_audio_tower(model_dir)
        self.settings = load_audio_feature_settings(model_dir)
        self.tokens = load_multimodal_tokens(model_dir, ["audio"])

    def soft_tokens(self, wave: np.ndarray, rate: int) -> tuple[Any, np.ndarray]:
        """(AudioFeatures, soft tokens [M, H]) of one clip."""
        from refimpl.audio import audio_tower
        from refimpl.audio_features import audio_features

        feats = audio_features(wave, rate, self.settings)
        return feats, audio_tower(feats.features, feats.mask, self.weights, self.cfg)

    def manifest(self) -> dict:
        t = self.tokens
        return {"token_ids": {"audio_token_id": t.audio_token_id, "boa_token_id": t.boa_token_id,
                              "eoa_token_id": t.eoa_token_id},
                "feature_extractor": {"sampling_rate": self.settings.sampling_rate,
                                      "feature_size": self.settings.feature_size},
                "tower": {"attention_chunk_size": self.cfg.attention_chunk_size,
                          "attention_context_left": self.cfg.attention_context_left,
                          "attention_logit_cap": self.cfg.attention_logit_cap}}


def _audio_sources(audio, seed: int, rate: int) -> list[tuple[np.ndarray, int, dict]]:
    """(waveform, sample rate, manifest description) per clip: the given WAV files or arrays, else synthetic."""
    if audio is None:
        return [(synthetic_waveform(seed, k, sec, rate), rate, {"source": "synthetic", "seconds": sec,
                                                                 "rng": f"numpy default_rng([{seed}, {200 + k}])"})
                for k, sec in enumerate(SYNTHETIC_AUDIO_SECONDS)]
    from refimpl.audio_features import read_wav

    out = []
    for k, item in enumerate(audio):
        if isinstance(item, (str, Path)):
            wave, r = read_wav(item)
            out.append((wave, r, {"source": "file", "name": Path(item).name, "sha256": sha256_file(Path(item))}))
        else:
            arr = np.asarray(item)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.floating):
                raise ValueError(f"audio clip {k} must be a WAV path or a float array [n] (16 kHz), got {arr.dtype} "
                                 f"{list(arr.shape)}")
            out.append((arr.astype(np.float64), rate, {"source": "array"}))
    if not out:
        raise ValueError("audio is an empty list; give at least one clip (or none for the synthetic ones)")
    return out


def _make_audio_base(model, audio: _Audio, pool: np.ndarray, bos: int, seed: int,
                     sources: Mapping[int, tuple[np.ndarray, int, dict]], b_index: int,
                     done: dict[int, tuple[Any, np.ndarray]] | None = None, n_sources: int | None = None) -> AudioBase:
    """Audio base number ``b_index`` of AUDIO_TEXT (one fixture-generation job). S0: text + one clip +
    text; S1: text + clip + text + clip + text; then DECODE_STEPS text tokens. Arguments as
    ``_make_image_base``."""
    from refimpl.multimodal import multimodal_inputs

    base, texts = list(AUDIO_TEXT.items())[b_index]
    t = audio.tokens
    pool = _text_pool(pool, t)
    done = {} if done is None else done
    which = _media_order(b_index, len(texts) - 1, len(sources) if n_sources is None else n_sources)
    for k in which:
        if k not in done:
            done[k] = audio.soft_tokens(sources[k][0], sources[k][1])
            if done[k][1].shape[0] == 0:
                raise ValueError(f"audio clip {k} is too short to give one soft token")
    feats, soft = [done[k][0] for k in which], [done[k][1] for k in which]
    ids, spans = _media_prompt(np.random.default_rng([seed, 20 + b_index]), pool, bos, texts,
                               [(t.boa_token_id, t.audio_token_id, t.eoa_token_id, st.shape[0]) for st in soft])
    described = [{**sources[k][2], "index": k, "samples": int(sources[k][0].shape[0]),
                  "frames": int(f.mask.shape[0]), "valid_frames": int(f.mask.sum()), "soft_tokens": M, "start": a}
                 for k, f, (a, M) in zip(which, feats, spans)]
    info = {"source": "audio", "length": len(ids), "rng": f"numpy default_rng([{seed}, {20 + b_index}])",
            "text": list(texts), "audio": described}
    inputs = multimodal_inputs(model, ids, [], t, audio_soft_tokens=soft)
    return AudioBase(ids, inputs, spans, [sources[k][0] for k in which], feats, soft, info)


def _base_logits(model, ids: list[int], inputs=None) -> tuple[np.ndarray, np.ndarray | None]:
    """Full float64 logits [N, V] of a base, and its per-token router margin (min over layers) for MoE.
    ``inputs`` (refimpl.multimodal.MultimodalInputs) for an image base."""
    from refimpl.model import Trace

    trace = Trace()
    if inputs is None:
        logits = model.forward(ids, rows="all", trace=trace)
    else:
        logits = model.forward(inputs.ids, rows="all", embeddings=inputs.embeddings,
                               vision_blocks=inputs.vision_blocks, trace=trace)
    margins = [v for k, v in trace.tensors.items() if k.endswith(".router.margin")]
    margin = np.min(np.stack(margins), axis=0) if margins else None
    return np.ascontiguousarray(logits, dtype=np.float64), margin


def _consistency_plan(n: int, window: int) -> list[int]:
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


def _consistency(model, ids: list[int], full: np.ndarray) -> float:
    """Max |chunked prefill + single-token decode through the KV cache - full forward| over every row."""
    from refimpl.model import KVCache

    cache, rows, at = KVCache(), [], 0
    for size in _consistency_plan(len(ids), model.cfg.sliding_window):
        rows.append(model.forward(ids[at:at + size], rows="all", cache=cache))
        at += size
    return float(np.max(np.abs(np.concatenate(rows) - full)))


def _cross_entries(result: Any, who: str) -> list[dict]:
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


# ----------------------------------------------------------------------------------------------
# generation


def _default_command() -> str:
    argv = [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]
    return shlex.join(argv)


class PartialRunMismatch(FixtureError):
    """The partial-run directory beside ``out`` belongs to a run with other arguments (never mixed)."""


class PartialRunBusy(FixtureError):
    """Another run holds the lock of ``out``'s partial run (conformance.parallel.RunLock): it is writing
    the same set now."""


def publish_path(out: str | Path) -> Path:
    """Where the set for ``out`` is published, absolute: ``out`` itself, or for a symbolic link to an
    existing directory the directory it points to (a rename cannot replace a link). ValueError for a
    dangling link: found before any work, not when the finished set cannot be renamed into place."""
    absolute = Path(os.path.abspath(out))
    if absolute.is_symlink():
        if not absolute.exists():
            raise ValueError(f"{out} is a symbolic link to {os.readlink(absolute)}, which does not exist; remove "
                             "the link or choose another --out")
        return Path(os.path.realpath(absolute))
    return absolute


def _job_versions() -> dict[str, str]:
    """The versions a job's numbers depend on (every worker must match the parent)."""
    v = _versions()
    return {k: v[k] for k in ("conformance_version", "refimpl_version", "numpy_version")}


def _media_key(items) -> list | None:
    """The given images or clips as the run key sees them: file name and sha256, or array digest."""
    if items is None:
        return None
    out = []
    for item in items:
        if isinstance(item, (str, Path)):
            p = Path(item)
            out.append({"file": str(p), "sha256": sha256_file(p) if p.is_file() else None})
        else:
            a = np.ascontiguousarray(np.asarray(item))
            out.append({"array": list(a.shape), "dtype": str(a.dtype), "sha256": hashlib.sha256(a.tobytes()).hexdigest()})
    return out


def _count_by_base(cases: Iterable[Case]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in cases:
        counts[c.base] = counts.get(c.base, 0) + 1
    return counts


def generate_set(out: str | Path, *, model_dir: str | Path | None = None, preset: str | None = None, seed: int = 0,
                 prompts=None, name: str | None = None, version: str = "1.0.0", progress: Progress | None = None,
                 cross_check: CrossCheck | None = None, command: str | None = None, cases: str = "auto",
                 images=None, audio=None, workers: int | None = None, cluster: str | None = None) -> Path:
    """Write a fixture set to ``out``: the only writer. Refuses an existing ``out`` (an empty directory
    is allowed). The work is split into one job per base (docs/distributed-generation.md), run in
    parallel, and resumable: every finished job's result is kept in ``<out.parent>/.<out.name>.partial/``
    (with the synthetic checkpoint of a ``preset``) until the set is published, so a run that fails or
    is killed is resumed by running it again with the same arguments (a partial directory of other
    arguments raises PartialRunMismatch, a FixtureError). The set is published atomically (renamed
    into place) only when every job is done and assembly succeeded; the partial directory is then
    removed. A failure before any job finished leaves nothing behind.

    ``workers``: local processes (default ``os.cpu_count()``; 1 runs everything in this process).
    ``cluster``: the address of a Dask distributed scheduler (e.g. ``tcp://host:8786``) whose workers
    run the jobs instead; they must see the model directory and ``out``'s parent at the same absolute
    paths. Not both. Whatever the executor, the set is the same, byte for byte (the manifest's
    provenance aside).

    Exactly one of ``model_dir`` (an external checkpoint: recorded by absolute path and sha256, never
    copied) and ``preset`` (a ``refimpl synth`` preset, regenerated from ``seed`` when the set is used).
    ``prompts``: a JSONL path or a list of entries (see ``load_prompts``) -> bases P0, P1, ...
    ``progress(done, total, label)`` is called as work completes (``label`` e.g. ``"base A: 48 tokens,
    14 cases, 0.3 s"``, or ``"base A: done in an earlier run"``). ``cross_check(model_dir, bases,
    base_logits)`` compares another implementation (entries are recorded only when it returns some).
    ``command`` is recorded as the generator command line (default: this process's argv).
    ``cases``: "text" (the text matrix), "images" (the image matrix only: image bases I0, I1), "audio"
    (the audio matrix only: audio bases S0, S1), "all" or "auto" (the text matrix plus the image and
    audio matrices the checkpoint's towers allow). ``images``: the images of the image bases (file
    paths or uint8 [h, w, 3] arrays; default: synthetic images from ``seed``); ``audio``: the clips
    of the audio bases (WAV paths or float arrays at 16 kHz; default: synthetic clips). With image or
    audio bases, ``cross_check`` is also given ``images={base: [ProcessedImage, ...]}`` and/or
    ``audio={base: [AudioFeatures, ...]}``.

    Errors: ValueError for bad arguments (PromptError, a ValueError, for bad prompts, naming the line;
    conformance.parallel.ClusterError, a ValueError, when the cluster cannot be used), refimpl's
    RefimplError when the oracle cannot load the checkpoint, FixtureError when ``out`` exists or the set
    cannot be made (the oracle is not self-consistent, a cross check returned garbage, a partial run of
    other arguments is in the way), PartialRunBusy (a FixtureError) at once when another run is
    generating ``out`` (one run per ``out``: conformance.parallel.RunLock, taken before any work), and
    ValueError for an ``out`` that is a dangling symbolic link (a link to an existing empty directory
    is followed: the set is published there).
    """
    from refimpl.synth import PRESETS

    from . import parallel

    out = Path(out)
    if (model_dir is None) == (preset is None):
        raise ValueError("give exactly one of a model directory (--model) and a synthetic preset (--preset)")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not isinstance(version, str) or not SEMVER_RE.match(version):
        raise ValueError(f"version {version!r} is not a semantic version (MAJOR.MINOR.PATCH, e.g. 1.0.0)")
    name = name if name is not None else (preset if preset is not None else out.name)
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"set name {name!r} must be letters, digits, '.', '_' or '-' (and start with a letter "
                         "or digit)")
    target = publish_path(out)
    _refuse_existing(out, target)
    entries = _prompt_entries(prompts)  # validate before any work
    if cases not in CASE_KINDS:
        raise ValueError(f"cases must be one of {', '.join(CASE_KINDS)}, got {cases!r}")
    if model_dir is not None:
        model_dir = Path(model_dir).resolve()
        if not model_dir.is_dir():
            raise ValueError(f"{model_dir}: not a directory")
    if cases == "images" and entries:
        raise ValueError("prompts make text bases, but cases='images' writes the image matrix only; use cases='all'")
    if images is not None and cases in ("text", "audio"):
        raise ValueError(f"images were given, but cases={cases!r} writes no image base; use cases='all' or 'images'")
    if audio is not None and cases in ("text", "images"):
        raise ValueError(f"audio was given, but cases={cases!r} writes no audio base; use cases='all' or 'audio'")
    if cases == "audio" and entries:
        raise ValueError("prompts make text bases, but cases='audio' writes the audio matrix only; use cases='all'")
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if cluster is not None and workers is not None:
        raise ValueError("give either workers (local processes) or cluster (a Dask scheduler address), not both")
    if cluster is not None and (not isinstance(cluster, str) or not cluster.strip()):
        raise ValueError(f"cluster must be a Dask scheduler address such as tcp://host:8786, got {cluster!r}")

    target.parent.mkdir(parents=True, exist_ok=True)
    with parallel.RunLock.acquire(target):  # PartialRunBusy at once while another run writes this set
        _refuse_existing(out, target)  # published by a run that held the lock until just now
        dask = parallel.DaskCluster(cluster) if cluster is not None else None  # ClusterError before any work
        try:
            return _generate(out, target, model_dir=model_dir, preset=preset, seed=seed, entries=entries, name=name,
                             version=version, progress=progress, cross_check=cross_check, command=command,
                             cases=cases, images=images, audio=audio,
                             workers=workers if workers is not None else (os.cpu_count() or 1), dask=dask)
        finally:
            if dask is not None:
                dask.close()


def _refuse_existing(out: Path, target: Path) -> None:
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise FixtureError(f"{out} already exists; fixture sets are never overwritten (choose another --out, or "
                           "remove it first)")


def _generate(out: Path, out_abs: Path, *, model_dir: Path | None, preset: str | None, seed: int, entries: list[dict],
              name: str, version: str, progress: Progress | None, cross_check: CrossCheck | None, command: str | None,
              cases: str, images, audio, workers: int, dask) -> Path:
    """generate_set after argument checks, under the run's lock: plan the jobs, run the missing ones, assemble,
    publish to ``out_abs`` (publish_path(out))."""
    from refimpl.model import Gemma4
    from refimpl.synth import write_checkpoint
    from refimpl.tokenizer import Tokenizer

    from . import parallel

    model = None
    if preset is not None:
        model_key: dict[str, Any] = {"kind": "synthetic", "preset": preset, "seed": seed, "dtype": "f32"}
    else:
        model = Gemma4(model_dir)  # float64, exact sqrt(H) embedding scale; RefimplError for a bad checkpoint
        model_key = {"kind": "external", "path": str(model_dir), "sha256": _hash_files(model_dir, _model_files(model_dir))}
    arguments = {"model": model_key, "cases": cases, "name": name, "version": version,
                 "prompts": [{k: e[k] for k in ("kind", "value", "id", "chat", "where")} for e in entries],
                 "images": _media_key(images), "audio": _media_key(audio), **_job_versions()}
    run = parallel.PartialRun.open(out_abs, arguments)
    done = 0
    total = 0

    def step(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    staging = None
    try:
        # the model
        if preset is not None:
            total = 1
            src = run.model_dir
            reused = src.is_dir()
            if not reused:  # deterministic; written once into the partial dir, renamed into place when complete
                tmp = Path(tempfile.mkdtemp(prefix=".model.tmp-", dir=run.path))
                try:
                    os.rename(write_checkpoint(preset, seed, tmp / "model", dtype="f32"), src)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            model_info = {**model_key, "sha256": _hash_files(src, SYNTHETIC_FILES)}
            model = Gemma4(src)
        else:
            src = model_dir
            model_info = model_key
        tokenizer = Tokenizer.from_dir(src)
        cfg = model.cfg
        vision_tower, audio_tower = has_vision_tower(src), has_audio_tower(src)
        if cases == "images" and not vision_tower:
            raise ValueError(f"cases={cases!r} needs image bases, but {src} has no vision tower (config.json has no "
                             "vision_config); use cases='text'")
        if cases == "audio" and not audio_tower:
            raise ValueError(f"cases={cases!r} needs audio bases, but {src} has no audio tower (config.json has no "
                             "audio_config); use cases='text'")
        if images is not None and not vision_tower:
            raise ValueError(f"images were given, but {src} has no vision tower (config.json has no vision_config)")
        if audio is not None and not audio_tower:
            raise ValueError(f"audio was given, but {src} has no audio tower (config.json has no audio_config)")
        with_text = cases in ("text", "all", "auto")
        with_images = cases == "images" or (cases in ("all", "auto") and vision_tower)
        with_audio = cases == "audio" or (cases in ("all", "auto") and audio_tower)
        prompt_ids = [_encode_prompt(p, tokenizer, cfg.vocab_size) for p in entries]
        bos = _bos(cfg, tokenizer)

        # the plan: one job per base, in the set's order; the parent only draws ids and encodes prompts
        plan: list[dict] = []  # {"base", "spec", "cost", "info" (text bases)}
        common = {"key": run.key, "partial": str(run.path), "model_dir": str(src), "seed": seed, "bos": bos}

        def add(base: str, kind: str, cost: float, info: dict | None = None, **spec) -> None:
            plan.append({"base": base, "cost": cost, "info": info,
                         "spec": {**common, "base": base, "kind": kind, **spec}})

        text_cases: dict[str, int] = {}
        if with_text:
            pool = _ordinary_ids(tokenizer, cfg.vocab_size)
            n = random_base_length(cfg)
            for k, b in enumerate(RANDOM_BASES):
                rng = np.random.default_rng([seed, k])
                add(b, "text", 3.0 * n, {"source": "random", "length": n, "rng": f"numpy default_rng([{seed}, {k}])"},
                    ids=[bos] + [int(t) for t in rng.choice(pool, n - 1)], greedy=0)
            if tokenizer is not None:
                prompt = tokenizer.encode_chat([{"role": "user", "content": CHAT_PROMPT}])
                source = {"source": "chat", "text": CHAT_PROMPT}
            else:
                rng = np.random.default_rng([seed, len(RANDOM_BASES)])
                prompt = [bos] + [int(t) for t in rng.choice(pool, G_RANDOM_PROMPT - 1)]
                source = {"source": "random", "rng": f"numpy default_rng([{seed}, {len(RANDOM_BASES)}])"}
            steps = GENERATION_STEPS
            add(GENERATION_BASE, "text", 4.0 * (len(prompt) + steps),
                {**source, "length": len(prompt) + steps, "prompt_length": len(prompt),
                 "continuation": f"greedy, {steps} tokens"}, ids=[int(t) for t in prompt], greedy=steps)
            for k, (ids, p) in enumerate(zip(prompt_ids, entries)):
                steps = PROMPT_CONTINUATION
                add(f"{PROMPT_PREFIX}{k}", "text", 4.0 * (len(ids) + steps),
                    {"source": "prompt", "length": len(ids) + steps, "prompt_length": len(ids),
                     "continuation": f"greedy, {steps} tokens",
                     "where": p["where"], **({"id": p["id"]} if p["id"] else {}), "kind": p["kind"]},
                    ids=[int(t) for t in ids], greedy=steps)
            lengths = {q["base"]: q["info"]["length"] for q in plan}
            text_cases = _count_by_base(generate_cases(name, cfg, {b: [0] * L for b, L in lengths.items()}))
        vision = None
        if with_images:
            vision = _Vision(src)
            sources = _image_sources(images, seed)
            for b_index, (b, texts) in enumerate(IMAGE_TEXT.items()):
                which = _media_order(b_index, len(texts) - 1, len(sources))
                m = len(which) * vision.settings.max_soft_tokens  # an upper bound: the tower runs before the merge
                add(b, "image", 3.0 * (sum(texts) + DECODE_STEPS + m) + 2.0 * m, b_index=b_index,
                    n_sources=len(sources), sources={k: sources[k] for k in sorted(set(which))})
        audio_side = None
        if with_audio:
            from refimpl.audio_features import check_samples

            audio_side = _Audio(src)
            clips = _audio_sources(audio, seed, audio_side.settings.sampling_rate)
            for wave, rate, _ in clips:
                check_samples(wave, rate, audio_side.settings)  # a wrong rate is a usage error: before any job
            for b_index, (b, texts) in enumerate(AUDIO_TEXT.items()):
                which = _media_order(b_index, len(texts) - 1, len(clips))
                m = sum(25.0 * clips[k][0].shape[0] / clips[k][1] for k in which)  # ~25 soft tokens a second
                add(b, "audio", 3.0 * (sum(texts) + DECODE_STEPS + m) + 2.0 * m, b_index=b_index,
                    n_sources=len(clips), sources={k: clips[k] for k in sorted(set(which))})

        total += len(plan) + (1 if cross_check is not None else 0) + 1
        if preset is not None:
            step("model: reused from an earlier run" if reused else "model")

        # run the jobs that are not done yet, longest first
        def count_cases(meta_base: str) -> int:
            if meta_base in text_cases:
                return text_cases[meta_base]
            r = run.result(meta_base)
            kind = "audio" if r.meta["kind"] == "audio" else "image"
            return len(generate_image_cases(name, cfg, {meta_base: r.meta["ids"]}, {meta_base: r.meta["spans"]},
                                            kind=kind))

        def on_done(meta: dict) -> None:
            b = meta["base"]
            step(f"base {b}: {meta['tokens']} tokens, {count_cases(b)} cases, {meta['seconds']:.1f} s")

        pending = []
        for q in plan:
            if run.is_done(q["base"]):
                step(f"base {q['base']}: done in an earlier run")
            else:
                pending.append(q)
        pending.sort(key=lambda q: -q["cost"])  # stable: ties keep the set's order
        if pending and dask is not None:
            dask.check_workers([str(src), str(run.path / parallel.JOBS)])
        context = None
        if pending and dask is None and workers <= 1:
            context = parallel._Context(src, model=model)
            context._vision, context._audio = vision, audio_side
        parallel.run_jobs([q["spec"] for q in pending], workers=workers, cluster=dask, on_done=on_done,
                          context=context)

        # assemble
        results = {q["base"]: run.result(q["base"]) for q in plan}
        mine = _job_versions()
        for b, r in results.items():
            if r.meta.get("versions") != mine:
                raise FixtureError(f"base {b} was computed by worker {r.meta.get('worker')} with {r.meta.get('versions')}, "
                                   f"but this process has {mine}; every worker must run the same environment "
                                   f"(remove {run.path} and run again)")
        bases: dict[str, list[int]] = {}
        base_info: dict[str, dict] = {}
        logits: dict[str, np.ndarray] = {}
        margins: dict[str, np.ndarray] = {}
        spans: dict[str, list[tuple[int, int]]] = {}
        audio_spans: dict[str, list[tuple[int, int]]] = {}
        worst = 0.0
        for q in plan:
            b, r = q["base"], results[q["base"]]
            bases[b] = [int(t) for t in r.meta["ids"]]
            if q["info"] is not None:
                base_info[b] = {**q["info"], "length": len(bases[b])}
            else:
                base_info[b] = r.meta["info"]
                (audio_spans if r.meta["kind"] == "audio" else spans)[b] = [(int(a), int(n)) for a, n in r.meta["spans"]]
            logits[b] = r.array("logits")
            if r.has("router_margin"):
                margins[b] = r.array("router_margin")
            worst = max(worst, float(r.meta["consistency"]))
        media_bases = {**spans, **audio_spans}
        # G's continuation is the greedy argmax of its own rows (checked, so a tie cannot slip through)
        if GENERATION_BASE in bases:
            prompt_len = base_info[GENERATION_BASE]["prompt_length"]
            g = bases[GENERATION_BASE]
            for pos in range(prompt_len - 1, len(g) - 1):
                if int(np.argmax(logits[GENERATION_BASE][pos])) != g[pos + 1]:
                    raise FixtureError(f"base G: the greedy continuation at position {pos + 1} is not the argmax of "
                                       "the full forward (a tie between cached decode and the full forward)")
        if worst > CONSISTENCY_BOUND:
            raise FixtureError(f"the oracle is not self-consistent on this checkpoint: chunked prefill through the KV "
                               f"cache differs from the full forward by {worst:.3g} (bound {CONSISTENCY_BOUND})")
        checks = [{"implementation": "refimpl KV cache (chunked prefill and single-token decode)",
                   "agreement": worst,
                   "detail": f"max abs over every row of the {len(bases)} bases ({', '.join(bases)}) against the "
                             "full forward; " + ("each text base fed as pieces of 3, W+2, 1, 1 and W+5 tokens, "
                                                 "then single-token decode of the rest" if with_text else "")
                             + ("; " if with_text and media_bases else "")
                             + ("each image or audio base cut before every opening marker (boi, boa) and after "
                                "every closing one, then single-token decode" if media_bases else "")}]
        if cross_check is not None:
            from refimpl.audio_features import AudioFeatures
            from refimpl.image import ProcessedImage

            arrays = {b: np.asarray(ids, dtype=np.int64) for b, ids in bases.items()}
            extra: dict[str, Any] = {}
            if spans:
                extra["images"] = {b: [ProcessedImage(pixels=np.array(results[b].array(f"media.{j}.resized")),
                                                      pixel_values=np.array(results[b].array(f"media.{j}.pixel_values")),
                                                      positions=np.array(results[b].array(f"media.{j}.positions")),
                                                      num_soft_tokens=results[b].meta["num_soft_tokens"][j])
                                       for j in range(results[b].meta["n_media"])] for b in spans}
            if audio_spans:
                extra["audio"] = {b: [AudioFeatures(features=np.array(results[b].array(f"media.{j}.features")),
                                                    mask=np.array(results[b].array(f"media.{j}.mask")))
                                      for j in range(results[b].meta["n_media"])] for b in audio_spans}
            checks += _cross_entries(cross_check(Path(src), arrays, logits, **extra), "cross_check")
            step("cross check")

        matrix = (generate_cases(name, cfg, bases) if with_text else []) + \
            (generate_image_cases(name, cfg, bases, spans) if with_images else []) + \
            (generate_image_cases(name, cfg, bases, audio_spans, kind="audio") if with_audio else [])
        set_cases = [annotate(c, logits, margins or None) for c in matrix]

        tensors: dict[str, np.ndarray] = {}
        for b, ids in bases.items():
            tensors[f"base/{b}/tokens"] = np.asarray(ids, dtype=np.int64)
            tensors[f"base/{b}/logits"] = logits[b]
            if b in margins:
                tensors[f"base/{b}/router_margin"] = margins[b]
        for kind, blocks, leaves, spans_leaf in (("image", spans, IMAGE_LEAVES, "images"),
                                                 ("audio", audio_spans, AUDIO_LEAVES, "audio")):
            for b in blocks:
                r = results[b]
                tensors[f"base/{b}/embeddings"] = r.array("embeddings")
                tensors[f"base/{b}/{spans_leaf}"] = np.asarray(blocks[b], dtype=np.int64)
                for j in range(r.meta["n_media"]):
                    for leaf in leaves:
                        a = r.array(f"media.{j}.{leaf}")
                        tensors[f"{kind}/{b}/{j}/{leaf}"] = np.asarray(a, dtype=np.uint8) if leaf == "mask" else a
        from refimpl.safetensors_io import write_safetensors

        staging = run.staging()
        staged = staging / "set"
        staged.mkdir()
        write_safetensors(staged / EXPECTED, tensors, "F64", metadata={"schema": SCHEMA, "name": name})
        _write_json(staged / CASES, {"cases": [c.to_json() for c in set_cases]})
        versions = _versions()
        manifest = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "name": name,
            "version": version,
            "provenance": {
                "generator": f"conformance.fixtures.generate_set (conformance {CONFORMANCE_VERSION})",
                "command": command if command is not None else _default_command(),
                **{k: v for k, v in versions.items() if k != "conformance_version"},
                "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
                "cross_checks": checks,
            },
            "model": model_info,
            "oracle": {"dtype": "float64", "embed_scale": "exact"},
            "config": {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                       "num_hidden_layers": cfg.num_hidden_layers, "sliding_window": cfg.sliding_window},
            "bases": base_info,
            **({"images": vision.manifest(cfg.use_bidirectional_attention == "vision")} if vision else {}),
            **({"audio": audio_side.manifest()} if audio_side else {}),
            "cases": len(set_cases),
            "files": {f: sha256_file(staged / f) for f in SET_FILES},
        }
        _write_json(staged / MANIFEST, manifest)
        step("write")
        try:
            os.replace(staged, out_abs)
        except OSError as e:
            raise FixtureError(f"{out}: cannot move the finished set into place ({e}); was it created meanwhile?") from None
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if run.created and not run.finished():
            run.remove()  # nothing worth keeping: leave nothing behind
        raise
    run.remove()  # published: the partial run is done
    return out


# ----------------------------------------------------------------------------------------------
# reading and verifying


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
            from refimpl.safetensors_io import TensorStore

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
        from .backend import AudioInput

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
        from refimpl.synth import write_checkpoint

        target = Path(workdir) / f"{model['preset']}-seed{model['seed']}-{model['dtype']}"
        if not (target.is_dir() and self._synthetic_matches(target)):
            write_checkpoint(model["preset"], model["seed"], target, dtype=model["dtype"], overwrite=True)
        bad = [n for n in SYNTHETIC_CHECKED if sha256_file(target / n) != model["sha256"][n]]
        if bad:
            rec = self.manifest.get("provenance", {})
            now = _versions()
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


def _check_manifest(m: Any, where: str) -> list[str]:
    from refimpl.synth import PRESETS

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
    if sv != SCHEMA_VERSION:
        return [f"{where}: schema_version {sv} is not supported (this harness reads {SCHEMA_VERSION})"]
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
            if not isinstance(model.get("path"), str) or not os.path.isabs(model["path"]):
                out.append(f"{where}: model.path must be an absolute path")
            elif "config.json" not in hashes:
                out.append(f"{where}: model.sha256 lacks config.json")
    files = m.get("files")
    if not isinstance(files, dict):
        out.append(f"{where}: files must map file names to sha256 digests")
    else:
        for f in SET_FILES:
            if f not in files:
                out.append(f"{where}: files lacks {f}")
        for f, h in files.items():
            if not isinstance(f, str) or Path(f).name != f or f in (".", "..", MANIFEST):
                out.append(f"{where}: files entry {f!r} is not a file name of the set")
            elif not isinstance(h, str) or not SHA_RE.match(h):
                out.append(f"{where}: files[{f!r}] is not a sha256 hex digest")
    return out


def _stored_items(infos: Mapping[str, Any], kind: str, b: str, leaves: tuple[str, ...],
                  where: str) -> tuple[list[tuple[str, tuple]], list[str]]:
    """The stored images/clips ``<kind>/<b>/<j>/<leaf>`` of base ``b`` (counted by the first leaf) as
    (name prefix, the leaves' tensor infos), and a problem for each one missing a leaf."""
    items, out, j = [], [], 0
    while f"{kind}/{b}/{j}/{leaves[0]}" in infos:
        prefix = f"{kind}/{b}/{j}/"
        got = [infos.get(prefix + leaf) for leaf in leaves]
        missing = [leaf for leaf, info in zip(leaves, got) if info is None]
        if missing:
            out.append(f"{where}: {prefix}{missing[0]} is missing")
        items.append((prefix, tuple(got)))
        j += 1
    return items, out


def _check_audio_tensors(infos: Mapping[str, Any], b: str, N: int, where: str) -> list[str]:
    """Shapes and dtypes of an audio base's tensors."""
    emb, au = infos.get(f"base/{b}/embeddings"), infos[f"base/{b}/audio"]
    out = []
    if emb is None or emb.dtype != "F64" or len(emb.shape) != 2 or emb.shape[0] != N:
        out.append(f"{where}: audio base {b} needs base/{b}/embeddings as F64 [{N}, H]")
    if au.dtype != "I64" or len(au.shape) != 2 or au.shape[1] != 2 or au.shape[0] < 1:
        return out + [f"{where}: base/{b}/audio must be I64 [n, 2] (first position, soft tokens), got {au.dtype} "
                      f"{list(au.shape)}"]
    clips, missing = _stored_items(infos, "audio", b, AUDIO_LEAVES, where)
    if len(clips) != au.shape[0]:
        out.append(f"{where}: base {b} has {au.shape[0]} audio blocks but {len(clips)} stored clips")
    out += missing
    for p, (wave, feats, mask, st) in clips:
        if None in (wave, feats, mask, st):
            continue
        if wave.dtype != "F64" or len(wave.shape) != 1:
            out.append(f"{where}: {p}waveform must be F64 [n]")
        if feats.dtype != "F64" or len(feats.shape) != 2 or mask.dtype != "U8" or mask.shape != feats.shape[:1]:
            out.append(f"{where}: {p}features must be F64 [T, F] and {p}mask U8 [T]")
        if st.dtype != "F64" or len(st.shape) != 2 or (emb is not None and st.shape[1] != emb.shape[-1]):
            out.append(f"{where}: {p}soft_tokens must be F64 [M, H]")
    return out


def _check_image_tensors(infos: Mapping[str, Any], b: str, N: int, where: str) -> list[str]:
    """Shapes and dtypes of an image base's tensors (none of them for a text base)."""
    if f"base/{b}/audio" in infos:
        return _check_audio_tensors(infos, b, N, where)
    emb, im = infos.get(f"base/{b}/embeddings"), infos.get(f"base/{b}/images")
    images, missing = _stored_items(infos, "image", b, IMAGE_LEAVES, where)
    if emb is None and im is None and not images:
        return []
    if emb is None or im is None:
        return [f"{where}: image base {b} needs both base/{b}/embeddings and base/{b}/images"]
    out = []
    if emb.dtype != "F64" or len(emb.shape) != 2 or emb.shape[0] != N:
        out.append(f"{where}: base/{b}/embeddings must be F64 [{N}, H], got {emb.dtype} {list(emb.shape)}")
    if im.dtype != "I64" or len(im.shape) != 2 or im.shape[1] != 2 or im.shape[0] < 1:
        return out + [f"{where}: base/{b}/images must be I64 [n, 2] (first position, soft tokens), got {im.dtype} "
                      f"{list(im.shape)}"]
    if len(images) != im.shape[0]:
        out.append(f"{where}: base {b} has {im.shape[0]} image blocks but {len(images)} stored images")
    out += missing
    for p, (px, pv, pos, st) in images:
        if None in (px, pv, pos, st):
            continue
        if px.dtype != "U8" or len(px.shape) != 3 or px.shape[2] != 3:
            out.append(f"{where}: {p}pixels must be U8 [h, w, 3], got {px.dtype} {list(px.shape)}")
        if pv.dtype != "F64" or len(pv.shape) != 2 or pos.dtype != "I64" or pos.shape != (pv.shape[0], 2):
            out.append(f"{where}: {p}pixel_values must be F64 [P, C] and {p}positions I64 [P, 2]")
        if st.dtype != "F64" or len(st.shape) != 2 or (emb.shape and st.shape[1] != emb.shape[-1]):
            out.append(f"{where}: {p}soft_tokens must be F64 [M, H]")
    return out


def _check_image_blocks(fs: "FixtureSet", blocks: Mapping[str, list[tuple[int, int]]],
                        tokens: Mapping[str, np.ndarray], manifest: dict, where: str,
                        what: str = "image") -> list[str]:
    """Each image (audio) block lies in its base, holds only the manifest's image (audio) token, and has
    as many rows as its stored soft tokens."""
    out = []
    section, key = ("images", "image_token_id") if what == "image" else ("audio", "audio_token_id")
    token = ((manifest.get(section) or {}).get("token_ids") or {}).get(key)
    if blocks and not isinstance(token, int):
        return [f"{where}: the set has {what} bases but the manifest records no {section}.token_ids.{key}"]
    for b, spans in blocks.items():
        ids = tokens[b]
        stored = fs.image_inputs(b) if what == "image" else fs.audio_inputs(b)
        for j, (a, n) in enumerate(spans):
            if n < 1 or a < 1 or a + n >= len(ids):
                out.append(f"{where}: base {b} {what} block {j} ({a}, {n}) does not lie inside its {len(ids)} tokens")
            elif not np.all(ids[a:a + n] == token):
                out.append(f"{where}: base {b} {what} block {j} ({a}, {n}) holds tokens other than the {what} token "
                           f"{token}")
            elif j < len(stored) and stored[j]["soft_tokens"].shape[0] != n:
                out.append(f"{where}: base {b} {what} block {j} has {n} tokens but its {what} "
                           f"{stored[j]['soft_tokens'].shape[0]} soft tokens")
    return out


def _verify(path: Path) -> tuple[list[str], FixtureSet | None]:
    """All problems of a set, and the loaded set when there are none."""
    from refimpl.errors import WeightsError
    from refimpl.safetensors_io import read_header

    path = Path(path)
    if not path.is_dir():
        return [f"{path}: not a directory (a fixture set is a directory with {MANIFEST})"], None
    mpath = path / MANIFEST
    try:
        manifest = _read_json(mpath)
    except FileNotFoundError:
        return [f"{mpath}: missing; {path} is not a fixture set"], None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [f"{mpath}: not valid JSON ({e})"], None
    problems = _check_manifest(manifest, str(mpath))
    if problems:
        return problems, None
    ok_files = set()
    for f, want in manifest["files"].items():
        fp = path / f
        if not fp.is_file():
            problems.append(f"{fp}: missing (listed in {MANIFEST})")
            continue
        got = sha256_file(fp)
        if got != want:
            problems.append(f"{fp}: sha256 mismatch: {MANIFEST} records {want}, the file has {got} (the file was "
                            "modified, or the manifest was edited)")
        else:
            ok_files.add(f)
    if not set(SET_FILES) <= ok_files:
        return problems, None

    # expected.safetensors
    epath = path / EXPECTED
    try:
        infos = read_header(epath)
    except WeightsError as e:
        return problems + [f"{epath}: {e}"], None
    lengths: dict[str, int] = {}
    vocab = None
    seen: dict[str, set] = {}
    for n, info in infos.items():
        parts = n.split("/")
        if len(parts) == 4 and parts[2].isdigit() and (parts[0], parts[3]) in MEDIA_LEAVES:
            continue  # checked with its base below
        if len(parts) != 3 or parts[0] != "base" or parts[2] not in BASE_LEAVES:
            problems.append(f"{epath}: unexpected tensor '{n}'")
            continue
        seen.setdefault(parts[1], set()).add(parts[2])
    for b, leaves in sorted(seen.items()):
        t, lg = infos.get(f"base/{b}/tokens"), infos.get(f"base/{b}/logits")
        if t is None or lg is None:
            problems.append(f"{epath}: base {b} needs both tokens and logits")
            continue
        if t.dtype != "I64" or len(t.shape) != 1 or t.shape[0] < 1:
            problems.append(f"{epath}: base/{b}/tokens must be a non-empty I64 vector, got {t.dtype} {list(t.shape)}")
            continue
        if lg.dtype != "F64" or lg.shape[:1] != t.shape or len(lg.shape) != 2:
            problems.append(f"{epath}: base/{b}/logits must be F64 [{t.shape[0]}, V], got {lg.dtype} {list(lg.shape)}")
            continue
        if vocab is None:
            vocab = lg.shape[1]
        elif lg.shape[1] != vocab:
            problems.append(f"{epath}: base/{b}/logits has {lg.shape[1]} columns, other bases {vocab}")
        rm = infos.get(f"base/{b}/router_margin")
        if rm is not None and (rm.dtype != "F64" or rm.shape != t.shape):
            problems.append(f"{epath}: base/{b}/router_margin must be F64 [{t.shape[0]}]")
        problems += _check_image_tensors(infos, b, t.shape[0], str(epath))
        lengths[b] = t.shape[0]
    if not lengths:
        problems.append(f"{epath}: holds no base")
    declared = manifest.get("bases")
    if isinstance(declared, dict):
        for b, d in declared.items():
            if b not in lengths:
                problems.append(f"{epath}: base {b} of {MANIFEST} is not stored")
            elif isinstance(d, dict) and d.get("length") not in (None, lengths[b]):
                problems.append(f"{epath}: base {b} has {lengths[b]} tokens, {MANIFEST} says {d.get('length')}")
    fs = FixtureSet(path=path, manifest=manifest, cases=[])
    blocks: dict[str, list[tuple[int, int]]] = {}
    if not problems:
        tokens = fs.bases()
        for b, ids in tokens.items():
            if vocab is not None and (ids.min() < 0 or ids.max() >= vocab):
                problems.append(f"{epath}: base/{b}/tokens holds ids outside the vocabulary [0, {vocab})")
        blocks = fs.image_blocks()
        problems += _check_image_blocks(fs, blocks, tokens, manifest, str(epath))
        audio_blocks = fs.audio_blocks()
        problems += _check_image_blocks(fs, audio_blocks, tokens, manifest, str(epath), "audio")
        blocks = {**blocks, **audio_blocks}
        for b, a in fs.base_logits().items():
            if not np.all(np.isfinite(a)):
                problems.append(f"{epath}: base/{b}/logits holds non-finite values")
    else:
        tokens = {}

    # cases.json
    cpath = path / CASES
    try:
        doc = _read_json(cpath)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return problems + [f"{cpath}: not valid JSON ({e})"], None
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list):
        return problems + [f"{cpath}: must be an object with a 'cases' list"], None
    cases: list[Case] = []
    for k, d in enumerate(doc["cases"]):
        try:
            cases.append(Case.from_json(d))
        except ValueError as e:
            problems.append(f"{cpath}: case {k}: {e}")
    ids = [c.id for c in cases]
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        problems.append(f"{cpath}: duplicate case id {dups[0]}")
    prefix = f"{manifest['name']}/"
    for c in cases:
        if not c.id.startswith(prefix):
            problems.append(f"{cpath}: case id {c.id} does not start with the set name '{prefix}'")
        problems += [f"{cpath}: {p}" for p in check_case(c, lengths, blocks)]
        if c.generation and tokens and not check_case(c, lengths, blocks):
            want = tuple(int(t) for t in tokens[c.base][c.length:c.length + c.decode_len + 1])
            if tuple(c.golden_tokens) != want:
                problems.append(f"{cpath}: case {c.id}: golden tokens {list(c.golden_tokens)} are not "
                                f"base {c.base}[{c.length}:{c.length + c.decode_len + 1}] = {list(want)}")
    if isinstance(manifest.get("cases"), int) and manifest["cases"] != len(cases):
        problems.append(f"{cpath}: holds {len(cases)} cases, {MANIFEST} says {manifest['cases']}")
    if problems:
        return problems, None
    fs.cases = cases
    return problems, fs


def verify_set(path: str | Path, *, recompute: bool = False, workdir: str | Path | None = None) -> list[str]:
    """Every problem of a set (empty list = ok): schema, sha256 of every file, cases against bases, tensor
    shapes, and for an external set the sha256 of every checkpoint file it records (a checkpoint that is
    not there is a problem: its files were not checked). With ``recompute`` the model is materialised
    (synthetic: regenerated under ``workdir`` or a temporary directory) and every base's logits are
    recomputed with the oracle (bound RECOMPUTE_BOUND), and every case's ties are re-derived. Never
    raises for content problems."""
    try:
        problems, fs = _verify(Path(path))
        if not problems:
            problems = fs.checkpoint_problems()  # an external checkpoint: its files, or that they were not checked
    except Exception as e:  # noqa: BLE001 - verify reports, it does not raise
        return [f"{path}: cannot be verified: {type(e).__name__}: {e}"]
    if problems or not recompute:
        return problems
    with contextlib.ExitStack() as stack:
        wd = Path(workdir) if workdir is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        try:
            model_dir = fs.model_dir(wd)
            from refimpl.model import Gemma4

            model = Gemma4(model_dir)
        except Exception as e:  # noqa: BLE001
            return [str(e) if isinstance(e, FixtureError) else f"{path}: the model cannot be loaded: {e}"]
        stored = fs.base_logits()
        fresh: dict[str, np.ndarray] = {}
        margins: dict[str, np.ndarray] = {}
        blocks, audio_blocks = fs.image_blocks(), fs.audio_blocks()
        for b, ids in fs.bases().items():
            inputs = None
            if b in blocks or b in audio_blocks:
                recompute = _recompute_image_inputs if b in blocks else _recompute_audio_inputs
                inputs, chain = recompute(model, fs, b, model_dir)
                problems += [f"{Path(path) / EXPECTED}: base {b}: {msg}" for msg in chain]
            fresh[b], m = _base_logits(model, [int(t) for t in ids], inputs)
            if m is not None:
                margins[b] = m
            diff = float(np.max(np.abs(fresh[b] - stored[b]))) if fresh[b].shape == stored[b].shape else math.inf
            if diff > RECOMPUTE_BOUND:
                problems.append(f"{Path(path) / EXPECTED}: base {b}: the oracle now gives logits that differ by "
                                f"{diff:.3g} from the stored ones (bound {RECOMPUTE_BOUND})")
        if not problems:
            for c in fs.cases:
                again = annotate(c, fresh, margins or None)
                if [t[0] for t in again.ties] != [t[0] for t in c.ties]:
                    problems.append(f"{Path(path) / CASES}: case {c.id}: recorded ties {[t[0] for t in c.ties]}, "
                                    f"recomputed {[t[0] for t in again.ties]}")
    return problems


def _recompute_image_inputs(model, fs: FixtureSet, b: str, model_dir: Path) -> tuple[Any, list[str]]:
    """The oracle's inputs for image base ``b`` recomputed from its stored images (preprocessing, vision
    tower, merge), and every step that differs from what the set stores."""
    from refimpl.multimodal import multimodal_inputs

    vision = _Vision(model_dir)
    problems, soft = [], []
    for j, img in enumerate(fs.image_inputs(b)):
        processed, st = vision.soft_tokens(np.asarray(img["pixels"]))
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


def _recompute_audio_inputs(model, fs: FixtureSet, b: str, model_dir: Path) -> tuple[Any, list[str]]:
    """The oracle's inputs for audio base ``b`` recomputed from its stored waveforms (features, audio
    tower, merge), and every step that differs from what the set stores."""
    from refimpl.multimodal import multimodal_inputs

    audio = _Audio(model_dir)
    problems, soft = [], []
    for j, clip in enumerate(fs.audio_inputs(b)):
        feats, st = audio.soft_tokens(np.asarray(clip["waveform"], dtype=np.float64), audio.settings.sampling_rate)
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


def load_set(path: str | Path) -> FixtureSet:
    """Load a set after verifying its schema and the sha256 of every file (FixtureError naming the file)."""
    problems, fs = _verify(Path(path))
    if problems:
        more = f" (and {len(problems) - 1} more problem(s); run `conformance verify`)" if len(problems) > 1 else ""
        raise FixtureError(problems[0] + more)
    assert fs is not None
    return fs


# ----------------------------------------------------------------------------------------------
# the bundled sets


_BUNDLE_STACK = contextlib.ExitStack()


def _materialise(node) -> Path:
    """A filesystem path for an importlib.resources Traversable (extracted when in a zip)."""
    if isinstance(node, Path):
        return node
    tmp = Path(_BUNDLE_STACK.enter_context(tempfile.TemporaryDirectory(prefix="gemma4-conformance-fixtures-")))

    def copy(src, dst: Path) -> None:
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            if child.is_dir():
                copy(child, dst / child.name)
            else:
                (dst / child.name).write_bytes(child.read_bytes())

    copy(node, tmp / "fixtures")
    return tmp / "fixtures"


_BUNDLE_ROOT: list[Path] = []


def bundled_sets() -> list[Path]:
    """The fixture sets shipped in the package (``conformance/fixtures/<name>/``), sorted by name."""
    if not _BUNDLE_ROOT:
        root = importlib.resources.files("conformance").joinpath("fixtures")
        if not root.is_dir():
            return []
        _BUNDLE_ROOT.append(_materialise(root))
    base = _BUNDLE_ROOT[0]
    return sorted(p for p in base.iterdir() if p.is_dir() and (p / MANIFEST).is_file())


def bundled_set(name: str) -> Path:
    """The bundled set called ``name`` (FixtureError listing the names when there is none)."""
    sets = bundled_sets()
    for p in sets:
        if p.name == name:
            return p
    raise FixtureError(f"no bundled fixture set {name!r}; bundled: {', '.join(p.name for p in sets) or 'none'}")
