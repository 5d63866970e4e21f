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

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from refimpl import RefimplError
from refimpl.audio import AudioConfig, AudioWeights, load_audio_tower
from refimpl.config_fields import read_config_json
from refimpl.errors import check_choice
from refimpl.frontends import ImageFrontEnd, image_front_end
from refimpl.gguf_io import is_gguf
from refimpl.model import VISION_MASK_RULES, Gemma4, LayerKV, experts, per_layer_inputs, rope_inv_freq, route
from refimpl.multimodal import MultimodalTokens, load_multimodal_tokens
from refimpl.ops import apply_rope, attention, attention_mask, gelu_tanh, linear, mlp, rms_norm, rope_cos_sin, softcap
from refimpl.unified import is_unified, load_unified_audio

from ..backends.refimpl_backend import all_capabilities, check_options
from ..protocol.trace import trace_rows
from ..protocol.types import BackendError, Request, Response
from .encoders import MediaEncoders
from .mtp import CONVENTIONS_SERVED, DraftModel, MtpDriver, load_draft_model, serve_mtp

__all__ = ["Batch", "CacheSet", "Engine", "KVView", "LayerKV", "MicroBatch", "NumpyEngineBackend", "Rows",
           "SequenceCache", "PLAIN_SEQ"]

HEAD_CHUNK = 16_384  # vocabulary rows projected per step of the LM head
PLAIN_SEQ = -1  # the sequence id of the plain last-logits entry point (the engine's fallback slot)
NO_BLOCK = -1  # the vision block id of a text token (and of every key written by one)


def _no_blocks(n: int) -> np.ndarray:
    return np.full(n, NO_BLOCK, dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# KV cache


def _take(kv: LayerKV, index: np.ndarray) -> LayerKV:
    """The entries ``index`` of one layer's K/V (refimpl's record; here ``blocks`` is always stored: the
    vision block id of each key, -1 for a text token, kept in the cache with its position)."""
    return LayerKV(kv.k[index], kv.v[index], kv.pos[index], kv.blocks[index])


class SequenceCache:
    """One sequence's state: per KV-owning layer its keys, values, positions and vision block ids, and
    its length."""

    def __init__(self) -> None:
        self.length = 0  # next position of this sequence (last written position + 1)
        self.layers: dict[int, LayerKV] = {}

    def read(self, layer: int) -> LayerKV | None:
        return self.layers.get(layer)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, pos: np.ndarray,
               block: np.ndarray | None = None) -> None:
        block = _no_blocks(pos.shape[0]) if block is None else np.asarray(block, dtype=np.int64)
        past = self.layers.get(layer)
        if past is None:
            self.layers[layer] = LayerKV(k, v, pos, block)
        else:
            self.layers[layer] = LayerKV(np.concatenate([past.k, k]), np.concatenate([past.v, v]),
                                         np.concatenate([past.pos, pos]), np.concatenate([past.blocks, block]))

    def advance(self, positions: np.ndarray) -> None:
        """Positions were written: the sequence now continues after the largest one."""
        if positions.size:
            self.length = max(self.length, int(positions.max()) + 1)

    def trim(self, layer: int, keep: int) -> None:
        """Keep only the entries of the last ``keep`` positions (all a future query can see)."""
        kv = self.layers.get(layer)
        if kv is not None:
            self.layers[layer] = _take(kv, kv.pos >= self.length - keep)

    def entries(self, layer: int) -> int:
        kv = self.layers.get(layer)
        return 0 if kv is None else int(kv.pos.shape[0])

    def truncate(self, length: int) -> None:
        """Remove every position from ``length`` on (an MTP round's rejected drafts), as llama.cpp's seq_rm."""
        for layer, kv in self.layers.items():
            self.layers[layer] = _take(kv, kv.pos < length)
        self.length = min(self.length, length)


class CacheSet:
    """The caches of one request, keyed by sequence id (created on first use)."""

    def __init__(self) -> None:
        self.by_seq: dict[Any, SequenceCache] = {}

    def get(self, seq: Any) -> SequenceCache:
        if seq not in self.by_seq:
            self.by_seq[seq] = SequenceCache()
        return self.by_seq[seq]


