"""The mutant zoo: the numpy engine with one known bug planted, for the harness's self-test.

Each mutant is a small subclass of ``conformance.backends.numpy_engine`` that overrides one hook:
an engine method (a subclass of ``Engine``, installed as the backend's ``engine_class``), the cache
set (``Engine.cache_set_class``), or a request hook of the backend (``last_row``, ``piece_rows``).
The bugs are those of ``conformance-semantics.md`` section 3 (B1-B12) and the traps of
``gemma4-text-spec.md`` section 12. Every one of them must be caught by the bundled fixture sets at the
``fp32`` profile; ``expected_checks`` names the grading checks that count as catching it for the right
reason (None: any failing check). ``kill_sets`` names the bundled sets that can kill a mutant when only
some can (the image mutants: only the image sets hold image prompts, and the vision-block mutants need
a ``use_bidirectional_attention == "vision"`` checkpoint; the audio mutants: only ``e2b-audio-mini``
holds audio prompts, and its audio cases run the engine's own audio tower); empty: every mutant is
killed on ``all-features``.

The audio mutants (``gemma4-multimodal-spec.md`` section 9, traps 22-24) override the audio hooks of
``Engine``: ``audio_context`` (the local attention's chunk context), ``audio_logit_cap``,
``audio_soft_tokens`` and ``ple_ids``. A chunk size off by one (W + 1) is not among them: on the
miniature tower (W = 4, 4 past keys) it is an equivalent mutant, since the mask is a distance rule
and the relative-position rows stay the distances while ``(W + L + R) // 2 == L`` (measured: 2e-15).

Run one by hand (every mutant backend is a module-level class, listed in ``BACKENDS``):

    conformance check --backend conformance.mutants:ShiftInteriorRow --profile fp32 -q

From Python: ``for m in MUTANTS: backend = m.backend()`` (a fresh, unopened float64 backend).

``EQUIVALENT`` lists a planted bug that no float profile can see, with the reason (skipping the MoE
top-k renormalisation: the expert branch's own post-norm cancels it); it is not in ``MUTANTS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from conformance.backend import Backend
from conformance.backends.numpy_engine import (
    CacheSet, Engine, KVView, MicroBatch, NumpyEngineBackend, Rows, SequenceCache,
)
from refimpl.model import apply_rope, linear, rms_norm, rope_cos_sin, softmax

__all__ = ["AUDIO_SET", "BACKENDS", "CLOSENESS", "EQUIVALENT", "IMAGE_SETS", "IMAGE_SET_BIDIRECTIONAL", "IMAGE_SET_PLE",
           "MUTANTS", "Mutant", "mutant"]

CLOSENESS = frozenset({"max_abs", "max_rel", "nmse", "cosine", "kl", "kl_mean", "delta_p"})
IDENTITY = frozenset({"identity"})


# ----------------------------------------------------------------------------------------------
# B1: row shifted or wrong index (request hooks of the backend)


class ShiftInteriorRow(NumpyEngineBackend):
    """Last-logits entry points: an interior last_pos returns row last_pos + 1."""

    name = "mutant/shift-interior-row"

    def last_row(self, T: int, last_pos: int) -> int:
        return last_pos + 1 if last_pos < T - 1 else last_pos


class ShiftLastRow(NumpyEngineBackend):
    """Last-logits entry points: when last_pos is the call's last row, return row T - 2."""

    name = "mutant/shift-last-row"

    def last_row(self, T: int, last_pos: int) -> int:
        return max(T - 2, 0) if last_pos == T - 1 else last_pos


class ChunkBoundaryRow(NumpyEngineBackend):
    """Prefill with several pieces: the output rows of pieces after the first are read one row early."""

    name = "mutant/chunk-boundary-row"

    def piece_rows(self, p: int, rows) -> list[int]:
        rows = super().piece_rows(p, rows)
        return rows if p == 0 else sorted({max(r - 1, 0) for r in rows})


# ----------------------------------------------------------------------------------------------
# B2: the head not reproduced in the single-row path


class _SoftcapDroppedSingleRowEngine(Engine):
    def final_softcap(self, logits: np.ndarray) -> np.ndarray:
        return logits if logits.shape[0] == 1 else super().final_softcap(logits)


class SoftcapDroppedSingleRow(NumpyEngineBackend):
    """A one-row head (last-logits entry points, decode) skips the final softcap."""

    name = "mutant/softcap-dropped-single-row"
    engine_class = _SoftcapDroppedSingleRowEngine


