"""``refimpl inspect``: a checkpoint's derived layer table, its storage and what it does with images and audio."""

from __future__ import annotations

import json
from pathlib import Path

from .config import load_config
from .frontends import audio_front_end, image_front_end
from .gguf_io import is_gguf
from .weights import Gemma4Weights


def _media_parts(model_dir: Path) -> dict[str, str]:
    """What the checkpoint does with images and audio, for inspect ({} for a text-only one)."""
    try:
        raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    parts = {}
    if isinstance(raw, dict) and raw.get("vision_config") is not None:
        front = image_front_end(model_dir)
        st = front.settings
        what = (f"encoder-free embedder, {st.patch_size * st.pooling_kernel_size}-px patches" if front.unified
                else f"vision tower, {st.patch_size}-px patches pooled "
                     f"{st.pooling_kernel_size}x{st.pooling_kernel_size}")
        parts["image"] = f"{what}, up to {st.max_soft_tokens} soft tokens"
    if isinstance(raw, dict) and raw.get("audio_config") is not None:
        front = audio_front_end(model_dir)
        parts["audio"] = (f"raw-waveform embedder, {front.cfg.audio_embed_dim} samples a soft token" if front.unified
                          else "conformer tower over log-mel features")
    return parts


def cmd_inspect(args) -> int:
    cfg = load_config(args.model)
    weights = Gemma4Weights(args.model, cfg)
    disagree = set(cfg.fixed_rule_disagreements())
    rows = []
    for layer in cfg.layers:
        fixed = cfg.fixed_rule_kv_source(layer.index)
        rows.append({
            "layer": layer.index, "type": "full" if not layer.is_sliding else "sliding",
            "head_dim": layer.head_dim, "kv_heads": layer.num_kv_heads, "k_eq_v": layer.k_eq_v,
            "kv_source": layer.kv_source, "fixed_rule_kv_source": fixed, "ffn_width": layer.ffn_width,
            "rope": layer.rope.rope_type, "rope_theta": layer.rope.theta,
            "partial_rotary_factor": layer.rope.partial_rotary_factor,
        })
    media = _media_parts(Path(args.model))
    if args.json:
        print(json.dumps({
            "architecture": cfg.architecture, "family": cfg.family, "media": media,
            "serialisation": cfg.serialisation, "tensor_prefix": weights.prefix,
            "checkpoint": "gguf" if is_gguf(args.model) else "safetensors",
            "storage_dtypes": weights.storage_dtypes, "ignored_tensors": weights.ignored, "notes": list(cfg.notes),
            "fixed_rule_disagreements": sorted(disagree), "layers": rows,
        }, indent=2))
        return 0
    moe = (f"{cfg.num_experts} experts, top-{cfg.top_k_experts}, expert width {cfg.moe_intermediate_size}"
           if cfg.enable_moe_block else "off")
    source = "GGUF metadata" if is_gguf(args.model) else f"{cfg.serialisation} config"
    print(f"{args.model}: {cfg.architecture} ({source}), tensors under '{weights.prefix}'")
    print(f"  hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
          f"vocab {cfg.vocab_size}, sliding window {cfg.sliding_window}, softcap {cfg.final_logit_softcapping}")
    print(f"  PLE: {'dim ' + str(cfg.hidden_size_per_layer_input) if cfg.has_ple else 'off'}; MoE: {moe}; "
          f"KV-shared layers: {cfg.num_kv_shared_layers}; stored as "
          + ", ".join(f"{n} {d}" for d, n in sorted(weights.storage_dtypes.items())))
    print(f"  stop ids {list(cfg.eos_token_ids)}, bos {cfg.bos_token_id}; vision blocks: "
          f"{'yes' if cfg.use_bidirectional_attention == 'vision' else 'no (causal)'}")
    for kind, part in media.items():
        print(f"  {kind}: {part}")
    print()
    print(f"  {'layer':>5} {'type':<8} {'head_dim':>8} {'kv_heads':>8} {'K=V':<4} {'kv_source':>9} {'ffn':>6}  rope")
    for r in rows:
        src = "own" if r["kv_source"] == r["layer"] else str(r["kv_source"])
        if r["layer"] in disagree:
            src += "*"
        rope = (f"{r['rope']} theta={r['rope_theta']:g}"
                + (f" prf={r['partial_rotary_factor']:g}" if r["rope"] == "proportional" else ""))
        print(f"  {r['layer']:>5} {r['type']:<8} {r['head_dim']:>8} {r['kv_heads']:>8} "
              f"{'yes' if r['k_eq_v'] else '':<4} {src:>9} {r['ffn_width']:>6}  {rope}")
    if disagree:
        print()
        print("  * the llama.cpp / JAX positional rule (full -> first_shared-1, sliding -> first_shared-2) would read "
              + ", ".join(f"layer {cfg.fixed_rule_kv_source(i)} for layer {i}" for i in sorted(disagree))
              + "; this oracle follows transformers (last KV-owning layer of the same type)")
    for note in cfg.notes:
        print(f"  note: {note}")
    if weights.ignored:
        print(f"  note: ignored {len(weights.ignored)} tensors (multimodal towers, tied lm_head, stale K/V on shared "
              "layers)")
    return 0
