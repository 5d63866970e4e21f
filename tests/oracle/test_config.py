"""Tests of ``refimpl.config``: derived per-layer tables, defaults, both architectures, both
serialisations, and the exact text of every inconsistent-config error.

Expected values come from gemma4-text-spec.md (sections 1, 2, 4.6, 4.7 and 12), written out by hand
here; they are never recomputed with the code under test.
"""

from __future__ import annotations

import copy
import json
import re

import pytest

from refimpl.config import FULL, SLIDING, load_config, parse_config
from refimpl.errors import ConfigError

S, F = SLIDING, FULL

ROPE = {
    S: {"rope_type": "default", "rope_theta": 10_000.0},
    F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


# ----------------------------------------------------------------------------------------------
# the published text configs (spec section 1 table), built from the spec's numbers


def e2b() -> dict:
    return {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "vocab_size": 262144, "hidden_size": 1536, "num_hidden_layers": 35,
        "layer_types": ([S] * 4 + [F]) * 7,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
        "intermediate_size": 6144, "use_double_wide_mlp": True, "num_kv_shared_layers": 20,
        "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
        "sliding_window": 512, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
        "attention_k_eq_v": False, "num_global_key_value_heads": None, "enable_moe_block": False,
        "use_bidirectional_attention": None, "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh", "rope_parameters": copy.deepcopy(ROPE),
        "eos_token_id": [1, 106], "bos_token_id": 2, "pad_token_id": 0,
    }


def e4b() -> dict:
    c = e2b()
    c.update({
        "hidden_size": 2560, "num_hidden_layers": 42, "layer_types": ([S] * 5 + [F]) * 7,
        "num_key_value_heads": 2, "intermediate_size": 10240, "use_double_wide_mlp": False,
        "num_kv_shared_layers": 18,
    })
    return c


def a26b() -> dict:
    c = e2b()
    c.update({
        "hidden_size": 2816, "num_hidden_layers": 30, "layer_types": ([S] * 5 + [F]) * 5,
        "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2,
        "attention_k_eq_v": True, "intermediate_size": 2112, "use_double_wide_mlp": False,
        "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "sliding_window": 1024,
        "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
        "use_bidirectional_attention": "vision",
    })
    return c


def b31() -> dict:
    c = e2b()
    c.update({
        "hidden_size": 5376, "num_hidden_layers": 60, "layer_types": ([S] * 5 + [F]) * 10,
        "num_attention_heads": 32, "num_key_value_heads": 16, "num_global_key_value_heads": 4,
        "attention_k_eq_v": True, "intermediate_size": 21504, "use_double_wide_mlp": False,
        "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "sliding_window": 1024,
        "use_bidirectional_attention": "vision",
    })
    return c


def small(**over) -> dict:
    """A small legacy Gemma4ForCausalLM config; keyword overrides replace fields (None deletes)."""
    c = {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6, "layer_types": [S] * 5 + [F],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
        "intermediate_size": 96, "sliding_window": 8, "final_logit_softcapping": 30.0,
        "hidden_size_per_layer_input": 0, "rope_parameters": copy.deepcopy(ROPE),
    }
    for k, v in over.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    return c


def full_layers(cfg) -> list[int]:
    return [layer.index for layer in cfg.layers if layer.layer_type == F]


# ----------------------------------------------------------------------------------------------
# derived tables of the published variants


def test_e2b_derived_table():
    cfg = parse_config(e2b())
    assert cfg.num_hidden_layers == 35 and len(cfg.layers) == 35
    assert full_layers(cfg) == [4, 9, 14, 19, 24, 29, 34]
    assert cfg.first_shared_layer == 15
    for layer in cfg.layers:
        i = layer.index
        if i < 15:
            assert layer.kv_source == i and layer.owns_kv
            assert layer.ffn_width == 6144
        else:
            assert layer.kv_source == (14 if layer.layer_type == F else 13), i
            assert not layer.owns_kv
            assert layer.ffn_width == 12288
        if layer.layer_type == F:
            assert (layer.head_dim, layer.num_kv_heads) == (512, 1)
            assert layer.rope.rope_type == "proportional"
            assert layer.rope.theta == 1_000_000.0 and layer.rope.partial_rotary_factor == 0.25
        else:
            assert (layer.head_dim, layer.num_kv_heads) == (256, 1)
            assert layer.rope.rope_type == "default" and layer.rope.theta == 10_000.0
        assert layer.k_eq_v is False
    assert cfg.hidden_size_per_layer_input == 256 and cfg.has_ple
    assert cfg.sliding_window == 512 and cfg.final_logit_softcapping == 30.0
    assert cfg.eos_token_ids == (1, 106)
    assert cfg.fixed_rule_disagreements() == []


def test_e4b_derived_table():
    cfg = parse_config(e4b())
    assert full_layers(cfg) == list(range(5, 42, 6))
    assert cfg.first_shared_layer == 24
    for layer in cfg.layers:
        i = layer.index
        if i < 24:
            assert layer.kv_source == i
        else:
            assert layer.kv_source == (23 if layer.layer_type == F else 22), i
        assert layer.ffn_width == 10240  # no double-wide MLP on E4B
        assert layer.num_kv_heads == 2
        assert layer.head_dim == (512 if layer.layer_type == F else 256)
        assert layer.k_eq_v is False
    assert cfg.fixed_rule_disagreements() == []


def test_26b_a4b_derived_table():
    cfg = parse_config(a26b())
    assert full_layers(cfg) == [5, 11, 17, 23, 29]
    for layer in cfg.layers:
        assert layer.owns_kv
        assert layer.ffn_width == 2112
        if layer.layer_type == F:
            assert (layer.head_dim, layer.num_kv_heads, layer.k_eq_v) == (512, 2, True), layer.index
        else:
            assert (layer.head_dim, layer.num_kv_heads, layer.k_eq_v) == (256, 8, False), layer.index
    assert (cfg.enable_moe_block, cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size) == (True, 128, 8, 704)
    assert not cfg.has_ple and cfg.hidden_size_per_layer_input == 0
    assert cfg.use_bidirectional_attention == "vision"
    assert cfg.fixed_rule_disagreements() == []


def test_31b_derived_table():
    cfg = parse_config(b31())
    assert full_layers(cfg) == list(range(5, 60, 6))
    for layer in cfg.layers:
        assert layer.owns_kv and layer.ffn_width == 21504
        if layer.layer_type == F:
            assert (layer.head_dim, layer.num_kv_heads, layer.k_eq_v) == (512, 4, True)
        else:
            assert (layer.head_dim, layer.num_kv_heads, layer.k_eq_v) == (256, 16, False)
    assert cfg.enable_moe_block is False and cfg.num_experts is None
    assert cfg.fixed_rule_disagreements() == []


def test_fixed_rule_disagrees_on_alternating_pattern():
    # layers 0..3 own KV (last sliding before 4 is 3, last full is 2); 4 (sliding) and 5 (full) are shared
    cfg = parse_config(small(layer_types=[S, S, F, S, S, F], num_kv_shared_layers=2))
    assert [layer.kv_source for layer in cfg.layers] == [0, 1, 2, 3, 3, 2]
    assert cfg.fixed_rule_kv_source(4) == 2  # sliding -> first_shared - 2
    assert cfg.fixed_rule_kv_source(5) == 3  # full -> first_shared - 1
    assert cfg.fixed_rule_kv_source(1) == 1
    assert cfg.fixed_rule_disagreements() == [4, 5]


# ----------------------------------------------------------------------------------------------
# defaults (spec section 2)


def test_default_layer_types_5_to_1():
    cfg = parse_config(small(num_hidden_layers=12, layer_types=None))
    assert full_layers(cfg) == [5, 11]
    assert any("layer_types absent" in n for n in cfg.notes)


def test_last_layer_forced_full_with_note():
    cfg = parse_config(small(layer_types=[S] * 6))
    assert cfg.layers[5].layer_type == F
    assert cfg.layers[5].head_dim == 32  # it really is a full layer (global_head_dim)
    assert full_layers(cfg) == [5]
    assert "the last layer (5) was 'sliding_attention'; forced to 'full_attention' as transformers does" in cfg.notes


def test_default_layer_types_last_layer_forced_full():
    # 7 layers: (i+1)%6 gives full at 5 only; the last layer 6 is then forced full
    cfg = parse_config(small(num_hidden_layers=7, layer_types=None))
    assert full_layers(cfg) == [5, 6]
    assert any("forced to 'full_attention'" in n for n in cfg.notes)


def test_default_rope_parameters():
    cfg = parse_config(small(rope_parameters=None))
    sliding, full = cfg.layers[0].rope, cfg.layers[5].rope
    assert (sliding.rope_type, sliding.theta, sliding.partial_rotary_factor, sliding.factor) == \
        ("default", 1e4, 1.0, 1.0)
    assert (full.rope_type, full.theta, full.partial_rotary_factor, full.factor) == ("proportional", 1e6, 0.25, 1.0)


def test_default_global_head_dim_512():
    cfg = parse_config(small(global_head_dim=None, num_attention_heads=4))
    assert cfg.layers[5].head_dim == 512
    assert cfg.layers[0].head_dim == 16
    assert any("global_head_dim absent" in n for n in cfg.notes)


def test_default_head_dim_256():
    cfg = parse_config(small(head_dim=None))
    assert cfg.layers[0].head_dim == 256


def test_global_kv_heads_ignored_without_k_eq_v():
    # 3 would not even divide 4 heads: it must be ignored, not used
    for g in (1, 3):
        cfg = parse_config(small(attention_k_eq_v=False, num_global_key_value_heads=g))
        assert [layer.num_kv_heads for layer in cfg.layers] == [2] * 6
        assert not any(layer.k_eq_v for layer in cfg.layers)


def test_global_kv_heads_used_with_k_eq_v():
    cfg = parse_config(small(attention_k_eq_v=True, num_global_key_value_heads=1))
    assert [layer.num_kv_heads for layer in cfg.layers] == [2] * 5 + [1]
    assert [layer.k_eq_v for layer in cfg.layers] == [False] * 5 + [True]


def test_k_eq_v_without_global_kv_heads_keeps_kv_heads():
    cfg = parse_config(small(attention_k_eq_v=True, num_global_key_value_heads=None))
    assert [layer.num_kv_heads for layer in cfg.layers] == [2] * 6
    assert cfg.layers[5].k_eq_v


# ----------------------------------------------------------------------------------------------
# both architectures


def _conditional(text: dict) -> dict:
    text = {k: v for k, v in text.items() if k != "architectures"}
    return {
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
        "vision_config": None, "audio_config": None, "tie_word_embeddings": True,
    }


@pytest.mark.parametrize("make", [e2b, e4b, a26b, b31], ids=["e2b", "e4b", "26b", "31b"])
def test_both_architectures_same_layers(make):
    causal = parse_config(make())
    cond = parse_config(_conditional(make()))
    assert causal.architecture == "Gemma4ForCausalLM"
    assert cond.architecture == "Gemma4ForConditionalGeneration"
    assert cond.layers == causal.layers
    assert cond.hidden_size == causal.hidden_size and cond.vocab_size == causal.vocab_size


def test_conditional_error_names_text_config():
    with pytest.raises(ConfigError) as e:
        parse_config(_conditional(small(hidden_size=None)))
    assert str(e.value) == "config.json text_config: required field 'hidden_size' is missing; add it to the config"


# ----------------------------------------------------------------------------------------------
# both serialisations (per_layer_config written by real transformers)


def _hf_serialised(legacy: dict, tmp_path) -> dict:
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in legacy.items() if k not in ("architectures", "model_type")}
    transformers.Gemma4TextConfig(**fields).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "per_layer_config" in written
    assert "global_head_dim" not in written
    return written