class _SoftcapTwiceEngine(Engine):
    def final_softcap(self, logits: np.ndarray) -> np.ndarray:
        return super().final_softcap(super().final_softcap(logits))


class SoftcapTwice(NumpyEngineBackend):
    """The final softcap is applied twice."""

    name = "mutant/softcap-twice"
    engine_class = _SoftcapTwiceEngine


# ----------------------------------------------------------------------------------------------
# B7: pruned prefill misaligned (Engine.prune gathers some fields with the first |O| rows)


class _PruneHiddenNotPositionsEngine(Engine):
    def prune(self, rows: Rows, index: np.ndarray) -> Rows:
        out = super().prune(rows, index)
        out.pos = rows.pos[: len(index)]  # RoPE positions of the first |O| tokens
        return out


class PruneHiddenNotPositions(NumpyEngineBackend):
    """Pruning gathers the hidden rows but keeps the RoPE positions of the first |O| tokens."""

    name = "mutant/prune-hidden-not-positions"
    engine_class = _PruneHiddenNotPositionsEngine


class _PruneHiddenNotMaskEngine(Engine):
    def prune(self, rows: Rows, index: np.ndarray) -> Rows:
        out = super().prune(rows, index)
        out.mask_pos, out.slot = rows.mask_pos[: len(index)], rows.slot[: len(index)]  # mask rows of the first |O|
        return out


class PruneHiddenNotMask(NumpyEngineBackend):
    """Pruning gathers the hidden rows but keeps the mask rows (position, sequence) of the first |O| tokens."""

    name = "mutant/prune-hidden-not-mask"
    engine_class = _PruneHiddenNotMaskEngine


class _PruneHiddenNotPleEngine(Engine):
    def prune(self, rows: Rows, index: np.ndarray) -> Rows:
        out = super().prune(rows, index)
        if rows.ple is not None:
            out.ple = rows.ple[: len(index)]  # per-layer inputs of the first |O| tokens
        return out


class PruneHiddenNotPle(NumpyEngineBackend):
    """Pruning gathers the hidden rows but keeps the per-layer inputs of the first |O| tokens."""

    name = "mutant/prune-hidden-not-ple"
    engine_class = _PruneHiddenNotPleEngine


class _PruneOneLayerEarlyEngine(Engine):
    @property
    def prune_layer(self) -> int:
        return self.first_shared - 1


class PruneOneLayerEarly(NumpyEngineBackend):
    """Pruning happens before layer K - 1, so that KV-owning layer writes only the output rows' K/V."""

    name = "mutant/prune-one-layer-early"
    engine_class = _PruneOneLayerEarlyEngine


# ----------------------------------------------------------------------------------------------
# B5 / B6: sequences


class SharedCacheSet(CacheSet):
    """Every sequence id maps to one cache slot."""

    def get(self, seq) -> SequenceCache:
        return super().get("shared")


class _SeqStateLeakEngine(Engine):
    cache_set_class = SharedCacheSet


class SeqStateLeak(NumpyEngineBackend):
    """The sequences of one batch share one KV cache (and so see each other's keys)."""

    name = "mutant/seq-state-leak"
    engine_class = _SeqStateLeakEngine


class _SeqWrongOffsetsEngine(Engine):
    def next_positions(self, caches: CacheSet, seq: np.ndarray) -> np.ndarray:
        if len(set(seq.tolist())) > 1:
            return np.arange(len(seq), dtype=np.int64)  # the packed batch index, not each cache's length
        return super().next_positions(caches, seq)


class SeqWrongOffsets(NumpyEngineBackend):
    """In a batch of several sequences, positions are the packed batch index, not each sequence's own."""

    name = "mutant/seq-wrong-offsets"
    engine_class = _SeqWrongOffsetsEngine


# ----------------------------------------------------------------------------------------------
# B4: chunked prefill (a continuation chunk = a sequence's tokens of a later batch, more than one)


def _continuation(mb: MicroBatch) -> np.ndarray:
    """[n_slots] bool: the slot's part of this batch is a prefill chunk that continues a cache."""
    return (mb.chunk_start > 0) & (mb.chunk_len > 1)


