"""The mutant zoo: the numpy engine with one known bug planted, for the harness's self-test.

Each mutant is the numpy engine (``conformance.selftest.engine``) with one hook replaced, made by one factory
(``planted``): an engine method or attribute (``engine=``: a method of ``Engine``, or ``cache_set_class``), or a
request hook of the backend (``backend=``: ``last_row``, ``piece_rows``). The bugs are those of
``conformance-semantics.md`` section 3 (B1-B12) and the traps of ``gemma4-text-spec.md`` section 12. Every one of them
must be caught by the bundled fixture sets at the ``fp32`` profile; ``expected_checks`` names the grading checks that
count as catching it for the right reason (None: any failing check). ``kill_sets`` names the bundled sets that can
kill a mutant when only some can (the image mutants: only the image sets hold image prompts, and the vision-block
mutants need a ``use_bidirectional_attention == "vision"`` checkpoint; the audio mutants: only ``e2b-audio-mini``
holds audio prompts, and its audio cases run the engine's own audio tower); empty: every mutant is killed on
``all-features``.

The Gemma 4 Unified mutants (``gemma4-unified-and-mtp-spec.md`` E2: U2 window clamp, U4 a block split across
micro-batches, U6 LayerNorm kind and eps, U7 patch order, U8 position axes, U9 padding rows, U10 the audio embedder's
norm; U1/U3/U5 are the vision-block and soft-token mutants above, also killed on ``12b-mini``) override the engine's
own embedder steps (``patch_norm``, ``patch_values``, ``patch_position_embedding``, ``real_patches``,
``audio_frame_norm``), ``vision_overlay`` and ``split``. k_eq_v (U11) is ``keqv-v-is-rotated-k``, killed on every K=V
set.

The audio mutants (``gemma4-multimodal-spec.md`` section 9, traps 22-24) override the audio hooks of ``Engine``:
``audio_context`` (the local attention's chunk context), ``audio_logit_cap``, ``audio_soft_tokens`` and ``ple_ids``. A
chunk size off by one (W + 1) is not among them: on the miniature tower (W = 4, 4 past keys) it is an equivalent
mutant, since the mask is a distance rule and the relative-position rows stay the distances while ``(W + L + R) // 2
== L`` (measured: 2e-15).

Run one by hand (every mutant backend is a module-level class, listed in ``BACKENDS``; from Python: ``for m in
MUTANTS: backend = m.backend()``, a fresh, unopened float64 backend):

    conformance check --backend conformance.selftest.mutants:ShiftInteriorRow --profile fp32 -q

``EQUIVALENT`` lists a planted bug that no float profile can see, with the reason (skipping the MoE
top-k renormalisation: the expert branch's own post-norm cancels it); it is not in ``MUTANTS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from refimpl.ops import linear, rope_cos_sin
from refimpl.schedule import apply_rope, layer_norm, rms_norm, softmax
from refimpl.unified import LAYER_NORM_EPS

from ..protocol.types import Backend
from . import video_mutants as vm
from .backend import NumpyEngineBackend
from .engine import Engine
from .mtp_mutants import (
    MTP_MEDIA_SETS,
    HiddenNormWeightSkipped,
    HiddenPreNorm,
    MtpBatchSharedState,
    MtpCentroidTopKMinus1,
    MtpDrafterReadsPreNorm,
    MtpEmbeddingUnscaled,
    MtpFirstRoundZeroHidden,
    MtpFirstStoreLayer,
    MtpFixedTargetState,
    MtpKeysRerotated,
    MtpLastRowAfterPartial,
    MtpMediaPositionsWithoutSoftTokens,
    MtpMediaStateNotAdvanced,
    MtpNoRollback,
    MtpPositionAdvances,
    MtpPositionalStoreLayers,
    MtpPositionPMinus1,
)
from .planting import planted
from .ple_mutants import PleFoldEpsKept, PleFoldEpsOverS, PleFoldRight
from .state import CacheSet, KVView, MicroBatch, Rows, SequenceCache
from .video_mutants import VideoFramesNotVision, VideoFramesOneBlock, VideoTimestampsDropped

__all__ = ["AUDIO_SET", "BACKENDS", "MTP_MEDIA_SETS", "MTP_SETS", "MTP_SET_CENTROID", "MTP_SET_LAYOUT", "CLOSENESS",
           "EQUIVALENT", "IMAGE_SETS", "IMAGE_SET_BIDIRECTIONAL", "IMAGE_SET_PLE", "MUTANTS", "Mutant", "PLE_EPS_SET",
           "REWRITES", "UNIFIED_SET", "mutant", "planted"]

CLOSENESS = frozenset({"max_abs", "max_rel", "nmse", "cosine", "kl", "kl_mean", "delta_p"})
IDENTITY = frozenset({"identity"})
HIDDEN = frozenset({"hidden", "hidden_identity"})
MTP = CLOSENESS | IDENTITY | frozenset({"top1", "topk", "mtp_output", "mtp_accepted", "mtp_trace"})
# the MTP and hidden-state mutants are defined in mtp_mutants.py (they replace hooks of selftest/mtp.py)

# ----------------------------------------------------------------------------------------------
# B1: row shifted or wrong index (request hooks of the backend)

ShiftInteriorRow = planted(
    "shift-interior-row", "Last-logits entry points: an interior last_pos returns row last_pos + 1.",
    backend={"last_row": lambda self, T, last_pos: last_pos + 1 if last_pos < T - 1 else last_pos})

ShiftLastRow = planted(
    "shift-last-row", "Last-logits entry points: when last_pos is the call's last row, return row T - 2.",
    backend={"last_row": lambda self, T, last_pos: max(T - 2, 0) if last_pos == T - 1 else last_pos})


def _rows_one_early(self, p: int, rows) -> list[int]:
    rows = NumpyEngineBackend.piece_rows(self, p, rows)
    return rows if p == 0 else sorted({max(r - 1, 0) for r in rows})


ChunkBoundaryRow = planted(
    "chunk-boundary-row", "Prefill with several pieces: the output rows of pieces after the first are read one row "
                          "early.",
    backend={"piece_rows": _rows_one_early})


# ----------------------------------------------------------------------------------------------
# B2: the head not reproduced in the single-row path

SoftcapDroppedSingleRow = planted(
    "softcap-dropped-single-row", "A one-row head (last-logits entry points, decode) skips the final softcap.",
    engine={"final_softcap": lambda self, logits: (logits if logits.shape[0] == 1
                                                   else Engine.final_softcap(self, logits))})

SoftcapTwice = planted(
    "softcap-twice", "The final softcap is applied twice.",
    engine={"final_softcap": lambda self, logits: Engine.final_softcap(self, Engine.final_softcap(self, logits))})

# ----------------------------------------------------------------------------------------------
# B7: pruned prefill misaligned (Engine.prune gathers some fields with the first |O| rows)


def _prune_keeping(*fields: str):
    """An Engine.prune that gathers the hidden rows but keeps ``fields`` of the first |O| tokens."""

    def prune(self, rows: Rows, index: np.ndarray) -> Rows:
        out = Engine.prune(self, rows, index)
        for f in fields:
            if getattr(rows, f) is not None:
                setattr(out, f, getattr(rows, f)[: len(index)])
        return out

    return prune


PruneHiddenNotPositions = planted(
    "prune-hidden-not-positions", "Pruning gathers the hidden rows but keeps the RoPE positions of the first |O| "
                                  "tokens.",
    engine={"prune": _prune_keeping("pos")})

PruneHiddenNotMask = planted(
    "prune-hidden-not-mask",
    "Pruning gathers the hidden rows but keeps the mask rows (position, sequence) of the first |O| tokens.",
    engine={"prune": _prune_keeping("mask_pos", "slot")})

PruneHiddenNotPle = planted(
    "prune-hidden-not-ple", "Pruning gathers the hidden rows but keeps the per-layer inputs of the first |O| tokens.",
    engine={"prune": _prune_keeping("ple")})

PruneOneLayerEarly = planted(
    "prune-one-layer-early",
    "Pruning happens before layer K - 1, so that KV-owning layer writes only the output rows' K/V.",
    engine={"prune_layer": property(lambda self: self.first_shared - 1)})


# ----------------------------------------------------------------------------------------------
# B5 / B6: sequences


class SharedCacheSet(CacheSet):
    """Every sequence id maps to one cache slot."""

    def get(self, seq) -> SequenceCache:
        return super().get("shared")


SeqStateLeak = planted(
    "seq-state-leak", "The sequences of one batch share one KV cache (and so see each other's keys).",
    engine={"cache_set_class": SharedCacheSet})


def _packed_positions(self, caches: CacheSet, seq: np.ndarray) -> np.ndarray:
    if len(set(seq.tolist())) > 1:
        return np.arange(len(seq), dtype=np.int64)  # the packed batch index, not each cache's length
    return Engine.next_positions(self, caches, seq)


SeqWrongOffsets = planted(
    "seq-wrong-offsets",
    "In a batch of several sequences, positions are the packed batch index, not each sequence's own.",
    engine={"next_positions": _packed_positions})


# ----------------------------------------------------------------------------------------------
# B4: chunked prefill (a continuation chunk = a sequence's tokens of a later batch, more than one)


def _continuation(mb: MicroBatch) -> np.ndarray:
    """[n_slots] bool: the slot's part of this batch is a prefill chunk that continues a cache."""
    return (mb.chunk_start > 0) & (mb.chunk_len > 1)


