"""A checkpoint with the published vocabulary and tiny everything else, for tests of what grows with V.

``write_bigvocab_checkpoint(path)`` writes ``config.json``, ``model.safetensors`` (F32) and the synthetic
``tokenizer.model`` into ``path`` and returns it: the E2B miniature's features (per-layer embeddings,
MQA, sliding and full layers, KV sharing, double-wide MLP, tied embedding, softcap) with the published
vocabulary of 262,144 ids (``vocab_size`` and ``vocab_size_per_layer_input``), hidden size 16, 4 layers
and 2 per-layer-input dims, so the weights stay about 26 MB. The tokenizer is the synthetic 512-piece
one: its ids are a prefix of the vocabulary, as with ``refimpl synth --preset e2b``. The same seed gives
the same bytes.

    from bigvocab import write_bigvocab_checkpoint
    ckpt = write_bigvocab_checkpoint(tmp_path / "ckpt")
"""

from __future__ import annotations

import json
from pathlib import Path

from refimpl.config import FULL, SLIDING
from refimpl.safetensors_io import write_safetensors
from refimpl.synth import SPECIAL_PIECES, make_weights, preset_config, train_tokenizer

PUBLISHED_VOCAB = 262_144

BIGVOCAB_FIELDS = dict(
    vocab_size=PUBLISHED_VOCAB, vocab_size_per_layer_input=PUBLISHED_VOCAB,
    hidden_size=16, num_attention_heads=2, head_dim=8, global_head_dim=16, num_key_value_heads=1,
    intermediate_size=32, num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, FULL],
    num_kv_shared_layers=2, hidden_size_per_layer_input=2, use_double_wide_mlp=True, sliding_window=8,
)


def bigvocab_config(**overrides) -> dict:
    """config.json (legacy serialisation, Gemma4ForCausalLM) of the checkpoint: e2b-mini's with
    BIGVOCAB_FIELDS, then ``overrides``."""
    turn_end = SPECIAL_PIECES.index("<turn|>") + 4  # as refimpl.synth.write_checkpoint numbers it
    config = preset_config("e2b-mini", turn_end)
    config.update(BIGVOCAB_FIELDS)
    config.update(overrides)
    return config


def write_bigvocab_checkpoint(path: str | Path, *, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """Write the checkpoint into ``path`` (created; files in it are replaced) and return ``path``.
    ``overrides`` change config fields (e.g. ``hidden_size=32``); ``tokenizer=False`` leaves out
    ``tokenizer.model`` (then base G is random ids, as for any checkpoint without one)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = bigvocab_config(**overrides)
    weights = make_weights(config, seed)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    write_safetensors(out / "model.safetensors", {"model." + k: v for k, v in weights.items()}, "F32",
                      metadata={"format": "pt", "preset": "bigvocab", "seed": str(seed)})
    if tokenizer:
        (out / "tokenizer.model").write_bytes(train_tokenizer())
    return out