# ----------------------------------------------------------------------------------------------
# batches


@dataclass
class Batch:
    """T tokens, each tagged with (sequence id, position, output flag, vision block), like llama.cpp's
    llama_batch."""

    ids: np.ndarray  # [T] token ids
    seq: np.ndarray  # [T] sequence ids
    pos: np.ndarray  # [T] absolute positions
    output: np.ndarray  # [T] bool: return this row's logits
    x0: np.ndarray | None = None  # [T, H] input embeddings replacing E[ids] * sqrt(H); ids still pick PLE rows
    block: np.ndarray | None = None  # [T] vision block id (position of the block's first token; -1: text)
    audio: np.ndarray | None = None  # [T] bool: an audio token (its x0 row is an audio soft token)

    def __post_init__(self) -> None:
        if self.block is None:
            self.block = _no_blocks(len(self))
        if self.audio is None:
            self.audio = np.zeros(len(self), dtype=bool)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def n_outputs(self) -> int:
        return int(np.count_nonzero(self.output))


@dataclass
class MicroBatch:
    """A slice of a batch that runs as one forward through the caches."""

    ids: np.ndarray  # [T]
    pos: np.ndarray  # [T] absolute positions
    output: np.ndarray  # [T] bool
    x0: np.ndarray | None  # [T, H] or None
    caches: list[SequenceCache]  # the distinct caches this micro-batch touches; slot s = caches[s]
    slot: np.ndarray  # [T] index into caches of each token's sequence cache
    chunk_start: np.ndarray  # [n_slots] first position of each slot's tokens in the enclosing batch
    chunk_len: np.ndarray  # [n_slots] how many tokens each slot has in the enclosing batch
    block: np.ndarray  # [T] vision block ids (-1: text)
    audio: np.ndarray | None = None  # [T] bool: audio tokens (never in a vision block)

    def __post_init__(self) -> None:
        if self.audio is None:
            self.audio = np.zeros(len(self), dtype=bool)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def output_index(self) -> np.ndarray:
        return np.flatnonzero(self.output)

    @property
    def image(self) -> np.ndarray:
        """[T] bool: the token is an image placeholder (its x0 row is a soft token)."""
        return self.block != NO_BLOCK


@dataclass
class Rows:
    """The rows a micro-batch carries through the layers: every token, or the output rows after pruning.

    ``pos`` are the RoPE positions (llama.cpp ``inp_pos``); ``mask_pos``, ``slot`` and ``block`` say which
    query each mask row is built for (llama.cpp ``kq_mask`` rows). All must be gathered with the same index.
    """

    x: np.ndarray  # [R, H] residual stream
    ple: np.ndarray | None  # [R, L, P] per-layer inputs, None without PLE
    pos: np.ndarray  # [R] RoPE positions
    mask_pos: np.ndarray  # [R] query position of each mask row
    slot: np.ndarray  # [R] sequence cache (index into MicroBatch.caches) of each mask row
    block: np.ndarray  # [R] vision block id of each mask row (-1: text)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def take(self, index: np.ndarray) -> "Rows":
        return Rows(self.x[index], None if self.ple is None else self.ple[index], self.pos[index],
                    self.mask_pos[index], self.slot[index], self.block[index])


@dataclass
class KVView:
    """The keys a layer attends over in one micro-batch: its source layer's caches, concatenated."""

    k: np.ndarray  # [S, Kh, D]
    v: np.ndarray  # [S, Kh, D]
    pos: np.ndarray  # [S] absolute positions
    slot: np.ndarray  # [S] which cache (sequence) each key belongs to
    block: np.ndarray  # [S] vision block id of each key (-1: text)


# ----------------------------------------------------------------------------------------------
# the engine


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
        block = _no_blocks(len(ids))
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


# ----------------------------------------------------------------------------------------------
# the backend: requests -> batches


