"""Shared helpers for the test-suite: micro checkpoints, reading weights back, small spec-level math.

``micro_checkpoint(tmp_dir, config_dict, seed)`` writes ``config.json`` and ``model.safetensors``
(weights from ``refimpl.synth.make_weights``, stored as F32 under the ``model.`` prefix) for any
config dict, so tests can build tiny models of arbitrary shape. ``read_weights`` reads a checkpoint
back with the independent ``safetensors`` package (not refimpl's reader) and strips the prefix, which
is what ``tests/naive_gemma4.naive_forward`` takes.

The math helpers at the bottom are written from gemma4-text-spec.md, not imported from refimpl, so a
test that uses them checks refimpl against a second reading of the spec.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import settings

from refimpl.config import parse_config
from refimpl.safetensors_io import write_safetensors
from refimpl.synth import make_unified_weights, make_weights, published_config

SLIDING = "sliding_attention"
FULL = "full_attention"
PREFIXES = ("model.language_model.", "model.")


# ----------------------------------------------------------------------------------------------
# configs and checkpoints


def micro_config(**overrides) -> dict:
    """A tiny, valid Gemma4ForCausalLM config.json dict (legacy serialisation); override any field.

    Defaults: 3 layers (S, S, F), vocab 64, hidden 16, 2 heads x 1 KV head, head_dim 4 / global 8,
    window 3, softcap 30, no PLE, no MoE, no sharing, no K=V.
    """
    cfg = {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "dtype": "float32",
        "vocab_size": 64, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 3, "layer_types": [SLIDING, SLIDING, FULL],
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "global_head_dim": 8,
        "sliding_window": 3, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True, "attention_bias": False,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 64, "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False, "attention_k_eq_v": False, "num_global_key_value_heads": None,
        "enable_moe_block": False, "num_experts": None, "top_k_experts": None, "moe_intermediate_size": None,
        "use_bidirectional_attention": None, "bos_token_id": 2, "pad_token_id": 0, "eos_token_id": [1],
    }
    cfg.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        L = cfg["num_hidden_layers"]
        cfg["layer_types"] = [FULL if i == L - 1 else SLIDING for i in range(L)]
    return cfg


def micro_checkpoint(tmp_dir: str | Path, config_dict: dict, seed: int, dtype: str = "F32",
                     prefix: str = "model.") -> Path:
    """Write ``config.json`` + ``model.safetensors`` for ``config_dict`` into ``tmp_dir``; return it.

    Weights come from ``make_weights(config_dict, seed)`` (every tensor the config needs, drawn so
    every parameter matters) and are stored as ``dtype`` under ``prefix``.
    """
    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = make_weights(config_dict, seed)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    write_safetensors(out / "model.safetensors", {prefix + k: v for k, v in weights.items()}, dtype)
    return out


def write_unified_checkpoint(out: str | Path, config: dict, seed: int) -> Path:
    """A Gemma 4 Unified checkpoint for a conditional ``config`` (text_config, vision_config, audio_config):
    config.json, the text and embedder weights (``refimpl.synth``'s draws, F32, published names) and a
    processor_config.json with the vision config's patch size and merge and a budget of 70 soft tokens."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tensors = {"model.language_model." + n: v for n, v in make_weights(config, seed).items()}
    tensors.update(make_unified_weights(config, seed))
    write_safetensors(out / "model.safetensors", tensors, "F32")
    vision = config["vision_config"]
    (out / "processor_config.json").write_text(json.dumps({"image_processor": {
        "patch_size": vision["patch_size"], "pooling_kernel_size": vision["pooling_kernel_size"],
        "max_soft_tokens": 70}}), encoding="utf-8")
    return out


def read_config(model_dir: str | Path) -> dict:
    """The text part of a checkpoint's config.json (``text_config`` for the conditional layout)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return raw.get("text_config", raw)


def read_weights(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All text-decoder tensors of a single-file checkpoint as float64, names without the prefix.

    Uses the ``safetensors`` package, not refimpl's reader, so a reader bug cannot hide here.
    """
    from safetensors.numpy import load_file

    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    out = {}
    for name, value in tensors.items():
        for prefix in PREFIXES:
            if name.startswith(prefix):
                out[name[len(prefix):]] = np.asarray(value, dtype=np.float64)
                break
    return out


def kv_sources(layer_types: list[str], num_shared: int) -> list[int]:
    """KV source of each layer by the HF rule (spec 4.6): a shared layer reads the last layer of its
    own type before ``first = L - num_shared``; every other layer reads itself."""
    L = len(layer_types)
    first = L - num_shared
    out = []
    for i, t in enumerate(layer_types):
        if i < first:
            out.append(i)
        else:
            out.append(max(j for j in range(first) if layer_types[j] == t))
    return out


def effective_layer_types(config: dict) -> list[str]:
    """layer_types with the last layer forced to full attention (spec 2, derived 1)."""
    L = config["num_hidden_layers"]
    types = list(config.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(L)])
    types[-1] = FULL
    return types