def _chunk_local_mask(self, i: int, rows: Rows, kv: KVView, mb: MicroBatch) -> np.ndarray:
    allowed = Engine.attention_mask(self, i, rows, kv, mb)
    cached = kv.pos < mb.chunk_start[kv.slot]  # keys written before this chunk
    return allowed & ~(cached & _continuation(mb)[kv.slot])[None, :]


def _chunk_local_positions(self, mb: MicroBatch) -> np.ndarray:
    local = _continuation(mb)[mb.slot]
    return np.where(local, mb.pos - mb.chunk_start[mb.slot], mb.pos)


ChunkLocalMask = planted(
    "chunk-local-mask",
    "A continuation chunk's mask is chunk-local (built as if it started at 0): the cached keys are hidden.",
    engine={"attention_mask": _chunk_local_mask})

ChunkLocalPositions = planted(
    "chunk-local-positions", "RoPE positions restart at 0 in every prefill chunk (the mask still uses the true "
                             "positions).",
    engine={"rope_positions": _chunk_local_positions})


# ----------------------------------------------------------------------------------------------
# B10: embedding input convention


def _embeddings_scaled_twice(self, mb: MicroBatch) -> np.ndarray:
    x0 = Engine.input_embeddings(self, mb)
    return x0 * self.dtype.type(self.model.embed_scale) if mb.x0 is not None else x0


