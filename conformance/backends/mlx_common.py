"""What the mlx-lm and mlx-vlm backends share: a config value compared as mlx reads it (``same``), the inverse RoPE
frequencies an mlx rope module applies (``inv_freq_of``) and the check of a built Gemma 4 text model against the
model refimpl derives from config.json (``GeometryCheck``, ``text_geometry``)."""

from __future__ import annotations

import json
import math
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

import numpy as np

from refimpl import RefimplError, load_config
from refimpl.model import rope_inv_freq

from ..protocol.types import BackendError

__all__ = ["ABSENT", "GeometryCheck", "inv_freq_of", "rope_effective", "same", "text_geometry", "text_key_patch"]

ABSENT = "absent"  # how a config patch shows a key the checkpoint does not have (or one a patch removes)
_MISSING = object()


def same(a: Any, b: Any) -> bool:
    """JSON-level equality with int/float equivalence (30 == 30.0), as mlx reads the value."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def rope_effective(entry: Any, type_keys: tuple[str, ...] = ("rope_type",)) -> Any:
    """How mlx's ``initialize_rope`` reads one rope_parameters entry (for comparing, not writing); its type from the
    first of ``type_keys`` present (mlx-vlm also reads ``type``)."""
    if not isinstance(entry, dict):
        return entry
    rope_type = next((entry[k] for k in type_keys if entry.get(k)), "default")
    out = {"rope_type": rope_type, "rope_theta": float(entry.get("rope_theta", 10000.0))}
    if rope_type == "proportional":
        out["partial_rotary_factor"] = float(entry.get("partial_rotary_factor", 1.0))
        out["factor"] = float(entry.get("factor", 1.0))
    return out


def text_key_patch(text: dict, keys: dict[str, Any], *, type_keys: tuple[str, ...] = ("rope_type",),
                   defaults: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """``{key: {"was": value or ABSENT, "now": derived value}}`` for every text-config key of ``keys`` (what the
    engine reads, derived from refimpl's config) that the text section ``text`` lacks or states in a form the
    engine reads differently; ``defaults``: keys whose absence the engine reads as that value."""
    patch: dict[str, dict[str, Any]] = {}
    for key, want in keys.items():
        have = text.get(key, _MISSING)
        if key == "rope_parameters" and isinstance(have, dict):
            ok = all(same(rope_effective(have.get(t), type_keys), want[t]) for t in want)
        elif defaults is not None and key in defaults:
            ok = same(defaults[key] if have is _MISSING else have, want)
        else:
            ok = have is not _MISSING and same(have, want)
        if not ok:
            patch[key] = {"was": ABSENT if have is _MISSING else have, "now": want}
    return patch


def inv_freq_of(rope_module, head_dim: int, who: str) -> np.ndarray:
    """The inverse RoPE frequencies an mlx rope module applies (zero where it does not rotate); BackendError
    naming ``who`` for a module this check does not know."""
    import mlx.core as mx  # imported here: ``same`` serves modules that do not need mlx
    import mlx.nn as nn

    if hasattr(rope_module, "_freqs"):  # ProportionalRoPE: freqs are wavelengths, inf = no rotation
        freqs = np.array(rope_module._freqs.astype(mx.float32), dtype=np.float64)
        return np.where(np.isinf(freqs), 0.0, 1.0 / freqs)
    if isinstance(rope_module, nn.RoPE) and rope_module.dims == head_dim and not rope_module.traditional:
        return rope_module.scale / float(rope_module.base) ** (np.arange(0, head_dim, 2) / head_dim)
    raise BackendError(f"{who} backend: unexpected RoPE module {type(rope_module).__name__}; this backend cannot "
                       "check it against the spec")


class GeometryCheck:
    """``check(what, got, want)`` records how the engine ``who`` (mlx-lm, mlx-vlm) builds the model differently
    from the config (``problems``)."""

    def __init__(self, who: str):
        self.who = who
        self.problems: list[str] = []

    def __call__(self, what: str, got: Any, want: Any) -> None:
        if not same(got, want):
            self.problems.append(f"{what}: {self.who} has {got!r}, the config means {want!r}")


def text_geometry(check: GeometryCheck, inner, cfg, *, softcap: Any, tied: Any,
                  owns_kv: Callable[[Any], bool]) -> None:
    """Every check of a built Gemma 4 text model ``inner`` (its layers, norms, embedding, RoPE, experts) against
    refimpl's ``cfg``; ``softcap`` and ``tied``: the engine's final-logit softcap and tied-head flag (they sit on
    different modules in mlx-lm and mlx-vlm); ``owns_kv(attention)``: whether a layer computes its own K/V."""
    check("number of layers", len(inner.layers), cfg.num_hidden_layers)
    check("vocab_size", inner.embed_tokens.weight.shape[0], cfg.vocab_size)
    check("sliding_window", inner.window_size, cfg.sliding_window)
    check("final_logit_softcapping", softcap, cfg.final_logit_softcapping)
    check("tie_word_embeddings", tied, cfg.tie_word_embeddings)
    check("embedding scale", inner.embed_scale, math.sqrt(cfg.hidden_size))
    check("hidden_size_per_layer_input", inner.hidden_size_per_layer_input or 0, cfg.hidden_size_per_layer_input)
    check("final norm eps", inner.norm.eps, cfg.rms_norm_eps)
    for spec, layer, prev in zip(cfg.layers, inner.layers, inner.previous_kvs, strict=True):
        i, attn = spec.index, layer.self_attn
        check(f"layer {i} type", layer.layer_type, spec.layer_type)
        check(f"layer {i} head_dim", attn.head_dim, spec.head_dim)
        check(f"layer {i} KV heads", attn.n_kv_heads, spec.num_kv_heads)
        check(f"layer {i} K=V", attn.use_k_eq_v, spec.k_eq_v)
        check(f"layer {i} KV source", prev, spec.kv_source)
        check(f"layer {i} owns K/V", owns_kv(attn), spec.owns_kv)
        check(f"layer {i} FFN width", layer.mlp.gate_proj.weight.shape[0], spec.ffn_width)
        check(f"layer {i} MoE", layer.enable_moe, cfg.enable_moe_block)
        check(f"layer {i} norm eps", layer.input_layernorm.eps, cfg.rms_norm_eps)
        want = rope_inv_freq(spec.rope, spec.head_dim)
        got = inv_freq_of(attn.rope, spec.head_dim, check.who)
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=0.0):
            check.problems.append(f"layer {i} RoPE inverse frequencies: {check.who} has {got.tolist()}, "
                                  f"the config means {want.tolist()}")
    if cfg.enable_moe_block:
        router = inner.layers[0].router
        check("num_experts", router.config.num_experts, cfg.num_experts)
        check("top_k_experts", router.config.top_k_experts, cfg.top_k_experts)


def versions(*dists: str) -> dict[str, str]:
    """The installed version of each distribution (``"unknown"`` for one importable but not installed as a
    distribution), as a backend's ``executed`` record and its messages report them."""
    out = {}
    for dist in dists:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:  # pragma: no cover - importable but not installed as a dist
            out[dist] = "unknown"
    return out


def read_configs(model_dir: Path, who: str) -> tuple[Any, dict[str, Any]]:
    """(refimpl's config of the checkpoint, its config.json as read), or one BackendError naming ``who``."""
    try:
        return load_config(model_dir), json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (RefimplError, OSError, ValueError) as exc:
        raise BackendError(f"{who} backend cannot open {model_dir}: {exc}") from exc
