"""What a call's positions decide, made once per call: RoPE's angles and the attention masks.

Every layer of a type rotates the same positions and, without vision blocks, masks its queries against the same
keys, so a call of ``Gemma4.hidden_states`` makes each table once, on the model's device (only the positions
and the frequencies cross: on a GPU the angles' cos and sin are CUDA's, within a unit of rounding of the host's,
and a [T, T] mask is not copied a layer type at a time). ``clear`` when the call returns: a long prompt's
tables are not kept.
"""

from __future__ import annotations

import numpy as np

from .config import RopeSpec, TextConfig
from .ops import attention_mask, rope_cos_sin

__all__ = ["CallTables", "rope_inv_freq"]


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> np.ndarray:
    """Inverse frequencies [D/2] for the rotate-half pairs (i, i + D/2).

    default:      1 / theta^(2i/D) for every pair.
    proportional: the first n_rot = int(prf * D // 2) pairs get 1 / theta^(2i/D) / factor, with the
                  FULL head dim D as denominator; the remaining pairs get 0 (cos 1, sin 0: identity).
    """
    if rope.rope_type == "default":
        return 1.0 / rope.theta ** (np.arange(0, head_dim, 2) / head_dim)
    n_rot = int(rope.partial_rotary_factor * head_dim // 2)
    rotated = 1.0 / rope.theta ** (np.arange(0, 2 * n_rot, 2) / head_dim) / rope.factor
    return np.concatenate([rotated, np.zeros(head_dim // 2 - n_rot)])


class CallTables:
    """RoPE cos/sin per (layer type, head dim) and masks per (window, query positions, key positions) of one
    call, on the model's device (``xp``) in its compute dtype."""

    def __init__(self, cfg: TextConfig, dtype: np.dtype, xp):
        self.inv_freq = {(layer.layer_type, layer.head_dim): rope_inv_freq(layer.rope, layer.head_dim)
                         for layer in cfg.layers}
        self.dtype, self.xp = dtype, xp
        self._rope: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._masks: dict[tuple[int | None, bytes, bytes], np.ndarray] = {}

    def rope(self, layer_type: str, head_dim: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [T, D/2] of a layer type's RoPE at ``positions``."""
        key = (layer_type, head_dim)
        kept = self._rope.get(key)
        if kept is None or not np.array_equal(kept[0], positions):
            xp = self.xp
            cos, sin = rope_cos_sin(xp.asarray(positions), xp.asarray(self.inv_freq[key]))
            kept = self._rope[key] = (positions.copy(), cos.astype(self.dtype, copy=False),
                                      sin.astype(self.dtype, copy=False))
        return kept[1], kept[2]

    def mask(self, q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> np.ndarray:
        """``ops.attention_mask(q_pos, k_pos, window)`` [T, S], made on the device."""
        key = (window, q_pos.tobytes(), k_pos.tobytes())
        if key not in self._masks:
            self._masks[key] = attention_mask(self.xp.asarray(q_pos), self.xp.asarray(k_pos), window)
        return self._masks[key]

    def clear(self) -> None:
        self._rope.clear()
        self._masks.clear()