class _ChunkLocalMaskEngine(Engine):
    def attention_mask(self, i: int, rows: Rows, kv: KVView, mb: MicroBatch) -> np.ndarray:
        allowed = super().attention_mask(i, rows, kv, mb)
        cached = kv.pos < mb.chunk_start[kv.slot]  # keys written before this chunk
        return allowed & ~(cached & _continuation(mb)[kv.slot])[None, :]


class ChunkLocalMask(NumpyEngineBackend):
    """A continuation chunk's mask is chunk-local (built as if it started at 0): the cached keys are hidden."""

    name = "mutant/chunk-local-mask"
    engine_class = _ChunkLocalMaskEngine


class _ChunkLocalPositionsEngine(Engine):
    def rope_positions(self, mb: MicroBatch) -> np.ndarray:
        local = _continuation(mb)[mb.slot]
        return np.where(local, mb.pos - mb.chunk_start[mb.slot], mb.pos)


class ChunkLocalPositions(NumpyEngineBackend):
    """RoPE positions restart at 0 in every prefill chunk (the mask still uses the true positions)."""

    name = "mutant/chunk-local-positions"
    engine_class = _ChunkLocalPositionsEngine


# ----------------------------------------------------------------------------------------------
# B10: embedding input convention


class _EmbeddingsScaledTwiceEngine(Engine):
    def input_embeddings(self, mb: MicroBatch) -> np.ndarray:
        x0 = super().input_embeddings(mb)
        return x0 * self.dtype.type(self.model.embed_scale) if mb.x0 is not None else x0


class EmbeddingsScaledTwice(NumpyEngineBackend):
    """The embeddings entry multiplies the given, already scaled embeddings by sqrt(H) again."""

    name = "mutant/embeddings-scaled-twice"
    engine_class = _EmbeddingsScaledTwiceEngine


class _SoftTokensScaledEngine(Engine):
    def input_embeddings(self, mb: MicroBatch) -> np.ndarray:
        x0 = super().input_embeddings(mb)
        if not mb.image.any():
            return x0
        x0 = np.array(x0, copy=True)
        x0[mb.image] *= self.dtype.type(self.model.embed_scale)  # as if the soft tokens were token embeddings
        return x0


class SoftTokensScaled(NumpyEngineBackend):
    """Image prompts: the soft tokens (image rows of the given embeddings) are multiplied by sqrt(H)."""

    name = "mutant/soft-tokens-scaled"
    engine_class = _SoftTokensScaledEngine


# ----------------------------------------------------------------------------------------------
# trap 17: multimodal per-layer inputs and vision masking (gemma4-multimodal-spec.md sections 6, 7)


class _PlePlaceholderRowEngine(Engine):
    def ple_ids(self, mb: MicroBatch) -> np.ndarray:
        return mb.ids  # the image token's own row of the per-layer table, not the pad row


class PlePlaceholderRow(NumpyEngineBackend):
    """Image prompts: per-layer inputs at image positions take the image token's own table row, not the pad row."""

    name = "mutant/ple-placeholder-row"
    engine_class = _PlePlaceholderRowEngine


class _VisionBlocksOnFullLayersEngine(Engine):
    def opens_vision_blocks(self, i: int) -> bool:
        return self.cfg.use_bidirectional_attention == "vision"  # every layer, as Gemma 3 did


class VisionBlocksOnFullLayers(NumpyEngineBackend):
    """Vision-bidirectional checkpoints: image blocks are opened on full layers too (Gemma 3 style)."""

    name = "mutant/vision-blocks-on-full-layers"
    engine_class = _VisionBlocksOnFullLayersEngine


class _VisionBlocksMissingEngine(Engine):
    def opens_vision_blocks(self, i: int) -> bool:
        return False


class VisionBlocksMissing(NumpyEngineBackend):
    """Vision-bidirectional checkpoints: image blocks are never opened (image tokens causal on every layer)."""

    name = "mutant/vision-blocks-missing"
    engine_class = _VisionBlocksMissingEngine


# ----------------------------------------------------------------------------------------------
# audio prompts: the engine's own audio tower and the audio rows of the decoder
# (gemma4-multimodal-spec.md section 9 and its traps 22-24; text-spec trap 17 for the PLE row)


class _AudioChunkingWrongEngine(Engine):
    def audio_context(self) -> tuple[int, int]:
        past, future = super().audio_context()
        return past + 1, future  # context_left past keys in each chunk's context, all of them admitted


