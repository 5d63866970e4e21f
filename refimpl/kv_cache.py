"""The oracle's KV cache: per KV-owning layer the keys and values of one sequence (on the model's device) and
their positions (on the host)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .arrays import take_rows
from .errors import InputError

__all__ = ["KVCache", "LayerKV"]


@dataclass
class LayerKV:
    """K/V of one KV-owning layer: post-k_norm, post-RoPE keys and post-v_norm values, with positions."""

    k: np.ndarray  # [S, K, D]
    v: np.ndarray  # [S, K, D]
    pos: np.ndarray  # [S] absolute positions
    blocks: np.ndarray | None = None  # [S] vision block ids of the keys during one call (-1 outside); not cached


@dataclass
class KVCache:
    """Per-sequence state. Sliding layers keep their last W - 1 keys (all a future query can see);
    full layers keep everything; KV-shared layers own nothing and read their source layer's K/V."""

    length: int = 0
    layers: dict[int, LayerKV] = field(default_factory=dict)
    keep_all: bool = False  # sliding layers keep every key too (the mask still applies the window): a
    #                         speculative round can then roll back rejected tokens (``truncate``)

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (rejected drafts). Needs ``keep_all`` for sliding
        layers: a cache trimmed to W - 1 keys no longer holds the keys before the rejected ones."""
        if not 0 <= length <= self.length:
            raise InputError(f"cannot truncate a cache of {self.length} positions to {length}")
        for i, kv in self.layers.items():
            keep = kv.pos < length
            self.layers[i] = LayerKV(take_rows(kv.k, keep), take_rows(kv.v, keep), kv.pos[keep])
        self.length = length
