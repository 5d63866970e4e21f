"""The Gemma 4 text decoder, one small pure function per math step (gemma4-text-spec.md section 4),
written over ``refimpl.ops`` (every primitive's plain definition) run as ``refimpl.schedule`` schedules them
(blocks of rows over the threads); the primitives stay importable from here too.

Where each Gemma 4 feature lives (here unless a file is named):

=================================================  ==========================================================
embedding x0 = E[ids] * sqrt(H) (exact or bf16)     ``Gemma4.embed``
per-layer inputs (PLE): table rows + projection     ``per_layer_inputs``, ``Gemma4.ple``; added per layer by
                                                    ``Gemma4.ple_block``
pre-norms, q/k norms, scale-free v norm             ``Gemma4.attention_block`` (``rms_norm``, ``norm_rope``)
RoPE: default and proportional (partial) per type   ``positions.py`` (``rope_inv_freq``, ``CallTables``);
                                                    ``ops.apply_rope``
sliding and full layers, the window                 ``Gemma4.attention_block``; ``ops.attention_mask``,
                                                    ``CallTables.mask``
KV sharing (layers >= first_shared_layer)           ``Gemma4.attention_block`` (``owns_kv``, ``kv_source``);
                                                    ``config.py`` (``first_shared_layer``)
K = V layers, double-wide MLPs, layer types         ``config.py`` (``LayerSpec``); ``Gemma4.attention_block``
attention (scale 1, GQA, no softcap)                ``ops.attention``; its blocks: ``schedule.attention``
image blocks in the mask (two rules)                ``VISION_MASK_RULES``; ``ops.vision_block_mask``,
                                                    ``ops.vision_overlay_mask``
GeGLU MLP; MoE router and experts (26B-A4B)         ``Gemma4.ffn_block``; ``route``, ``router_margin``,
                                                    ``experts``
layer_scalar, the residual adds                     ``Gemma4.layer``
row pruning before the KV-shared layers             ``Gemma4.hidden_states`` (``keep``)
KV cache (sliding layers keep W - 1 keys)           ``kv_cache.py``; ``Gemma4.hidden_states``
final norm, tied streamed LM head, final softcap    ``Gemma4.final_norm``, ``Gemma4.logits_of`` (``HEAD_CHUNK``)
traces of the named points                          ``Trace``; ``Gemma4.layer``
quantised weights, ggml's activation conventions    ``weights.py``, ``ggml_act.py``; ``Gemma4.__init__``
vision and audio towers, Unified's embedders        ``vision.py``, ``audio.py``, ``unified.py``
MTP drafters and the round protocol                 ``assistant.py``, ``mtp.py``
the device: NumPy, or CuPy on a GPU                 ``arrays.py``; ``Gemma4.__init__`` (``xp``)
=================================================  ==========================================================

Shapes: T new tokens, S keys (cached + new), H hidden, N query heads, K KV heads, G = N / K,
D head dim, P per-layer-input dim, L layers, V vocabulary, E experts.

``Gemma4.forward`` runs every layer over the new tokens (vectorised over tokens and heads; from the
last layer that makes K/V on, past its keys and values, over the requested rows only), keeps an
explicit KV cache, and projects only the requested rows through the LM head, streaming over the
vocabulary so the full ``[T, V]`` logits exist only when all rows are asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .arrays import array_module, memory_errors, resolve_device, take_rows, to_host
from .config import TextConfig, load_config
from .errors import InputError, NonFiniteError, check_choice
from .ggml_act import convention_gelu, convention_kv
from .kv_cache import KVCache, LayerKV
from .ops import attention_mask as attention_mask  # re-exported
from .ops import bf16_round, fp16, geglu_table, linear, vision_block_mask, vision_overlay_mask
from .ops import rope_cos_sin as rope_cos_sin  # re-exported
from .positions import CallTables
from .positions import rope_inv_freq as rope_inv_freq  # re-exported: refimpl.model.rope_inv_freq stays importable
from .schedule import apply_rope as apply_rope  # re-exported: refimpl.model.apply_rope stays importable
from .schedule import attention, geglu, norm_rope, rms_norm, softcap, softmax
from .schedule import gelu_tanh as gelu_tanh  # re-exported
from .schedule import mlp as mlp  # re-exported
from .threads import all_finite
from .weights import FEW_ROWS, Gemma4Weights, expected_tensors, nonfinite_error, weight_cache_bytes

# how vision blocks open the decoder mask (Unified spec A9). "sliding-clamped" (rule B, the default): on
# sliding layers only, inside the window; transformers' static-cache path, Gemma4Model, google/gemma,
# llama.cpp, vLLM. "all-unclamped" (rule A): on every layer, after the window; transformers 5.24's default
# Gemma4UnifiedModel.forward, mlx-vlm, mlxcel.
VISION_MASK_RULES = ("sliding-clamped", "all-unclamped")
KV_CACHES = ("exact", "f16")  # how the oracle keeps K and V (Gemma4 kv_cache)
# vocabulary rows decoded per step of the streamed LM head (100 MB of float64 at H 1536), into the buffer the
# projections are decoded into (Gemma4Weights.product), which the largest projection has made larger at every
# published dense shape; 2 048 before: on 16 cores an all-rows forward of the 10-layer E2B cut took 10% longer
HEAD_CHUNK = 8_192
# ... when at most FEW_ROWS rows ask (a last-row prefill, a decode step): the head is then streamed a block
# at a time by every thread (Gemma4Weights.product) and no decoded chunk is kept, so a step can be long
FEW_ROWS_HEAD_CHUNK = 32_768


# ----------------------------------------------------------------------------------------------
# the text decoder's own steps (the generic primitives are in ops.py)


def route(r: np.ndarray, scale: np.ndarray, proj: np.ndarray, per_expert_scale: np.ndarray,
          top_k: int, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Router on the un-normalised residual r [T, H].

    z = rms(r) * scale * H^-1/2; probs = softmax(z proj^T) over all E experts; take the top-k,
    renormalise them to sum 1, then multiply by per_expert_scale. Ties go to the lower expert index.
    Returns (expert index [T, k], weight [T, k], probs [T, E]).
    """
    z = rms_norm(r, None, eps) * scale * r.shape[-1] ** -0.5
    probs = softmax(linear(z, proj))  # [T, E]
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # [T, k]
    top = np.take_along_axis(probs, idx, axis=-1)
    weight = top / np.sum(top, axis=-1, keepdims=True) * per_expert_scale[idx]
    return idx, weight, probs


