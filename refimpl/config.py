"""Read a Gemma 4 ``config.json`` and derive the per-layer geometry of the text decoder.

Both architectures are read: ``Gemma4ForCausalLM`` (text fields at the top level) and
``Gemma4ForConditionalGeneration`` (text fields under ``text_config``), and the same two of Gemma 4
Unified (``Gemma4UnifiedForCausalLM``, ``Gemma4UnifiedForConditionalGeneration``, model type
``gemma4_unified``: the 12B encoder-free family, whose decoder has no per-layer inputs and no MoE
whatever its config says, and whose class defaults differ: a 1024-token window and vision blocks). Both serialisations
are read:
the legacy one (``global_head_dim``, ``num_global_key_value_heads``) and the ``per_layer_config`` one
written by transformers 5.23+ (a sparse map from layer index to overridden fields).

Everything the spec derives (gemma4-text-spec.md sections 2 and 4) is derived here, once, into
``TextConfig.layers``: layer type, head dim, KV heads, K=V, the KV source of every layer, FFN width
and RoPE parameters. The forward pass reads only this table.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config_fields import (
    check_positive,
    check_positive_float,
    get_field,
    json_kind,
    read_config_json,
    read_json,
    required_positive,
    token_ids,
)
from .errors import ConfigError, WeightsError
from .gguf_config import hf_config
from .gguf_io import is_gguf, open_gguf
from .safetensors_io import TensorStore

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
TEXT_PREFIXES = ("model.language_model.", "model.")  # where the text decoder's tensors live
# where a checkpoint's files keep the decoder layers: the text prefixes, and mlx-lm's gemma4 wrapper's
# (language_model.model.X for model.language_model.X; refimpl/mlx_store.py maps it back)
_LAYER_TENSOR = re.compile("(?:" + "|".join(map(re.escape, (*TEXT_PREFIXES, "language_model.model.")))
                           + r")layers\.(\d+)\.")
ROPE_TYPES = ("default", "proportional")

FAMILIES = ("gemma4", "gemma4_unified")
UNIFIED_MODEL_TYPES = ("gemma4_unified", "gemma4_unified_text")
# fields the published Unified config carries "for backward compatibility, not used by the model"
UNIFIED_IGNORED = ("hidden_size_per_layer_input", "enable_moe_block")

DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class RopeSpec:
    """RoPE parameters of one layer type."""

    rope_type: str  # "default" | "proportional"
    theta: float
    partial_rotary_factor: float = 1.0  # proportional only: fraction of the head that rotates
    factor: float = 1.0  # proportional only: divides inv_freq


@dataclass(frozen=True)
class LayerSpec:
    """Derived geometry of one decoder layer."""

    index: int
    layer_type: str  # SLIDING | FULL
    head_dim: int  # D_l
    num_kv_heads: int  # K_l
    k_eq_v: bool  # V is the scale-free-normed raw key projection (no v_proj)
    kv_source: int  # the layer whose K/V this layer attends over (== index when it owns KV)
    ffn_width: int  # I_l: intermediate_size, or 2x on double-wide KV-shared layers
    rope: RopeSpec

    @property
    def owns_kv(self) -> bool:
        return self.kv_source == self.index

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == SLIDING


@dataclass(frozen=True)
class TextConfig:
    """The text decoder's configuration with every derived quantity resolved."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    sliding_window: int
    rms_norm_eps: float
    final_logit_softcapping: float | None
    hidden_size_per_layer_input: int  # P; 0 means no per-layer embeddings
    vocab_size_per_layer_input: int
    num_kv_shared_layers: int
    use_double_wide_mlp: bool
    attention_k_eq_v: bool
    enable_moe_block: bool
    num_experts: int | None
    top_k_experts: int | None
    moe_intermediate_size: int | None
    tie_word_embeddings: bool
    use_bidirectional_attention: str | None
    layers: tuple[LayerSpec, ...]
    bos_token_id: int | None = 2
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = 0
    architecture: str = "Gemma4ForCausalLM"
    serialisation: str = "legacy"  # "legacy" | "per_layer_config"
    family: str = "gemma4"  # "gemma4" | "gemma4_unified" (FAMILIES)
    max_position_embeddings: int | None = None  # the context limit config.json states (None: it states none)
    notes: tuple[str, ...] = field(default=())  # things the loader changed or wants to point out

    @property
    def first_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def has_ple(self) -> bool:
        return self.hidden_size_per_layer_input > 0

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(layer.layer_type for layer in self.layers)

    def fixed_rule_kv_source(self, index: int) -> int:
        """KV source under the llama.cpp / JAX positional rule (-1 for full, -2 for sliding)."""
        layer = self.layers[index]
        if layer.owns_kv:
            return index
        return self.first_shared_layer - (2 if layer.is_sliding else 1)

    def fixed_rule_disagreements(self) -> list[int]:
        """Shared layers whose source differs under the llama.cpp / JAX positional rule."""
        return [
            layer.index
            for layer in self.layers
            if not layer.owns_kv and self.fixed_rule_kv_source(layer.index) != layer.kv_source
        ]


