"""The numpy engine's state: batches of tagged tokens and per-sequence KV caches (llama.cpp's ``llama_batch``,
``ubatch`` and KV cells), the records the engine's hooks (``conformance.selftest.engine``) pass between steps.

* :class:`Batch`: T tokens, each with a sequence id, an absolute position, an output flag, a vision block id
  and an audio flag; :class:`MicroBatch`: a slice of one that runs as one forward through the caches.
* :class:`SequenceCache`: one sequence's keys, values, positions and vision block ids per KV-owning layer;
  :class:`CacheSet`: a request's caches, keyed by sequence id.
* :class:`Rows`: the rows a micro-batch carries through the layers (every token, or the output rows after
  pruning) and what each mask row is built for; :class:`KVView`: the keys one layer attends over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refimpl.model import LayerKV

__all__ = ["Batch", "CacheSet", "KVView", "LayerKV", "MicroBatch", "NO_BLOCK", "PLAIN_SEQ", "Rows", "SequenceCache",
           "no_blocks"]

PLAIN_SEQ = -1  # the sequence id of the plain last-logits entry point (the engine's fallback slot)
NO_BLOCK = -1  # the vision block id of a text token (and of every key written by one)


def no_blocks(n: int) -> np.ndarray:
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
        block = no_blocks(pos.shape[0]) if block is None else np.asarray(block, dtype=np.int64)
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
            self.block = no_blocks(len(self))
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
