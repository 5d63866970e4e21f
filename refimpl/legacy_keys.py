"""A ``TextConfig`` written back as the text keys of config.json's legacy serialisation, for readers that know
only that one (mlx-lm, mlx-vlm)."""

from __future__ import annotations

from typing import Any

from .config import FULL, SLIDING, TextConfig


def legacy_text_keys(cfg: TextConfig) -> dict[str, Any]:
    """The text keys of the legacy serialisation (``global_head_dim``, ``num_global_key_value_heads``; no
    ``per_layer_config``) that describe ``cfg``: what readers of that serialisation alone (mlx-lm, mlx-vlm)
    need, every default resolved. Sliding layers carry ``head_dim`` / ``num_key_value_heads``, full layers
    ``global_head_dim`` and, only with K=V, ``num_global_key_value_heads``; geometry this cannot express
    (per-layer overrides that differ within a type) is for the reader's own check."""
    sliding = [layer for layer in cfg.layers if layer.layer_type == SLIDING]
    full = [layer for layer in cfg.layers if layer.layer_type == FULL]
    keys: dict[str, Any] = {
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "sliding_window": cfg.sliding_window,
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "hidden_size_per_layer_input": cfg.hidden_size_per_layer_input,
        "num_kv_shared_layers": cfg.num_kv_shared_layers, "use_double_wide_mlp": cfg.use_double_wide_mlp,
        "attention_k_eq_v": cfg.attention_k_eq_v, "enable_moe_block": cfg.enable_moe_block,
        "tie_word_embeddings": cfg.tie_word_embeddings, "layer_types": list(cfg.layer_types),
    }
    if cfg.has_ple:
        keys["vocab_size_per_layer_input"] = cfg.vocab_size_per_layer_input
    if cfg.enable_moe_block:
        keys.update(num_experts=cfg.num_experts, top_k_experts=cfg.top_k_experts,
                    moe_intermediate_size=cfg.moe_intermediate_size)
    kv_layers = sliding or full
    keys["head_dim"] = kv_layers[0].head_dim
    keys["num_key_value_heads"] = kv_layers[0].num_kv_heads
    if full:
        keys["global_head_dim"] = full[0].head_dim
        if cfg.attention_k_eq_v:
            keys["num_global_key_value_heads"] = full[0].num_kv_heads
    rope = {}
    for layer in (sliding[:1] + full[:1]):
        spec = layer.rope
        entry: dict[str, Any] = {"rope_type": spec.rope_type, "rope_theta": spec.theta}
        if spec.rope_type == "proportional":
            entry.update(partial_rotary_factor=spec.partial_rotary_factor, factor=spec.factor)
        rope[layer.layer_type] = entry
    keys["rope_parameters"] = rope
    return keys