@pytest.mark.parametrize("kind", ["k_eq_v_global_kv", "plain", "shared"])
def test_per_layer_config_serialisation_same_layers(kind, tmp_path):
    if kind == "k_eq_v_global_kv":
        legacy = small(attention_k_eq_v=True, num_global_key_value_heads=1,
                       layer_types=[S, S, F, S, S, F])
    elif kind == "plain":
        legacy = small()
    else:  # KV sharing and double-wide as in E2B, in miniature
        legacy = small(num_hidden_layers=10, layer_types=[S, S, S, S, F] * 2, num_key_value_heads=1,
                       num_kv_shared_layers=5, use_double_wide_mlp=True, hidden_size_per_layer_input=8)
    written = _hf_serialised(legacy, tmp_path)
    old = parse_config(legacy)
    new = parse_config(written)
    assert old.serialisation == "legacy"
    assert new.serialisation == "per_layer_config"
    assert new.layers == old.layers
    if kind == "k_eq_v_global_kv":
        assert [(x.head_dim, x.num_kv_heads, x.k_eq_v) for x in new.layers] == [
            (16, 2, False), (16, 2, False), (32, 1, True), (16, 2, False), (16, 2, False), (32, 1, True)]
    # and through load_config from the directory transformers wrote
    assert load_config(tmp_path).layers == old.layers


