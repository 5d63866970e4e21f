"""The vision tower of a Gemma 4 mmproj GGUF (llama.cpp's ``convert_hf_to_gguf.py --mmproj``, projector type
``gemma4v``), read as the checkpoint's tower (docs/quantised.md, "Projector files").

The converter (conversion/gemma.py, ``Gemma4VisionAudioModel``) writes the tower's geometry as ``clip.vision.*``
keys and its tensors under ``v.*`` and ``mm.*`` names; what the file does not hold, llama.cpp fixes in
tools/mtmd/clip.cpp for ``PROJECTOR_TYPE_GEMMA4V``, and so does this reader: the RoPE theta 100 and the pooling
kernel 3 (unless ``clip.vision.projector.scale_factor`` says otherwise). The head dim and the KV heads are read
from the q_norm and k_proj shapes, the table size from the position table, clipped linears and standardization
from the tensors present. The converter's transforms are undone: the patch embedder, stored as [D, 3, p, p]
(channels first), goes back to the checkpoint's [D, p·p·3]; the clip bounds, stored as [1], back to scalars.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .gguf_config import config_decimal
from .gguf_io import GGUFError, GGUFFile, open_gguf
from .gguf_store import undecodable_type
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
_BLOCK = re.compile(r"v\.blk\.(\d+)\.([a-z_0-9]+)\.(weight|input_min|input_max|output_min|output_max)")


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


@dataclass(frozen=True)
class MmprojInfo:
    name: str  # the checkpoint's name
    gguf_name: str
    shape: tuple[int, ...]  # the checkpoint's shape
    dtype: str
    path: Path


class MmprojStore:
    """The vision tensors of an mmproj GGUF under the checkpoint's names and shapes (the TensorStore calls the
    tower makes: ``infos``, ``names``, ``get``, ``rows``, ``nonfinite``, ``undecodable``); each decoded whole
    when asked."""

    source = "its metadata"  # what the tensors are checked against, for messages

    def describe(self, name: str) -> str:
        return f"'{self.infos[name].gguf_name}' ({name})"

    def undecodable(self, name: str) -> str | None:
        return undecodable_type(self.describe(name), self.infos[name].dtype)

    def __init__(self, f: GGUFFile):
        self.file, self.model_dir = f, f.path
        self.infos: dict[str, MmprojInfo] = {}
        for t in f.tensors.values():
            if t.name.startswith(("a.", "mm.a.")):
                continue  # the audio tower's (not read here)
            try:
                name = hf_name(t.name)
            except GGUFError as e:
                raise GGUFError(f"{f.path}: {e}") from None
            self.infos[name] = MmprojInfo(name, t.name, self._shape(name, t.shape), t.type_name, f.path)

    @staticmethod
    def _shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if name.endswith(("input_min", "input_max", "output_min", "output_max")) and shape == (1,):
            return ()
        if name.endswith("patch_embedder.input_proj.weight") and len(shape) == 4:
            return (shape[0], math.prod(shape[1:]))
        return shape

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    @property
    def names(self) -> list[str]:
        return list(self.infos)

    def get(self, name: str, dtype: np.dtype = np.float64) -> np.ndarray:
        info = self.infos[name]
        x = self.file.get(info.gguf_name)
        if name.endswith("patch_embedder.input_proj.weight") and x.ndim == 4:
            x = x.transpose(0, 2, 3, 1)  # [D, 3, p, p] (the converter's channels first) -> [D, p, p, 3]
        return x.reshape(info.shape).astype(dtype)  # a copy, C-ordered (ascontiguousarray would make a scalar 1-D)

    def rows(self, name: str, index, dtype: np.dtype = np.float64) -> np.ndarray:
        return self.get(name, dtype)[index]

    def nonfinite(self, name: str, index=None) -> int:
        x = self.get(name) if index is None else self.rows(name, index)
        return int(np.count_nonzero(~np.isfinite(x)))


def mmproj_vision_config(f: GGUFFile) -> VisionConfig:
    """The vision config of an mmproj GGUF (its keys, its tensor shapes and llama.cpp's fixed values)."""
    meta, where = f.metadata, str(f.path)
    if meta.get("general.architecture") != "clip" or meta.get("clip.has_vision_encoder") is not True:
        raise GGUFError(f"{where}: not a vision projector GGUF (architecture 'clip' with a vision encoder, from "
                        "convert_hf_to_gguf.py --mmproj)")
    kind = meta.get("clip.vision.projector_type")
    if kind != GEMMA4V:
        raise GGUFError(f"{where}: projector type {kind!r}; the oracle reads Gemma 4's vision projector "
                        f"({GEMMA4V!r}), not Gemma 4 Unified's ('gemma4uv') or others")

    def key(name: str, kind_: type = int):
        value = meta.get("clip.vision." + name)
        if not isinstance(value, kind_) or isinstance(value, bool) or value <= 0:
            raise GGUFError(f"{where}: metadata key 'clip.vision.{name}' must be a positive "
                            f"{'integer' if kind_ is int else 'number'}, got {value!r}")
        return value

    def shape(gguf_name: str) -> tuple[int, ...]:
        if gguf_name not in f.tensors:
            raise GGUFError(f"{where}: no tensor {gguf_name!r}; a Gemma 4 vision projector holds it")
        return f.tensors[gguf_name].shape

    D, heads = key("embedding_length"), key("attention.head_count")
    head_dim = shape("v.blk.0.attn_q_norm.weight")[0]
    return VisionConfig(
        hidden_size=D, intermediate_size=key("feed_forward_length"), num_hidden_layers=key("block_count"),
        num_attention_heads=heads, num_key_value_heads=shape("v.blk.0.attn_k.weight")[0] // head_dim,
        head_dim=head_dim, rms_norm_eps=config_decimal(float(key("attention.layer_norm_epsilon", float))),
        rope_theta=ROPE_THETA, patch_size=key("patch_size"),
        pooling_kernel_size=int(meta.get("clip.vision.projector.scale_factor", POOLING)),
        position_embedding_size=shape("v.position_embd.weight")[1],
        use_clipped_linears="v.blk.0.attn_q.input_max" in f.tensors, standardize="v.std_bias" in f.tensors,
        text_hidden_size=shape("mm.input_projection.weight")[0])


def load_mmproj_vision_tower(path: str | Path, dtype: str | np.dtype = "float64") -> tuple[VisionWeights, VisionConfig]:
    """(weights, cfg) of an mmproj GGUF's vision tower, for ``vision.vision_tower(..., weights, cfg)``."""
    f = open_gguf(path)
    cfg = mmproj_vision_config(f)
    return VisionWeights(path, cfg, dtype, store=MmprojStore(f)), cfg