def _soft_tokens_scaled(self, mb: MicroBatch) -> np.ndarray:
    x0 = Engine.input_embeddings(self, mb)
    if not mb.image.any():
        return x0
    x0 = np.array(x0, copy=True)
    x0[mb.image] *= self.dtype.type(self.model.embed_scale)  # as if the soft tokens were token embeddings
    return x0


EmbeddingsScaledTwice = planted(
    "embeddings-scaled-twice", "The embeddings entry multiplies the given, already scaled embeddings by sqrt(H) again.",
    engine={"input_embeddings": _embeddings_scaled_twice})

SoftTokensScaled = planted(
    "soft-tokens-scaled", "Image prompts: the soft tokens (image rows of the given embeddings) are multiplied by "
                          "sqrt(H).",
    engine={"input_embeddings": _soft_tokens_scaled})


# ----------------------------------------------------------------------------------------------
# trap 17: multimodal per-layer inputs and vision masking (gemma4-multimodal-spec.md sections 6, 7)

PlePlaceholderRow = planted(
    "ple-placeholder-row",
    "Image prompts: per-layer inputs at image positions take the image token's own table row, not the pad row.",
    engine={"ple_ids": lambda self, mb: mb.ids})  # the image token's own row of the per-layer table

VisionBlocksOnFullLayers = planted(
    "vision-blocks-on-full-layers",
    "Vision-bidirectional checkpoints: image blocks are opened on full layers too (Gemma 3 style).",
    engine={"opens_vision_blocks": lambda self, i: self.cfg.use_bidirectional_attention == "vision"})