def _rope_specs(text: dict, used_types: set[str], where: str) -> dict[str, RopeSpec]:
    raw = text.get("rope_parameters")
    if raw is None:
        raw = DEFAULT_ROPE
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: field 'rope_parameters' must be an object keyed by layer type, got {raw!r}")
    if "rope_type" in raw or "rope_theta" in raw:
        raise ConfigError(
            f"{where}: 'rope_parameters' must be keyed by layer type ('{SLIDING}', '{FULL}'), each with its own "
            "rope_type and rope_theta; got one flat set of parameters"
        )
    specs = {}
    for layer_type in sorted(used_types):
        if layer_type not in raw or not isinstance(raw[layer_type], dict):
            raise ConfigError(
                f"{where}: 'rope_parameters' has no entry for layer type '{layer_type}'; add "
                f'"{layer_type}": {json.dumps(DEFAULT_ROPE[layer_type])}'
            )
        entry = raw[layer_type]
        key = f"rope_parameters.{layer_type}"
        rope_type = entry.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"{where}: '{key}.rope_type' is {rope_type!r}, which this oracle does not know; "
                f"Gemma 4 uses one of {', '.join(ROPE_TYPES)}"
            )
        theta = get_field(entry, "rope_theta", float, where=f"{where} {key}")
        check_positive_float(theta, f"{key}.rope_theta", where)
        prf = get_field(entry, "partial_rotary_factor", float, 1.0, where=f"{where} {key}")
        factor = get_field(entry, "factor", float, 1.0, where=f"{where} {key}")
        if rope_type == "default" and (prf != 1.0 or factor != 1.0):
            raise ConfigError(
                f"{where}: '{key}' sets partial_rotary_factor or factor with rope_type 'default'; Gemma 4 only "
                "uses them with rope_type 'proportional' (remove them, or set rope_type to 'proportional')"
            )
        if not 0.0 < prf <= 1.0:
            raise ConfigError(f"{where}: '{key}.partial_rotary_factor' must be in (0, 1], got {prf}")
        check_positive_float(factor, f"{key}.factor", where)
        specs[layer_type] = RopeSpec(rope_type, theta, prf, factor)
    return specs


def _layer_types(text: dict, num_layers: int, where: str) -> tuple[list[str], list[str]]:
    notes = []
    raw = text.get("layer_types")
    if raw is None:
        types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]
        notes.append("layer_types absent: derived the default 5:1 sliding/full pattern")
    else:
        if not isinstance(raw, list):
            raise ConfigError(
                f"{where}: 'layer_types' must be a list of one type per layer ({num_layers} = num_hidden_layers), "
                f"got {raw!r}"
            )
        if len(raw) != num_layers:
            raise ConfigError(
                f"{where}: 'layer_types' must list one type per layer ({num_layers} = num_hidden_layers), "
                f"got {len(raw)} entries"
            )
        for i, t in enumerate(raw):
            if t not in LAYER_TYPES:
                raise ConfigError(
                    f"{where}: 'layer_types[{i}]' is {t!r}; each entry must be one of {', '.join(LAYER_TYPES)}"
                )
        types = list(raw)
    if types[-1] != FULL:
        types[-1] = FULL
        notes.append(
            f"the last layer ({num_layers - 1}) was '{SLIDING}'; forced to '{FULL}' as transformers does"
        )
    return types, notes


