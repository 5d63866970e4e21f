"""The Gemma 4 MTP assistant (drafter): ``gemma4_assistant`` and ``gemma4_unified_assistant`` checkpoints
(gemma4-unified-and-mtp-spec.md Part B, sections B1 to B5).

A drafter is a small Gemma 4 text model in which every layer is KV-shared: its queries attend to the K/V
of the target's last KV-owning layer of the same type. One step maps a token and a target-width hidden
vector to logits and the next step's hidden vector:

    e      = E_target[t] * sqrt(H_t)                          the target's scaled embedding
    z      = [e ; h] W_pre^T                                  [H_a], embedding first; no sqrt(H_a)
    z      = layer_l(z) for every drafter layer               q-only attention over the target's K/V
    z_hat  = RMSNorm(z; model.norm)
    h_next = z_hat W_post^T                                   [H_t], the next step's h
    logits = z_hat E_a^T  or the centroid-masked head         no softcap

Shapes: H_t target width, H_a drafter width, S keys, K KV heads, D head dim, V vocabulary, C centroids.
What the target hands over and which keys a step sees are the round protocol's business (``refimpl.mtp``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import memory
from .config import FULL, SLIDING, TextConfig, parse_config
from .config_fields import check_positive, get_field, read_config_json
from .errors import ConfigError, InputError, WeightsError
from .gguf_config import ASSISTANT_ARCH, hf_assistant_config
from .gguf_io import GGUFError, is_gguf, open_gguf
from .model import LayerKV, rope_inv_freq
from .ops import linear, rope_cos_sin
from .schedule import apply_rope, attention, geglu, rms_norm
from .stores import open_store

ASSISTANT_ARCHITECTURES = {"gemma4_assistant": "Gemma4AssistantForCausalLM",
                           "gemma4_unified_assistant": "Gemma4UnifiedAssistantForCausalLM"}
TEXT_MODEL_TYPES = {"gemma4_assistant": "gemma4_text", "gemma4_unified_assistant": "gemma4_unified_text"}
BACKBONE_DEFAULT = {"gemma4_assistant": 1536, "gemma4_unified_assistant": 3840}


@dataclass(frozen=True)
class AssistantConfig:
    """A drafter's config.json, resolved. ``text`` holds the drafter's own geometry (its layers' KV sources
    are meaningless: every layer reads the target's K/V of its type)."""

    family: str  # "gemma4_assistant" | "gemma4_unified_assistant"
    text: TextConfig
    backbone_hidden_size: int  # H_t
    use_ordered_embeddings: bool  # the centroid-masked head (B5)
    num_centroids: int  # C
    centroid_intermediate_top_k: int  # clusters kept per step

    @property
    def vocab_per_centroid(self) -> int:
        return self.text.vocab_size // self.num_centroids


def assistant_family(raw) -> str | None:
    """"gemma4_assistant" / "gemma4_unified_assistant" for a drafter's config.json (by model type or
    architecture), else None."""
    if not isinstance(raw, dict):
        return None
    if raw.get("model_type") in ASSISTANT_ARCHITECTURES:
        return raw["model_type"]
    archs = raw.get("architectures")
    for family, arch in ASSISTANT_ARCHITECTURES.items():
        if isinstance(archs, list) and arch in archs:
            return family
    return None


def parse_assistant_config(raw: dict, where: str = "config.json") -> AssistantConfig:
    """An ``AssistantConfig`` from a parsed drafter config.json; ConfigError naming the field otherwise."""
    family = assistant_family(raw)
    if family is None:
        raise ConfigError(f"{where}: not a Gemma 4 assistant config (model_type "
                          f"{', '.join(ASSISTANT_ARCHITECTURES)}, or their architectures)")
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: an assistant config needs a 'text_config' object (the drafter's geometry)")
    at = f"{where} text_config"
    L = get_field(text, "num_hidden_layers", int, where=at)
    shared = text.get("num_kv_shared_layers") or L  # transformers: 0 / null means "every layer"
    if shared != L:
        raise ConfigError(f"{at}: 'num_kv_shared_layers' is {shared}; every layer of an assistant is KV-shared "
                          f"(set it to num_hidden_layers = {L}, or 0)")
    for key, bad in (("hidden_size_per_layer_input", lambda v: v != 0),
                     ("vocab_size_per_layer_input", lambda v: v != 0),
                     ("enable_moe_block", bool), ("use_double_wide_mlp", bool)):
        if key in text and text[key] is not None and bad(text[key]):
            raise ConfigError(f"{at}: '{key}' is {text[key]!r}; an assistant has no per-layer inputs, MoE or "
                              "double-wide MLP (transformers refuses it too)")
    if "hidden_size_per_layer_input" not in text:
        raise ConfigError(f"{at}: 'hidden_size_per_layer_input' is missing; an assistant sets it to 0 (the "
                          "Gemma 4 text default is 256)")
    # the geometry of a text model whose layers own their K/V (the projections are simply absent)
    geometry = dict(text, num_kv_shared_layers=0, model_type=TEXT_MODEL_TYPES[family])
    cfg = parse_config(geometry, at)
    types = set(cfg.layer_types)
    if types != {SLIDING, FULL}:
        raise ConfigError(f"{at}: an assistant needs both sliding and full layers (transformers hands over the "
                          f"K/V of one target layer of each type), got only {sorted(types)}")
    backbone = check_positive(get_field(raw, "backbone_hidden_size", int, BACKBONE_DEFAULT[family], where),
                              "backbone_hidden_size", where)
    ordered = get_field(raw, "use_ordered_embeddings", bool, False, where)
    C = check_positive(get_field(raw, "num_centroids", int, 2048, where), "num_centroids", where)
    top_k = check_positive(get_field(raw, "centroid_intermediate_top_k", int, 32, where),
                           "centroid_intermediate_top_k", where)
    if ordered:
        if cfg.vocab_size % C:
            raise ConfigError(f"{where}: 'num_centroids' ({C}) must divide the vocabulary ({cfg.vocab_size}): "
                              "every cluster holds vocab_size / num_centroids tokens")
        if top_k > C:
            raise ConfigError(f"{where}: 'centroid_intermediate_top_k' ({top_k}) exceeds 'num_centroids' ({C})")
    return AssistantConfig(family, cfg, backbone, ordered, C, top_k)


def load_assistant_config(model_dir: str | Path) -> AssistantConfig:
    """A drafter's config: its directory's config.json, or the metadata of its GGUF (gguf_config.py)."""
    if is_gguf(model_dir):
        return parse_assistant_config(hf_assistant_config(open_gguf(model_dir)), f"{model_dir} (GGUF metadata)")
    path, raw = read_config_json(model_dir)
    return parse_assistant_config(raw, str(path))


def is_assistant(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a drafter checkpoint (by its config.json, or a GGUF's architecture; False when
    it has neither)."""
    if is_gguf(model_dir):
        try:
            return open_gguf(model_dir).metadata.get("general.architecture") == ASSISTANT_ARCH
        except GGUFError:
            return False
    path = Path(model_dir) / "config.json"
    try:
        return assistant_family(json.loads(path.read_text(encoding="utf-8"))) is not None
    except (OSError, ValueError):
        return False


def expected_assistant_tensors(acfg: AssistantConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a drafter checkpoint (full names) and its shape (spec B3)."""
    cfg = acfg.text
    H, Ht, V, N = cfg.hidden_size, acfg.backbone_hidden_size, cfg.vocab_size, cfg.num_attention_heads
    t: dict[str, tuple[int, ...]] = {
        "pre_projection.weight": (H, 2 * Ht), "post_projection.weight": (Ht, H),
        "model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
    }
    for layer in cfg.layers:
        p, D, I = f"model.layers.{layer.index}.", layer.head_dim, layer.ffn_width  # noqa: E741 - I: the intermediate size (spec)
        t.update({p + "input_layernorm.weight": (H,), p + "self_attn.q_proj.weight": (N * D, H),
                  p + "self_attn.q_norm.weight": (D,), p + "self_attn.o_proj.weight": (H, N * D),
                  p + "post_attention_layernorm.weight": (H,), p + "pre_feedforward_layernorm.weight": (H,),
                  p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                  p + "mlp.down_proj.weight": (H, I), p + "post_feedforward_layernorm.weight": (H,),
                  p + "layer_scalar": (1,)})
    if acfg.use_ordered_embeddings:
        t["masked_embedding.centroids.weight"] = (acfg.num_centroids, H)
        t["masked_embedding.token_ordering"] = (V,)
    return t


# ----------------------------------------------------------------------------------------------
# the steps


def centroid_head(z: np.ndarray, centroids: np.ndarray, ordering: np.ndarray, table_rows, top_k: int,
                  vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The centroid-masked head (B5) of z [R, H_a] -> (logits [R, V], selected canonical ids [R, top_k V/C]).

    Cluster scores z C^T; the top_k clusters (descending score, ties to the lower cluster); their tokens
    ``ordering.reshape(C, V/C)[top]`` are canonical ids, scored against the canonical table
    (``table_rows(ids)`` -> [n, H_a]); every other entry is min(selected logits of the row) - 1. transformers
    takes that minimum over the whole batch; a drafter step has one row, where both agree."""
    C = centroids.shape[0]
    scores = linear(z, centroids)  # [R, C]
    top = np.argsort(-scores, axis=-1, kind="stable")[:, :top_k]  # [R, top_k]
    selected = ordering.reshape(C, -1)[top].reshape(z.shape[0], -1)  # [R, top_k * V/C]
    logits = np.empty((z.shape[0], vocab_size), dtype=z.dtype)
    for r in range(z.shape[0]):
        s = linear(z[r:r + 1], table_rows(selected[r]))[0]  # [n]
        logits[r] = s.min() - 1.0
        logits[r, selected[r]] = s
    return logits, selected


@dataclass
class DraftStep:
    """One drafter step's outputs."""

    logits: np.ndarray  # [V]
    h_next: np.ndarray  # [H_t], post_projection of the final-normed state
    z_hat: np.ndarray  # [H_a], the final-normed state (the head's input)
    selected: np.ndarray | None  # centroid head: the canonical ids scored [top_k V/C]; None for the dense head


class Drafter:
    """An exact Gemma 4 assistant over a Hugging Face checkpoint directory or its GGUF (float64 by default).

    ``step(e, h, position, kv)``: e [H_t] the target's scaled embedding of the step's token, h [H_t] the
    hidden vector, ``position`` the query position, ``kv`` the target K/V each layer type attends to
    (``LayerKV`` per SLIDING / FULL: every key given is attended to; choosing them is the round
    protocol's job)."""

    def __init__(self, model_dir: str | Path, dtype: str | np.dtype = "float64"):
        self.model_dir = Path(model_dir)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float64, np.float32):
            raise InputError(f"dtype must be float64 or float32, got {self.dtype}")
        self.acfg = load_assistant_config(model_dir)
        self.cfg = self.acfg.text
        memory.for_the_oracle()  # the allocator reuses freed arrays (memory.py); once per process
        self.store = open_store(model_dir)
        self._validate()
        self._inv_freq = {(layer.layer_type, layer.head_dim): rope_inv_freq(layer.rope, layer.head_dim)
                          for layer in self.cfg.layers}
        self._w: dict[str, np.ndarray] = {}

    def _validate(self) -> None:
        expected = expected_assistant_tensors(self.acfg)
        problems = []
        for name, shape in expected.items():
            info = self.store.infos.get(name)
            if info is None:
                problems.append(f"missing tensor '{name}' (expected shape {list(shape)})")
            elif info.shape != shape:
                problems.append(f"tensor '{name}' has shape {list(info.shape)}, expected {list(shape)}")
            elif name != "masked_embedding.token_ordering" and (problem := self.store.undecodable(name)):
                problems.append(problem)
        tied = {"lm_head.weight"}  # tied to model.embed_tokens.weight; ignored when present
        problems += [f"unexpected tensor '{n}'" for n in self.store.names if n not in expected and n not in tied]
        if problems:
            shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
            raise WeightsError(f"{self.model_dir}: the assistant's weights do not match {self.store.source}:\n  "
                               + "\n  ".join(shown))
        if self.acfg.use_ordered_embeddings:
            order = np.asarray(self.store.raw("masked_embedding.token_ordering")).astype(np.int64)
            if not np.array_equal(np.sort(order), np.arange(self.cfg.vocab_size)):
                raise WeightsError(f"{self.model_dir}: 'masked_embedding.token_ordering' is not a permutation of "
                                   f"the {self.cfg.vocab_size} token ids")
            self.ordering = order

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._w:
            self._w[name] = self.store.get(name, self.dtype)
        return self._w[name]

    # -- what it reads of the target ----------------------------------------------------------

    def store_layers(self, target_cfg: TextConfig) -> dict[str, int]:
        """The target layer whose K/V each drafter layer type reads: the last KV-owning layer of that type
        (spec B6, the transformers and vLLM rule); InputError when the geometries do not fit."""
        owners = {layer.layer_type: layer for layer in target_cfg.layers if layer.owns_kv}
        if target_cfg.hidden_size != self.acfg.backbone_hidden_size:
            raise InputError(f"{self.model_dir}: the assistant's backbone_hidden_size is "
                             f"{self.acfg.backbone_hidden_size}, the target's hidden_size {target_cfg.hidden_size}")
        if target_cfg.vocab_size != self.cfg.vocab_size:
            raise InputError(f"{self.model_dir}: the assistant's vocabulary ({self.cfg.vocab_size}) is not the "
                             f"target's ({target_cfg.vocab_size})")
        out = {}
        for layer in self.cfg.layers:
            src = owners.get(layer.layer_type)
            if src is None:
                raise InputError(f"{self.model_dir}: drafter layer {layer.index} is '{layer.layer_type}', but "
                                 "the target has no KV-owning layer of that type")
            if (src.head_dim, src.num_kv_heads) != (layer.head_dim, layer.num_kv_heads):
                raise InputError(f"{self.model_dir}: drafter layer {layer.index} (head_dim {layer.head_dim}, "
                                 f"{layer.num_kv_heads} KV heads) reads target layer {src.index} (head_dim "
                                 f"{src.head_dim}, {src.num_kv_heads} KV heads); their geometry must match")
            out[layer.layer_type] = src.index
        return out

    # -- one step -------------------------------------------------------------------------------

    def layer(self, i: int, z: np.ndarray, position: int, kv: LayerKV) -> np.ndarray:
        """One q-only layer on z [1, H_a]: the target's K/V (already normed and rotated) are used as stored."""
        cfg, layer = self.cfg, self.cfg.layers[i]
        p, N, D, eps = f"model.layers.{i}.", cfg.num_attention_heads, layer.head_dim, cfg.rms_norm_eps
        cos, sin = (a.astype(self.dtype) for a in rope_cos_sin(np.array([position]),
                                                               self._inv_freq[(layer.layer_type, D)]))
        a = rms_norm(z, self[p + "input_layernorm.weight"], eps)
        q = linear(a, self[p + "self_attn.q_proj.weight"]).reshape(1, N, D)
        q = apply_rope(rms_norm(q, self[p + "self_attn.q_norm.weight"], eps), cos, sin)
        mask = np.ones((1, kv.k.shape[0]), dtype=bool)  # every handed-over key
        o = linear(attention(q, kv.k, kv.v, mask).reshape(1, N * D), self[p + "self_attn.o_proj.weight"])
        z = z + rms_norm(o, self[p + "post_attention_layernorm.weight"], eps)
        u = rms_norm(z, self[p + "pre_feedforward_layernorm.weight"], eps)
        m = linear(geglu(linear(u, self[p + "mlp.gate_proj.weight"]), linear(u, self[p + "mlp.up_proj.weight"])),
                   self[p + "mlp.down_proj.weight"])
        z = z + rms_norm(m, self[p + "post_feedforward_layernorm.weight"], eps)
        return z * self[p + "layer_scalar"][0]

    def head(self, z_hat: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Logits [R, V] of final-normed states [R, H_a] (and the centroid head's selected ids)."""
        if not self.acfg.use_ordered_embeddings:
            return linear(z_hat, self["model.embed_tokens.weight"]), None
        return centroid_head(z_hat, self["masked_embedding.centroids.weight"], self.ordering,
                             lambda ids: self.store.rows("model.embed_tokens.weight", ids, self.dtype),
                             self.acfg.centroid_intermediate_top_k, self.cfg.vocab_size)

    def step(self, e: np.ndarray, h: np.ndarray, position: int, kv: dict[str, LayerKV]) -> DraftStep:
        """One draft step (spec B4). e, h [H_t] -> logits [V], h_next [H_t]."""
        x = np.concatenate([np.asarray(e, self.dtype), np.asarray(h, self.dtype)])[None]  # [1, 2 H_t]
        z = linear(x, self["pre_projection.weight"])  # [1, H_a], not scaled
        for layer in self.cfg.layers:
            z = self.layer(layer.index, z, position, kv[layer.layer_type])
        z_hat = rms_norm(z, self["model.norm.weight"], self.cfg.rms_norm_eps)
        logits, selected = self.head(z_hat)
        h_next = linear(z_hat, self["post_projection.weight"])
        return DraftStep(logits[0], h_next[0], z_hat[0], None if selected is None else selected[0])

