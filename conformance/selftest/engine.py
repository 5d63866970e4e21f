"""A NumPy Gemma 4 inference engine built on the oracle's primitives, behind the backend protocol.

``refimpl`` is written like the spec: one forward over one sequence. This module computes the same
float64 numbers, but organised the way a serving engine is (llama.cpp is the model):

* **Batches of tagged tokens.** A :class:`Batch` is a list of tokens, each with a sequence id, an
  absolute position and an output flag (llama.cpp's ``llama_batch``). A single-sequence request is a
  batch of one sequence; a ``multi`` request puts the tokens of every sequence into one batch, so the
  attention mask keeps the sequences apart and each sequence's positions continue its own cache.
* **Per-sequence KV caches.** A :class:`SequenceCache` holds, per KV-owning layer, the keys, values
  and positions of one sequence. Sliding layers keep their last W - 1 entries after each micro-batch;
  KV-shared layers own nothing and read their source layer's cache. A :class:`CacheSet` maps
  sequence ids to caches; every request starts with a fresh one.
* **One prefill path.** :meth:`Engine.prefill` splits a batch into micro-batches (``ubatch`` tokens,
  or one) and runs each through :meth:`Engine.forward_micro_batch`: layers ``< K`` on every token
  (K = the first KV-shared layer, L when nothing is shared), writing K/V into the sequences' caches;
  then *one* index list of the micro-batch's output rows gathers the hidden states, the RoPE
  positions, the mask rows (position and sequence of each query) and the per-layer inputs
  (:meth:`Engine.prune`), and layers ``>= K``, the final norm, the LM head and the softcap run on
  those rows only. A micro-batch with no output row stops after layer K - 1.
* Chunked prefill is consecutive batches on the same caches, decode a batch of one token whose
  output flag is set, the last-logits entry points a batch whose only output is ``last_pos``, and
  ``full`` a batch whose every row is an output.
* **Image prompts** (``Request.images``; see ``conformance.protocol``). The batch's given embeddings
  (``x0``) already hold the soft tokens, unscaled; the batch also tags every token with a **vision
  block id** (``Batch.block``: the absolute position of the first token of its image block, unique
  within a sequence; -1 for text). The per-layer inputs take their table part from the pad row at
  image positions (:meth:`Engine.ple_ids`). The block ids travel like positions: the mask rows carry
  them (``Rows.block``, gathered by pruning with the same index), and every cache entry stores its
  key's block id next to its position (``LayerKV.blocks``), so the mask of a KV-shared layer over a
  pruned row still sees the keys of its own block. On checkpoints with
  ``use_bidirectional_attention == "vision"`` the sliding layers open same-block keys
  (:meth:`Engine.opens_vision_blocks`: ``(k > q - W) and (k <= q or same block)``); full layers stay
  causal (the backend option ``vision_mask=all-unclamped`` opens whole blocks on every layer instead).
  An image block runs in one micro-batch (image requests refuse ``ubatch`` and blocks that straddle
  two pieces). The engine computes the image soft tokens itself from ``Request.image_inputs``
  (:meth:`Engine.image_soft_tokens`): for Gemma 4 Unified step by step (``patch_values``,
  ``patch_norm``, ``patch_position_embedding``, ``real_patches``), otherwise with the oracle's vision
  tower; the rows of all images are handed to the blocks in order.
* **Audio prompts** (``Request.audio``). Audio tokens are flagged in the batch (``Batch.audio``,
  ``MicroBatch.audio``): :meth:`Engine.ple_ids` takes the pad row there too, and they keep block id -1,
  so they are causal on every layer (an audio block is never a vision block). The engine has its own
  audio encoder: the backend loads the checkpoint's audio tower at ``open`` (only when config.json has
  an ``audio_config``) and computes every clip's soft tokens from ``Request.audio_inputs`` with
  :meth:`Engine.audio_soft_tokens` (the oracle's conformer, ``refimpl.audio.audio_tower``, run with the
  config of :meth:`Engine.audio_config`, whose local-attention geometry and logit cap come from the
  hooks ``audio_chunk_size``, ``audio_context`` and ``audio_logit_cap``); it writes them into a copy of
  the given embeddings at the block's rows (Gemma 4 Unified: its raw-waveform embedder,
  ``audio_frame_norm`` then the projection). The given audio rows are ignored (see the backend). Same
  rules as images otherwise: ``last`` (entry ``embeddings``) and ``prefill`` only, no ``ubatch``, a
  block within one piece.

Every step is a small method, so a known engine bug is a few-line override in a subclass
(``conformance/selftest/mutants.py`` holds a zoo of them for the harness's self-test). The hooks:
``Engine.next_positions``, ``prune_layer``, ``prune``, ``input_embeddings``, ``ple_ids``, ``ple_table_rows``,
``rope_positions``, ``norm``, ``rope``, ``values``, ``value_norm``, ``kv_source``, ``window``,
``attention_mask``, ``opens_vision_blocks``, ``vision_overlay``, ``attend``, ``route``, ``layer_scalar``,
``final_softcap``, ``image_soft_tokens``, ``patch_values``, ``patch_norm``, ``patch_position_embedding``,
``real_patches``, ``audio_soft_tokens``, ``audio_frame_norm``, ``audio_tower``, ``audio_config``,
``audio_chunk_size``, ``audio_context``, ``audio_logit_cap``; ``Engine.cache_set_class``
(``CacheSet.get``); and on the backend ``engine_class``, ``last_row`` and ``piece_rows``.

    conformance check --backend numpy-engine            # must pass every bundled case at exact-f64
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from refimpl.audio import AudioConfig, AudioWeights
from refimpl.frontends import ImageFrontEnd
from refimpl.model import Gemma4, experts, per_layer_inputs, rope_inv_freq, route
from refimpl.ops import attention_mask, linear, rope_cos_sin
from refimpl.schedule import apply_rope, attention, gelu_tanh, mlp, rms_norm, softcap

from .encoders import MediaEncoders
from .state import NO_BLOCK, Batch, CacheSet, KVView, MicroBatch, Rows, no_blocks

__all__ = ["Engine", "HEAD_CHUNK"]

HEAD_CHUNK = 16_384  # vocabulary rows projected per step of the LM head


class Engine(MediaEncoders):
    """Batched, cached Gemma 4 forward on the oracle's primitives (float64, or float32); its image and
    audio encoders are ``MediaEncoders``' (``conformance/selftest/encoders.py``)."""

    cache_set_class = CacheSet

    def __init__(self, model: Gemma4, audio: tuple[AudioWeights, AudioConfig] | None = None,
                 image: ImageFrontEnd | None = None):
        """``audio``: the checkpoint's audio tower (``refimpl.audio.load_audio_tower``) or Gemma 4
        Unified's audio embedder (``refimpl.unified.load_unified_audio``), None without one; ``image``:
        its image front end (``refimpl.frontends``: the vision tower, or Unified's embedder, whose steps
        this engine runs itself), None without one. The vision-mask rule is the model's
        (``Gemma4.vision_mask``)."""
        self.model = model
        self.audio_weights, self.audio_cfg = audio if audio is not None else (None, None)
        self.image = image
        self.vision_mask = model.vision_mask
        self.cfg = model.cfg
        self.w = model.weights
        self.dtype = model.dtype
        self.eps = model.cfg.rms_norm_eps
        self.n_layers = model.cfg.num_hidden_layers
        self.first_shared = model.cfg.first_shared_layer  # K (== L without KV sharing)
        self.inv_freq = [rope_inv_freq(spec.rope, spec.head_dim) for spec in model.cfg.layers]
        self.log: list[dict[str, Any]] = []  # one record per micro-batch (what actually ran)
        self.hidden_log: list[np.ndarray] = []  # the final-normed rows of every LM-head call (hidden_state)
        self.residual_log: list[np.ndarray] = []  # the same rows before the final norm
        self.spare_keys = 0  # sliding layers keep W - 1 + this many keys (an MTP run's rollback needs them)
        # the trace of every LM-head call, output rows only (conformance.protocol.trace); None: not tracing
        self.trace_log: list[dict[str, np.ndarray]] | None = None
        self._mb: MicroBatch | None = None  # the micro-batch in flight
        self._mb_trace: dict[str, np.ndarray] = {}  # its trace, while tracing

    # -- requests build batches ---------------------------------------------------------------

    def new_caches(self) -> CacheSet:
        return self.cache_set_class()

    def batch(self, caches: CacheSet, ids: Sequence[int], seq: Sequence[Any], output: Sequence[bool],
              x0: np.ndarray | None = None, images: Sequence[tuple[int, int]] = (),
              audio: Sequence[tuple[int, int]] = ()) -> Batch:
        """Tag tokens with positions that continue each sequence's cache, with vision block ids, and
        with the audio flag.

        ``images``: ``(start, length)`` of each image block within ``ids`` (the tokens of one sequence);
        its rows of ``x0`` are soft tokens. Each block's id is the position of its first token.
        ``audio``: the same for each audio block; its tokens are flagged (``Batch.audio``) and keep
        block id -1 (an audio block is never a vision block)."""
        ids = self.model.check_ids(np.asarray(ids, dtype=np.int64))
        seq = np.asarray(seq, dtype=object)
        output = np.asarray(output, dtype=bool)
        if x0 is not None:
            x0 = np.asarray(x0, dtype=self.dtype)
            if x0.shape != (len(ids), self.cfg.hidden_size):
                raise ValueError(f"embeddings must have shape [{len(ids)}, {self.cfg.hidden_size}], "
                                 f"got {list(x0.shape)}")
        pos = self.next_positions(caches, seq)
        block = no_blocks(len(ids))
        for start, n in images:
            if x0 is None:
                raise ValueError("image blocks need input embeddings (their rows are the soft tokens)")
            if n < 1 or start < 0 or start + n > len(ids):
                raise ValueError(f"image block ({start}, {n}) is outside the {len(ids)} tokens of the batch")
            if len(set(seq[start:start + n].tolist())) != 1:
                raise ValueError(f"image block ({start}, {n}) spans several sequences")
            if (block[start:start + n] != NO_BLOCK).any():
                raise ValueError(f"image block ({start}, {n}) overlaps another block")
            block[start:start + n] = pos[start]
        is_audio = np.zeros(len(ids), dtype=bool)
        for start, n in audio:
            if x0 is None:
                raise ValueError("audio blocks need input embeddings (their rows are the soft tokens)")
            if n < 1 or start < 0 or start + n > len(ids):
                raise ValueError(f"audio block ({start}, {n}) is outside the {len(ids)} tokens of the batch")
            if len(set(seq[start:start + n].tolist())) != 1:
                raise ValueError(f"audio block ({start}, {n}) spans several sequences")
            if (block[start:start + n] != NO_BLOCK).any() or is_audio[start:start + n].any():
                raise ValueError(f"audio block ({start}, {n}) overlaps another block")
            is_audio[start:start + n] = True
        return Batch(ids, seq, pos, output, x0, block, is_audio)

    def next_positions(self, caches: CacheSet, seq: np.ndarray) -> np.ndarray:
        """[T]: each token's position continues its own sequence's cache."""
        nxt: dict[int, int] = {}
        pos = np.empty(len(seq), dtype=np.int64)
        for t, s in enumerate(seq):
            cache = caches.get(s)
            pos[t] = nxt.get(id(cache), cache.length)
            nxt[id(cache)] = pos[t] + 1
        return pos

    # -- prefill: the one path ----------------------------------------------------------------

    def prefill(self, caches: CacheSet, batch: Batch, ubatch: int | None = None) -> np.ndarray:
        """Run a batch through the caches; logits [n_outputs, V] of its output rows in batch order."""
        out = [self.forward_micro_batch(mb) for mb in self.split(caches, batch, ubatch)]
        return np.concatenate(out) if out else np.empty((0, self.cfg.vocab_size), dtype=self.dtype)

    def split(self, caches: CacheSet, batch: Batch, ubatch: int | None) -> list[MicroBatch]:
        """Consecutive micro-batches of ``ubatch`` tokens (the last may be shorter), or one."""
        T = len(batch)
        size = ubatch or T
        if size < 1:
            raise ValueError(f"ubatch must be >= 1, got {ubatch}")
        owner = [caches.get(s) for s in batch.seq]  # [T] the cache of each token
        start: dict[int, int] = {}
        count: dict[int, int] = {}
        for cache, p in zip(owner, batch.pos, strict=True):
            start[id(cache)] = min(start.get(id(cache), int(p)), int(p))
            count[id(cache)] = count.get(id(cache), 0) + 1
        micro = []
        for a in range(0, T, size):
            b = min(a + size, T)
            distinct = list({id(c): c for c in owner[a:b]}.values())
            slot_of = {id(c): s for s, c in enumerate(distinct)}
            micro.append(MicroBatch(
                ids=batch.ids[a:b], pos=batch.pos[a:b], output=batch.output[a:b],
                x0=None if batch.x0 is None else batch.x0[a:b], caches=distinct,
                slot=np.array([slot_of[id(c)] for c in owner[a:b]], dtype=np.int64),
                chunk_start=np.array([start[id(c)] for c in distinct], dtype=np.int64),
                chunk_len=np.array([count[id(c)] for c in distinct], dtype=np.int64),
                block=batch.block[a:b], audio=batch.audio[a:b],
            ))
        return micro

    @property
    def prune_layer(self) -> int:
        """Where the output rows are gathered: right before the first KV-shared layer (L: before the final norm)."""
        return self.first_shared

    def forward_micro_batch(self, mb: MicroBatch) -> np.ndarray:
        """Layers < K on every token (writing K/V), prune to the output rows, the rest on those rows."""
        record = {"tokens": len(mb), "sequences": len(mb.caches), "outputs": int(mb.output_index.size),
                  "layer_rows": [], "head_rows": 0}
        self.log.append(record)
        K = self.prune_layer
        rows = self.initial_rows(mb)
        self._mb, self._mb_trace = mb, {}
        self.trace_point("embed", rows.x)
        rows = self.run_layers(range(0, K), rows, mb, record)  # every K/V write happens here
        if mb.output_index.size == 0:
            logits = np.empty((0, self.cfg.vocab_size), dtype=self.dtype)
        else:
            rows = self.prune(rows, mb.output_index)
            rows = self.run_layers(range(K, self.n_layers), rows, mb, record)  # KV-shared layers read only
            record["head_rows"] = len(rows)
            logits = self.lm_head(rows.x)
            if self.trace_log is not None:
                self.trace_log.append({**self._mb_trace, "final_norm": self.hidden_log[-1]})
        self.commit(mb)  # trim after the shared layers have read this micro-batch's keys
        return logits

    def trace_point(self, name: str, value: np.ndarray) -> None:
        """Record a trace point at the output rows of the micro-batch in flight (``value`` covers every token
        before the pruning, the output rows after it), when tracing."""
        mb = self._mb
        if self.trace_log is not None and mb.output_index.size:
            self._mb_trace[name] = value[mb.output_index] if value.shape[0] == len(mb) else value

    def run_layers(self, layers: Iterable[int], rows: Rows, mb: MicroBatch, record: dict) -> Rows:
        for i in layers:
            record["layer_rows"].append(len(rows))
            rows.x = self.layer(i, rows, mb)
        return rows

    def prune(self, rows: Rows, index: np.ndarray) -> Rows:
        """Gather the output rows: hidden states, positions, mask rows and PLE with ONE index list."""
        return rows.take(index)

    def commit(self, mb: MicroBatch) -> None:
        """After a micro-batch: advance each sequence and trim its sliding layers to the last W - 1."""
        for s, cache in enumerate(mb.caches):
            cache.advance(mb.pos[mb.slot == s])
            for i, spec in enumerate(self.cfg.layers):
                if spec.owns_kv and spec.is_sliding:
                    cache.trim(i, self.window(i) - 1 + self.spare_keys)

    # -- inputs -------------------------------------------------------------------------------

    def initial_rows(self, mb: MicroBatch) -> Rows:
        x0 = self.input_embeddings(mb)  # [T, H]
        ple = self.per_layer_inputs(x0, self.ple_ids(mb)) if self.cfg.has_ple else None  # [T, L, P]
        return Rows(x0, ple, self.rope_positions(mb), mb.pos.copy(), mb.slot.copy(), mb.block.copy())

    def input_embeddings(self, mb: MicroBatch) -> np.ndarray:
        """x0 [T, H]: the given embeddings (text rows already scaled, image and audio rows unscaled soft
        tokens, used as given; the backend has already written its own audio soft tokens there), or
        E[ids] * sqrt(H)."""
        return mb.x0 if mb.x0 is not None else self.model.embed(mb.ids)

    def ple_ids(self, mb: MicroBatch) -> np.ndarray:
        """[T] ids whose per-layer table rows the tokens take: the pad row at image and audio positions."""
        pad = self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0
        return np.where(mb.image | mb.audio, pad, mb.ids)

    def per_layer_inputs(self, x0: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """PLE [T, L, P] from the scaled embeddings and the per-layer table rows of the ids."""
        cfg = self.cfg
        return per_layer_inputs(x0, self.ple_table_rows(ids), self.w["per_layer_model_projection.weight"],
                                self.w["per_layer_projection_norm.weight"], cfg.num_hidden_layers,
                                cfg.hidden_size_per_layer_input, self.eps)

    def ple_table_rows(self, ids: np.ndarray) -> np.ndarray:
        """[T, L*P] rows of the per-layer table (ids outside it use row 0, the pad row)."""
        inside = (ids >= 0) & (ids < self.cfg.vocab_size_per_layer_input)
        return self.w.rows("embed_tokens_per_layer.weight", np.where(inside, ids, 0))

    def rope_positions(self, mb: MicroBatch) -> np.ndarray:
        return mb.pos.copy()

    # -- one decoder layer --------------------------------------------------------------------

    def layer(self, i: int, rows: Rows, mb: MicroBatch) -> np.ndarray:
        x, p = rows.x, f"layers.{i}."
        a = self.attention_block(i, rows, mb)
        r = x + a
        m = self.ffn_block(i, r)
        x = r + m
        self.trace_point(p + "attn_out", a)
        self.trace_point(p + "ffn_out", m)
        if rows.ple is not None:
            g = self.ple_block(i, x, rows.ple[:, i, :])
            x = x + g
            self.trace_point(p + "ple_add", g)
        x = x * self.layer_scalar(i)
        self.trace_point(p + "residual", x)
        return x

    def norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """RMSNorm with weight w (Gemma 4: w, not 1 + w)."""
        return rms_norm(x, weight, self.eps)

    def attention_block(self, i: int, rows: Rows, mb: MicroBatch) -> np.ndarray:
        spec, p = self.cfg.layers[i], f"layers.{i}."
        R, N, D = len(rows), self.cfg.num_attention_heads, spec.head_dim
        h = self.norm(rows.x, self.w[p + "input_layernorm.weight"])
        q = linear(h, self.w[p + "self_attn.q_proj.weight"]).reshape(R, N, D)
        q = self.rope(i, self.norm(q, self.w[p + "self_attn.q_norm.weight"]), rows.pos)  # [R, N, D]
        if spec.owns_kv:
            k, v = self.keys_values(i, h, rows.pos)  # [R, Kh, D] each
            self.write_kv(i, k, v, rows, mb)
        kv = self.read_kv(self.kv_source(i), mb)  # [S, Kh, D]
        mask = self.attention_mask(i, rows, kv, mb)  # [R, S]
        a = self.attend(q, kv, mask).reshape(R, N * D)
        o = linear(a, self.w[p + "self_attn.o_proj.weight"])
        return self.norm(o, self.w[p + "post_attention_layernorm.weight"])

    def rope(self, i: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x [R, heads, D] rotated (rotate-half pairs (j, j + D/2)) by this layer type's frequencies."""
        cos, sin = rope_cos_sin(pos, self.inv_freq[i])
        return apply_rope(x, cos.astype(self.dtype), sin.astype(self.dtype))

    def keys_values(self, i: int, h: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        spec, p = self.cfg.layers[i], f"layers.{i}."
        R, Kh, D = h.shape[0], spec.num_kv_heads, spec.head_dim
        kr = linear(h, self.w[p + "self_attn.k_proj.weight"]).reshape(R, Kh, D)  # raw keys
        k = self.rope(i, self.norm(kr, self.w[p + "self_attn.k_norm.weight"]), pos)
        return k, self.values(i, h, kr, k)

    def values(self, i: int, h: np.ndarray, kr: np.ndarray, k: np.ndarray) -> np.ndarray:
        """V [R, Kh, D]: v_norm of v_proj(h), or of the RAW key projection on K=V layers."""
        spec = self.cfg.layers[i]
        vr = kr if spec.k_eq_v else linear(h, self.w[f"layers.{i}.self_attn.v_proj.weight"]).reshape(kr.shape)
        return self.value_norm(vr)

    def value_norm(self, v: np.ndarray) -> np.ndarray:
        return rms_norm(v, None, self.eps)  # scale-free

    def write_kv(self, i: int, k: np.ndarray, v: np.ndarray, rows: Rows, mb: MicroBatch) -> None:
        """Append each row's K/V to its own sequence's cache of layer i."""
        for s, cache in enumerate(mb.caches):
            mine = rows.slot == s
            if mine.any():
                cache.append(i, k[mine], v[mine], rows.mask_pos[mine], rows.block[mine])

    def kv_source(self, i: int) -> int:
        """The KV-owning layer whose cache layer i attends over (itself, or the last owner of its type)."""
        return self.cfg.layers[i].kv_source

    def read_kv(self, source: int, mb: MicroBatch) -> KVView:
        parts = [(s, kv) for s, cache in enumerate(mb.caches) if (kv := cache.read(source)) is not None]
        if not parts:
            raise RuntimeError(f"layer {source} has no keys in this micro-batch")
        return KVView(k=np.concatenate([kv.k for _, kv in parts]), v=np.concatenate([kv.v for _, kv in parts]),
                      pos=np.concatenate([kv.pos for _, kv in parts]),
                      slot=np.concatenate([np.full(kv.pos.shape[0], s) for s, kv in parts]),
                      block=np.concatenate([kv.blocks for _, kv in parts]))

    def window(self, i: int) -> int:
        """Sliding window W: a query sees itself and W - 1 earlier keys."""
        return self.cfg.sliding_window

    def attention_mask(self, i: int, rows: Rows, kv: KVView, mb: MicroBatch) -> np.ndarray:
        """bool [R, S]: same sequence, causal, and within the window on sliding layers; plus the keys of
        the query's own image block on the layers that open vision blocks."""
        window = self.window(i) if self.cfg.layers[i].is_sliding else None
        same_seq = rows.slot[:, None] == kv.slot[None, :]
        allowed = attention_mask(rows.mask_pos, kv.pos, window)
        if self.opens_vision_blocks(i):
            allowed = allowed | self.vision_overlay(rows, kv, window)
        return same_seq & allowed

    def opens_vision_blocks(self, i: int) -> bool:
        """Whether layer i lets image tokens see their whole block on ``use_bidirectional_attention ==
        "vision"`` checkpoints: sliding layers (rule "sliding-clamped", full layers causal), or every layer
        (rule "all-unclamped")."""
        return self.cfg.use_bidirectional_attention == "vision" and (
            self.cfg.layers[i].is_sliding or self.vision_mask == "all-unclamped")

    def vision_overlay(self, rows: Rows, kv: KVView, window: int | None) -> np.ndarray:
        """bool [R, S]: key in the query's own image block and, under "sliding-clamped" with a window, not
        W or more positions back (the window bounds only the past side, later keys of the block are all
        visible); under "all-unclamped" the whole block, whatever the window."""
        same_block = (rows.block[:, None] == kv.block[None, :]) & (rows.block[:, None] != NO_BLOCK)
        if window is not None and self.vision_mask == "sliding-clamped":
            same_block &= (rows.mask_pos[:, None] - kv.pos[None, :]) < window
        return same_block

    def attend(self, q: np.ndarray, kv: KVView, mask: np.ndarray) -> np.ndarray:
        """[R, N, D]; scale 1.0 (q and k are RMS-normed), GQA."""
        return attention(q, kv.k, kv.v, mask)

    def ffn_block(self, i: int, r: np.ndarray) -> np.ndarray:
        """Dense GeGLU, plus the MoE branch in parallel on MoE models; post-FFN-normed [R, H]."""
        p = f"layers.{i}."
        u = self.norm(r, self.w[p + "pre_feedforward_layernorm.weight"])
        m = mlp(u, self.w[p + "mlp.gate_proj.weight"], self.w[p + "mlp.up_proj.weight"],
                self.w[p + "mlp.down_proj.weight"])
        if self.cfg.enable_moe_block:
            m = (self.norm(m, self.w[p + "post_feedforward_layernorm_1.weight"])
                 + self.norm(self.moe(i, r), self.w[p + "post_feedforward_layernorm_2.weight"]))
        return self.norm(m, self.w[p + "post_feedforward_layernorm.weight"])

    def moe(self, i: int, r: np.ndarray) -> np.ndarray:
        """The experts' weighted sum [R, H], routed on the un-normalised residual r."""
        p = f"layers.{i}."
        idx, weight = self.route(i, r)  # [R, k] each
        self.trace_point(p + "router.experts", idx)
        u = self.norm(r, self.w[p + "pre_feedforward_layernorm_2.weight"])

        def expert_weights(e: int) -> tuple[np.ndarray, np.ndarray]:
            return self.w.rows(p + "experts.gate_up_proj", e), self.w.rows(p + "experts.down_proj", e)

        return experts(u, idx, weight, expert_weights)

    def route(self, i: int, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = f"layers.{i}."
        idx, weight, _ = route(r, self.w[p + "router.scale"], self.w[p + "router.proj.weight"],
                               self.w[p + "router.per_expert_scale"], self.cfg.top_k_experts, self.eps)
        return idx, weight

    def ple_block(self, i: int, x: np.ndarray, ple_i: np.ndarray) -> np.ndarray:
        """gelu(x gate^T) * ple_i -> proj -> norm: the term added after the FFN residual [R, H]."""
        p = f"layers.{i}."
        g = gelu_tanh(linear(x, self.w[p + "per_layer_input_gate.weight"])) * ple_i
        return self.norm(linear(g, self.w[p + "per_layer_projection.weight"]),
                         self.w[p + "post_per_layer_input_norm.weight"])

    def layer_scalar(self, i: int) -> float:
        return self.w[f"layers.{i}.layer_scalar"][0]

    # -- head ---------------------------------------------------------------------------------

    def lm_head(self, x: np.ndarray) -> np.ndarray:
        """x [R, H] -> final norm, tied head streamed over the vocabulary, softcap -> logits [R, V]. The
        final-normed rows go to ``hidden_log`` (the hidden-state output, ``hidden_state``)."""
        y = self.norm(x, self.w["norm.weight"])
        self.hidden_log.append(self.hidden_state(x, y))
        self.residual_log.append(x)
        V = self.cfg.vocab_size
        logits = np.empty((y.shape[0], V), dtype=self.dtype)
        for a in range(0, V, HEAD_CHUNK):
            b = min(a + HEAD_CHUNK, V)
            logits[:, a:b] = linear(y, self.w.head_rows(a, b))
        return self.final_softcap(logits)

    def hidden_state(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The hidden state an output row reports: the final norm's output y (x: the residual before it)."""
        return y

    def final_softcap(self, logits: np.ndarray) -> np.ndarray:
        return softcap(logits, self.cfg.final_logit_softcapping)