def router_margin(probs: np.ndarray, top_k: int) -> np.ndarray:
    """[T]: probability gap between the k-th chosen and the best unchosen expert (inf if all chosen)."""
    if top_k >= probs.shape[-1]:
        return np.full(probs.shape[0], np.inf)
    ordered = -np.sort(-probs, axis=-1)
    return ordered[:, top_k - 1] - ordered[:, top_k]


def experts(u: np.ndarray, idx: np.ndarray, weight: np.ndarray, expert_weights, as_seen=None,
            glu=None) -> np.ndarray:
    """Weighted sum of the chosen experts' GeGLU outputs. u [T, H]; idx, weight [T, k] -> [T, H].

    ``expert_weights(e)`` returns (gate_up [2 Im, H] with gate rows first, down [H, Im]).
    Loops over experts (not tokens): each expert runs once on the tokens routed to it. ``as_seen(x, which)``
    (which: "gate_up" or "down"): the activations as that product takes them (an activation convention);
    ``glu``: the gated activation (default ``geglu``).
    """
    seen = as_seen if as_seen is not None else (lambda x, _which: x)
    glu = glu if glu is not None else geglu
    out = np.zeros_like(u)
    for e in np.unique(idx):
        tok, slot = np.nonzero(idx == e)  # a token picks an expert at most once
        gate_up, down = expert_weights(int(e))
        gu = linear(seen(u[tok], "gate_up"), gate_up)  # [n, 2 Im]
        half = gu.shape[-1] // 2
        y = linear(seen(glu(gu[:, :half], gu[:, half:]), "down"), down)  # [n, H]
        out[tok] += weight[tok, slot][:, None] * y
    return out


def per_layer_inputs(x0: np.ndarray, tok_rows: np.ndarray, proj: np.ndarray, norm_w: np.ndarray,
                     L: int, P: int, eps: float) -> np.ndarray:
    """PLE [T, L, P] = (RMSNorm_P(x0 proj^T * H^-1/2) + table[ids] * sqrt(P)) / sqrt(2).

    x0 [T, H] is the sqrt(H)-scaled embedding; tok_rows [T, L*P] the gathered PLE table rows.
    """
    T, H = x0.shape
    ctx = rms_norm((linear(x0, proj) * H**-0.5).reshape(T, L, P), norm_w, eps)
    tok = tok_rows.reshape(T, L, P) * math.sqrt(P)
    return (ctx + tok) * 2**-0.5


