"""Synthetic Gemma 4 checkpoints: published variants in miniature, written as Hugging Face directories.

``write_checkpoint(preset, seed, out)`` writes ``config.json`` (legacy serialisation, which
transformers 5.23+, mlx-lm and the llama.cpp converter all read), ``model.safetensors`` (F32 or
BF16) and a SentencePiece ``tokenizer.model`` trained deterministically with Gemma's special pieces.
The same preset and seed give the same bytes.

Weights are drawn so that every parameter matters: norm weights, layer scalars and router scales
lie in [0.5, 1.5] (so a ``1 + w`` norm or a skipped scalar shows), the final norm is large enough that
logits reach the non-linear part of the softcap, and router projections are wide enough to give
clear expert margins. Every preset but ``mtp-layout-mini`` ends its KV-owning prefix with (sliding, full), so
the HF rule and the llama.cpp / JAX positional rule pick the same KV source; ``mtp-layout-mini`` is the MTP
pair where they do not.

Presets with a ``vision`` (or ``audio``) entry are image-text (audio-text) models: they are always written in the
published
Gemma4ForConditionalGeneration layout (``text_config``, ``vision_config`` and the placeholder token ids
at the top level; tensors under ``model.language_model.``, ``model.vision_tower.`` and
``model.embed_vision.``) with a tiny vision tower (patch 4, pooling 3: an image of up to 70 soft
tokens is at most 84 x 84 pixels) and a ``processor_config.json`` (max_soft_tokens 70). The audio
preset adds a tiny conformer tower (``model.audio_tower.``, ``model.embed_audio.``) for the standard
128-bin log-mel front end (``feature_extractor`` in processor_config.json). The placeholder ids are
the tokenizer's own ``<|image>``, ``<image|>``, ``<|image|>``, ``<|audio>``, ... pieces.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import sentencepiece as spm

from .assistant import ASSISTANT_ARCHITECTURES, expected_assistant_tensors, parse_assistant_config
from .audio import expected_audio_tensors, parse_audio_config
from .config import parse_config
from .errors import InputError
from .multimodal import MULTIMODAL_PIECES
from .presets import (
    ASSISTANT_DIR,
    COMMON,
    PRESET_EXTRAS,
    PRESETS,
    PUBLISHED,
    PUBLISHED_COMMON,
    SPECIAL_PIECES,
    TOKENIZER_VOCAB,
    UNIFIED_ARCHITECTURES,
    F,
    S,
)
from .safetensors_io import write_safetensors
from .safetensors_stream import write_safetensors_streamed
from .threads import threads
from .unified import (
    expected_unified_audio_tensors,
    expected_unified_vision_tensors,
    parse_unified_audio_config,
    parse_unified_vision_config,
)
from .vision import expected_vision_tensors, parse_vision_config
from .weights import expected_tensors


def published_layer_types(variant: str, layers: int) -> list[str]:
    """The variant's pattern (period - 1 sliding, then 1 full) cut to ``layers``; the last layer is full."""
    period = PUBLISHED[variant]["period"]
    types = [F if (i + 1) % period == 0 else S for i in range(layers)]
    types[-1] = F
    return types


def published_kv_shared(variant: str, layers: int) -> int:
    """KV-shared layers of a ``layers``-deep cut: the published fraction (E2B 20/35, E4B 18/42), rounded,
    then lowered until the KV-owning prefix ends with (sliding, full), so every shared layer has a source
    of its type and the HF and positional rules agree (module doc). 0 when no such prefix exists."""
    spec = PUBLISHED[variant]
    if not spec.get("num_kv_shared_layers"):
        return 0
    types = published_layer_types(variant, layers)
    shared = round(layers * spec["num_kv_shared_layers"] / spec["num_hidden_layers"])
    while shared > 0:
        first = layers - shared
        if first >= 2 and types[first - 1] == F and types[first - 2] == S:
            return shared
        shared -= 1
    return 0