def _kv_sources(types: list[str], num_shared: int, where: str) -> list[int]:
    num_layers = len(types)
    first = num_layers - num_shared
    sources = list(range(num_layers))
    last_of_type = {t: j for j, t in enumerate(types[:first])}  # the last KV-owning layer of each type
    for i in range(first, num_layers):
        if types[i] not in last_of_type:
            raise ConfigError(
                f"{where}: KV-shared layer {i} is '{types[i]}' but no layer before the first shared layer "
                f"({first} = num_hidden_layers - num_kv_shared_layers) has that type, so nothing produces its "
                "K/V; lower 'num_kv_shared_layers' or change 'layer_types'"
            )
        sources[i] = last_of_type[types[i]]
    return sources


# ----------------------------------------------------------------------------------------------
# public entry points


def text_section(raw: dict, where: str = "config.json") -> tuple[dict, dict, str]:
    """Split a parsed config.json into (text fields, top-level fields, architecture name)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object at the top level")
    archs = raw.get("architectures") or []
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ConfigError(f"{where}: 'architectures' must be a list of class names, got {archs!r}")
    if "text_config" in raw:
        text = raw["text_config"]
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: 'text_config' must be an object")
        arch = archs[0] if archs else ("Gemma4UnifiedForConditionalGeneration"
                                       if raw.get("model_type") == "gemma4_unified"
                                       else "Gemma4ForConditionalGeneration")
    else:
        text = raw
        arch = archs[0] if archs else ("Gemma4UnifiedForCausalLM" if raw.get("model_type") in UNIFIED_MODEL_TYPES
                                       else "Gemma4ForCausalLM")
    return text, raw, arch


def config_family(raw: dict) -> str:
    """"gemma4_unified" for a Gemma 4 Unified config.json (by architecture or model type, at the top level
    or in ``text_config``), else "gemma4"."""
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    if isinstance(archs, list) and any(isinstance(a, str) and a.startswith("Gemma4Unified") for a in archs):
        return "gemma4_unified"
    text = raw.get("text_config") if isinstance(raw, dict) else None
    types = [raw.get("model_type") if isinstance(raw, dict) else None,
             text.get("model_type") if isinstance(text, dict) else None]
    return "gemma4_unified" if any(t in UNIFIED_MODEL_TYPES for t in types) else "gemma4"


def _unified_text(text: dict, notes: list[str]) -> dict:
    """The Unified decoder has no code path for PLE or MoE, and its class defaults differ from Gemma 4's."""
    ignored = [key for key in UNIFIED_IGNORED if text.get(key)]
    if ignored:
        notes.append(f"Gemma 4 Unified: ignored {', '.join(ignored)} (kept in the config for backward "
                     "compatibility, not used by the model)")
    text = {k: v for k, v in text.items() if k not in UNIFIED_IGNORED}
    text["hidden_size_per_layer_input"] = 0
    text.setdefault("sliding_window", 1024)
    text.setdefault("use_bidirectional_attention", "vision")
    return text


def _num_layers(text: dict, layers_held: int | None, where: str) -> int:
    """num_hidden_layers, refused when the checkpoint's tensors hold fewer layers."""
    L = required_positive(text, "num_hidden_layers", where)
    if layers_held is not None and L > layers_held:
        raise ConfigError(f"{where}: 'num_hidden_layers' is {L}, but the checkpoint's tensors hold "
                          f"{layers_held or 'no'} decoder layer{'' if layers_held == 1 else 's'}; set "
                          "num_hidden_layers to the number of layers the weights hold")
    return L


def _optional_positive(text: dict, key: str, kind: type, where: str) -> Any:
    value = get_field(text, key, kind, None, where)
    if value is not None:
        (check_positive if kind is int else check_positive_float)(value, key, where)
    return value