# ----------------------------------------------------------------------------------------------
# the model


@dataclass
class Trace:
    """Named intermediates, filled by ``forward`` when passed in. Arrays are [T, H] unless noted."""

    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def put(self, name: str, value: np.ndarray) -> None:
        self.tensors[name] = np.array(to_host(value), copy=True)


class Gemma4:
    """Exact Gemma 4 text decoder over a Hugging Face checkpoint directory."""

    def __init__(self, model_dir: str | Path, dtype: str | np.dtype = "float64", embed_scale: str = "exact",
                 weight_cache: int | str | None = None, vision_mask: str = "sliding-clamped",
                 activations: str = "none", kv_cache: str = "exact", device: str | None = None):
        """``kv_cache``: "exact" (float64 keys and values), or "f16" (llama.cpp's default cache type as ggml's
        CPU path computes with it: K and V stored rounded to fp16, the queries and the attention probabilities
        rounded to fp16 for their products). ``activations``: the activation convention of the products
        (refimpl.ggml_act.CONVENTIONS; "none", or "ggml-cpu/x86" / "ggml-cpu/ref" / "ggml-cpu/arm" on a GGUF
        checkpoint: ggml's CPU activation quantisation emulated, docs/quantised.md; with "/f16-kv", the "f16" cache
        too).
        ``vision_mask``: how vision blocks open the mask (VISION_MASK_RULES). ``weight_cache``: bytes of
        decoded weights kept between forwards (an int, "12GiB", "all"; None: the REFIMPL_WEIGHT_CACHE
        environment variable, else 0). 0 streams every weight from the checkpoint on every forward (the least
        memory); a cache makes repeated forwards (decode steps, many prompts) skip the decoding of the weights
        it holds (docs/refimpl.md, "Weight cache"). ``device``: "cpu" (NumPy) or "cuda" (CuPy: the weights, the
        activations and the KV cache on the GPU, the same float64 formulas; refimpl/arrays.py); None: the
        REFIMPL_DEVICE environment variable, else cpu; a ggml activation convention (which emulates CPU kernels)
        runs on the cpu unless cuda is asked for by name, which is refused. ``forward`` and
        ``forward_rows`` return NumPy arrays either way; the steps below them keep the device's arrays."""
        dtype = np.dtype(dtype)
        if dtype not in (np.float64, np.float32):
            raise InputError(f"dtype must be float64 or float32, got {dtype}")
        if embed_scale not in ("exact", "bf16"):
            raise InputError(f"embed_scale must be 'exact' or 'bf16', got {embed_scale!r}")
        self.vision_mask = check_choice("vision_mask", vision_mask, VISION_MASK_RULES)
        self.model_dir = Path(model_dir)
        self.cfg: TextConfig = load_config(model_dir)
        self.device = resolve_device(device if device is not None or activations == "none" else "cpu")
        if self.device != "cpu" and activations != "none":
            raise InputError(f"activations {activations}: ggml's CPU activation convention runs on device cpu only")
        self.xp = array_module(self.device)  # numpy or cupy: the arrays the forward makes live there
        self.weights = Gemma4Weights(model_dir, self.cfg, dtype, weight_cache_bytes(weight_cache), activations,
                                     self.xp)
        self.activations = activations
        check_choice("kv_cache", kv_cache, KV_CACHES)
        self.kv_cache = "f16" if convention_kv(activations) == "f16" else kv_cache  # a /f16-kv convention
        self.geglu = geglu_table if convention_gelu(activations) == "table" else geglu  # a /gelu-table one
        self.dtype = dtype
        root = math.sqrt(self.cfg.hidden_size)
        self.embed_scale = root if embed_scale == "exact" else bf16_round(root)
        self.tables = CallTables(self.cfg, dtype, self.xp)  # RoPE angles and masks, once per call

    # -- inputs -------------------------------------------------------------------------------

    def check_ids(self, ids: Iterable[int]) -> np.ndarray:
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise InputError("token ids must be a non-empty 1-D list of integers")
        bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
        if bad.size:
            raise InputError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.cfg.vocab_size})")
        return ids.astype(np.int64)

    def check_vision_blocks(self, blocks, T: int) -> np.ndarray | None:
        if blocks is None:
            return None
        if self.cfg.use_bidirectional_attention != "vision":
            raise InputError(
                f"vision_blocks given, but this checkpoint's use_bidirectional_attention is "
                f"{self.cfg.use_bidirectional_attention!r}: its image tokens are causal in every layer (only "
                "'vision' checkpoints open vision blocks)"
            )
        b = np.asarray(blocks)
        if b.shape != (T,) or not np.issubdtype(b.dtype, np.integer) or (b < -1).any():
            raise InputError(f"vision_blocks must be {T} integers (block id >= 0, or -1 outside a block), "
                             f"got {b.dtype} {list(b.shape)}")
        return b.astype(np.int64)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """x0 [T, H] = E[ids] * sqrt(H) (exact, or bf16-rounded on request); rows read from the memory map."""
        return self.weights.rows("embed_tokens.weight", ids) * self.dtype.type(self.embed_scale)

    def ple(self, x0: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Per-layer inputs [T, L, P]; ids outside the PLE table use row 0 (the pad row), as HF and JAX do."""
        cfg, w = self.cfg, self.weights
        ple_ids = np.where((ids >= 0) & (ids < cfg.vocab_size_per_layer_input), ids, 0)
        x0 = w.activations_for(x0, w.prefix + "per_layer_model_projection.weight")  # as its product sees it
        return per_layer_inputs(
            x0, w.rows("embed_tokens_per_layer.weight", ple_ids), w["per_layer_model_projection.weight"],
            w["per_layer_projection_norm.weight"], cfg.num_hidden_layers, cfg.hidden_size_per_layer_input,
            cfg.rms_norm_eps,
        )

    # -- finiteness ---------------------------------------------------------------------------
    # The input rows, the per-layer inputs, the residual stream after every layer, the final norm and each
    # head chunk before the softcap are checked (np.isfinite over [T, H] / [R, chunk]: cheap next to the
    # products). Only once something is not finite are the weights of that step read, to name the tensor.

    def _refuse_nonfinite(self, what: str, suspects: list[tuple[str, int | None]]) -> None:
        """NonFiniteError (``nonfinite_error``) for ``what`` ("the logits are") not finite; ``suspects``:
        (tensor name without the prefix or full name, a row of it or None for all of it)."""
        w = self.weights
        raise nonfinite_error(w.store, what, [(name if name in w.store else w.prefix + name, row)
                                              for name, row in suspects], self.dtype)

    def _check_inputs_finite(self, x: np.ndarray, ids: np.ndarray, given: bool) -> None:
        """The input rows [T, H]: a non-finite text row names its embedding row; one of given embeddings
        that is finite in the table is a soft token (or the caller's own row)."""
        if np.isfinite(x).all():
            return
        r = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0])
        token = int(ids[r])
        if not given or self.weights.store.nonfinite(self.weights.prefix + "embed_tokens.weight", token):
            self._refuse_nonfinite(f"the embedding of token {token} (row {r}) is", [("embed_tokens.weight", token)])
        raise NonFiniteError(f"{self.model_dir}: the input embeddings are not finite at row {r}, a row given in place "
                             "of the token's embedding (an image or audio soft token: check that tower's weights)")

    def _check_ple_finite(self, ple: np.ndarray, ids: np.ndarray) -> None:
        if np.isfinite(ple).all():
            return
        r = int(np.flatnonzero(~np.isfinite(ple.reshape(ple.shape[0], -1)).all(axis=1))[0])
        row = int(ids[r]) if 0 <= ids[r] < self.cfg.vocab_size_per_layer_input else 0  # as ``ple`` reads it
        self._refuse_nonfinite(f"the per-layer inputs of token {int(ids[r])} (row {r}) are", [
            ("embed_tokens_per_layer.weight", row), ("per_layer_model_projection.weight", None),
            ("per_layer_projection_norm.weight", None)])

    def _check_layer_finite(self, i: int, x: np.ndarray, pending: list | None = None) -> None:
        """The residual stream after layer i. On the device (``pending``, a list) the check's answer stays there
        and ``_check_layers`` reads them all once the last layer is queued: one wait for the GPU a forward, not
        one a layer, and the first layer that is not finite still named."""
        if pending is not None:
            pending.append(np.isfinite(x).all())
        elif not all_finite(x):
            self._refuse_layer(i)

    def _check_layers(self, pending: list) -> None:
        """The answers ``_check_layer_finite`` left on the device, read at once: the first layer not finite."""
        bad = np.flatnonzero(~to_host(self.xp.stack(pending)))
        if bad.size:
            self._refuse_layer(int(bad[0]))

    def _refuse_layer(self, i: int) -> None:
        p = f"layers.{i}."
        self._refuse_nonfinite(f"the residual stream after layer {i} is",
                               [(name, None) for name in expected_tensors(self.cfg) if name.startswith(p)])

    # -- one layer ----------------------------------------------------------------------------

    def attention_block(self, i: int, x: np.ndarray, positions: np.ndarray, cache: KVCache,
                        call_kv: dict[int, LayerKV], blocks: np.ndarray | None = None,
                        keep: np.ndarray | None = None) -> np.ndarray:
        """Pre-norm attention with q/k/v norms and RoPE; returns the post-attention-normed output [T, H]
        ([R, H] with ``keep`` [R]: the keys and values of every row, the queries of rows ``keep`` only).

        ``blocks`` [T] (vision block id of each new token, -1 outside) opens same-block keys: on sliding
        layers inside the window (``vision_block_mask``, full layers causal) by default, on every layer
        after the window (``vision_overlay_mask``) under the "all-unclamped" rule."""
        cfg, layer, w = self.cfg, self.cfg.layers[i], self.weights
        p = f"layers.{i}."
        T, N, D, eps = x.shape[0], cfg.num_attention_heads, layer.head_dim, cfg.rms_norm_eps
        cos, sin = self.tables.rope(layer.layer_type, D, positions)
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)

        q_rows = slice(None) if keep is None else keep  # the rows that ask (the positions of their queries)
        q_pos, q_blocks = positions[q_rows], None if blocks is None else blocks[q_rows]
        hq, cq, sq = (h, cos, sin) if keep is None else (take_rows(h, keep), take_rows(cos, keep), take_rows(sin, keep))
        q = w.linear(hq, p + "self_attn.q_proj.weight").reshape(len(hq), N, D)
        q = norm_rope(q, cq, sq, w[p + "self_attn.q_norm.weight"], eps)  # q_norm, then RoPE

        if layer.owns_kv:
            K = layer.num_kv_heads
            kr = w.linear(h, p + "self_attn.k_proj.weight").reshape(T, K, D)
            vr = kr if layer.k_eq_v else w.linear(h, p + "self_attn.v_proj.weight").reshape(T, K, D)
            k = norm_rope(kr, cos, sin, w[p + "self_attn.k_norm.weight"], eps)  # k_norm, then RoPE
            v = rms_norm(vr, None, eps)  # v_norm: scale-free
            if self.kv_cache == "f16":  # stored in the cache as fp16
                k, v = fp16(k), fp16(v)
            past = cache.layers.get(i)
            if past is not None:
                k, v = np.concatenate([past.k, k]), np.concatenate([past.v, v])
                positions_all = np.concatenate([past.pos, positions])
            else:
                positions_all = positions
            # keys from the cache belong to earlier calls, never to a block of this one
            k_blocks = None if blocks is None else np.concatenate([np.full(len(positions_all) - T, -1), blocks])
            kv = call_kv[i] = LayerKV(k, v, positions_all, k_blocks)
        else:
            kv = call_kv[layer.kv_source]  # post-norm, post-RoPE K/V of the source layer

        window = cfg.sliding_window if layer.is_sliding else None
        if blocks is not None and self.vision_mask == "all-unclamped":  # (made on the host, used on the device)
            mask = self.xp.asarray(vision_overlay_mask(q_pos, kv.pos, window, q_blocks, kv.blocks))
        elif blocks is not None and layer.is_sliding:
            mask = self.xp.asarray(vision_block_mask(q_pos, kv.pos, cfg.sliding_window, q_blocks, kv.blocks))
        else:
            mask = self.tables.mask(q_pos, kv.pos, window)  # (on the device, made once per call)
        a = (attention(q, kv.k, kv.v, mask, half=True) if self.kv_cache == "f16"
             else attention(q, kv.k, kv.v, mask)).reshape(len(q), N * D)
        o = w.linear(a, p + "self_attn.o_proj.weight")
        return rms_norm(o, w[p + "post_attention_layernorm.weight"], eps)

    def ffn_block(self, i: int, r: np.ndarray, trace: Trace | None) -> np.ndarray:
        """Dense GeGLU, or MoE with its dense branch in parallel; returns the post-FFN-normed output [T, H]."""
        cfg, w, eps = self.cfg, self.weights, self.cfg.rms_norm_eps
        p = f"layers.{i}."
        u = rms_norm(r, w[p + "pre_feedforward_layernorm.weight"], eps)
        # GeGLU (``mlp``), each projection through ``w.linear`` (decoded from the checkpoint as it runs)
        m = w.linear(self.geglu(w.linear(u, p + "mlp.gate_proj.weight"), w.linear(u, p + "mlp.up_proj.weight")),
                     p + "mlp.down_proj.weight")
        if cfg.enable_moe_block:
            m1 = rms_norm(m, w[p + "post_feedforward_layernorm_1.weight"], eps)
            idx, weight, probs = route(r, w[p + "router.scale"], w[p + "router.proj.weight"],
                                       w[p + "router.per_expert_scale"], cfg.top_k_experts, eps)
            u2 = rms_norm(r, w[p + "pre_feedforward_layernorm_2.weight"], eps)

            def expert_weights(e: int) -> tuple[np.ndarray, np.ndarray]:
                return w.rows(p + "experts.gate_up_proj", e), w.rows(p + "experts.down_proj", e)

            def as_seen(x: np.ndarray, which: str) -> np.ndarray:  # under ggml's convention: its activations
                return w.activations_for(x, w.prefix + p + f"experts.{which}_proj")

            routed = experts(u2, idx, weight, expert_weights, as_seen if w.activation_path is not None else None,
                             self.geglu if self.geglu is not geglu else None)
            m2 = rms_norm(routed, w[p + "post_feedforward_layernorm_2.weight"], eps)
            if trace is not None:
                trace.put(p + "router.experts", idx)
                trace.put(p + "router.margin", router_margin(probs, cfg.top_k_experts))
            m = m1 + m2
        return rms_norm(m, w[p + "post_feedforward_layernorm.weight"], eps)

    def ple_block(self, i: int, x: np.ndarray, ple_i: np.ndarray) -> np.ndarray:
        """gelu(x gate^T) * ple_l -> proj -> norm; returns the term added to the residual [T, H]."""
        w, p = self.weights, f"layers.{i}."
        g = self.geglu(w.linear(x, p + "per_layer_input_gate.weight"), ple_i)
        g = w.linear(g, p + "per_layer_projection.weight")
        return rms_norm(g, w[p + "post_per_layer_input_norm.weight"], self.cfg.rms_norm_eps)

    def layer(self, i: int, x: np.ndarray, ple_i: np.ndarray | None, positions: np.ndarray, cache: KVCache,
              call_kv: dict[int, LayerKV], trace: Trace | None, blocks: np.ndarray | None = None,
              keep: np.ndarray | None = None) -> np.ndarray:
        """One decoder layer: x [T, H] -> [T, H]; with ``keep`` [R], the K/V of every row and the rest of the
        layer for rows ``keep`` only: -> [R, H]."""
        p = f"layers.{i}."
        a = self.attention_block(i, x, positions, cache, call_kv, blocks, keep)
        if keep is not None:
            x, ple_i = take_rows(x, keep), None if ple_i is None else take_rows(ple_i, keep)
        r = x + a
        m = self.ffn_block(i, r, trace)
        x = r + m  # a new array: the two steps below work in place
        if ple_i is not None:
            g = self.ple_block(i, x, ple_i)
            x += g
        x *= self.weights[p + "layer_scalar"][0]
        if trace is not None:
            trace.put(p + "attn_out", a)
            trace.put(p + "ffn_out", m)
            if ple_i is not None:
                trace.put(p + "ple_add", g)
            trace.put(p + "residual", x)
        return x

    # -- whole model --------------------------------------------------------------------------

    @memory_errors
    def hidden_states(self, ids: Sequence[int] | np.ndarray, *, cache: KVCache | None = None,
                      embeddings: np.ndarray | None = None, vision_blocks: Sequence[int] | np.ndarray | None = None,
                      trace: Trace | None = None, keep: np.ndarray | None = None) -> np.ndarray:
        """Run every layer over the new tokens; returns the residual stream [T, H] before the final norm
        (only rows ``keep`` [R], an index array, when given).

        ``keep``: the KV-shared layers (from ``first_shared_layer`` on) produce no K/V, so a row there
        only feeds its own output: they run on the ``keep`` rows alone. So does the last layer with K/V
        of its own (every layer's K/V is read by later queries), once its keys and values are made from
        every token: its queries, attention output and FFN only feed the rows after it (the last layer,
        without KV sharing). The earlier layers run on every token. Each kept row is computed by the same
        formulas as in the full pass (equal to BLAS rounding). With a ``trace`` every row runs through
        every layer (the trace records them all) and the kept rows are returned.

        ``embeddings`` [T, H], when given, replaces E[ids] * sqrt(H) as the input (it must already be
        scaled); ``ids`` then only select the per-layer-embedding rows (use the pad id 0 for soft tokens).
        ``vision_blocks`` [T], only for ``use_bidirectional_attention == "vision"`` checkpoints: the
        vision block id of each new token (0, 1, ... per image, -1 outside); sliding layers then let
        tokens of one block see each other (``vision_block_mask``). A block must not be split across
        calls. ``cache`` is advanced in place; positions continue from ``cache.length``.
        """
        cfg = self.cfg
        ids = self.check_ids(ids)
        cache = cache if cache is not None else KVCache()
        T = ids.shape[0]
        blocks = self.check_vision_blocks(vision_blocks, T)
        if embeddings is None:
            x = self.embed(ids)
        else:
            x = self.xp.asarray(np.asarray(to_host(embeddings), dtype=self.dtype))
            if x.shape != (T, cfg.hidden_size):
                raise InputError(f"embeddings must have shape [{T}, {cfg.hidden_size}], got {list(x.shape)}")
        self._check_inputs_finite(x, ids, embeddings is not None)
        ple = self.ple(x, ids) if cfg.has_ple else None
        if ple is not None:
            self._check_ple_finite(ple, ids)
        positions = np.arange(cache.length, cache.length + T)
        if trace is not None:
            trace.put("embed", x)
            if ple is not None:
                trace.put("ple", ple)

        call_kv: dict[int, LayerKV] = {}
        prune = None if trace is not None else keep  # rows to prune to, [T] -> [R], after the last K/V
        pending = None if self.device == "cpu" else []  # (the device's layer checks, read after the last layer)
        for i in range(cfg.num_hidden_layers):
            ple_i = None if ple is None else ple[:, i, :]
            if prune is not None and i >= cfg.first_shared_layer - 1:  # the last layer that makes K/V
                x = self.layer(i, x, ple_i, positions, cache, call_kv, trace, blocks, keep=prune)
                positions, blocks = positions[prune], None if blocks is None else blocks[prune]
                ple, prune = None if ple is None else take_rows(ple, prune), None
            else:
                x = self.layer(i, x, ple_i, positions, cache, call_kv, trace, blocks)
            self._check_layer_finite(i, x, pending)
        if pending:
            self._check_layers(pending)
        if keep is not None and trace is not None:
            x = take_rows(x, keep)

        self.tables.clear()  # (a long prompt's angles and masks are not kept past the call)
        # keep what future tokens can attend to: sliding layers their last W - 1 keys, full layers all
        end = cache.length + T  # (positions may be pruned by now; the call still covered T tokens)
        for i, kv in call_kv.items():
            if cfg.layers[i].is_sliding and not cache.keep_all:
                recent = kv.pos > end - cfg.sliding_window
                kv = LayerKV(take_rows(kv.k, recent), take_rows(kv.v, recent), kv.pos[recent])
            cache.layers[i] = LayerKV(kv.k, kv.v, kv.pos)
        cache.length = end
        return x

    @memory_errors
    def final_norm(self, x: np.ndarray) -> np.ndarray:
        """The final norm: residual stream x [R, H] -> the LM head's input [R, H] (what an MTP drafter reads
        of the target, and the protocol's hidden-state rows)."""
        x = self.xp.asarray(x)  # (a caller's host rows, on a model on the GPU)
        y = rms_norm(x, self.weights["norm.weight"], self.cfg.rms_norm_eps)
        if not np.isfinite(y).all():
            self._refuse_nonfinite("the final norm's output is", [("norm.weight", None)])
        return y

    def head(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Final norm, tied LM head and softcap, streamed over the vocabulary: x [R, H] -> logits [R, V].
        Only HEAD_CHUNK rows of the head are decoded at a time; the [R, V] result is the only full-width array
        (``out``, when given: e.g. a memory-mapped file, written a block of columns at a time)."""
        return self.logits_of(self.final_norm(x), out)

    @memory_errors
    def logits_of(self, y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Tied LM head and softcap of final-normed rows y [R, H] -> logits [R, V] (``head`` without the norm),
        HEAD_CHUNK vocabulary rows at a time (FEW_ROWS_HEAD_CHUNK for at most FEW_ROWS rows of y)."""
        cfg, y = self.cfg, self.xp.asarray(y)  # (a caller's host rows, on a model on the GPU)
        logits = out if out is not None else np.empty((y.shape[0], cfg.vocab_size), dtype=self.dtype)
        chunk = HEAD_CHUNK if y.shape[0] > FEW_ROWS else FEW_ROWS_HEAD_CHUNK
        for start in range(0, cfg.vocab_size, chunk):
            stop = min(start + chunk, cfg.vocab_size)
            z = self.weights.head_linear(y, start, stop)
            if not all_finite(z):  # before the softcap, which turns +-inf into +-cap
                self._refuse_nonfinite("the logits are", [(self.weights.head_name, None)])
            if self.device == "cpu":  # straight into the columns of the logits
                softcap(z, cfg.final_logit_softcapping, out=logits[:, start:stop])
            else:  # the logits are returned on the host
                logits[:, start:stop] = to_host(softcap(z, cfg.final_logit_softcapping))
        return logits

    def forward(self, ids: Sequence[int] | np.ndarray, *, rows: str | Sequence[int] = "all",
                cache: KVCache | None = None, embeddings: np.ndarray | None = None,
                vision_blocks: Sequence[int] | np.ndarray | None = None, trace: Trace | None = None) -> np.ndarray:
        """Logits [R, V] for the requested rows of this call: "last", "all", or a list of indices.
        ``embeddings`` and ``vision_blocks`` as in ``hidden_states``. NaN or inf anywhere along the way
        raises NonFiniteError naming the step and the weight tensor responsible (docs/refimpl.md)."""
        return self.forward_rows(ids, rows=rows, cache=cache, embeddings=embeddings, vision_blocks=vision_blocks,
                                 trace=trace)[0]

    def forward_rows(self, ids: Sequence[int] | np.ndarray, *, rows: str | Sequence[int] = "all",
                     cache: KVCache | None = None, embeddings: np.ndarray | None = None,
                     vision_blocks: Sequence[int] | np.ndarray | None = None,
                     trace: Trace | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``forward`` and the final-normed hidden states of the same rows: (logits [R, V], hidden [R, H])."""
        ids = self.check_ids(ids)
        index = resolve_rows(rows, len(ids))
        with np.errstate(over="ignore", invalid="ignore"):  # a non-finite result is refused (NonFiniteError)
            if trace is not None or np.array_equal(index, np.arange(len(ids))):
                x = take_rows(self.hidden_states(ids, cache=cache, embeddings=embeddings, vision_blocks=vision_blocks,
                                                 trace=trace), index)
            else:
                x = self.hidden_states(ids, cache=cache, embeddings=embeddings, vision_blocks=vision_blocks, keep=index)
            y = self.final_norm(x)
            return self.logits_of(y), to_host(y)


def resolve_rows(rows: str | Sequence[int], T: int) -> np.ndarray:
    """"last" | "all" | indices (negative counts from the end) -> index array into [0, T)."""
    if isinstance(rows, str):
        if rows == "last":
            return np.array([T - 1])
        if rows == "all":
            return np.arange(T)
        raise InputError(f"rows must be 'last', 'all' or a list of indices, got {rows!r}")
    index = np.asarray(list(rows), dtype=np.int64)
    if index.ndim != 1:
        raise InputError("rows must be a flat list of indices")
    bad = index[(index < -T) | (index >= T)]
    if bad.size:
        raise InputError(f"row {int(bad[0])} is outside the {T} tokens of this call")
    return np.where(index < 0, index + T, index)