def published_config(variant: str, turn_end_id: int, layers: int | None = None) -> dict:
    """config.json (legacy serialisation, Gemma4ForCausalLM) of a published variant, optionally cut to
    ``layers`` layers (every tensor keeps its published shape; the layer pattern, KV sharing and PLE
    table width follow the cut)."""
    if variant not in PUBLISHED:
        raise InputError(f"unknown published variant {variant!r}; choose one of {', '.join(PUBLISHED)}")
    spec = PUBLISHED[variant]
    full = spec["num_hidden_layers"]
    if layers is None:
        layers = full
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= full:
        raise InputError(f"--layers must be an integer in [1, {full}] for {variant}, got {layers!r}")
    fields = {k: v for k, v in spec.items() if k not in ("description", "period", "family")}
    fields.update(num_hidden_layers=layers, layer_types=published_layer_types(variant, layers),
                  num_kv_shared_layers=published_kv_shared(variant, layers))
    arch, model_type = (UNIFIED_ARCHITECTURES["causal"] if spec.get("family") == "gemma4_unified"
                        else ("Gemma4ForCausalLM", "gemma4_text"))
    return {"architectures": [arch], "model_type": model_type, "dtype": "bfloat16",
            **PUBLISHED_COMMON, **fields, "eos_token_id": [1, turn_end_id]}


CHUNK_VALUES = 1 << 24  # values drawn per piece when streaming a published-shape tensor


def published_tensor_chunks(name: str, shape: tuple[int, ...], seed: int, index: int, hidden: int):
    """A function yielding the float32 values of one tensor, CHUNK_VALUES at a time, from its own
    generator ``default_rng([seed, 7, index])`` (the same values whatever else is written). The rules
    of ``_spread``, with the embedding std scaled by sqrt(64 / H) so that logits stay about 10 at any
    width (the softcap stays non-linear but not saturated)."""
    kind, a, b = _spread(name, shape, embed_std=0.6 * (64 / hidden) ** 0.5)
    total = int(np.prod(shape))

    def chunks():
        rng = np.random.default_rng([seed, 7, index])
        for start in range(0, total, CHUNK_VALUES):
            n = min(CHUNK_VALUES, total - start)
            if kind == "uniform":
                yield rng.random(n, dtype=np.float32) * np.float32(b - a) + np.float32(a)
            else:
                yield rng.standard_normal(n, dtype=np.float32) * np.float32(b) + np.float32(a)
    return chunks


def published_parameters(config: dict) -> int:
    """Number of text-decoder parameters of a config (what the checkpoint stores)."""
    return sum(int(np.prod(shape)) for shape in expected_tensors(parse_config(config)).values())