# ----------------------------------------------------------------------------------------------
# errors: exact messages


def _err(raw: dict, where: str = "config.json") -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(raw, where)
    return str(e.value)


def test_error_heads_not_divisible_by_kv_heads():
    assert _err(small(num_key_value_heads=3)) == (
        "config.json: layer 0 (sliding_attention) has 4 attention heads, not divisible by its 3 KV heads "
        "('num_key_value_heads'); choose a KV head count that divides num_attention_heads"
    )


def test_error_heads_not_divisible_by_global_kv_heads():
    assert _err(small(attention_k_eq_v=True, num_global_key_value_heads=3)) == (
        "config.json: layer 5 (full_attention) has 4 attention heads, not divisible by its 3 KV heads "
        "('num_global_key_value_heads'); choose a KV head count that divides num_attention_heads"
    )


@pytest.mark.parametrize("missing", ["num_experts", "top_k_experts", "moe_intermediate_size"])
def test_error_moe_field_missing(missing):
    moe = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)
    moe[missing] = None
    assert _err(small(**moe)) == (
        f"config.json: 'enable_moe_block' is true but '{missing}' is missing; set '{missing}' "
        "(the 26B-A4B uses num_experts 128, top_k_experts 8, moe_intermediate_size 704)"
    )


def test_error_moe_field_null_same_as_missing():
    raw = small(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)
    raw["top_k_experts"] = None  # explicit JSON null
    assert _err(raw) == (
        "config.json: 'enable_moe_block' is true but 'top_k_experts' is missing; set 'top_k_experts' "
        "(the 26B-A4B uses num_experts 128, top_k_experts 8, moe_intermediate_size 704)"
    )


