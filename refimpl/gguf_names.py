"""GGUF tensor names of a Gemma 4 text model, mapped to the oracle's (the checkpoint's names without the
``model.`` / ``model.language_model.`` prefix; docs/quantised.md).

llama.cpp's converter names the tensors through gguf-py's TensorNameMap (``blk.<l>.attn_q.weight`` for
``model.layers.<l>.self_attn.q_proj.weight``) and adds its own rules for Gemma 4 (convert_hf_to_gguf.py,
``Gemma4Model``): ``layer_scalar`` gets ``.weight`` appended, the router's ``scale`` and ``per_expert_scale``
become ``ffn_gate_inp.scale`` and ``ffn_down_exps.scale``, and ``rope_freqs.weight`` is generated (it is not a
checkpoint tensor: it encodes the full layers' partial rotation). ``oracle_name(gguf_name)`` undoes that;
``None`` for ``rope_freqs.weight``; GGUFNameError for a name no Gemma 4 text model has.
"""

from __future__ import annotations

import re

from .errors import RefimplError


class GGUFNameError(RefimplError):
    """A GGUF tensor name that is not one of a Gemma 4 text model's."""


GLOBAL = {
    "token_embd.weight": "embed_tokens.weight",
    "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "per_layer_projection_norm.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",  # only in a file whose checkpoint had an untied head
    "nextn.pre_projection.weight": "pre_projection.weight",  # an MTP drafter's (gemma4-assistant)
    "nextn.post_projection.weight": "post_projection.weight",
}
UNPREFIXED = {"lm_head.weight", "pre_projection.weight", "post_projection.weight"}  # not under model. in HF

# blk.<l>.<gguf> -> layers.<l>.<oracle>
LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "layer_output_scale.weight": "layer_scalar",  # the converter appends .weight
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",  # Gemma4Model.modify_tensors
    "ffn_down_exps.scale": "router.per_expert_scale",  # applied as the down projection's per-expert scale
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",  # rows [0, Im) gate, [Im, 2 Im) up, per expert
    "ffn_down_exps.weight": "experts.down_proj",
}

GENERATED = {"rope_freqs.weight"}  # made by the converter from the config, not a checkpoint tensor

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def oracle_name(gguf_name: str) -> str | None:
    """The oracle's name of a GGUF tensor (``None`` for a generated one), or GGUFNameError."""
    if gguf_name in GLOBAL:
        return GLOBAL[gguf_name]
    if gguf_name in GENERATED:
        return None
    m = _BLOCK.fullmatch(gguf_name)
    if m is not None and m.group(2) in LAYER:
        return f"layers.{int(m.group(1))}.{LAYER[m.group(2)]}"
    raise GGUFNameError(f"tensor {gguf_name!r} is not one of a Gemma 4 text model's (a vision or audio tensor "
                        "belongs in the mmproj file; a fused attn_qkv, from convert --fuse-qkv, is not read)")