def write_published_checkpoint(variant: str, seed: int, out: str | Path, layers: int | None = None,
                               dtype: str = "bf16", layout: str = "causal", overwrite: bool = False,
                               progress=None) -> Path:
    """Write a checkpoint with the published shapes of ``variant`` (optionally cut to ``layers`` layers),
    weights streamed to disk (never the whole checkpoint in memory: the tensors drawn ahead on the oracle's
    threads, ``threads()``, within ``safetensors_stream``'s budget, each from its own generator, so the bytes do
    not depend on their number); atomic like ``write_checkpoint``.
    The tokenizer is the synthetic one (its ids are a prefix of the 262144-id vocabulary).
    ``progress(bytes_done, bytes_total)`` is called as the weights are written."""
    if dtype not in ("f32", "bf16"):
        raise InputError(f"dtype must be f32 or bf16, got {dtype!r}")
    if layout not in ("causal", "conditional"):
        raise InputError(f"layout must be causal or conditional, got {layout!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InputError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise InputError(f"{out} already exists and is not an empty directory; choose another --out")
    turn_end = SPECIAL_PIECES.index("<turn|>") + 4
    config = published_config(variant, turn_end, layers)
    config["dtype"] = "bfloat16" if dtype == "bf16" else "float32"
    shapes = sorted(expected_tensors(parse_config(config)).items())
    need = sum(int(np.prod(shape)) for _, shape in shapes) * (2 if dtype == "bf16" else 4)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if need > free:
        raise InputError(f"{out.parent}: the checkpoint needs {need / 2**30:.1f} GiB, but only {free / 2**30:.1f} GiB "
                         "are free; choose another --out or fewer --layers")
    prefix = "model."
    if layout == "conditional":
        prefix = "model.language_model."
        text = {k: v for k, v in config.items() if k != "architectures"}
        arch, model_type = ((UNIFIED_ARCHITECTURES["conditional"]) if PUBLISHED[variant].get("family")
                            == "gemma4_unified" else ("Gemma4ForConditionalGeneration", "gemma4"))
        config = {"architectures": [arch], "model_type": model_type, "text_config": text,
                  "vision_config": None, "audio_config": None, "eos_token_id": text["eos_token_id"],
                  "tie_word_embeddings": True, "dtype": text["dtype"]}
    hidden = dict(shapes)["embed_tokens.weight"][1]
    tensors = {prefix + name: (shape, published_tensor_chunks(name, shape, seed, k, hidden))
               for k, (name, shape) in enumerate(shapes)}
    with _atomic_directory(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        write_safetensors_streamed(tmp / "model.safetensors", tensors, "BF16" if dtype == "bf16" else "F32",
                                   metadata={"format": "pt", "preset": variant, "seed": str(seed),
                                             "layers": str(len(config.get("text_config", config)["layer_types"]))},
                                   progress=progress, ahead=threads())
        (tmp / "tokenizer.model").write_bytes(train_tokenizer())
    return out


@contextlib.contextmanager
def _atomic_directory(out: Path):
    """Yield a new temporary directory beside ``out``; on success it replaces ``out``, on any failure
    (or interrupt) it is removed and ``out`` is left as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


IMAGE_SOFT_TOKENS = 70  # processor_config.json max_soft_tokens of the vision presets


def piece_id(piece: str) -> int:
    """The id of one of SPECIAL_PIECES in the synthetic tokenizer (user-defined pieces follow the 4 core ids)."""
    return SPECIAL_PIECES.index(piece) + 4


def preset_config(preset: str, turn_end_id: int) -> dict:
    """The config.json (legacy serialisation, Gemma4ForCausalLM) of a preset."""
    if preset not in PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    fields = {k: v for k, v in PRESETS[preset].items() if k not in PRESET_EXTRAS}
    arch, model_type = (UNIFIED_ARCHITECTURES["causal"] if PRESETS[preset].get("family") == "gemma4_unified"
                        else ("Gemma4ForCausalLM", "gemma4_text"))
    cfg = {
        "architectures": [arch], "model_type": model_type, "dtype": "float32",
        **COMMON, **fields, "eos_token_id": [1, turn_end_id],
    }
    return cfg


# ----------------------------------------------------------------------------------------------
# weights


def _spread(name: str, shape: tuple[int, ...], embed_std: float = 0.6) -> tuple[str, float, float]:
    """(distribution, a, b) of one text tensor: "uniform" on [a, b] or "normal" with mean a, std b.
    Norms and scales in [0.5, 1.5]; the final norm in [1.5, 2.5] (logits of ~10: the softcap of 30 is
    visibly non-linear); router projections of std 2 (clear top-k margins); projections
    ~ N(0, 1/fan_in); see module doc."""
    leaf = name.rsplit(".", 2)
    if name == "norm.weight":
        return "uniform", 1.5, 2.5
    if name == "embed_tokens.weight":
        return "normal", 0.0, embed_std
    if name == "embed_tokens_per_layer.weight":
        return "normal", 0.0, 0.5
    if name.endswith("router.proj.weight"):
        return "normal", 0.0, 2.0
    if ("norm" in name and name.endswith(".weight")) or leaf[-1] in ("layer_scalar", "scale", "per_expert_scale"):
        return "uniform", 0.5, 1.5
    return "normal", 0.0, shape[-1] ** -0.5


def _draw(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One tensor of a miniature, drawn from ``_spread``."""
    kind, a, b = _spread(name, shape)
    return rng.uniform(a, b, shape) if kind == "uniform" else rng.normal(a, b, shape)


def make_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    cfg = parse_config(config)
    rng = np.random.default_rng(seed)
    return {name: _draw(name, shape, rng) for name, shape in sorted(expected_tensors(cfg).items())}


def assistant_checkpoint(spec: dict, target_config: dict, seed: int) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, tensors) of a preset's drafter for the target ``target_config`` (written by
    ``write_checkpoint``). Drawn like a text model, with a token ordering that is a random permutation (so a
    port that reads the ordered table as the canonical one, or skips the cluster map, shows)."""
    target = target_config.get("text_config", target_config)
    family = spec["family"]
    text_keys = {k: v for k, v in spec.items()
                 if k not in ("family", "use_ordered_embeddings", "num_centroids", "centroid_intermediate_top_k")}
    text = {**{k: v for k, v in COMMON.items() if k not in text_keys}, **text_keys,
            "vocab_size": target["vocab_size"], "sliding_window": target["sliding_window"],
            "rope_parameters": target["rope_parameters"], "num_kv_shared_layers": text_keys["num_hidden_layers"],
            "model_type": "gemma4_unified_text" if family == "gemma4_unified_assistant" else "gemma4_text",
            "eos_token_id": target["eos_token_id"]}
    config = {"architectures": [ASSISTANT_ARCHITECTURES[family]], "model_type": family, "text_config": text,
              "backbone_hidden_size": target["hidden_size"], "tie_word_embeddings": True,
              "use_ordered_embeddings": spec.get("use_ordered_embeddings", False),
              "num_centroids": spec.get("num_centroids", 2048),
              "centroid_intermediate_top_k": spec.get("centroid_intermediate_top_k", 32)}
    acfg = parse_assistant_config(config, "assistant config")
    rng = np.random.default_rng(seed + 7919)
    tensors = {}
    for name, shape in sorted(expected_assistant_tensors(acfg).items()):
        if name == "masked_embedding.token_ordering":
            tensors[name] = rng.permutation(shape[0]).astype(np.int64)
        elif name.startswith("model."):
            tensors[name] = _draw(name[len("model."):], shape, rng)
        elif name == "masked_embedding.centroids.weight":
            tensors[name] = rng.normal(0.0, 1.0, shape)  # clear cluster margins
        else:
            tensors[name] = rng.normal(0.0, shape[-1] ** -0.5, shape)
    return config, tensors


def _draw_vision(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One vision tensor: norms and std_scale in [0.5, 1.5], std_bias of a few units (so the pooler's
    sqrt(D) and the standardization both show), clip bounds that bite, projections ~ N(0, 1/fan_in)."""
    leaf = name.rsplit(".", 1)[-1]
    if ("norm" in name and leaf == "weight") or leaf == "std_scale":
        return rng.uniform(0.5, 1.5, shape)
    if leaf == "std_bias":
        return rng.normal(0.0, 2.0, shape)
    if leaf == "position_embedding_table":
        return rng.normal(0.0, 0.5, shape)
    if leaf in ("input_min", "output_min"):
        return -rng.uniform(0.6, 1.2, shape)
    if leaf in ("input_max", "output_max"):
        return rng.uniform(0.6, 1.2, shape)
    return rng.normal(0.0, shape[-1] ** -0.5, shape)


