"""The text config of a Gemma 4 GGUF file, from its metadata and tensor shapes (docs/quantised.md).

llama.cpp's converter (convert_hf_to_gguf.py, ``Gemma4Model.set_gguf_parameters``) writes the config as
``gemma4.*`` keys; ``hf_config(f)`` turns them back into a config.json in the ``per_layer_config``
serialisation, which ``config.parse_config`` validates and derives from like any other. What the keys do not
say is read from the tensors:

    vocab_size                  token_embd.weight's rows (the converter trims it to the tokenizer's size)
    vocab_size_per_layer_input  per_layer_token_embd.weight's rows
    tie_word_embeddings         no output.weight
    attention_k_eq_v            the KV-owning full layers have attn_k and no attn_v
    full layers' RoPE           rope_freqs.weight: n entries 1.0 then 1e30 -> proportional, factor 2n / head dim
    use_double_wide_mlp         feed_forward_length per layer: I, and 2I on the KV-shared layers
    use_bidirectional_attention "vision" unless the model has per-layer inputs (null): the rule of every published
                                config (E2B/E4B causal; 26B-A4B, 31B, Unified 12B "vision"). llama.cpp decides by
                                the text width instead (mtmd.cpp: causal at 1536 and 2560, E2B/E4B), which agrees
                                on the published shapes, not on miniatures; it only matters for image prompts

Every key is checked for presence, type and range before use: one GGUFError naming the file and the key.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .gguf_io import GGUFError, GGUFFile

ARCH = "gemma4"
ASSISTANT_ARCH = "gemma4-assistant"
_BLOCK = re.compile(r"blk\.(\d+)\.")
MISSING = "is missing; is this a Gemma 4 GGUF written by llama.cpp's convert_hf_to_gguf.py?"
NO_ROTATION = np.float32(1e30)  # the converter's rope_freqs entry for a dimension pair that does not rotate


class _Keys:
    """Typed reads of one GGUF file's ``gemma4.*`` metadata; each refusal names the file and the key."""

    def __init__(self, f: GGUFFile, arch: str = ARCH):
        self.meta, self.where, self.arch = f.metadata, str(f.path), arch

    def fail(self, key: str, what: str) -> GGUFError:
        return GGUFError(f"{self.where}: metadata key {key!r} {what}")

    def has(self, key: str) -> bool:
        return self.arch + "." + key in self.meta

    def _get(self, key: str, default: Any) -> tuple[str, Any, bool]:
        """(the full key, its value or ``default``, whether it is present); GGUFError when it is absent without a
        default (None)."""
        full = self.arch + "." + key
        if full in self.meta:
            return full, self.meta[full], True
        if default is None:
            raise self.fail(full, MISSING)
        return full, default, False

    def integer(self, key: str, default: Any = None, least: int = 1) -> int:
        """Key ``gemma4.<key>``: an integer >= ``least``; ``default`` when absent (None: required)."""
        full, value, present = self._get(key, default)
        if not present:
            return value
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(full, f"must be an integer, got {_shown(value)}")
        if value < least:
            raise self.fail(full, f"must be at least {least}, got {value}")
        return value

    def number(self, key: str, default: Any = None) -> float:
        """Key ``gemma4.<key>``: a finite number > 0; ``default`` when absent (None: required)."""
        full, value, present = self._get(key, default)
        if not present:
            return value
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.fail(full, f"must be a number, got {_shown(value)}")
        if not (np.isfinite(value) and value > 0):
            raise self.fail(full, f"must be a positive number, got {value}")
        return config_decimal(float(value))

    def per_layer(self, key: str, n_layers: int, kind: type, least: int = 1) -> list:
        """Key ``gemma4.<key>`` (required): one value per layer, or one scalar for every layer."""
        full, value, _ = self._get(key, None)
        items = value if isinstance(value, list) else [value] * n_layers
        name = "a boolean" if kind is bool else "an integer"
        if isinstance(value, list) and len(value) != n_layers:
            raise self.fail(full, f"must hold one value per layer ({n_layers} = {self.arch}.block_count), got "
                                  f"{len(value)}")
        for v in items:
            if (kind is bool) != isinstance(v, bool) or not isinstance(v, (int, bool)):
                raise self.fail(full, f"must be {name} or a list of them, got {_shown(value)}")
            if kind is int and v < least:
                raise self.fail(full, f"must be at least {least} for every layer, got {v}")
        return list(items)


