"""Projector GGUFs (llama.cpp's ``convert_hf_to_gguf.py --mmproj``) read as the checkpoint's towers
(docs/quantised.md, "Projector files"): ``load_mmproj_tower(path, "vision" | "audio")`` picks the reader by the
file's ``clip.<tower>.projector_type``: ``gemma4v`` (here), ``gemma4a`` (gguf_mmproj_audio), ``gemma4uv`` and
``gemma4ua`` (Gemma 4 Unified, gguf_mmproj_unified).

The vision tower (``gemma4v``): the converter (conversion/gemma.py, ``Gemma4VisionAudioModel``) writes its
geometry as ``clip.vision.*`` keys and its tensors under ``v.*`` and ``mm.*`` names; what the file does not hold,
llama.cpp fixes in tools/mtmd/clip.cpp for ``PROJECTOR_TYPE_GEMMA4V``, and so does this reader: the RoPE theta
100 and the pooling kernel 3 (unless ``clip.vision.projector.scale_factor`` says otherwise). The head dim and the
KV heads are read from the q_norm and k_proj shapes, the table size from the position table, clipped linears and
standardization from the tensors present. The converter's transforms are undone: the patch embedder, stored as
[D, 3, p, p] (channels first), goes back to the checkpoint's [D, p·p·3]; the clip bounds, stored as [1], back to
scalars.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from .gguf_io import GGUFError, GGUFFile, open_gguf
from .gguf_mmproj_audio import GEMMA4A, load_gemma4a
from .gguf_mmproj_store import CLIP_LEAVES, MmprojStore, ProjectorKeys, TowerMap, scalar_clip_bounds
from .gguf_mmproj_unified import GEMMA4UA, GEMMA4UV, load_gemma4ua, load_gemma4uv
from .vision import EMBED, TOWER, VisionConfig, VisionWeights

GEMMA4V = "gemma4v"
ROPE_THETA, POOLING = 100.0, 3  # llama.cpp's fixed values for gemma4v (clip.cpp)
GLOBAL = {"mm.input_projection.weight": EMBED + "embedding_projection.weight",
          "v.patch_embd.weight": TOWER + "patch_embedder.input_proj.weight",
          "v.position_embd.weight": TOWER + "patch_embedder.position_embedding_table",
          "v.std_bias": TOWER + "std_bias", "v.std_scale": TOWER + "std_scale"}
LAYER = {"ln1": "input_layernorm", "attn_post_norm": "post_attention_layernorm", "ln2": "pre_feedforward_layernorm",
         "ffn_post_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm"}
LINEAR = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_out": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"v\.blk\.(\d+)\.([a-z_0-9]+)\.(weight|" + "|".join(CLIP_LEAVES) + ")")
PATCH = TOWER + "patch_embedder.input_proj.weight"


def hf_name(gguf_name: str) -> str:
    """The checkpoint's name of an mmproj vision tensor; GGUFError for one the reader does not know."""
    if gguf_name in GLOBAL:
        return GLOBAL[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is not None:
        i, part, leaf = int(m.group(1)), m.group(2), m.group(3)
        p = f"{TOWER}encoder.layers.{i}."
        if part in LAYER and leaf == "weight":
            return p + LAYER[part] + ".weight"
        if part in LINEAR:
            return p + LINEAR[part] + (".linear.weight" if leaf == "weight" else "." + leaf)
    raise GGUFError(f"tensor {gguf_name!r} is not one of a Gemma 4 vision tower's (mmproj, projector gemma4v)")


def _shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if name == PATCH and len(shape) == 4:
        return (shape[0], math.prod(shape[1:]))
    return scalar_clip_bounds(name, shape)


def _undo(name: str, x: np.ndarray) -> np.ndarray:
    if name == PATCH and x.ndim == 4:
        return x.transpose(0, 2, 3, 1)  # [D, 3, p, p] (the converter's channels first) -> [D, p, p, 3]
    return x


VISION = TowerMap(lambda n: not n.startswith(("a.", "mm.a.")),
                  hf_name, _shape, _undo)


def projector_type(f: GGUFFile, tower: str) -> str:
    """The file's ``clip.<tower>.projector_type``; GGUFError when the file is no projector with that tower."""
    meta, where = f.metadata, str(f.path)
    if meta.get("general.architecture") != "clip":
        raise GGUFError(f"{where}: not a projector GGUF (architecture 'clip', from convert_hf_to_gguf.py --mmproj); "
                        f"its architecture is {meta.get('general.architecture')!r}")
    if meta.get(f"clip.has_{tower}_encoder") is not True:
        raise GGUFError(f"{where}: the projector holds no {tower} tower (clip.has_{tower}_encoder is not true)")
    kind = meta.get(f"clip.{tower}.projector_type")
    if not isinstance(kind, str):
        raise GGUFError(f"{where}: metadata key 'clip.{tower}.projector_type' is missing or not a string")
    return kind


def mmproj_vision_config(f: GGUFFile) -> VisionConfig:
    """The vision config of a ``gemma4v`` projector (its keys, its tensor shapes and llama.cpp's fixed values)."""
    keys = ProjectorKeys(f, "vision")
    head_dim = keys.shape("v.blk.0.attn_q_norm.weight")[0]
    return VisionConfig(
        hidden_size=keys.integer("embedding_length"), intermediate_size=keys.integer("feed_forward_length"),
        num_hidden_layers=keys.integer("block_count"), num_attention_heads=keys.integer("attention.head_count"),
        num_key_value_heads=keys.shape("v.blk.0.attn_k.weight")[0] // head_dim, head_dim=head_dim,
        rms_norm_eps=keys.decimal("attention.layer_norm_epsilon"), rope_theta=ROPE_THETA,
        patch_size=keys.integer("patch_size"),
        pooling_kernel_size=int(f.metadata.get("clip.vision.projector.scale_factor", POOLING)),
        position_embedding_size=keys.shape("v.position_embd.weight")[1],
        use_clipped_linears="v.blk.0.attn_q.input_max" in f.tensors, standardize="v.std_bias" in f.tensors,
        text_hidden_size=keys.shape("mm.input_projection.weight")[0])


def load_gemma4v(f: GGUFFile, dtype: str | np.dtype = "float64") -> tuple[VisionWeights, VisionConfig]:
    cfg = mmproj_vision_config(f)
    return VisionWeights(f.path, cfg, dtype, store=MmprojStore(f, VISION)), cfg


READERS = {"vision": {GEMMA4V: load_gemma4v, GEMMA4UV: load_gemma4uv},
           "audio": {GEMMA4A: load_gemma4a, GEMMA4UA: load_gemma4ua}}


def load_mmproj_tower(path: str | Path, tower: str, dtype: str | np.dtype = "float64"):
    """(weights, cfg) of a projector GGUF's ``tower`` ("vision" or "audio"), the classes a checkpoint directory's
    tower loads as: VisionWeights (gemma4v), AudioWeights (gemma4a), UnifiedVisionWeights (gemma4uv),
    UnifiedAudioWeights (gemma4ua). GGUFError in one line for any other file."""
    if tower not in READERS:
        raise ValueError(f"tower must be 'vision' or 'audio', got {tower!r}")
    f = open_gguf(path)
    kind = projector_type(f, tower)
    if kind not in READERS[tower]:
        raise GGUFError(f"{f.path}: {tower} projector type {kind!r}; the oracle reads Gemma 4's "
                        f"({' and '.join(repr(k) for k in READERS[tower])})")
    return READERS[tower][kind](f, dtype)