VisionBlocksMissing = planted(
    "vision-blocks-missing",
    "Vision-bidirectional checkpoints: image blocks are never opened (image tokens causal on every layer).",
    engine={"opens_vision_blocks": lambda self, i: False})


# ----------------------------------------------------------------------------------------------
# audio prompts: the engine's own audio tower and the audio rows of the decoder
# (gemma4-multimodal-spec.md section 9 and its traps 22-24; text-spec trap 17 for the PLE row)


def _audio_context_one_more(self) -> tuple[int, int]:
    past, future = Engine.audio_context(self)
    return past + 1, future  # context_left past keys in each chunk's context, all of them admitted


def _audio_ple_own_row(self, mb: MicroBatch) -> np.ndarray:
    pad = self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0
    return np.where(mb.image, pad, mb.ids)  # the pad row at image positions only: audio keep their own row


AudioChunkingWrong = planted(
    "audio-chunking-wrong",
    "Audio tower: the local attention admits attention_context_left keys (self + context_left - 1 past), one too many "
    "(trap 24).",
    engine={"audio_context": _audio_context_one_more})

AudioLogitCapMissing = planted(
    "audio-logit-cap-missing", "Audio tower: the local attention's logit soft cap (attention_logit_cap) is not "
                               "applied.",
    engine={"audio_logit_cap": lambda self: None})

AudioSoftTokensScaled = planted(
    "audio-soft-tokens-scaled", "Audio prompts: the audio soft tokens are multiplied by sqrt(H) as if they were token "
                                "embeddings.",
    engine={"audio_soft_tokens": lambda self, features, mask: (Engine.audio_soft_tokens(self, features, mask)
                                                               * self.dtype.type(self.model.embed_scale))})

AudioPlePlaceholderRow = planted(
    "audio-ple-placeholder-row",
    "Audio prompts: per-layer inputs at audio positions take the audio token's own table row, not the pad row.",
    engine={"ple_ids": _audio_ple_own_row})


# ----------------------------------------------------------------------------------------------
# the spec's traps (gemma4-text-spec.md section 12)