def config_decimal(value: float) -> float:
    """A float32 key's value as the config.json decimal it was written from: the shortest decimal that rounds to
    that float32 (the converter stores rms_norm_eps 1e-6 as the float32 9.99999997e-07; the model's eps is 1e-6).
    A value float32 cannot hold (a float64 key) is kept as it is."""
    single = np.float32(value)
    if float(single) != value:
        return value
    return float(np.format_float_positional(single, unique=True, trim="-"))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _architecture(f: GGUFFile, want: str) -> None:
    arch = f.metadata.get("general.architecture")
    if arch == want:
        return
    if arch is None:
        raise GGUFError(f"{f.path}: metadata key 'general.architecture' is missing; the oracle reads Gemma 4 GGUFs "
                        f"(architecture {want!r})")
    if arch == ASSISTANT_ARCH:
        raise GGUFError(f"{f.path}: an MTP drafter GGUF (architecture {ASSISTANT_ARCH!r}); pass it as the drafter, "
                        f"and the target model's GGUF (architecture {ARCH!r}) as the model")
    if want == ASSISTANT_ARCH and arch == ARCH:
        raise GGUFError(f"{f.path}: a Gemma 4 text model's GGUF (architecture {ARCH!r}), not an MTP drafter's "
                        f"({ASSISTANT_ARCH!r})")
    raise GGUFError(f"{f.path}: architecture {_shown(arch)}, not {want!r}; the oracle reads Gemma 4 text models")


def _rows(f: GGUFFile, name: str) -> int | None:
    """The NumPy row count of tensor ``name`` (its last GGUF dimension), None when the file lacks it."""
    t = f.tensors.get(name)
    return None if t is None else t.shape[0]