def test_error_top_k_exceeds_num_experts():
    raw = small(enable_moe_block=True, num_experts=4, top_k_experts=5, moe_intermediate_size=32)
    assert _err(raw) == "config.json: 'top_k_experts' (5) exceeds 'num_experts' (4); lower top_k_experts"


def test_error_shared_layer_type_without_producer():
    raw = small(num_hidden_layers=5, layer_types=[S, S, S, F, F], num_kv_shared_layers=2)
    assert _err(raw) == (
        "config.json: KV-shared layer 3 is 'full_attention' but no layer before the first shared layer "
        "(3 = num_hidden_layers - num_kv_shared_layers) has that type, so nothing produces its K/V; "
        "lower 'num_kv_shared_layers' or change 'layer_types'"
    )


def test_error_unknown_rope_type():
    raw = small()
    raw["rope_parameters"][F]["rope_type"] = "yarn"
    assert _err(raw) == (
        "config.json: 'rope_parameters.full_attention.rope_type' is 'yarn', which this oracle does not know; "
        "Gemma 4 uses one of default, proportional"
    )


def test_error_rope_parameters_missing_layer_type():
    raw = small()
    del raw["rope_parameters"][F]
    assert _err(raw) == (
        "config.json: 'rope_parameters' has no entry for layer type 'full_attention'; add "
        '"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}'
    )


