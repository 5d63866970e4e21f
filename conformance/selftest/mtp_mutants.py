"""The mutants of the hidden-state output and of the MTP path (gemma4-unified-and-mtp-spec.md E1), each the
numpy engine with one hook of ``conformance/selftest/mtp.py`` (``DraftModel``, ``MtpDriver``) or of the
engine replaced; listed with the rest of the zoo in ``mutants.py`` (docs/bug-classes.md, "MTP drafters")."""

from __future__ import annotations

import math

import numpy as np

from refimpl.ops import rope_cos_sin
from refimpl.schedule import apply_rope, rms_norm

from .planting import planted

# the hidden-state output (MTP spec B6, E1 M1): what an engine hands a drafter or an embedding user

HiddenPreNorm = planted(
    "hidden-pre-norm", "Hidden-state rows: the residual stream before the final norm instead of its output.",
    engine={"hidden_state": lambda self, x, y: x})

HiddenNormWeightSkipped = planted(
    "hidden-norm-weight-skipped", "Hidden-state rows: the final norm without its weight (scale-free RMSNorm).",
    engine={"hidden_state": lambda self, x, y: rms_norm(x, None, self.cfg.rms_norm_eps)})


# ----------------------------------------------------------------------------------------------
# MTP (gemma4-unified-and-mtp-spec.md E1): the drafter's graph and the round loop


def _rerotated(self, kv, layer_type):
    """The target's keys rotated once more at their positions (the drafter re-applies RoPE)."""
    spec = next(layer for layer in self.cfg.layers if layer.layer_type == layer_type)
    cos, sin = rope_cos_sin(kv.pos, self.inv_freq[spec.index])
    return apply_rope(kv.k, cos.astype(self.dtype), sin.astype(self.dtype))


MtpDrafterReadsPreNorm = planted(
    "mtp-drafter-reads-pre-norm", "MTP: the drafter is fed the target's residual before the final norm (M1).",
    driver={"target_states": lambda self: self.engine.residual_log[-1][self.span]})

MtpLastRowAfterPartial = planted(
    "mtp-last-row-after-partial", "MTP: after a verification the next round reads the chunk's last row, not row n "
                                  "(M2).",
    driver={"hidden_for_next": lambda self, states, kept: states[-1]})

MtpFirstRoundZeroHidden = planted(
    "mtp-first-round-zero-hidden", "MTP: the first round after the prompt starts from a zero hidden state (M3).",
    driver={"first_hidden": lambda self, states: np.zeros_like(states[-1])})

MtpPositionPMinus1 = planted(
    "mtp-position-p-minus-1", "MTP: the drafter queries at P - 1 whatever the convention declared (M4).",
    draft={"position": lambda self, P, j, rule: P - 1})

MtpPositionAdvances = planted(
    "mtp-position-advances", "MTP: the drafter's query position advances with the step, P + j (M4).",
    draft={"position": lambda self, P, j, rule: (P if rule == "P" else P - 1) + j})

MtpFirstStoreLayer = planted(
    "mtp-first-store-layer", "MTP: the drafter reads the first KV-owning target layer of its type, not the last (M5).",
    draft={"store_layer": lambda self, t: min(s.index for s in self.engine.cfg.layers
                                                if s.owns_kv and s.layer_type == t)})

MtpPositionalStoreLayers = planted(
    "mtp-positional-store-layers", "MTP: the store layers by position, n_layer - 2 (sliding) and n_layer - 1 (full), "
    "through the KV-sharing map, as llama.cpp's rule (M5).",
    draft={"store_layer": lambda self, t: self.engine.cfg.layers[
        self.engine.n_layers - (2 if t == "sliding_attention" else 1)].kv_source})

MtpKeysRerotated = planted(
    "mtp-keys-rerotated", "MTP: the drafter rotates the target's keys again (M6).", draft={"keys": _rerotated})

MtpCentroidTopKMinus1 = planted(
    "mtp-centroid-top-k-minus-1", "MTP: the centroid head keeps one cluster fewer than centroid_intermediate_top_k "
                                  "(M9).",
    draft={"top_clusters": lambda self: self.acfg.centroid_intermediate_top_k - 1})

MtpEmbeddingUnscaled = planted(
    "mtp-embedding-unscaled", "MTP: the drafter's token input is the target's embedding row without sqrt(H) (M11).",
    draft={"embedding": lambda self, token: self.engine.model.embed(np.array([int(token)]))[0]
           / math.sqrt(self.engine.cfg.hidden_size)})

MtpFixedTargetState = planted(
    "mtp-fixed-target-state", "MTP: every draft step reads the target's hidden state again, not post_projection (M12).",
    draft={"next_hidden": lambda self, z, z_hat, h: h})

MtpNoRollback = planted(
    "mtp-no-rollback", "MTP: rejected drafts stay in the target's cache (M13, a verifier bug).",
    driver={"rollback": lambda self, length: None})


# MTP after media (gemma4-unified-and-mtp-spec.md M14): what an engine's drafter gets wrong after an image or audio
# prompt, killed on the Unified pair after an image and an audio prompt (M4, M5) and on E2B-vision with the E2B
# drafter after an image prompt (M4)
MTP_MEDIA_SETS = ("12b-assistant-mini", "e2b-vision-assistant-mini")

def _rows_before_media(self, n: int, blocks: list[tuple[int, int]]) -> list[int]:
    """The prefill's output rows with the last text row before the first media block first (the mutant's state)."""
    return ([blocks[0][0] - 1] if blocks else []) + [n - 1]


MtpMediaStateNotAdvanced = planted(
    "mtp-media-state-not-advanced", "MTP after media: the drafter's state is not advanced past a media chunk: round 1 "
                                    "starts from the last text row before the first block (M14).",
    driver={"prompt_rows": _rows_before_media, "first_hidden": lambda self, states: states[0]})

MtpMediaPositionsWithoutSoftTokens = planted(
    "mtp-media-positions-without-soft-tokens", "MTP after media: the drafter's query position counts the prompt's "
                                               "text only, not its soft tokens (M14).",
    draft={"position": lambda self, P, j, rule: (P if rule == "P" else P - 1) - self.media_tokens})


# batched MTP (gemma4-unified-and-mtp-spec.md M15): drafter state leaking between the sequences of one batch

def _remember_shared(self, h) -> None:
    self.draft.shared_state = h  # one slot for the whole batch: the drafter object every driver shares


MtpBatchSharedState = planted(
    "mtp-batch-shared-state", "Batched MTP: the drafter's state is one slot for the whole batch: a sequence's round "
                              "starts from the state the last settled sequence left (M15).",
    driver={"remember": _remember_shared, "recall": lambda self: self.draft.shared_state})