def _rope_ordinary_partial(self, i: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    spec = self.cfg.layers[i]
    if spec.rope.rope_type != "proportional":
        return Engine.rope(self, i, x, pos)
    n_rot = int(spec.rope.partial_rotary_factor * spec.head_dim // 2)
    d = 2 * n_rot  # rotate the first 2 n_rot dims, denominator 2 n_rot, pairs (j, j + n_rot)
    inv_freq = 1.0 / spec.rope.theta ** (np.arange(0, d, 2) / d) / spec.rope.factor
    cos, sin = rope_cos_sin(pos, inv_freq)
    rotated = apply_rope(x[..., :d], cos.astype(self.dtype), sin.astype(self.dtype))
    return np.concatenate([rotated, x[..., d:]], axis=-1)


def _first_source_of_type(self, i: int) -> int:
    spec = self.cfg.layers[i]
    if spec.owns_kv:
        return i
    return min(j for j in range(self.first_shared) if self.cfg.layers[j].layer_type == spec.layer_type)


def _ple_unscaled(self, ids: np.ndarray) -> np.ndarray:
    # per_layer_inputs multiplies the table rows by sqrt(P); undoing it = the lookup is not scaled
    return Engine.ple_table_rows(self, ids) / math.sqrt(self.cfg.hidden_size_per_layer_input)


def _route_not_renormalised(self, i: int, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = f"layers.{i}."
    z = rms_norm(r, None, self.eps) * self.w[p + "router.scale"] * r.shape[-1] ** -0.5
    probs = softmax(linear(z, self.w[p + "router.proj.weight"]))  # [R, E]
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, : self.cfg.top_k_experts]
    top = np.take_along_axis(probs, idx, axis=-1)  # not renormalised to sum 1
    return idx, top * self.w[p + "router.per_expert_scale"][idx]


NormOnePlusW = planted(
    "norm-one-plus-w", "RMSNorm multiplies by (1 + w) as in Gemma 1-3 (trap 1).",
    engine={"norm": lambda self, x, weight: rms_norm(x, 1.0 + weight, self.eps)})

AttentionScaleRsqrtD = planted(
    "attention-scale-rsqrt-d", "Attention scores scaled by 1/sqrt(D) instead of 1.0 (trap 2).",
    engine={"attend": lambda self, q, kv, mask: Engine.attend(self, q * q.shape[-1] ** -0.5, kv, mask)})

RopeOrdinaryPartial = planted(
    "rope-ordinary-partial", "Full layers use ordinary partial RoPE on the first 2 n_rot dims, denominator 2 n_rot "
                             "(trap 3).",
    engine={"rope": _rope_ordinary_partial})

SlidingWindowOffByOne = planted(
    "sliding-window-off-by-one", "Sliding layers see W + 1 keys (itself and W earlier ones), and keep W in the cache "
                                 "(trap 7).",
    engine={"window": lambda self, i: Engine.window(self, i) + 1})

KeqvVIsRotatedK = planted(
    "keqv-v-is-rotated-k", "K=V layers use V = K after k_norm and RoPE instead of v_norm(raw k_proj) (trap 5).",
    engine={"values": lambda self, i, h, kr, k: k if self.cfg.layers[i].k_eq_v else Engine.values(self, i, h, kr, k)})

SharedWrongSource = planted(
    "shared-wrong-source", "A KV-shared layer reads the FIRST KV-owning layer of its type instead of the last (trap "
                           "8).",
    engine={"kv_source": _first_source_of_type})

PleMissingSqrtP = planted(
    "ple-missing-sqrt-p", "The per-layer-embedding table lookup is not multiplied by sqrt(P) (trap 10).",
    engine={"ple_table_rows": _ple_unscaled})

MoeNoRenormalise = planted(
    "moe-no-renormalise", "MoE router weights are the top-k softmax probabilities without renormalising them (trap "
                          "12).",
    engine={"route": _route_not_renormalised})

MoeRouterNormedInput = planted(
    "moe-router-normed-input",
    "The MoE router reads the expert branch's pre-normed input, not the un-normalised residual (trap 12).",
    engine={"route": lambda self, i, r: Engine.route(
        self, i, self.norm(r, self.w[f"layers.{i}.pre_feedforward_layernorm_2.weight"]))})

LayerScalarSkipped = planted(
    "layer-scalar-skipped", "The per-layer layer_scalar is not applied (trap 11).",
    engine={"layer_scalar": lambda self, i: 1.0})

VNormMissing = planted(
    "v-norm-missing", "Values are not passed through the scale-free v_norm (trap 4).",
    engine={"value_norm": lambda self, v: v})


# ----------------------------------------------------------------------------------------------
# Gemma 4 Unified (gemma4-unified-and-mtp-spec.md E2): the engine's own encoder-free embedders, the vision
# mask rule, blocks across micro-batches


def _patch_values_chw(self, pv: np.ndarray) -> np.ndarray:
    """Each patch read channel-major (C, row, column) instead of (row, column, C)."""
    M = self.image.cfg.model_patch_size
    return pv.reshape(-1, M, M, 3).transpose(0, 3, 1, 2).reshape(pv.shape)


def _positions_swapped(self, pos: np.ndarray) -> np.ndarray:
    return Engine.patch_position_embedding(self, pos[:, ::-1])


def _vision_overlay_unclamped(self, rows: Rows, kv: KVView, window):
    return Engine.vision_overlay(self, rows, kv, None)  # the whole block, past the window


def _media_split(self, caches, batch, ubatch):
    """On vision-block checkpoints image prompts run in micro-batches of 16 tokens (as an engine whose
    n_ubatch is small does): a longer block is split, its overlay built per micro-batch."""
    if ubatch is None and (batch.block != -1).any() and self.cfg.use_bidirectional_attention == "vision":
        ubatch = 16
    return Engine.split(self, caches, batch, ubatch)


VisionWindowUnclamped = planted(
    "vision-window-unclamped",
    "Vision blocks on sliding layers open the whole block, past the window (the overlay after the window).",
    engine={"vision_overlay": _vision_overlay_unclamped})

ImageSplitAcrossUbatches = planted(
    "image-split-across-ubatches",
    "Vision-block image prompts are split into micro-batches of 16 tokens: a longer block is half-causal across them.",
    engine={"split": _media_split})

PatchLayernormEps1e6 = planted(
    "patch-layernorm-eps-1e-6",
    "Unified vision embedder: the LayerNorms use rms_norm_eps (1e-6) instead of torch's 1e-5.",
    engine={"patch_norm": lambda self, x, w, b: layer_norm(x, w, b, 1e-6)})

PatchRmsnorm = planted(
    "patch-rmsnorm",
    "Unified vision embedder: RMSNorm (no mean, no bias) where the embedder has LayerNorms.",
    engine={"patch_norm": lambda self, x, w, b: rms_norm(x, w, LAYER_NORM_EPS)})

PatchOrderChw = planted(
    "patch-order-chw", "Unified vision embedder: patches flattened channel-major (CHW) instead of (row, column, "
                       "channel).",
    engine={"patch_values": _patch_values_chw})

PositionAxesSwapped = planted(
    "position-axes-swapped", "Unified vision embedder: the position table is read with x and y swapped.",
    engine={"patch_position_embedding": _positions_swapped})

PaddingRowsKept = planted(
    "padding-rows-kept",
    "Unified vision embedder: padding rows are not dropped, so a later image's block gets an earlier one's padding.",
    engine={"real_patches": lambda self, e, pos: e})

AudioFramesNotNormed = planted(
    "audio-frames-not-normed", "Unified audio embedder: the 640-sample frames go to the projection without their "
                               "RMSNorm.",
    engine={"audio_frame_norm": lambda self, frames: frames})


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
    # where its code changed, as a trace point (conformance.protocol.trace) with a layer rule: "embed", "logits",
    # "final_norm", or "<sub-block>@<rule>", rule a layer index or first-of: full, sliding, shared (the first
    # KV-shared layer), shared-1, keqv, wrong-source (the first shared layer whose last and first KV-owning
    # layers of its type differ); None: not a point of the model (a row selection, an MTP round)
    where: str | None = None

    def backend(self) -> Backend:
        """A fresh mutated numpy-engine (float64), not yet opened."""
        return self.backend_class()


def _m(cls: type, bug_class: str, expected: frozenset[str] | None = None, kill_sets: tuple[str, ...] = (),
       where: str | None = None) -> Mutant:
    name = cls.name.removeprefix("mutant/")
    return Mutant(name, cls.__doc__.strip().splitlines()[0], bug_class, expected, cls, tuple(kill_sets), where)


#: the bundled image sets: PLE with image tokens causal (E-series), and bidirectional vision blocks (31B)
IMAGE_SET_PLE = "e2b-vision-mini"
IMAGE_SET_BIDIRECTIONAL = "31b-vision-mini"
IMAGE_SETS = (IMAGE_SET_PLE, IMAGE_SET_BIDIRECTIONAL)
#: the bundled set of the PLE-fold trap: tokens whose per-layer context is near the RMSNorm eps
PLE_EPS_SET = "e2b-ple-eps-mini"
#: the bundled audio set: E2B miniature with PLE and a tiny audio tower (audio bases S0, S1)
AUDIO_SET = "e2b-audio-mini"
#: the bundled Gemma 4 Unified set: encoder-free image and audio embedders, vision blocks longer than the window
UNIFIED_SET = "12b-mini"
#: the bundled MTP sets: an E2B-like target with the centroid-head drafter, a Unified one with a dense drafter
MTP_SET_CENTROID = "e2b-assistant-mini"
MTP_SET_LAYOUT = "mtp-layout-mini"  # a target whose KV-owning prefix does not end in (sliding, full)
MTP_SETS = (MTP_SET_CENTROID, "12b-assistant-mini", MTP_SET_LAYOUT)


MUTANTS: tuple[Mutant, ...] = (
    _m(ShiftInteriorRow, "B1", IDENTITY),
    _m(ShiftLastRow, "B1", IDENTITY),
    _m(ChunkBoundaryRow, "B1", IDENTITY),
    _m(SoftcapDroppedSingleRow, "B2", CLOSENESS, where="logits"),
    _m(SoftcapTwice, "B2", CLOSENESS, where="logits"),
    _m(PruneHiddenNotPositions, "B7", where="attn_out@shared"),
    _m(PruneHiddenNotMask, "B7", where="attn_out@shared"),
    _m(PruneHiddenNotPle, "B7", where="ple_add@shared"),
    _m(PruneOneLayerEarly, "B7", where="attn_out@shared-1"),
    _m(SeqStateLeak, "B5", where="attn_out@0"),
    _m(SeqWrongOffsets, "B6", where="attn_out@0"),
    _m(ChunkLocalMask, "B4", where="attn_out@0"),
    _m(ChunkLocalPositions, "B4", where="attn_out@0"),
    _m(EmbeddingsScaledTwice, "B10", where="embed"),
    _m(SoftTokensScaled, "B10", kill_sets=(IMAGE_SET_PLE, IMAGE_SET_BIDIRECTIONAL, UNIFIED_SET), where="embed"),
    _m(NormOnePlusW, "trap 1", where="attn_out@0"),
    _m(AttentionScaleRsqrtD, "trap 2", where="attn_out@0"),
    _m(RopeOrdinaryPartial, "trap 3", where="attn_out@full"),
    _m(VNormMissing, "trap 4", where="attn_out@0"),
    _m(KeqvVIsRotatedK, "trap 5", where="attn_out@keqv"),
    _m(SlidingWindowOffByOne, "trap 7", where="attn_out@sliding"),
    _m(SharedWrongSource, "trap 8", where="attn_out@wrong-source"),
    _m(PleMissingSqrtP, "trap 10", where="ple_add@0"),
    _m(PleFoldEpsKept, "trap 10", CLOSENESS, kill_sets=(PLE_EPS_SET,), where="ple_add@0"),
    _m(PleFoldEpsOverS, "trap 10", CLOSENESS, kill_sets=(PLE_EPS_SET,), where="ple_add@0"),
    _m(LayerScalarSkipped, "trap 11", where="residual@0"),
    _m(MoeRouterNormedInput, "trap 12", where="ffn_out@0"),
    _m(PlePlaceholderRow, "trap 17", kill_sets=(IMAGE_SET_PLE,), where="ple_add@0"),
    _m(VisionBlocksOnFullLayers, "trap 17", kill_sets=(IMAGE_SET_BIDIRECTIONAL, UNIFIED_SET), where="attn_out@full"),
    _m(VisionBlocksMissing, "trap 17", kill_sets=(IMAGE_SET_BIDIRECTIONAL, UNIFIED_SET), where="attn_out@sliding"),
    _m(AudioChunkingWrong, "mm trap 24", kill_sets=(AUDIO_SET,), where="embed"),
    _m(AudioLogitCapMissing, "mm §9", kill_sets=(AUDIO_SET,), where="embed"),
    _m(AudioSoftTokensScaled, "B10", kill_sets=(AUDIO_SET,), where="embed"),
    _m(AudioPlePlaceholderRow, "trap 17", kill_sets=(AUDIO_SET,), where="ple_add@0"),
    _m(VisionWindowUnclamped, "unified U2", kill_sets=(IMAGE_SET_BIDIRECTIONAL, UNIFIED_SET), where="attn_out@sliding"),
    _m(ImageSplitAcrossUbatches, "unified "
                                 "U4", kill_sets=(IMAGE_SET_BIDIRECTIONAL, UNIFIED_SET), where="attn_out@sliding"),
    _m(PatchLayernormEps1e6, "unified U6", kill_sets=(UNIFIED_SET,), where="embed"),
    _m(PatchRmsnorm, "unified U6", kill_sets=(UNIFIED_SET,), where="embed"),
    _m(PatchOrderChw, "unified U7", kill_sets=(UNIFIED_SET,), where="embed"),
    _m(PositionAxesSwapped, "unified U8", kill_sets=(UNIFIED_SET,), where="embed"),
    _m(PaddingRowsKept, "unified U9", kill_sets=(UNIFIED_SET,), where="embed"),
    _m(AudioFramesNotNormed, "unified U10", kill_sets=(UNIFIED_SET,), where="embed"),
    _m(VideoFramesNotVision, "trap 17", kill_sets=vm.VIDEO_SETS, where="ple_add@0"),
    _m(VideoFramesOneBlock, "trap 17", kill_sets=(vm.VIDEO_SET_UNIFIED,), where="attn_out@sliding"),
    _m(VideoTimestampsDropped, "trap 17", kill_sets=vm.VIDEO_SETS, where="attn_out@full"),
    _m(HiddenPreNorm, "mtp M1", HIDDEN, where="final_norm"),
    _m(HiddenNormWeightSkipped, "mtp M1", HIDDEN, where="final_norm"),
    _m(MtpDrafterReadsPreNorm, "mtp M1", MTP, kill_sets=MTP_SETS),
    _m(MtpLastRowAfterPartial, "mtp M2", MTP, kill_sets=MTP_SETS),
    _m(MtpFirstRoundZeroHidden, "mtp M3", MTP, kill_sets=MTP_SETS),
    _m(MtpPositionPMinus1, "mtp M4", MTP, kill_sets=MTP_SETS),
    _m(MtpPositionAdvances, "mtp M4", MTP, kill_sets=MTP_SETS),
    _m(MtpFirstStoreLayer, "mtp M5", MTP, kill_sets=MTP_SETS),
    _m(MtpPositionalStoreLayers, "mtp M5", None, kill_sets=(MTP_SET_LAYOUT,)),
    _m(MtpKeysRerotated, "mtp M6", MTP, kill_sets=MTP_SETS),
    _m(MtpCentroidTopKMinus1, "mtp M9", MTP, kill_sets=(MTP_SET_CENTROID,)),
    _m(MtpEmbeddingUnscaled, "mtp M11", MTP, kill_sets=MTP_SETS),
    _m(MtpFixedTargetState, "mtp M12", MTP, kill_sets=MTP_SETS),
    _m(MtpNoRollback, "mtp M13", MTP, kill_sets=MTP_SETS),
    _m(MtpMediaStateNotAdvanced, "mtp M14", MTP, kill_sets=MTP_MEDIA_SETS),
    _m(MtpMediaPositionsWithoutSoftTokens, "mtp M14", MTP, kill_sets=MTP_MEDIA_SETS),
    _m(MtpBatchSharedState, "mtp M15", MTP, kill_sets=MTP_SETS),
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

# Engines rewritten to compute the same function otherwise (not bugs): each must pass at exact-f64 where the
# mutants beside it are killed, or the gate would fail an engine that is right.
REWRITES: dict[str, tuple[Mutant, str]] = {
    "ple-fold-right": (
        _m(PleFoldRight, "trap 10", kill_sets=(PLE_EPS_SET, "e2b-mini"), where="ple_add@0"),
        "RMSNorm(s y; eps) = RMSNorm(y; eps / s^2) for s > 0 and (a + b) / sqrt(2) = a / sqrt(2) + b / sqrt(2): the "
        "fold llama.cpp's PLE simplification makes, done right, changes only the rounding; on the sets where the "
        "two wrong folds are killed and on one where they pass",
    ),
}


def mutant(name: str) -> Mutant:
    """The mutant called ``name`` (KeyError with the known names otherwise)."""
    for m in MUTANTS:
        if m.name == name:
            return m
    raise KeyError(f"unknown mutant {name!r}; known: {', '.join(BACKENDS)}")