def sharing_is_valid(layer_types: list[str], num_shared: int) -> bool:
    """Whether every shared layer's type has a producer before the first shared layer."""
    first = len(layer_types) - num_shared
    if first < 1:
        return False
    before = set(layer_types[:first])
    return all(t in before for t in layer_types[first:])


def spec_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The text-decoder tensors a checkpoint for ``config`` holds (names without prefix, shapes),
    written from the table of spec section 5 (shared layers carry no k/v projections or k_norm)."""
    H, V, N = config["hidden_size"], config["vocab_size"], config["num_attention_heads"]
    L, I = config["num_hidden_layers"], config["intermediate_size"]  # noqa: E741 - I: the intermediate size (spec)
    P = int(config.get("hidden_size_per_layer_input") or 0)
    n_shared = int(config.get("num_kv_shared_layers") or 0)
    k_eq_v = bool(config.get("attention_k_eq_v"))
    types = effective_layer_types(config)
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (V, H), "norm.weight": (H,)}
    if P:
        out["embed_tokens_per_layer.weight"] = (int(config.get("vocab_size_per_layer_input") or V), L * P)
        out["per_layer_model_projection.weight"] = (L * P, H)
        out["per_layer_projection_norm.weight"] = (P,)
    for i, t in enumerate(types):
        p = f"layers.{i}."
        full = t == FULL
        D = (config.get("global_head_dim") or 512) if full else config["head_dim"]
        gkv = config.get("num_global_key_value_heads")
        K = gkv if (full and k_eq_v and gkv is not None) else config["num_key_value_heads"]
        shared = i >= L - n_shared
        width = 2 * I if (config.get("use_double_wide_mlp") and shared) else I
        out.update({p + "input_layernorm.weight": (H,), p + "self_attn.q_proj.weight": (N * D, H),
                    p + "self_attn.q_norm.weight": (D,), p + "self_attn.o_proj.weight": (H, N * D),
                    p + "post_attention_layernorm.weight": (H,), p + "pre_feedforward_layernorm.weight": (H,),
                    p + "mlp.gate_proj.weight": (width, H), p + "mlp.up_proj.weight": (width, H),
                    p + "mlp.down_proj.weight": (H, width), p + "post_feedforward_layernorm.weight": (H,),
                    p + "layer_scalar": (1,)})
        if not shared:
            out[p + "self_attn.k_proj.weight"] = (K * D, H)
            out[p + "self_attn.k_norm.weight"] = (D,)
            if not (full and k_eq_v):
                out[p + "self_attn.v_proj.weight"] = (K * D, H)
        if P:
            out.update({p + "per_layer_input_gate.weight": (P, H), p + "per_layer_projection.weight": (H, P),
                        p + "post_per_layer_input_norm.weight": (H,)})
        if config.get("enable_moe_block"):
            E, Im = config["num_experts"], config["moe_intermediate_size"]
            out.update({p + "router.proj.weight": (E, H), p + "router.scale": (H,), p + "router.per_expert_scale": (E,),
                        p + "experts.gate_up_proj": (E, 2 * Im, H), p + "experts.down_proj": (E, H, Im),
                        p + "pre_feedforward_layernorm_2.weight": (H,),
                        p + "post_feedforward_layernorm_1.weight": (H,),
                        p + "post_feedforward_layernorm_2.weight": (H,)})
    return out


# ----------------------------------------------------------------------------------------------
# spec-level math (written from the spec, independent of refimpl)


def rms(x: np.ndarray, w: np.ndarray | None = None, eps: float = 1e-6) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def inv_freq(rope: dict, head_dim: int) -> np.ndarray:
    """Inverse frequencies [D/2] for one layer type (spec 4.3)."""
    theta = float(rope["rope_theta"])
    exps = np.arange(head_dim // 2) * 2.0 / head_dim
    freqs = theta ** -exps
    if rope.get("rope_type", "default") == "proportional":
        n_rot = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        freqs = freqs / float(rope.get("factor", 1.0) or 1.0)
        freqs[n_rot:] = 0.0
    return freqs


def rope(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE; x [T, heads, D]."""
    ang = positions[:, None, None] * freqs[None, None, :]
    c, s = np.cos(ang), np.sin(ang)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def max_abs(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def tup(a) -> tuple[int, ...]:
    """A sequence of ids as a tuple of Python ints (what Request fields hold)."""
    return tuple(int(x) for x in a)


def open_per_preset(factory, preset_dirs):
    """Yield {preset: backend opened on it} and close them all afterwards (for module fixtures)."""
    opened = {}
    for preset, path in preset_dirs.items():
        backend = factory()
        backend.open(path)
        opened[preset] = backend
    yield opened
    for backend in opened.values():
        backend.close()


# ----------------------------------------------------------------------------------------------
# image prompts


def image_prompt(model_dir: str | Path, grids=((9, 12),), seed: int = 0, text=(4, 6)) -> dict:
    """An image prompt for a vision checkpoint (e.g. ``refimpl.synth`` preset ``e2b-vision-mini``), made
    with refimpl: random [0, 1] patches on ``ph x pw`` patch grids (multiples of the pooling kernel; one
    grid per image) through the vision tower, merged into ``bos + text + (boi + image x M + eoi + text)``.

    Returns ``ids`` (with placeholders), ``embeddings`` [T, H] (scaled convention: E[id] * sqrt(H) at
    text rows, soft tokens unscaled at image rows), ``images`` [(start, M), ...], ``soft`` (per image),
    ``inputs`` (the ``ImageInput`` of each image: its patches and positions) and ``logits`` [T, V] (the
    oracle's full forward, float64)."""
    from conformance.protocol.types import ImageInput
    from refimpl import Gemma4
    from refimpl.multimodal import image_spans, load_multimodal_tokens, multimodal_inputs
    from refimpl.vision import load_vision_tower, vision_tower

    model = Gemma4(model_dir)
    weights, vcfg = load_vision_tower(model_dir)
    tokens = load_multimodal_tokens(model_dir)
    rng = np.random.default_rng(seed)
    soft, inputs = [], []
    for ph, pw in grids:
        pixels = rng.uniform(0.0, 1.0, (ph * pw, vcfg.patch_dim))
        gx, gy = np.meshgrid(np.arange(pw), np.arange(ph), indexing="xy")
        positions = np.stack([gx, gy], -1).reshape(-1, 2)
        soft.append(vision_tower(pixels, positions, weights, vcfg))
        inputs.append(ImageInput(pixels, positions))
    words = lambda n: [int(t) for t in rng.integers(20, 400, n)]  # noqa: E731 - ordinary pieces of the tiny vocab
    ids = [2] + words(text[0])
    for s in soft:
        ids += [tokens.boi_token_id] + [tokens.image_token_id] * s.shape[0] + [tokens.eoi_token_id] + words(text[1])
    m = multimodal_inputs(model, ids, soft, tokens)
    logits = model.forward(m.ids, embeddings=m.embeddings, vision_blocks=m.vision_blocks)
    return {"ids": np.asarray(ids, dtype=np.int64), "embeddings": m.embeddings, "soft": soft, "inputs": inputs,
            "images": image_spans(ids, tokens), "logits": logits, "tokens": tokens}


def micro_assistant(out: str | Path, target_config: dict, seed: int, *, layer_types=(SLIDING, FULL),
                    hidden: int = 8, centroids: int | None = None, top_k: int = 2) -> Path:
    """A drafter checkpoint for the target ``target_config`` (a config.json dict) in ``out``: its layers take
    the target's head dims, KV heads and K=V; the centroid head with ``centroids`` clusters when given
    (``refimpl.synth.assistant_checkpoint`` draws the weights)."""
    from refimpl.synth import assistant_checkpoint  # test helper; keeps the module light

    text = target_config.get("text_config", target_config)
    unified = str(text.get("model_type", "")).startswith("gemma4_unified") or str(
        target_config.get("model_type", "")).startswith("gemma4_unified")
    spec = dict(family="gemma4_unified_assistant" if unified else "gemma4_assistant", hidden_size=hidden,
                num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                num_attention_heads=text["num_attention_heads"], head_dim=text["head_dim"],
                global_head_dim=text["global_head_dim"], num_key_value_heads=text["num_key_value_heads"],
                attention_k_eq_v=text.get("attention_k_eq_v", False),
                num_global_key_value_heads=text.get("num_global_key_value_heads"), intermediate_size=2 * hidden,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=None,
                use_ordered_embeddings=centroids is not None, num_centroids=centroids or 2048,
                centroid_intermediate_top_k=top_k)
    config, tensors = assistant_checkpoint(spec, target_config, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    write_safetensors(out / "model.safetensors", tensors, "F32")
    return out


def same_run(a, b, what: str = "") -> None:
    """Two runs of the same engine computation (e.g. traced and not): equal to float32 rounding, never asserted
    bit for bit (another call may take other kernels or thread splits)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, what
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1.0, float(np.abs(b).max(initial=0.0))), err_msg=what)


DEEP = "deep"  # the hypothesis profile of `pytest --hypothesis-profile deep` (tests/conftest.py)


def examples(n: int) -> int:
    """A hypothesis test's budget: ``n`` examples under the default profile (``ci``), ten times as many under
    ``--hypothesis-profile deep`` (docs/testing.md)."""
    return 10 * n if settings.default.max_examples >= settings.get_profile(DEEP).max_examples else n


# audio prompts


def audio_prompt(model_dir, clips=((41, 41), (37, 26)), seed: int = 0, text=(4, 5)) -> dict:
    """An audio prompt for an audio checkpoint (``refimpl.synth`` preset ``e2b-audio-mini``), made with
    refimpl: per clip ``(T, valid)``, T random log-mel frames of which the first ``valid`` are real (the
    rest masked padding, as the feature extractor pads a batch), through the oracle's audio tower, merged
    into ``bos + text + (boa + audio x M + eoa + text)``.

    Returns ``ids``, ``embeddings`` [T, H] (scaled convention: E[id] * sqrt(H) at text rows, soft tokens
    unscaled at audio rows), ``audio`` [(start, M), ...], ``audio_inputs`` (``AudioInput`` per clip),
    ``soft`` (per clip) and ``logits`` [T, V] (the oracle's full forward, float64)."""
    from conformance.protocol import AudioInput
    from refimpl import Gemma4
    from refimpl.audio import audio_tower, load_audio_tower
    from refimpl.multimodal import audio_spans, load_multimodal_tokens, multimodal_inputs

    model = Gemma4(model_dir)
    weights, cfg = load_audio_tower(model_dir)
    tokens = load_multimodal_tokens(model_dir)
    rng = np.random.default_rng(seed)
    inputs, soft = [], []
    for T, valid in clips:
        mask = np.arange(T) < valid
        n_mels = 4 * cfg.freq_out  # what input_proj_linear takes: ceil(F / 4) == C0 // 4
        inputs.append(AudioInput(rng.normal(0.0, 1.0, (T, n_mels)), mask))
        soft.append(audio_tower(inputs[-1].features, mask, weights, cfg))
    words = lambda n: [int(t) for t in rng.integers(20, 400, n)]  # noqa: E731 - ordinary pieces of the tiny vocab
    ids = [2] + words(text[0])
    for s in soft:
        ids += [tokens.boa_token_id] + [tokens.audio_token_id] * s.shape[0] + [tokens.eoa_token_id] + words(text[1])
    m = multimodal_inputs(model, ids, [], tokens, audio_soft_tokens=soft)
    logits = model.forward(m.ids, embeddings=m.embeddings, vision_blocks=m.vision_blocks)
    return {"ids": np.asarray(ids, dtype=np.int64), "embeddings": m.embeddings, "soft": soft,
            "audio": audio_spans(ids, tokens), "audio_inputs": tuple(inputs), "logits": logits, "tokens": tokens}


# published shapes


def e2b_config(layers: int | None = None):
    """The published E2B text config (refimpl.synth.published_config, seed 7), cut to ``layers`` if given."""
    return parse_config(published_config("e2b", 7, layers))