class NumpyEngineBackend:
    """The engine behind the backend protocol. Claims everything; float64 is exact (profile exact-f64).

    Options: ``dtype`` ("float64" or "float32"), ``embed_scale`` ("exact" or "bf16").
    Subclasses swap the engine (``engine_class``) or override a request hook (``last_row``,
    ``piece_rows``) to plant a bug: see ``conformance/selftest/mutants.py``.

    Image and audio prompts: ``last`` (entry ``embeddings``) and ``prefill`` (every piece with
    embeddings); the image and audio blocks of each call go into its batch (``Engine.batch(images=...,
    audio=...)``). Refused with a ValueError: media on ``full``/``multi`` or another ``last`` entry, with
    ``ubatch``, a block that straddles two pieces or holds other tokens than its placeholder.

    Audio: the backend claims ``audio_tower``. At ``open`` it loads the checkpoint's audio tower when
    config.json has an ``audio_config``; for every audio request it computes each clip's soft tokens
    itself from ``request.audio_inputs`` (``Engine.audio_soft_tokens``: the oracle's conformer), checks
    their count against the block and writes them into a copy of the given embeddings at the block's rows.
    The audio rows of the given embeddings are therefore **ignored**: they are only the harness's
    reference (a request whose rows are wrong gets the same answer), so the engine's own audio tower is
    what the audio cases grade. An audio request without one ``AudioInput`` per block is refused.
    """

    name = "numpy-engine"
    engine_class: type[Engine] = Engine
    draft_model_class: type[DraftModel] = DraftModel  # the MTP drafter's graph (conformance/selftest/mtp.py)
    driver_class: type[MtpDriver] = MtpDriver  # the MTP round loop

    def __init__(self, dtype: str = "float64", embed_scale: str = "exact", vision_mask: str = "sliding-clamped"):
        self.dtype, self.embed_scale = check_options("numpy-engine", dtype, embed_scale)
        self.vision_mask = check_choice("vision_mask", vision_mask, VISION_MASK_RULES, who="numpy-engine",
                                        error=ValueError)
        exact = self.dtype == "float64" and embed_scale == "exact"
        self.capabilities = all_capabilities("exact-f64" if exact else "fp32")  # audio_tower, image_tower included
        self.engine: Engine | None = None
        self.tokens: MultimodalTokens | None = None
        self._drafters: dict[str, DraftModel] = {}
        self.capabilities = replace(self.capabilities, mtp_conventions=",".join(CONVENTIONS_SERVED))

    # -- protocol -------------------------------------------------------------------------------

    def open(self, model_dir: Path) -> None:
        try:
            model = Gemma4(model_dir, dtype=self.dtype, embed_scale=self.embed_scale, vision_mask=self.vision_mask)
            self.tokens = load_multimodal_tokens(model_dir)
            raw = {} if is_gguf(model_dir) else read_config_json(model_dir)[1]  # a GGUF: the text model only
            load_audio = load_unified_audio if is_unified(model_dir) else load_audio_tower
            audio = load_audio(model_dir, self.dtype) if raw.get("audio_config") is not None else None
            image = image_front_end(model_dir, self.dtype) if raw.get("vision_config") is not None else None
        except (RefimplError, OSError) as exc:
            raise BackendError(f"numpy-engine cannot open {model_dir}: {exc}") from exc
        self.engine = self.engine_class(model, audio, image)

    def close(self) -> None:
        self.engine = None
        self.tokens = None

    @property
    def image_token_id(self) -> int | None:
        return None if self.tokens is None else self.tokens.image_token_id

    @property
    def audio_token_id(self) -> int | None:
        return None if self.tokens is None else self.tokens.audio_token_id

    def run(self, request: Request) -> Response:
        if self.engine is None:
            raise RuntimeError("numpy-engine: run() called before open()")
        self.engine.log = []
        self.engine.hidden_log, self.engine.residual_log = [], []
        self.engine.trace_log = [] if request.trace else None
        self.engine.spare_keys = 0
        caches = self.engine.new_caches()  # fresh state per request
        if request.kind == "mtp":
            return self._mtp(request, caches)
        handler = {"full": self._full, "last": self._last, "prefill": self._prefill, "multi": self._multi}
        response = handler[request.kind](request, caches)
        if request.hidden:
            response.hidden, response.decode_hidden = self._head_rows(request, response, self.engine.hidden_log)
        if request.trace:
            points = trace_rows(self.engine.trace_log)
            split = {name: self._head_rows(request, response, [rows]) for name, rows in points.items()}
            response.trace = {name: got for name, (got, _) in split.items()}
            if request.kind == "multi" and request.decode:
                response.decode_trace = [{name: dec[i] for name, (_, dec) in split.items()}
                                         for i in range(len(request.decode))]
            elif request.decode:
                response.decode_trace = {name: dec for name, (_, dec) in split.items()}
        return response

    # -- MTP (conformance/selftest/mtp.py) ------------------------------------------------------

    def sequence_batch(self, caches: CacheSet, seq: Any, ids: Sequence[int], rows: Iterable[int]) -> Batch:
        """A text batch of one sequence with output ``rows`` (the MTP driver's prefill and verification)."""
        return self._one_sequence(caches, seq, ids, rows)

    def _mtp(self, request: Request, caches: CacheSet) -> Response:
        if request.drafter not in self._drafters or self._drafters[request.drafter].engine is not self.engine:
            self._drafters = {request.drafter: load_draft_model(self.draft_model_class, request.drafter, self.engine)}
        return serve_mtp(self, self._drafters[request.drafter], request, caches)

    def _head_rows(self, request: Request, response: Response, log: list[np.ndarray]) -> tuple[np.ndarray, Any]:
        """Rows logged at every LM-head call (``Engine.hidden_log``, or one trace point), in call order: the
        prefill's output rows, then one decode step after another (multi steps batch the live sequences),
        split as the response's (rows of ``logits``, rows of ``decode_logits``: None without decode, a list
        per sequence for multi)."""
        flat = np.concatenate(log) if log else np.empty((0, self.engine.cfg.hidden_size), dtype=self.dtype)
        R = np.asarray(response.logits).shape[0]
        got, rest = flat[:R], flat[R:]
        if request.kind == "multi" and request.decode:
            per_seq: list[list[np.ndarray]] = [[] for _ in request.decode]
            at = 0
            for j in range(max(len(d) for d in request.decode)):
                for i, d in enumerate(request.decode):
                    if j < len(d):
                        per_seq[i].append(rest[at:at + 1])
                        at += 1
            return got, [np.concatenate(h) if h else rest[:0] for h in per_seq]
        return got, (rest if request.decode else None)

    # -- request hooks (what a request adapter decides) -------------------------------------------

    def last_row(self, T: int, last_pos: int) -> int:
        """The row flagged as output on the last-logits entry points."""
        return last_pos

    def piece_rows(self, p: int, rows: Sequence[int]) -> list[int]:
        """The rows flagged as output in piece p of a prefill."""
        return [int(r) for r in rows]

    # -- request kinds --------------------------------------------------------------------------

    def _one_sequence(self, caches: CacheSet, seq: Any, ids: Sequence[int], rows: Iterable[int],
                      x0: np.ndarray | None = None, images: Sequence[tuple[int, int]] = (),
                      audio: Sequence[tuple[int, int]] = ()) -> Batch:
        if len(ids) == 0:
            raise ValueError("numpy-engine: a call has no tokens")
        rows = list(rows)
        if any(not 0 <= r < len(ids) for r in rows):
            raise ValueError(f"numpy-engine: rows {rows} must lie within the {len(ids)} tokens of the call")
        output = np.zeros(len(ids), dtype=bool)
        output[rows] = True
        return self.engine.batch(caches, ids, [seq] * len(ids), output, x0, images, audio)

    @staticmethod
    def _media(request: Request) -> bool:
        return bool(request.images or request.audio)

    def _check_block_tokens(self, ids: Sequence[int], blocks: Sequence[tuple[int, int]], what: str,
                            token: int) -> None:
        """Every block (start, n) within the call's ids, filled with its placeholder token."""
        T = len(ids)
        for s, n in blocks:
            if n < 1 or s < 0 or s + n > T:
                raise ValueError(f"numpy-engine: {what} block ({s}, {n}) is outside the {T} tokens of the call")
            if any(int(t) != token for t in ids[s:s + n]):
                raise ValueError(f"numpy-engine: the {what} block ({s}, {n}) holds tokens other than the {what} "
                                 f"token {token}")

    def _check_media_tokens(self, ids: Sequence[int], images: Sequence[tuple[int, int]],
                            audio: Sequence[tuple[int, int]]) -> None:
        self._check_block_tokens(ids, images, "image", self.image_token_id)
        self._check_block_tokens(ids, audio, "audio", self.audio_token_id)

    def _piece_blocks(self, request: Request, blocks: Sequence[tuple[int, int]], what: str
                      ) -> list[list[tuple[int, int]]]:
        """The blocks of each prefill piece as (start, n) within the piece; a block must lie in one piece."""
        total = sum(len(p.tokens) for p in request.pieces)
        for s, n in blocks:
            if n < 1 or s < 0 or s + n > total:
                raise ValueError(f"numpy-engine: {what} block ({s}, {n}) is outside the {total} prompt tokens")
        out, lo = [], 0
        for p, piece in enumerate(request.pieces):
            hi = lo + len(piece.tokens)
            mine = [(s - lo, n) for s, n in blocks if lo <= s < hi]
            for s, n in mine:
                if s + n > len(piece.tokens):
                    raise ValueError(f"numpy-engine: the {what} block at position {s + lo} ({n} tokens) straddles "
                                     f"pieces {p} and {p + 1}; a block must lie in one piece")
            out.append(mine)
            lo = hi
        return out

    def _piece_media(self, request: Request) -> tuple[list[list[tuple[int, int]]], list[list[tuple[int, int]]]]:
        """(image blocks, audio blocks) of each prefill piece, within the piece. Media prompts run without
        micro-batches (a block is one forward)."""
        if self._media(request) and request.ubatch is not None:
            what = "image" if request.images else "audio"
            raise ValueError(f"numpy-engine: {what} prompts cannot be split into micro-batches (ubatch "
                             f"{request.ubatch}); an {what} block must run in one forward")
        images = self._piece_blocks(request, request.images, "image")
        audio = self._piece_blocks(request, request.audio, "audio")
        for piece, im, au in zip(request.pieces, images, audio, strict=True):
            self._check_media_tokens(piece.tokens, im, au)
        return images, audio

    def _audio_soft_tokens(self, request: Request) -> list[np.ndarray]:
        """Each audio block's soft tokens [M, H], computed by the engine's own audio tower from
        ``request.audio_inputs`` (one per block, in prompt order); M must equal the block's length."""
        if not request.audio:
            return []
        if len(request.audio_inputs) != len(request.audio):
            raise ValueError(f"numpy-engine: {len(request.audio)} audio block(s) but {len(request.audio_inputs)} "
                             "audio input(s); the engine computes the soft tokens itself from one AudioInput per block")
        out = []
        for j, ((s, n), clip) in enumerate(zip(request.audio, request.audio_inputs, strict=True)):
            soft = self.engine.audio_soft_tokens(np.asarray(clip.features), np.asarray(clip.mask))
            if soft.shape[0] != n:
                raise ValueError(f"numpy-engine: audio clip {j} gives {soft.shape[0]} soft tokens but its block at "
                                 f"position {s} holds {n} audio tokens")
            out.append(soft)
        return out

    def _image_soft_tokens(self, request: Request) -> list[np.ndarray]:
        """Each image block's soft tokens [M, H], computed by the engine's own tower or embedder from
        ``request.image_inputs`` (one per block, in prompt order). The rows of all images are concatenated
        and handed out to the blocks in order, as a scatter into the placeholder rows does."""
        if not request.images:
            return []
        if len(request.image_inputs) != len(request.images):
            raise ValueError(f"numpy-engine: {len(request.images)} image block(s) but {len(request.image_inputs)} "
                             "image input(s); the engine computes the soft tokens itself from one ImageInput per block")
        flat = np.concatenate([self.engine.image_soft_tokens(i.pixel_values, i.positions)
                               for i in request.image_inputs])
        need = sum(n for _, n in request.images)
        if flat.shape[0] < need:
            raise ValueError(f"numpy-engine: the images give {flat.shape[0]} soft tokens but the prompt's image blocks "
                             f"hold {need} image tokens")
        ends = np.cumsum([n for _, n in request.images])
        return [flat[e - n:e] for (_, n), e in zip(request.images, ends, strict=True)]

    @staticmethod
    def _with_soft_tokens(x0: np.ndarray, blocks: Sequence[tuple[int, int]], soft: Sequence[np.ndarray]) -> np.ndarray:
        """A copy of the call's embeddings with each audio (or image) block's rows replaced by its soft tokens."""
        x0 = np.array(x0, dtype=np.float64, copy=True)  # never write into the request's array
        for (s, n), e in zip(blocks, soft, strict=True):
            x0[s:s + n] = e
        return x0

    def _decode(self, caches: CacheSet, seq: Any, tokens: Sequence[int]) -> np.ndarray:
        """Teacher-forced decode: one batch of one output token per step."""
        out = [self.engine.prefill(caches, self._one_sequence(caches, seq, [int(t)], [0])) for t in tokens]
        return np.concatenate(out) if out else np.empty((0, self.engine.cfg.vocab_size), dtype=self.dtype)

    def _executed(self, path: str, n_prefill: int, **extra) -> dict[str, Any]:
        log = self.engine.log
        return {"path": path, "engine": "numpy-engine", "dtype": self.dtype, "embed_scale": self.embed_scale,
                "fresh_state": True, "prune_layer": self.engine.prune_layer,
                "ubatches": log[:n_prefill], "decode_ubatches": len(log) - n_prefill,
                "state_len_after_prefill": extra.pop("state_len"), **extra}

    @staticmethod
    def _media_record(request: Request) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if request.images:
            out["images"] = list(request.images)
            out["image_soft_tokens"] = "own vision tower or embedder (the embeddings' image rows are not read)"
        if request.audio:
            out["audio"] = list(request.audio)
            out["audio_soft_tokens"] = "own audio tower (the embeddings' audio rows are not read)"
        return out

    def _no_media(self, request: Request) -> None:
        if self._media(request):
            what = "image" if request.images else "audio"
            raise ValueError(f"numpy-engine: {what} prompts are served on 'last' (entry 'embeddings') and "
                             f"'prefill' only, not on {request.kind!r}")

    def _full(self, request: Request, caches: CacheSet) -> Response:
        self._no_media(request)
        T = len(request.tokens)
        logits = self.engine.prefill(caches, self._one_sequence(caches, 0, request.tokens, range(T)))
        n, state = len(self.engine.log), caches.get(0).length
        decode = self._decode(caches, 0, request.decode) if request.decode else None
        return Response(logits, decode, self._executed("full", n, state_len=state))

    def _last(self, request: Request, caches: CacheSet) -> Response:
        T = len(request.tokens)
        if not 0 <= request.last_pos < T:
            raise ValueError(f"numpy-engine: last_pos {request.last_pos} is outside the {T} tokens of the call")
        x0 = None
        if request.entry == "embeddings":
            if request.embeddings is None:
                raise ValueError("numpy-engine: entry 'embeddings' without embeddings")
            x0 = np.asarray(request.embeddings)
        elif self._media(request):
            what = "an image" if request.images else "an audio"
            raise ValueError(f"numpy-engine: {what} prompt needs entry 'embeddings', got {request.entry!r}")
        self._check_media_tokens(request.tokens, request.images, request.audio)
        if request.images:
            x0 = self._with_soft_tokens(x0, request.images, self._image_soft_tokens(request))
        if request.audio:
            x0 = self._with_soft_tokens(x0, request.audio, self._audio_soft_tokens(request))
        seq = PLAIN_SEQ if request.entry == "plain" else request.seq_id
        row = self.last_row(T, request.last_pos)
        batch = self._one_sequence(caches, seq, request.tokens, [row], x0, request.images, request.audio)
        logits = self.engine.prefill(caches, batch)
        n, state = len(self.engine.log), caches.get(seq).length
        decode = self._decode(caches, seq, request.decode) if request.decode else None
        return Response(logits, decode, self._executed(
            "last", n, state_len=state, entry=request.entry, seq_id=request.seq_id,
            last_pos=request.last_pos, output_row=row, **self._media_record(request)))

    def _prefill(self, request: Request, caches: CacheSet) -> Response:
        if not request.pieces:
            raise ValueError("numpy-engine: prefill request has no pieces")
        piece_images, piece_audio = self._piece_media(request)
        media = self._media(request)
        for p, piece in enumerate(request.pieces):  # checked before any soft token is computed
            if media and piece.embeddings is None:  # image / audio prompts: every piece carries its embeddings
                what = "an image" if request.images else "an audio"
                raise ValueError(f"numpy-engine: piece {p} of {what} prompt has no embeddings")
            if not media and piece.embeddings is not None:
                raise ValueError(f"numpy-engine: piece {p} carries embeddings but the request has no images or audio")
        soft = self._audio_soft_tokens(request)
        image_soft = self._image_soft_tokens(request)
        out, pieces, clip, image = [], [], 0, 0
        for p, piece in enumerate(request.pieces):
            rows = self.piece_rows(p, piece.rows)
            x0 = np.asarray(piece.embeddings) if media else None
            if piece_images[p]:
                x0 = self._with_soft_tokens(x0, piece_images[p], image_soft[image:image + len(piece_images[p])])
                image += len(piece_images[p])
            if piece_audio[p]:
                x0 = self._with_soft_tokens(x0, piece_audio[p], soft[clip:clip + len(piece_audio[p])])
                clip += len(piece_audio[p])
            batch = self._one_sequence(caches, 0, piece.tokens, rows, x0, piece_images[p], piece_audio[p])
            out.append(self.engine.prefill(caches, batch, request.ubatch))
            pieces.append({"tokens": len(piece.tokens), "rows": rows,
                           **({"images": piece_images[p]} if request.images else {}),
                           **({"audio": piece_audio[p]} if request.audio else {})})
        n, state = len(self.engine.log), caches.get(0).length
        logits = np.concatenate(out)
        decode = self._decode(caches, 0, request.decode) if request.decode else None
        return Response(logits, decode, self._executed("prefill", n, state_len=state, ubatch=request.ubatch,
                                                       pieces=pieces, **self._media_record(request)))

    def _multi(self, request: Request, caches: CacheSet) -> Response:
        """All sequences in ONE batch (tokens tagged with their sequence ids); decode steps batched too."""
        self._no_media(request)
        n = len(request.sequences)
        seq_ids = list(request.seq_ids) if request.seq_ids else list(range(n))
        if n == 0 or len(seq_ids) != n or len(set(seq_ids)) != n:
            raise ValueError(f"numpy-engine: multi request needs {n} distinct seq_ids, got {seq_ids}")
        if any(len(s) == 0 for s in request.sequences):
            raise ValueError("numpy-engine: a sequence has no tokens")
        ids = [int(t) for s in request.sequences for t in s]
        seq = [sid for sid, s in zip(seq_ids, request.sequences, strict=True) for _ in s]
        ends = np.cumsum([len(s) for s in request.sequences]) - 1
        output = np.zeros(len(ids), dtype=bool)
        output[ends] = True
        logits = self.engine.prefill(caches, self.engine.batch(caches, ids, seq, output))
        n_log, state = len(self.engine.log), [caches.get(s).length for s in seq_ids]
        decode_logits = None
        if request.decode:
            decode = [tuple(int(t) for t in d) for d in request.decode]
            if len(decode) != n:
                raise ValueError(f"numpy-engine: {n} sequences but {len(decode)} decode lists")
            V = self.engine.cfg.vocab_size
            decode_logits = [np.empty((len(d), V), dtype=self.dtype) for d in decode]
            for j in range(max(len(d) for d in decode)):  # one batch per step: one token per live sequence
                live = [i for i, d in enumerate(decode) if j < len(d)]
                step = self.engine.batch(caches, [decode[i][j] for i in live], [seq_ids[i] for i in live],
                                         [True] * len(live))
                for i, row in zip(live, self.engine.prefill(caches, step), strict=True):
                    decode_logits[i][j] = row
        return Response(logits, decode_logits, self._executed("multi", n_log, state_len=state,
                                                              seq_ids=seq_ids))