def test_rope_parameters_for_unused_type_not_required():
    # only sliding layers would be used... but the last layer is always full, so use an all-full model
    raw = small(layer_types=[F] * 6, rope_parameters={F: ROPE[F]})
    cfg = parse_config(raw)
    assert full_layers(cfg) == list(range(6))


def test_error_layer_types_wrong_length():
    assert _err(small(layer_types=[S] * 4 + [F])) == (
        "config.json: 'layer_types' must list one type per layer (6 = num_hidden_layers), got 5 entries"
    )


def test_error_layer_types_not_a_list():
    assert _err(small(layer_types="sliding_attention")) == (
        "config.json: 'layer_types' must be a list of one type per layer (6 = num_hidden_layers), "
        "got 'sliding_attention'"
    )


def test_error_unknown_layer_type():
    assert _err(small(layer_types=[S, S, "local_attention", S, S, F])) == (
        "config.json: 'layer_types[2]' is 'local_attention'; each entry must be one of "
        "sliding_attention, full_attention"
    )


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "intermediate_size"])
def test_error_missing_required_field(key):
    assert _err(small(**{key: None})) == f"config.json: required field '{key}' is missing; add it to the config"


def test_error_wrong_type_float_for_int():
    assert _err(small(vocab_size=512.0)) == (
        "config.json: field 'vocab_size' must be int, got 512.0; fix the value in the config"
    )


def test_error_wrong_type_bool_for_int():
    assert _err(small(num_key_value_heads=True)) == (
        "config.json: field 'num_key_value_heads' must be int, got True; fix the value in the config"
    )


def test_error_wrong_type_string_for_bool():
    assert _err(small(use_double_wide_mlp="true")) == (
        "config.json: field 'use_double_wide_mlp' must be bool, got 'true'; fix the value in the config"
    )


def test_int_accepted_for_float_field():
    cfg = parse_config(small(final_logit_softcapping=30, rms_norm_eps=1))
    assert cfg.final_logit_softcapping == 30.0 and isinstance(cfg.final_logit_softcapping, float)


def test_error_all_layers_shared():
    assert _err(small(num_kv_shared_layers=6)) == (
        "config.json: 'num_kv_shared_layers' must be in [0, num_hidden_layers) = [0, 6), got 6 "
        "(an all-shared assistant/drafter model needs its target's cache, which this oracle does not serve)"
    )


def test_error_negative_kv_shared():
    assert _err(small(num_kv_shared_layers=-1)) == (
        "config.json: 'num_kv_shared_layers' must be in [0, num_hidden_layers) = [0, 6), got -1"
    )


def test_error_bidirectional_all():
    assert _err(small(use_bidirectional_attention="all")) == (
        "config.json: 'use_bidirectional_attention' is 'all'; this oracle serves causal language models "
        "(null) and 'vision' checkpoints, not fully bidirectional embedding models"
    )


def test_error_invalid_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 64,\n "vocab_size": }\n')
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(e.value) == f"{path}: not valid JSON (Expecting value at line 2 column 16)"


def test_error_config_missing_in_directory(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(e.value) == f"{tmp_path / 'config.json'}: not found; a checkpoint directory must hold config.json"


def test_error_model_dir_not_a_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError) as e:
        load_config(missing)
    assert str(e.value) == f"{missing}: not a directory; pass a checkpoint directory holding config.json"