def _ple_fields(text: dict, where: str) -> tuple[int, int]:
    """(hidden_size_per_layer_input P, vocab_size_per_layer_input; 0 without PLE)."""
    P = get_field(text, "hidden_size_per_layer_input", int, 256, where)
    if P < 0:
        raise ConfigError(f"{where}: 'hidden_size_per_layer_input' must be >= 0, got {P}")
    V_ple = get_field(text, "vocab_size_per_layer_input", int, 262_144, where)
    if P > 0:
        check_positive(V_ple, "vocab_size_per_layer_input", where)
    return P, V_ple if P > 0 else 0


def _num_shared(text: dict, L: int, where: str) -> int:
    num_shared = get_field(text, "num_kv_shared_layers", int, 0, where)
    if not 0 <= num_shared < L:
        hint = " (an all-shared assistant/drafter model needs its target's cache, which this oracle does not serve)"
        raise ConfigError(
            f"{where}: 'num_kv_shared_layers' must be in [0, num_hidden_layers) = [0, {L}), got {num_shared}"
            + (hint if num_shared == L else "")
        )
    return num_shared


def _check_served(text: dict, where: str) -> Any:
    """Refuse what the oracle does not compute (fully bidirectional models, another activation, biases);
    returns use_bidirectional_attention (None or "vision")."""
    bidir = text.get("use_bidirectional_attention")
    if bidir not in (None, "vision"):
        raise ConfigError(
            f"{where}: 'use_bidirectional_attention' is {bidir!r}; this oracle serves causal language models "
            "(null) and 'vision' checkpoints, not fully bidirectional embedding models"
        )
    act = text.get("hidden_activation", text.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{where}: 'hidden_activation' is {act!r}; Gemma 4 uses 'gelu_pytorch_tanh'")
    if text.get("attention_bias"):
        raise ConfigError(f"{where}: 'attention_bias' is true; Gemma 4 has no biases (set it to false)")
    return bidir


def _moe_fields(text: dict, moe: bool, where: str) -> tuple[int | None, int | None, int | None]:
    """(num_experts, top_k_experts, moe_intermediate_size) of a MoE block (``moe``), or three Nones."""
    if not moe:
        return None, None, None
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if text.get(key) is None:
            raise ConfigError(
                f"{where}: 'enable_moe_block' is true but '{key}' is missing; set '{key}' "
                "(the 26B-A4B uses num_experts 128, top_k_experts 8, moe_intermediate_size 704)"
            )
    num_experts = required_positive(text, "num_experts", where)
    top_k = required_positive(text, "top_k_experts", where)
    moe_I = required_positive(text, "moe_intermediate_size", where)
    if top_k > num_experts:
        raise ConfigError(
            f"{where}: 'top_k_experts' ({top_k}) exceeds 'num_experts' ({num_experts}); lower top_k_experts"
        )
    return num_experts, top_k, moe_I


def _layer_overrides(plc: Any, L: int, where: str) -> dict[int, dict]:
    """per_layer_config's overrides by layer index, each only head_dim and num_key_value_heads."""
    if not isinstance(plc, dict):
        raise ConfigError(f"{where}: 'per_layer_config' must map layer indices to override objects")
    overrides: dict[int, dict] = {}
    for key, value in plc.items():
        if not (isinstance(key, str) and key.lstrip("-").isdigit()) or not 0 <= int(key) < L:
            raise ConfigError(f"{where}: 'per_layer_config' key {key!r} is not a layer index in [0, {L})")
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: 'per_layer_config[{key}]' must be an object of overridden fields")
        unknown = sorted(set(value) - {"head_dim", "num_key_value_heads"})
        if unknown:
            raise ConfigError(
                f"{where}: 'per_layer_config[{key}]' overrides {unknown}, which this oracle does not derive "
                "per layer (only head_dim and num_key_value_heads)"
            )
        overrides[int(key)] = value
    return overrides


def _per_layer_heads(text: dict, types: list[str], head_dim: int, k_eq_v: bool, where: str,
                     notes: list[str]) -> tuple[list[tuple[int, int]], str]:
    """([(head_dim, KV heads)] per layer, the serialisation it was read from: per_layer_config or legacy);
    ``head_dim`` is the config's default for the layers."""
    kv_heads = text["num_key_value_heads"]
    if text.get("per_layer_config") is not None:
        overrides = _layer_overrides(text["per_layer_config"], len(types), where)
        per_layer = []
        for i in range(len(types)):
            o, at = overrides.get(i, {}), f"{where} per_layer_config[{i}]"
            d = check_positive(get_field(o, "head_dim", int, head_dim, at), "head_dim", where)
            k = get_field(o, "num_key_value_heads", int, kv_heads, at)
            per_layer.append((d, check_positive(k, "num_key_value_heads", where)))
        return per_layer, "per_layer_config"
    global_head_dim = check_positive(get_field(text, "global_head_dim", int, 512, where), "global_head_dim", where)
    if "global_head_dim" not in text:
        notes.append("global_head_dim absent: full layers use the transformers default 512")
    global_kv = get_field(text, "num_global_key_value_heads", int, None, where)
    per_layer = []
    for t in types:
        if t == FULL:
            k = global_kv if (k_eq_v and global_kv is not None) else kv_heads
            per_layer.append((global_head_dim, check_positive(k, "num_global_key_value_heads", where)))
        else:
            per_layer.append((head_dim, kv_heads))
    return per_layer, "legacy"


def _layer_specs(text: dict, types: list[str], per_layer: list[tuple[int, int]], serialisation: str,
                 num_shared: int, k_eq_v: bool, double_wide: bool, where: str) -> tuple[LayerSpec, ...]:
    """Every layer's spec, checked: heads divisible by KV heads, even head_dim, a shared layer's geometry
    equal to its source's."""
    N, I = text["num_attention_heads"], text["intermediate_size"]  # noqa: E741 - I: the intermediate size (spec)
    rope = _rope_specs(text, set(types), where)
    sources, first = _kv_sources(types, num_shared, where), len(types) - num_shared
    layers = []
    for i, t in enumerate(types):
        d, k = per_layer[i]
        if N % k:
            global_kv = t == FULL and k_eq_v and serialisation == "legacy" and "num_global_key_value_heads" in text
            field_name = "num_global_key_value_heads" if global_kv else "num_key_value_heads"
            raise ConfigError(
                f"{where}: layer {i} ({t}) has {N} attention heads, not divisible by its {k} KV heads "
                f"('{field_name}'); choose a KV head count that divides num_attention_heads"
            )
        if d % 2:
            raise ConfigError(f"{where}: layer {i} has odd head_dim {d}; RoPE pairs dimension i with i + D/2")
        width = 2 * I if (double_wide and i >= first) else I
        layers.append(LayerSpec(i, t, d, k, k_eq_v and t == FULL, sources[i], width, rope[t]))
    for layer in layers:  # a shared layer attends over its source's K/V, so the geometry must match
        src = layers[layer.kv_source]
        if (layer.head_dim, layer.num_kv_heads) != (src.head_dim, src.num_kv_heads):
            raise ConfigError(
                f"{where}: shared layer {layer.index} (head_dim {layer.head_dim}, {layer.num_kv_heads} KV heads) "
                f"reads the K/V of layer {src.index} (head_dim {src.head_dim}, {src.num_kv_heads} KV heads); "
                "their geometry must match"
            )
    return tuple(layers)


def parse_config(raw: dict, where: str = "config.json", extra_eos: tuple[int, ...] = (),
                 layers_held: int | None = None) -> TextConfig:
    """Build a ``TextConfig`` from a parsed config.json (either architecture, either serialisation).

    ``layers_held``: how many decoder layers the checkpoint's tensors hold (``decoder_layers_held``);
    a larger num_hidden_layers is refused before any per-layer list is derived from it."""
    text, top, arch = text_section(raw, where)
    family = config_family(top)
    if "text_config" in top:
        where = f"{where} text_config"
    notes: list[str] = []
    if family == "gemma4_unified":
        text = _unified_text(text, notes)
    L = _num_layers(text, layers_held, where)
    text = {**text, **{key: required_positive(text, key, where) for key in (
        "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")}}
    head_dim = check_positive(get_field(text, "head_dim", int, 256, where), "head_dim", where)
    W = check_positive(get_field(text, "sliding_window", int, 512, where), "sliding_window", where)
    eps = get_field(text, "rms_norm_eps", float, 1e-6, where)
    check_positive_float(eps, "rms_norm_eps", where)
    context = _optional_positive(text, "max_position_embeddings", int, where)
    softcap = _optional_positive(text, "final_logit_softcapping", float, where)
    P, V_ple = _ple_fields(text, where)
    num_shared = _num_shared(text, L, where)
    double_wide = get_field(text, "use_double_wide_mlp", bool, False, where)
    k_eq_v = get_field(text, "attention_k_eq_v", bool, False, where)
    moe = get_field(text, "enable_moe_block", bool, False, where)
    tie = get_field(text, "tie_word_embeddings", bool, top.get("tie_word_embeddings", True) is not False, where)
    bidir = _check_served(text, where)
    num_experts, top_k, moe_I = _moe_fields(text, moe, where)
    types, type_notes = _layer_types(text, L, where)
    notes += type_notes
    per_layer, serialisation = _per_layer_heads(text, types, head_dim, k_eq_v, where, notes)
    layers = _layer_specs(text, types, per_layer, serialisation, num_shared, k_eq_v, double_wide, where)
    eos = token_ids(text.get("eos_token_id", top.get("eos_token_id", 1)), "eos_token_id", where)
    return TextConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], num_hidden_layers=L,
        num_attention_heads=text["num_attention_heads"], intermediate_size=text["intermediate_size"],
        sliding_window=W, rms_norm_eps=eps, final_logit_softcapping=softcap,
        hidden_size_per_layer_input=P, vocab_size_per_layer_input=V_ple, num_kv_shared_layers=num_shared,
        use_double_wide_mlp=double_wide, attention_k_eq_v=k_eq_v, enable_moe_block=moe,
        num_experts=num_experts, top_k_experts=top_k, moe_intermediate_size=moe_I, tie_word_embeddings=tie,
        use_bidirectional_attention=bidir, layers=layers,
        bos_token_id=text.get("bos_token_id", top.get("bos_token_id", 2)),
        eos_token_ids=tuple(dict.fromkeys(eos + tuple(extra_eos))),
        pad_token_id=text.get("pad_token_id", top.get("pad_token_id", 0)), architecture=arch,
        serialisation=serialisation, family=family, notes=tuple(notes),
        max_position_embeddings=context,
    )