def _full_rotary_factor(f: GGUFFile, head_dim: int) -> float:
    """The partial rotary factor of the full layers, from rope_freqs.weight (1.0 without it)."""
    t = f.tensors.get("rope_freqs.weight")
    if t is None:
        return 1.0
    if t.shape != (head_dim // 2,):
        raise GGUFError(f"{f.path}: rope_freqs.weight has shape {list(t.shape)}, expected [{head_dim // 2}] "
                        f"(half of gemma4.attention.key_length, {head_dim})")
    freqs = f.get("rope_freqs.weight")
    n = int(np.count_nonzero(freqs == 1.0))
    if not (np.all(freqs[:n] == 1.0) and np.all(freqs[n:] == NO_ROTATION) and n > 0):
        raise GGUFError(f"{f.path}: rope_freqs.weight is not n entries of 1.0 followed by 1e30 (the converter's "
                        "encoding of Gemma 4's proportional RoPE); the oracle reads no other frequency factors")
    return 2 * n / head_dim


def _ffn(keys: _Keys, n_layers: int, n_shared: int) -> tuple[int, bool]:
    """(intermediate_size, use_double_wide_mlp) from feed_forward_length."""
    widths = keys.per_layer("feed_forward_length", n_layers, int)
    first = n_layers - n_shared
    if all(w == widths[0] for w in widths):
        return widths[0], False
    if all(w == (2 * widths[0] if i >= first else widths[0]) for i, w in enumerate(widths)):
        return widths[0], True
    raise keys.fail(f"{keys.arch}.feed_forward_length", f"is {widths}; Gemma 4 has one width, or twice it on "
                                                        f"the KV-shared layers (from layer {first}) with "
                                                        "use_double_wide_mlp")


def _k_eq_v(f: GGUFFile, full_owners: list[int]) -> bool:
    """Whether the KV-owning full layers use K as V: they have attn_k and none has attn_v."""
    if not full_owners:
        return False
    has_k = [f"blk.{i}.attn_k.weight" in f.tensors for i in full_owners]
    has_v = [f"blk.{i}.attn_v.weight" in f.tensors for i in full_owners]
    return all(has_k) and not any(has_v)


def _moe(keys: _Keys) -> dict[str, Any]:
    if not keys.has("expert_count") or keys.integer("expert_count", least=0) == 0:
        return {}
    return {"enable_moe_block": True, "num_experts": keys.integer("expert_count"),
            "top_k_experts": keys.integer("expert_used_count"),
            "moe_intermediate_size": keys.integer("expert_feed_forward_length")}


def _token_ids(f: GGUFFile) -> dict[str, Any]:
    """bos / eos (with eot) / pad ids from the tokenizer keys, where present."""
    out: dict[str, Any] = {}
    for key, field in (("bos", "bos_token_id"), ("padding", "pad_token_id")):
        value = f.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            out[field] = _token_id(f, f"tokenizer.ggml.{key}_token_id", value)
    eos = [_token_id(f, f"tokenizer.ggml.{k}_token_id", f.metadata[f"tokenizer.ggml.{k}_token_id"])
           for k in ("eos", "eot") if f"tokenizer.ggml.{k}_token_id" in f.metadata]
    if eos:
        out["eos_token_id"] = list(dict.fromkeys(eos))
    return out


def _token_id(f: GGUFFile, key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise GGUFError(f"{f.path}: metadata key {key!r} must be a token id (an integer >= 0), got {_shown(value)}")
    return value


def hf_config(f: GGUFFile) -> tuple[dict[str, Any], int]:
    """(a config.json of the per_layer_config serialisation equivalent to ``f``'s metadata, the decoder layers
    its tensors hold)."""
    _architecture(f, ARCH)
    return _text_config(f, _Keys(f)), len({int(m.group(1)) for m in map(_BLOCK.match, f.tensors) if m})


def hf_assistant_config(f: GGUFFile) -> dict[str, Any]:
    """The config.json of the MTP drafter GGUF ``f`` (architecture gemma4-assistant): its text geometry, every
    layer KV-shared, ``backbone_hidden_size`` from ``embedding_length_out``, and the dense tied head (the
    converter drops the centroid head's ``masked_embedding`` tensors)."""
    _architecture(f, ASSISTANT_ARCH)
    keys = _Keys(f, ASSISTANT_ARCH)
    text = _text_config(f, keys, drafter=True)
    return {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
            "backbone_hidden_size": keys.integer("embedding_length_out"), "use_ordered_embeddings": False,
            "text_config": text}


def _text_config(f: GGUFFile, keys: _Keys, drafter: bool = False) -> dict[str, Any]:
    """The text config.json of the keys; a drafter's layers are all KV-shared (its shared_kv_layers is its
    layer count, or 0 for "all")."""
    L = keys.integer("block_count")
    full_dim, swa_dim = keys.integer("attention.key_length"), keys.integer("attention.key_length_swa")
    for key, want in (("attention.value_length", full_dim), ("attention.value_length_swa", swa_dim),
                      ("rope.dimension_count", full_dim), ("rope.dimension_count_swa", swa_dim)):
        if keys.integer(key, want) != want:
            raise keys.fail(f"{keys.arch}.{key}", f"is {keys.integer(key)}, not {want}; Gemma 4 layers use one head "
                                                  "dim for K and V and rotate all of it (the full layers' partial "
                                                  "rotation is rope_freqs.weight)")
    sliding = keys.per_layer("attention.sliding_window_pattern", L, bool)
    types = ["sliding_attention" if s else "full_attention" for s in sliding]
    kv_heads = keys.per_layer("attention.head_count_kv", L, int)
    n_shared = keys.integer("attention.shared_kv_layers", 0, least=0)
    if drafter and n_shared not in (0, L):
        raise keys.fail(f"{keys.arch}.attention.shared_kv_layers", f"is {n_shared}; every layer of a drafter is "
                                                                   f"KV-shared ({L}, or 0)")
    if not drafter and n_shared >= L:
        raise keys.fail(f"{keys.arch}.attention.shared_kv_layers", f"is {n_shared}, not below {keys.arch}.block_count "
                                                                   f"({L})")
    n_shared = L if drafter else n_shared
    width, double_wide = _ffn(keys, L, n_shared)
    theta_full = keys.number("rope.freq_base")
    rope = {"full_attention": {"rope_type": "proportional", "rope_theta": theta_full,
                               "partial_rotary_factor": _full_rotary_factor(f, full_dim)},
            "sliding_attention": {"rope_type": "default", "rope_theta": keys.number("rope.freq_base_swa", theta_full)}}
    P = keys.integer("embedding_length_per_layer_input", least=0)
    vocab = _rows(f, "token_embd.weight")
    if vocab is None:
        raise GGUFError(f"{f.path}: no tensor 'token_embd.weight'; a Gemma 4 text GGUF holds its embedding table")
    first_shared = L - n_shared
    raw: dict[str, Any] = {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "num_hidden_layers": L, "hidden_size": keys.integer("embedding_length"), "vocab_size": vocab,
        "num_attention_heads": keys.integer("attention.head_count"), "num_key_value_heads": kv_heads[0],
        "head_dim": swa_dim, "intermediate_size": width, "use_double_wide_mlp": double_wide,
        "rms_norm_eps": keys.number("attention.layer_norm_rms_epsilon"), "layer_types": types,
        "sliding_window": keys.integer("attention.sliding_window", 512 if not any(sliding) else None),
        "num_kv_shared_layers": n_shared, "hidden_size_per_layer_input": P, "rope_parameters": rope,
        "attention_k_eq_v": _k_eq_v(f, [i for i in range(first_shared) if not sliding[i]]),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "use_bidirectional_attention": None if P else "vision",
        "per_layer_config": {str(i): {"head_dim": swa_dim if sliding[i] else full_dim,
                                      "num_key_value_heads": kv_heads[i]} for i in range(L)},
        **_moe(keys), **_token_ids(f),
    }
    if P and "per_layer_token_embd.weight" in f.tensors:  # else the weights' check names the missing table
        raw["vocab_size_per_layer_input"] = _rows(f, "per_layer_token_embd.weight")
    if keys.has("final_logit_softcapping"):
        raw["final_logit_softcapping"] = keys.number("final_logit_softcapping")
    if keys.has("context_length"):
        raw["max_position_embeddings"] = keys.integer("context_length")
    return raw