class AudioChunkingWrong(NumpyEngineBackend):
    """Audio tower: the local attention admits attention_context_left keys (self + context_left - 1 past), one too many (trap 24)."""

    name = "mutant/audio-chunking-wrong"
    engine_class = _AudioChunkingWrongEngine


class _AudioLogitCapMissingEngine(Engine):
    def audio_logit_cap(self) -> float | None:
        return None


class AudioLogitCapMissing(NumpyEngineBackend):
    """Audio tower: the local attention's logit soft cap (attention_logit_cap) is not applied."""

    name = "mutant/audio-logit-cap-missing"
    engine_class = _AudioLogitCapMissingEngine


class _AudioSoftTokensScaledEngine(Engine):
    def audio_soft_tokens(self, features: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return super().audio_soft_tokens(features, mask) * self.dtype.type(self.model.embed_scale)


class AudioSoftTokensScaled(NumpyEngineBackend):
    """Audio prompts: the audio soft tokens are multiplied by sqrt(H) as if they were token embeddings."""

    name = "mutant/audio-soft-tokens-scaled"
    engine_class = _AudioSoftTokensScaledEngine


class _AudioPlePlaceholderRowEngine(Engine):
    def ple_ids(self, mb: MicroBatch) -> np.ndarray:
        pad = self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0
        return np.where(mb.image, pad, mb.ids)  # the pad row at image positions only: audio keep their own row


class AudioPlePlaceholderRow(NumpyEngineBackend):
    """Audio prompts: per-layer inputs at audio positions take the audio token's own table row, not the pad row."""

    name = "mutant/audio-ple-placeholder-row"
    engine_class = _AudioPlePlaceholderRowEngine


# ----------------------------------------------------------------------------------------------
# the spec's traps (gemma4-text-spec.md section 12)


class _NormOnePlusWEngine(Engine):
    def norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return rms_norm(x, 1.0 + weight, self.eps)


class NormOnePlusW(NumpyEngineBackend):
    """RMSNorm multiplies by (1 + w) as in Gemma 1-3 (trap 1)."""

    name = "mutant/norm-one-plus-w"
    engine_class = _NormOnePlusWEngine


class _AttentionScaleRsqrtDEngine(Engine):
    def attend(self, q: np.ndarray, kv: KVView, mask: np.ndarray) -> np.ndarray:
        return super().attend(q * q.shape[-1] ** -0.5, kv, mask)


class AttentionScaleRsqrtD(NumpyEngineBackend):
    """Attention scores scaled by 1/sqrt(D) instead of 1.0 (trap 2)."""

    name = "mutant/attention-scale-rsqrt-d"
    engine_class = _AttentionScaleRsqrtDEngine


class _RopeOrdinaryPartialEngine(Engine):
    def rope(self, i: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        spec = self.cfg.layers[i]
        if spec.rope.rope_type != "proportional":
            return super().rope(i, x, pos)
        n_rot = int(spec.rope.partial_rotary_factor * spec.head_dim // 2)
        d = 2 * n_rot  # rotate the first 2 n_rot dims, denominator 2 n_rot, pairs (j, j + n_rot)
        inv_freq = 1.0 / spec.rope.theta ** (np.arange(0, d, 2) / d) / spec.rope.factor
        cos, sin = rope_cos_sin(pos, inv_freq)
        rotated = apply_rope(x[..., :d], cos.astype(self.dtype), sin.astype(self.dtype))
        return np.concatenate([rotated, x[..., d:]], axis=-1)


class RopeOrdinaryPartial(NumpyEngineBackend):
    """Full layers use ordinary partial RoPE on the first 2 n_rot dims, denominator 2 n_rot (trap 3)."""

    name = "mutant/rope-ordinary-partial"
    engine_class = _RopeOrdinaryPartialEngine


class _SlidingWindowOffByOneEngine(Engine):
    def window(self, i: int) -> int:
        return super().window(i) + 1


class SlidingWindowOffByOne(NumpyEngineBackend):
    """Sliding layers see W + 1 keys (itself and W earlier ones), and keep W in the cache (trap 7)."""

    name = "mutant/sliding-window-off-by-one"
    engine_class = _SlidingWindowOffByOneEngine


class _KeqvVIsRotatedKEngine(Engine):
    def values(self, i: int, h: np.ndarray, kr: np.ndarray, k: np.ndarray) -> np.ndarray:
        return k if self.cfg.layers[i].k_eq_v else super().values(i, h, kr, k)


class KeqvVIsRotatedK(NumpyEngineBackend):
    """K=V layers use V = K after k_norm and RoPE instead of v_norm(raw k_proj) (trap 5)."""

    name = "mutant/keqv-v-is-rotated-k"
    engine_class = _KeqvVIsRotatedKEngine


class _SharedWrongSourceEngine(Engine):
    def kv_source(self, i: int) -> int:
        spec = self.cfg.layers[i]
        if spec.owns_kv:
            return i
        return min(j for j in range(self.first_shared) if self.cfg.layers[j].layer_type == spec.layer_type)


class SharedWrongSource(NumpyEngineBackend):
    """A KV-shared layer reads the FIRST KV-owning layer of its type instead of the last (trap 8)."""

    name = "mutant/shared-wrong-source"
    engine_class = _SharedWrongSourceEngine


class _PleMissingSqrtPEngine(Engine):
    def ple_table_rows(self, ids: np.ndarray) -> np.ndarray:
        # per_layer_inputs multiplies the table rows by sqrt(P); undoing it = the lookup is not scaled
        return super().ple_table_rows(ids) / math.sqrt(self.cfg.hidden_size_per_layer_input)


class PleMissingSqrtP(NumpyEngineBackend):
    """The per-layer-embedding table lookup is not multiplied by sqrt(P) (trap 10)."""

    name = "mutant/ple-missing-sqrt-p"
    engine_class = _PleMissingSqrtPEngine


class _MoeNoRenormaliseEngine(Engine):
    def route(self, i: int, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = f"layers.{i}."
        z = rms_norm(r, None, self.eps) * self.w[p + "router.scale"] * r.shape[-1] ** -0.5
        probs = softmax(linear(z, self.w[p + "router.proj.weight"]))  # [R, E]
        idx = np.argsort(-probs, axis=-1, kind="stable")[:, : self.cfg.top_k_experts]
        top = np.take_along_axis(probs, idx, axis=-1)  # not renormalised to sum 1
        return idx, top * self.w[p + "router.per_expert_scale"][idx]


class MoeNoRenormalise(NumpyEngineBackend):
    """MoE router weights are the top-k softmax probabilities without renormalising them (trap 12)."""

    name = "mutant/moe-no-renormalise"
    engine_class = _MoeNoRenormaliseEngine


class _MoeRouterNormedInputEngine(Engine):
    def route(self, i: int, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return super().route(i, self.norm(r, self.w[f"layers.{i}.pre_feedforward_layernorm_2.weight"]))


class MoeRouterNormedInput(NumpyEngineBackend):
    """The MoE router reads the expert branch's pre-normed input, not the un-normalised residual (trap 12)."""

    name = "mutant/moe-router-normed-input"
    engine_class = _MoeRouterNormedInputEngine


class _LayerScalarSkippedEngine(Engine):
    def layer_scalar(self, i: int) -> float:
        return 1.0


class LayerScalarSkipped(NumpyEngineBackend):
    """The per-layer layer_scalar is not applied (trap 11)."""

    name = "mutant/layer-scalar-skipped"
    engine_class = _LayerScalarSkippedEngine


class _VNormMissingEngine(Engine):
    def value_norm(self, v: np.ndarray) -> np.ndarray:
        return v


class VNormMissing(NumpyEngineBackend):
    """Values are not passed through the scale-free v_norm (trap 4)."""

    name = "mutant/v-norm-missing"
    engine_class = _VNormMissingEngine


# ----------------------------------------------------------------------------------------------
# the catalogue


@dataclass(frozen=True)
class Mutant:
    name: str  # short id, e.g. "shift-interior-row"
    breaks: str  # one line: what it breaks
    bug_class: str  # "B1".."B12" (conformance-semantics.md section 3) or "trap N" (gemma4-text-spec.md section 12)
    expected_checks: frozenset[str] | None  # grading checks that count as "caught by the matching check"; None = any
    backend_class: type = field(repr=False, compare=False, default=NumpyEngineBackend)
    kill_sets: tuple[str, ...] = ()  # the bundled sets that can kill it, when only some can; () = any (all-features)

    def backend(self) -> Backend:
        """A fresh mutated numpy-engine (float64), not yet opened."""
        return self.backend_class()


def _m(cls: type, bug_class: str, expected: frozenset[str] | None = None, kill_sets: tuple[str, ...] = ()) -> Mutant:
    name = cls.name.removeprefix("mutant/")
    return Mutant(name, cls.__doc__.strip().splitlines()[0], bug_class, expected, cls, tuple(kill_sets))


#: the bundled image sets: PLE with image tokens causal (E-series), and bidirectional vision blocks (31B)
IMAGE_SET_PLE = "e2b-vision-mini"
IMAGE_SET_BIDIRECTIONAL = "31b-vision-mini"
IMAGE_SETS = (IMAGE_SET_PLE, IMAGE_SET_BIDIRECTIONAL)
#: the bundled audio set: E2B miniature with PLE and a tiny audio tower (audio bases S0, S1)
AUDIO_SET = "e2b-audio-mini"


MUTANTS: tuple[Mutant, ...] = (
    _m(ShiftInteriorRow, "B1", IDENTITY),
    _m(ShiftLastRow, "B1", IDENTITY),
    _m(ChunkBoundaryRow, "B1", IDENTITY),
    _m(SoftcapDroppedSingleRow, "B2", CLOSENESS),
    _m(SoftcapTwice, "B2", CLOSENESS),
    _m(PruneHiddenNotPositions, "B7"),
    _m(PruneHiddenNotMask, "B7"),
    _m(PruneHiddenNotPle, "B7"),
    _m(PruneOneLayerEarly, "B7"),
    _m(SeqStateLeak, "B5"),
    _m(SeqWrongOffsets, "B6"),
    _m(ChunkLocalMask, "B4"),
    _m(ChunkLocalPositions, "B4"),
    _m(EmbeddingsScaledTwice, "B10"),
    _m(SoftTokensScaled, "B10", kill_sets=(IMAGE_SET_PLE, IMAGE_SET_BIDIRECTIONAL)),
    _m(NormOnePlusW, "trap 1"),
    _m(AttentionScaleRsqrtD, "trap 2"),
    _m(RopeOrdinaryPartial, "trap 3"),
    _m(VNormMissing, "trap 4"),
    _m(KeqvVIsRotatedK, "trap 5"),
    _m(SlidingWindowOffByOne, "trap 7"),
    _m(SharedWrongSource, "trap 8"),
    _m(PleMissingSqrtP, "trap 10"),
    _m(LayerScalarSkipped, "trap 11"),
    _m(MoeRouterNormedInput, "trap 12"),
    _m(PlePlaceholderRow, "trap 17", kill_sets=(IMAGE_SET_PLE,)),
    _m(VisionBlocksOnFullLayers, "trap 17", kill_sets=(IMAGE_SET_BIDIRECTIONAL,)),
    _m(VisionBlocksMissing, "trap 17", kill_sets=(IMAGE_SET_BIDIRECTIONAL,)),
    _m(AudioChunkingWrong, "mm trap 24", kill_sets=(AUDIO_SET,)),
    _m(AudioLogitCapMissing, "mm §9", kill_sets=(AUDIO_SET,)),
    _m(AudioSoftTokensScaled, "B10", kill_sets=(AUDIO_SET,)),
    _m(AudioPlePlaceholderRow, "trap 17", kill_sets=(AUDIO_SET,)),
)

BACKENDS: dict[str, type] = {m.name: m.backend_class for m in MUTANTS}

# Bugs that are real but that no logits test can see at a float profile: kept as classes (and
# listed here, outside MUTANTS, with the reason) so the self-test does not count them as survivors.
EQUIVALENT: dict[str, tuple[Mutant, str]] = {
    "moe-no-renormalise": (
        _m(MoeNoRenormalise, "trap 12"),
        "skipping the top-k renormalisation scales each token's expert sum by one positive number "
        "(1 / sum of its top-k probabilities), and post_feedforward_layernorm_2 (an RMSNorm) comes right "
        "after the expert sum and removes any per-token scale; only the eps of that norm leaks the "
        "difference (max_abs ~3e-5 on the bundled MoE sets: caught at exact-f64, invisible at fp32 and "
        "coarser, on any input)",
    ),
}


def mutant(name: str) -> Mutant:
    """The mutant called ``name`` (KeyError with the known names otherwise)."""
    for m in MUTANTS:
        if m.name == name:
            return m
    raise KeyError(f"unknown mutant {name!r}; known: {', '.join(BACKENDS)}")