def load_config(model_dir: str | Path) -> TextConfig:
    """Read ``config.json`` (and ``generation_config.json`` stop ids, if present) from a checkpoint directory,
    or the metadata of a Gemma 4 GGUF file (gguf_config.py).

    The sizes are bounded by what the checkpoint holds before anything is derived from them:
    num_hidden_layers may not exceed the decoder layers of its safetensors headers (when it has weights)."""
    model_dir = Path(model_dir)
    if is_gguf(model_dir):
        raw, held = hf_config(open_gguf(model_dir))
        return parse_config(raw, f"{model_dir} (GGUF metadata)", layers_held=held)
    path, raw = read_config_json(model_dir)
    extra_eos: tuple[int, ...] = ()
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        gen_raw = read_json(gen)
        if not isinstance(gen_raw, dict):
            raise ConfigError(f"{gen}: expected a JSON object at the top level, got {json_kind(gen_raw)}; "
                              "fix or remove generation_config.json")
        extra_eos = token_ids(gen_raw.get("eos_token_id"), "eos_token_id", str(gen))
    return parse_config(raw, str(path), extra_eos, _layers_held(model_dir))


def decoder_layers_held(names) -> int:
    """How many decoder layers tensor ``names`` hold: the distinct N of ``<text prefix>layers.N.*``."""
    return len({int(m.group(1)) for m in map(_LAYER_TENSOR.match, names) if m})


def _layers_held(model_dir: Path) -> int | None:
    """``decoder_layers_held`` of the checkpoint's safetensors headers (no tensor data is read); None
    when it has no readable weights (``Gemma4Weights`` reports that problem)."""
    try:
        return decoder_layers_held(TensorStore(model_dir).names)
    except WeightsError:
        return None