def test_load_config_error_names_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(small(hidden_size=None)))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(e.value) == f"{tmp_path / 'config.json'}: required field 'hidden_size' is missing; add it to the config"


def test_generation_config_adds_stop_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(small(eos_token_id=1)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert load_config(tmp_path).eos_token_ids == (1, 106)


def _plc_base() -> dict:
    raw = small()
    del raw["global_head_dim"]
    raw["per_layer_config"] = {"5": {"head_dim": 32}}
    return raw


def test_per_layer_config_hand_written():
    cfg = parse_config(_plc_base())
    assert cfg.serialisation == "per_layer_config"
    assert [(x.head_dim, x.num_kv_heads) for x in cfg.layers] == [(16, 2)] * 5 + [(32, 2)]


@pytest.mark.parametrize("key", ["6", "-1", "five"])
def test_error_per_layer_config_bad_key(key):
    raw = _plc_base()
    raw["per_layer_config"] = {key: {"head_dim": 32}}
    assert _err(raw) == f"config.json: 'per_layer_config' key {key!r} is not a layer index in [0, 6)"


def test_error_per_layer_config_unknown_field():
    raw = _plc_base()
    raw["per_layer_config"] = {"5": {"head_dim": 32, "sliding_window": 4}}
    assert _err(raw) == (
        "config.json: 'per_layer_config[5]' overrides ['sliding_window'], which this oracle does not derive "
        "per layer (only head_dim and num_key_value_heads)"
    )


def test_error_per_layer_config_not_object():
    raw = _plc_base()
    raw["per_layer_config"] = {"5": 32}
    assert _err(raw) == "config.json: 'per_layer_config[5]' must be an object of overridden fields"


def test_error_shared_layer_geometry_mismatch():
    # per_layer_config gives shared layer 5 a different head_dim from its source 4
    raw = small(layer_types=[S, S, S, S, F, F], num_kv_shared_layers=1)
    del raw["global_head_dim"]
    raw["per_layer_config"] = {"4": {"head_dim": 32}, "5": {"head_dim": 64}}
    assert _err(raw) == (
        "config.json: shared layer 5 (head_dim 64, 2 KV heads) reads the K/V of layer 4 (head_dim 32, "
        "2 KV heads); their geometry must match"
    )


def test_error_message_is_full_string_regex_for_custom_where():
    with pytest.raises(ConfigError) as e:
        parse_config(small(num_key_value_heads=3), where="/x/y/config.json")
    assert re.fullmatch(r"/x/y/config\.json: layer 0 \(sliding_attention\) has 4 attention heads, .*", str(e.value))


def test_error_required_field_null():
    raw = small()
    raw["hidden_size"] = None
    assert _err(raw) == "config.json: field 'hidden_size' must be int, got None; fix the value in the config"


def test_architectures_string_not_indexed_by_character():
    assert _err(small(architectures="Gemma4ForCausalLM")) == (
        "config.json: 'architectures' must be a list of class names, got 'Gemma4ForCausalLM'"
    )


def test_error_flat_rope_parameters():
    raw = small(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert _err(raw) == (
        "config.json: 'rope_parameters' must be keyed by layer type ('sliding_attention', 'full_attention'), "
        "each with its own rope_type and rope_theta; got one flat set of parameters"
    )


def test_error_rope_default_with_partial_rotary_factor():
    raw = small()
    raw["rope_parameters"][S]["partial_rotary_factor"] = 0.5
    assert _err(raw) == (
        "config.json: 'rope_parameters.sliding_attention' sets partial_rotary_factor or factor with rope_type "
        "'default'; Gemma 4 only uses them with rope_type 'proportional' (remove them, or set rope_type to "
        "'proportional')"
    )


def test_error_rope_theta_missing():
    raw = small()
    del raw["rope_parameters"][F]["rope_theta"]
    assert _err(raw) == (
        "config.json rope_parameters.full_attention: required field 'rope_theta' is missing; add it to the config"
    )