def _draw_audio(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One audio tensor: norm weights in [0.5, 1.5], per-dim scales in [10, 14] (softplus of them scales
    the queries, so attention logits reach the cap of 50 and the cap changes the soft tokens by ~0.1;
    below torch's softplus threshold of 20), clip bounds that bite, biases small, the rest
    ~ N(0, 1/fan_in) over the kernel's fan-in."""
    leaf = name.rsplit(".", 1)[-1]
    if ("norm" in name and leaf == "weight") or leaf == "weight" and len(shape) == 1 and "conv" not in name:
        return rng.uniform(0.5, 1.5, shape)
    if leaf == "per_dim_scale":
        return rng.uniform(10.0, 14.0, shape)
    if leaf in ("input_min", "output_min"):
        return -rng.uniform(1.0, 2.0, shape)
    if leaf in ("input_max", "output_max"):
        return rng.uniform(1.0, 2.0, shape)
    if leaf == "bias":
        return rng.normal(0.0, 0.1, shape)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    return rng.normal(0.0, fan_in ** -0.5, shape)


def make_audio_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """The audio tower and projector tensors (full checkpoint names) of a conditional config."""
    rng = np.random.default_rng([seed, 2])
    return {name: _draw_audio(name, shape, rng)
            for name, shape in sorted(expected_audio_tensors(parse_audio_config(config)).items())}


def _draw_unified(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One Unified embedder tensor: LayerNorm weights in [0.5, 1.5] and biases of 0.2 (both show), the
    position table N(0, 0.5), projections ~ N(0, 1/fan_in) with a small dense bias."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "weight" and len(shape) == 1:
        return rng.uniform(0.5, 1.5, shape)
    if leaf == "bias":
        return rng.normal(0.0, 0.2, shape)
    if leaf == "pos_embedding":
        return rng.normal(0.0, 0.5, shape)
    return rng.normal(0.0, shape[-1] ** -0.5, shape)


def make_unified_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """The vision and audio embedder tensors (published names) of a Unified conditional config."""
    rng = np.random.default_rng([seed, 3])
    shapes = {}
    if config.get("vision_config") is not None:
        shapes.update(expected_unified_vision_tensors(parse_unified_vision_config(config)))
    if config.get("audio_config") is not None:
        shapes.update(expected_unified_audio_tensors(parse_unified_audio_config(config)))
    return {name: _draw_unified(name, shape, rng) for name, shape in sorted(shapes.items())}


def make_vision_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """The vision tower and projector tensors (full checkpoint names) of a conditional config."""
    rng = np.random.default_rng([seed, 1])
    return {name: _draw_vision(name, shape, rng)
            for name, shape in sorted(expected_vision_tensors(parse_vision_config(config)).items())}


# ----------------------------------------------------------------------------------------------
# tokenizer


def _corpus(seed: int = 0):
    rng = random.Random(seed)
    words = (
        "the a an of to in is and gemma model token layer attention window cache prefill decode logits "
        "vocabulary sliding full rotary norm expert router scale embedding head softcap sequence batch "
        "chunk position mask key value query hidden width double shared per table projection hello world "
        "what why how when where which who this that these those it they we you user question answer"
    ).split()
    tails = [".", "!", "?", ",", " 123", " 4096", " café", " 漢字", " naïve", "\n", "  ", ""]
    for _ in range(3000):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) + rng.choice(tails)


def train_tokenizer() -> bytes:
    """A 512-piece BPE SentencePiece model with Gemma's ids (pad 0, eos 1, bos 2, unk 3, <mask> 4),
    Gemma 4's markers as user-defined pieces, byte fallback; deterministic."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_corpus(), model_writer=buf, vocab_size=TOKENIZER_VOCAB, model_type="bpe",
        byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", add_dummy_prefix=False,
        num_threads=1, user_defined_symbols=SPECIAL_PIECES, minloglevel=2,
    )
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------
# the directory


def quieten(weights: dict[str, np.ndarray], quiet: dict | None) -> dict[str, np.ndarray]:
    """The weights with the embedding rows of ids [first, stop) scaled by ``scale`` (a preset's ``quiet_rows``;
    the other tensors, drawn before, unchanged)."""
    if quiet is not None:
        weights["embed_tokens.weight"][quiet["first"]:quiet["stop"]] *= quiet["scale"]
    return weights


def write_checkpoint(preset: str, seed: int, out: str | Path, dtype: str = "f32",
                     layout: str = "causal", overwrite: bool = False) -> Path:
    """Write a complete checkpoint directory; atomic (a temporary directory renamed into place).

    layout "causal" writes Gemma4ForCausalLM (tensors under ``model.``); "conditional" writes the
    published Gemma4ForConditionalGeneration form (config under ``text_config``, tensors under
    ``model.language_model.``) without vision or audio towers.
    """
    if dtype not in ("f32", "bf16"):
        raise InputError(f"dtype must be f32 or bf16, got {dtype!r}")
    if layout not in ("causal", "conditional"):
        raise InputError(f"layout must be causal or conditional, got {layout!r}")
    if not isinstance(seed, int) or seed < 0:
        raise InputError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise InputError(f"{out} already exists and is not an empty directory; choose another --out")

    tokenizer = train_tokenizer()
    turn_end = SPECIAL_PIECES.index("<turn|>") + 4  # user-defined pieces follow the 4 core ids
    config = preset_config(preset, turn_end)
    weights = quieten(make_weights(config, seed), PRESETS[preset].get("quiet_rows"))
    config["dtype"] = "bfloat16" if dtype == "bf16" else "float32"
    prefix = "model."
    vision, audio = PRESETS[preset].get("vision"), PRESETS[preset].get("audio")
    u_vision, u_audio = PRESETS[preset].get("unified_vision"), PRESETS[preset].get("unified_audio")
    unified = PRESETS[preset].get("family") == "gemma4_unified"
    if vision is not None or audio is not None or u_vision is not None or u_audio is not None:
        layout = "conditional"  # image/audio-text models exist only in this layout
    if layout == "conditional":
        prefix = "model.language_model."
        config = _conditional_config(config, unified)
    tensors = {prefix + name: value for name, value in weights.items()}
    processor = _towers(preset, config, tensors, seed)
    with _atomic_directory(out) as tmp:
        if PRESETS[preset].get("assistant") is not None:
            _write_assistant(tmp / ASSISTANT_DIR, preset, config, seed, dtype, tokenizer)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        write_safetensors(tmp / "model.safetensors", tensors, "BF16" if dtype == "bf16" else "F32",
                          metadata={"format": "pt", "preset": preset, "seed": str(seed)})
        (tmp / "tokenizer.model").write_bytes(tokenizer)
        if processor is not None:
            (tmp / "processor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n",
                                                       encoding="utf-8")
    return out


def _conditional_config(config: dict, unified: bool) -> dict:
    """The Gemma4ForConditionalGeneration (or Unified) form of a text config: the text under ``text_config``."""
    text = {k: v for k, v in config.items() if k not in ("architectures",)}
    arch, model_type = UNIFIED_ARCHITECTURES["conditional"] if unified else ("Gemma4ForConditionalGeneration",
                                                                             "gemma4")
    text["model_type"] = "gemma4_unified_text" if unified else "gemma4_text"
    return {
        "architectures": [arch], "model_type": model_type, "text_config": text,
        "vision_config": None, "audio_config": None, "eos_token_id": text["eos_token_id"],
        "tie_word_embeddings": True, "dtype": text["dtype"],
    }


def _towers(preset: str, config: dict, tensors: dict, seed: int) -> dict | None:
    """A preset's vision and audio towers (or Unified's embedders): their config sections and token ids into
    ``config``, their weights into ``tensors``; returns the processor config (None without towers)."""
    vision, audio = PRESETS[preset].get("vision"), PRESETS[preset].get("audio")
    u_vision, u_audio = PRESETS[preset].get("unified_vision"), PRESETS[preset].get("unified_audio")
    processor = None
    if vision is not None:
        config["vision_config"] = dict(vision)
        config.update({key: piece_id(piece) for key, piece in MULTIMODAL_PIECES.items()})
        tensors.update(make_vision_weights(config, seed))
        processor = {"image_processor": {"image_processor_type": "Gemma4ImageProcessor",
                                         "patch_size": vision["patch_size"],
                                         "pooling_kernel_size": vision["pooling_kernel_size"],
                                         "max_soft_tokens": IMAGE_SOFT_TOKENS}}
    if audio is not None:
        config["audio_config"] = dict(audio)
        config.update({key: piece_id(piece) for key, piece in MULTIMODAL_PIECES.items()})
        tensors.update(make_audio_weights(config, seed))
        processor = {**(processor or {}), "audio_seq_length": 750,
                     "feature_extractor": {"feature_extractor_type": "Gemma4AudioFeatureExtractor",
                                           "feature_size": 128, "sampling_rate": 16000}}

    if u_vision is not None or u_audio is not None:
        config["vision_config"], config["audio_config"] = u_vision and dict(u_vision), u_audio and dict(u_audio)
        config.update({key: piece_id(piece) for key, piece in MULTIMODAL_PIECES.items()})
        tensors.update(make_unified_weights(config, seed))
        processor = {}
        if u_vision is not None:
            processor["image_processor"] = {"image_processor_type": "Gemma4UnifiedImageProcessor",
                                            "patch_size": u_vision["patch_size"],
                                            "pooling_kernel_size": u_vision["pooling_kernel_size"],
                                            "max_soft_tokens": IMAGE_SOFT_TOKENS}
        if u_audio is not None:
            processor["feature_extractor"] = {"feature_extractor_type": "Gemma4UnifiedAudioFeatureExtractor",
                                              "audio_samples_per_token": u_audio["audio_embed_dim"],
                                              "sampling_rate": 16000}
    return processor


def _write_assistant(folder: Path, preset: str, config: dict, seed: int, dtype: str, tokenizer: bytes) -> None:
    """The preset's MTP assistant (drafter) checkpoint in ``folder``, made for the target's ``config``."""
    a_config, a_tensors = assistant_checkpoint(PRESETS[preset]["assistant"], config, seed)
    a_config["dtype"] = config.get("dtype", "float32")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(a_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    write_safetensors(folder / "model.safetensors", a_tensors, "BF16" if dtype == "bf16" else "F32",
                      metadata={"format": "pt", "preset": preset, "seed": str(seed)})
    (folder / "tokenizer.model").write_bytes(tokenizer)
    # transformers takes the drafts per round from the assistant's generation config (and fails without)
    (folder / "generation_config.json").write_text(
        json.dumps({"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "constant"}, indent=2) + "\n",
        encoding="utf-8")
