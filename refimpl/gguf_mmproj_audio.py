"""The audio tower of a Gemma 4 projector GGUF (projector type ``gemma4a``), read as the checkpoint's conformer
(docs/quantised.md, "Projector files").

The converter (conversion/gemma.py, ``Gemma4VisionAudioModel``) renames ``model.audio_tower.*`` to
``conformer.*`` and maps it through gguf-py's table to ``a.*`` (the embedder's projection to ``mm.a.*``); this
reader maps every name back. It also transforms two kinds of tensor, undone or taken as they are here:

* ``per_dim_scale`` is stored as ``softplus(per_dim_scale)``, computed by torch in the checkpoint's dtype and
  stored in float32. The stored value *is* the query's per-channel scale, and the tower uses it as such
  (``MmprojAudioWeights.query_scale``), not an inverse softplus of it: the oracle computes what the file says.
* the depthwise conv kernel [D, 1, K] is stored as [D, K]; the clip bounds, scalars, as [1].

The file holds the geometry (``clip.audio.embedding_length``, ``block_count``, ``attention.head_count``) and the
tensor shapes give the rest of it (subsampling channels, kernel, output width, text width). What neither holds,
llama.cpp fixes in tools/mtmd/models/gemma4a.cpp and clip.cpp, and so does this reader: the published E2B/E4B
values (chunk 12, left context 13, right context 0, logit cap 50, residual weight 0.5), and eps 1e-6 (clip.cpp
ignores the file's epsilon, which the converter reads from a key the audio config does not have). The invalid-
logit value and the gradient clipping are transformers' defaults.
"""

from __future__ import annotations

import re

import numpy as np

from .audio import EMBED, HF_DEFAULTS, SUB, TOWER, AudioConfig, AudioWeights
from .gguf_io import GGUFError, GGUFFile
from .gguf_mmproj_store import CLIP_LEAVES, MmprojStore, ProjectorKeys, TowerMap, scalar_clip_bounds

GEMMA4A = "gemma4a"
# llama.cpp's fixed values for gemma4a (models/gemma4a.cpp: C = 12, P = 12, softcap 50, res_weight 0.5; clip.cpp:
# eps 1e-6): the published E2B/E4B audio config
LLAMA_CPP_FIXED = dict(attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
                       attention_logit_cap=50.0, residual_weight=0.5, rms_norm_eps=1e-6)
GLOBAL = {"a.input_projection.weight": SUB + "input_proj_linear.weight",
          "a.pre_encode.out.weight": TOWER + "output_proj.weight",
          "a.pre_encode.out.bias": TOWER + "output_proj.bias",
          "mm.a.input_projection.weight": EMBED + "embedding_projection.weight"}
_CONV = re.compile(r"a\.conv1d\.([01])\.(norm\.)?weight")
FFN = {"ffn_up": "feed_forward1.ffw_layer_1", "ffn_down": "feed_forward1.ffw_layer_2",
       "ffn_up_1": "feed_forward2.ffw_layer_1", "ffn_down_1": "feed_forward2.ffw_layer_2",
       "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
       "attn_out": "self_attn.post", "conv_pw1": "lconv1d.linear_start", "conv_pw2": "lconv1d.linear_end"}
PLAIN = {"ffn_norm": "feed_forward1.pre_layer_norm.weight", "ffn_post_norm": "feed_forward1.post_layer_norm.weight",
         "ffn_norm_1": "feed_forward2.pre_layer_norm.weight",
         "ffn_post_norm_1": "feed_forward2.post_layer_norm.weight",
         "attn_pre_norm": "norm_pre_attn.weight", "attn_post_norm": "norm_post_attn.weight", "ln2": "norm_out.weight",
         "conv_norm": "lconv1d.pre_layer_norm.weight", "norm_conv": "lconv1d.conv_norm.weight",
         "conv_dw": "lconv1d.depthwise_conv1d.weight", "attn_k_rel": "self_attn.relative_k_proj.weight",
         "per_dim_scale": "self_attn.per_dim_scale"}
_BLOCK = re.compile(r"a\.blk\.(\d+)\.([a-z_0-9]+)\.(weight|" + "|".join(CLIP_LEAVES) + ")")
DEPTHWISE = "lconv1d.depthwise_conv1d.weight"


def hf_name(gguf_name: str) -> str:
    """The checkpoint's name of a ``gemma4a`` tensor; GGUFError for one the reader does not know."""
    if gguf_name in GLOBAL:
        return GLOBAL[gguf_name]
    m = _CONV.fullmatch(gguf_name)
    if m is not None:
        return f"{SUB}layer{m.group(1)}.{'norm' if m.group(2) else 'conv'}.weight"
    m = _BLOCK.fullmatch(gguf_name)
    if m is not None:
        i, part, leaf = int(m.group(1)), m.group(2), m.group(3)
        p = f"{TOWER}layers.{i}."
        if part in PLAIN and leaf == "weight":
            return p + PLAIN[part]
        if part in FFN:
            return p + FFN[part] + (".linear.weight" if leaf == "weight" else "." + leaf)
    raise GGUFError(f"tensor {gguf_name!r} is not one of a Gemma 4 audio tower's (mmproj, projector gemma4a)")


def _shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if name.endswith(DEPTHWISE) and len(shape) == 2:
        return (shape[0], 1, shape[1])
    return scalar_clip_bounds(name, shape)


AUDIO = TowerMap(lambda n: n.startswith(("a.", "mm.a.")), hf_name,
                 _shape)


class MmprojAudioWeights(AudioWeights):
    """The audio tower of a ``gemma4a`` projector: the checkpoint's, but for the query scale, which the file
    holds already passed through softplus."""

    def query_scale(self, attn: str) -> np.ndarray:
        return self[attn + "per_dim_scale"]


def mmproj_audio_config(f: GGUFFile) -> AudioConfig:
    """The audio config of a ``gemma4a`` projector (its keys, its tensor shapes and llama.cpp's fixed values)."""
    keys = ProjectorKeys(f, "audio")
    c0, c1 = keys.shape("a.conv1d.0.weight")[0], keys.shape("a.conv1d.1.weight")[0]
    return AudioConfig(
        hidden_size=keys.integer("embedding_length"), num_hidden_layers=keys.integer("block_count"),
        num_attention_heads=keys.integer("attention.head_count"), subsampling_conv_channels=(c0, c1),
        output_proj_dims=keys.shape("a.pre_encode.out.weight")[0],
        conv_kernel_size=keys.shape("a.blk.0.conv_dw.weight")[-1],
        attention_invalid_logits_value=HF_DEFAULTS["attention_invalid_logits_value"],
        use_clipped_linears="a.blk.0.attn_q.input_max" in f.tensors,
        gradient_clipping=HF_DEFAULTS["gradient_clipping"],
        text_hidden_size=keys.shape("mm.a.input_projection.weight")[0], **LLAMA_CPP_FIXED)


def load_gemma4a(f: GGUFFile, dtype: str | np.dtype = "float64") -> tuple[AudioWeights, AudioConfig]:
    cfg = mmproj_audio_config(f)
    return MmprojAudioWeights(f.path, cfg, dtype, store=MmprojStore(f, AUDIO)), cfg

