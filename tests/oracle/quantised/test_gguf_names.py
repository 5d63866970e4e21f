"""GGUF tensor names back to the oracle's (refimpl/gguf_names.py; issue 45): every tensor the oracle reads from
the miniatures (dense, MoE, PLE, K=V, KV sharing) named forward as llama.cpp's converter names it, through
gguf-py's own TensorNameMap for Gemma 4 plus the converter's three Gemma 4 rules of the quantised-weights spec
(§3.4), then mapped back: the original name, every time."""

from __future__ import annotations

import pytest
from gguf_writer import converter_name

from refimpl.config import load_config
from refimpl.gguf_names import GGUFNameError, oracle_name
from refimpl.weights import expected_tensors


@pytest.mark.parametrize("preset", ["all-features", "e2b-mini", "26b-a4b-mini", "31b-mini", "e4b-mini"])
def test_every_tensor_named_by_the_converter_maps_back(preset, preset_dirs):
    cfg = load_config(preset_dirs[preset])
    names = sorted(expected_tensors(cfg))
    gguf_names = {converter_name(n, cfg.num_hidden_layers): n for n in names}
    assert len(gguf_names) == len(names)  # no two tensors share a GGUF name
    for g, n in gguf_names.items():
        assert oracle_name(g) == n, (g, n)


def test_generated_and_foreign_names():
    assert oracle_name("rope_freqs.weight") is None
    assert oracle_name("output.weight") == "lm_head.weight"
    assert oracle_name("blk.12.layer_output_scale.weight") == "layers.12.layer_scalar"
    for bad in ("v.blk.0.attn_q.weight", "blk.0.attn_qkv.weight", "blk.x.attn_q.weight", "token_embd"):
        with pytest.raises(GGUFNameError, match=rf"^tensor '{bad}' is not one of a Gemma 4 text model's"):
            oracle_name(bad)
