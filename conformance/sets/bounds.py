"""Rounding bounds that hold at every size: how far two evaluations of the same Gemma 4 computation (other
row subsets, chunkings, cache paths, another machine's BLAS) may differ from rounding alone, from the
model's shapes, the sequence length and the logit scale. Pure arithmetic on a ``refimpl`` config; the
derivation, its assumptions and the measurements behind ``SAFETY`` are in docs/profiles.md ("Rounding
bounds").

The model, for one evaluation at unit roundoff u (2^-53 in float64), to first order in u:

* an inner product of length K has relative error at most gamma_K ~ K u (Higham, Accuracy and
  Stability of Numerical Algorithms, Lemma 3.1 / Thm 3.5, on sum |x_i y_i|, which is the size of the value
  itself when the terms do not cancel); a mean of squares over H values (RMSNorm), a softmax sum over S
  keys and a probability-weighted sum of S values likewise, with K = H, S, S; an elementwise step (GELU,
  RoPE, a product, a residual add, the layer scalar, the softcap) a few u;
* along a layer the relative errors of its steps add, and so do those of the L layers (every layer is
  pre- and post-normed and adds to the residual stream, so an error carried in passes with gain about 1):
  the path sum ``decoder_units(cfg, n)`` counts, for every layer, the lengths of its norms, projections,
  attention sums and MLP, plus the per-layer inputs and the head;
* a logit's error is that relative error times the logit scale s (the largest |logit| of the rows, at
  least 1); the softcap's derivative (<= 1) only shrinks it;
* two evaluations each carry such an error, so they differ by at most twice one;
* the check takes the worst of n rows, and rows are not equally conditioned (an RMSNorm of a small input
  amplifies its rounding by the inverse of its size, and such rows become likelier as n grows): beyond
  ``REFERENCE_LENGTH`` tokens the bound grows as sqrt(n / REFERENCE_LENGTH) (``length_factor``; measured,
  the worst row grows about as n^0.5..0.75);
* the safety factor ``SAFETY`` covers what the first-order model leaves out (amplification by later
  layers beyond gain 1), measured on the miniatures and the published E2B and E4B shapes.

    bound = 2 * SAFETY * u * decoder_units(cfg, n) * max(1, s) * length_factor(n)

Gain 1 per layer is an assumption about the weights: random deep weights amplify rounding chaotically
(docs/profiles.md has the depth sweep), which no bound from the config can follow. Where a base's
chunked-vs-full difference exceeds the bound, the generator measures the checkpoint's own amplification
(``conformance.generate.bases.rounding_probe``: the logits' change when the input embeddings move by one
unit roundoff) and holds the base to ``probe_bound`` = PROBE_FACTOR x that probe when it is larger; the set
records the probe, and grading scales with it too.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ELEMENTWISE", "EVENT_FACTOR", "EVENT_ULPS", "FLOAT32_UNIT", "PROBE_FACTOR", "REFERENCE_LENGTH",
           "SAFETY", "UNIT_ROUNDOFF", "audio_units", "consistency_bound", "decoder_units", "event_bound",
           "feature_units", "first_order", "has_events", "layer_units", "length_factor", "logit_bound",
           "logit_scale", "probe_bound", "recorded_probes", "tensor_bound", "vision_units"]

UNIT_ROUNDOFF = 2.0 ** -53  # float64, round to nearest
FLOAT32_UNIT = 2.0 ** -24  # float32, for profiles of float32 engines (conformance.check.profiles)
ELEMENTWISE = 8  # u per layer for its elementwise steps (GELU, products, RoPE, residual adds, the layer scalar)
SAFETY = 5.0  # over the first-order model; docs/profiles.md has what it was measured against
REFERENCE_LENGTH = 128  # rows up to which the first-order model holds for the worst row as it is
PROBE_FACTOR = 10.0  # over a checkpoint's measured amplification of a one-ulp input perturbation (probe_bound)
EVENT_FACTOR = 2.0  # over a base's event probe, a float32 engine's one-unit events under a ggml-cpu convention
EVENT_ULPS = 8  # the event probe's move, in float32 unit roundoffs: what a float32 engine's values are off by


def _length(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"the sequence length must be a positive integer, got {n!r}")
    return int(n)


def layer_units(cfg, n: int) -> list[int]:
    """Per decoder layer of ``cfg`` (a ``refimpl.config.TextConfig``), the relative-error constant of one
    evaluation over ``n`` tokens in units of u: the lengths of the layer's norms, projections, attention
    sums (keys seen: min(n, W) on sliding layers, n on full ones) and MLP, plus ``ELEMENTWISE``."""
    n = _length(n)
    H, heads, P = cfg.hidden_size, cfg.num_attention_heads, cfg.hidden_size_per_layer_input
    out = []
    for layer in cfg.layers:
        D = layer.head_dim
        S = min(n, cfg.sliding_window) if layer.is_sliding else n
        attention = (H  # input norm
                     + H  # q, k, v projections
                     + 2 * D  # q and k norms, the scores q . k
                     + 2 * S  # the softmax sum, probabilities x values
                     + heads * D  # output projection
                     + H)  # post-attention norm
        ffn = H + H + layer.ffn_width + H  # pre-norm, gate and up, down, post-norm
        if cfg.enable_moe_block:  # the expert branch beside the dense one: its norms, router, experts
            ffn += 4 * H + H + (cfg.moe_intermediate_size or 0)
        ple = 2 * H + P if P else 0  # gate, projection, post norm
        out.append(attention + ffn + ple + ELEMENTWISE)
    return out


def decoder_units(cfg, n: int) -> int:
    """The path sum of one evaluation of the text decoder's logits over ``n`` tokens, in units of u: the
    per-layer inputs (projection of length H, norm of length P), every layer (``layer_units``) and the head
    (final norm and tied head, both of length H, and the softcap)."""
    H, P = cfg.hidden_size, cfg.hidden_size_per_layer_input
    inputs = H + P + 4 if P else 1
    return inputs + sum(layer_units(cfg, n)) + 2 * H + 4


def logit_scale(logits) -> float:
    """The logit scale of some rows: the largest finite |logit|, at least 1 (read a block of rows at a
    time: a memory-mapped base stays lazy, and no full-size temporary is made)."""
    a = np.asarray(logits)
    if a.ndim == 0:
        a = a.reshape(1)
    best, step = 1.0, max(1, (1 << 22) // max(1, int(np.prod(a.shape[1:], dtype=np.int64))))
    for start in range(0, a.shape[0], step):
        block = np.asarray(a[start:start + step], dtype=np.float64)
        if block.size == 0:
            continue
        top = max(float(np.max(block)), -float(np.min(block)))  # two passes, no temporary: |x| of finite rows
        if not math.isfinite(top):  # a NaN or an infinity in the block: the finite ones only
            top = float(np.max(np.abs(block), where=np.isfinite(block), initial=0.0))
        best = max(best, top)
    return best


def first_order(cfg, n: int, scale: float, unit: float = UNIT_ROUNDOFF) -> float:
    """u x decoder_units(cfg, n) x max(1, scale): the first-order error of one evaluation of the logits at
    unit roundoff ``unit`` (float64's by default; ``FLOAT32_UNIT`` for a float32 engine)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not math.isfinite(scale) \
            or scale < 0:
        raise ValueError(f"the logit scale must be a non-negative finite number, got {scale!r}")
    return float(unit) * decoder_units(cfg, n) * max(1.0, float(scale))


def length_factor(n: int) -> float:
    """sqrt(max(1, n / REFERENCE_LENGTH)): how the worst of n rows outgrows the first-order model."""
    return math.sqrt(max(1.0, _length(n) / REFERENCE_LENGTH))


def logit_bound(cfg, n: int, scale: float, *, safety: float = SAFETY) -> float:
    """The largest |difference| two float64 evaluations of the logits of the same ``n``-token sequence
    may show from rounding alone: 2 x safety x first_order(cfg, n, scale) x length_factor(n). ``scale``:
    the rows' ``logit_scale`` (or the softcap, which bounds it)."""
    return 2.0 * safety * first_order(cfg, n, scale) * length_factor(n)


def probe_bound(probe: float, *, factor: float = PROBE_FACTOR) -> float:
    """The bound a checkpoint's measured amplification gives: ``factor`` x ``probe``, the largest logit
    change when the input embeddings move by one unit roundoff (``conformance.generate.bases.rounding_probe``).
    Used where the checkpoint amplifies rounding beyond the first-order model (random deep weights):
    the oracle's chunked-vs-full difference measured 0.6x..1.3x the probe."""
    if isinstance(probe, bool) or not isinstance(probe, (int, float, np.floating)) or not math.isfinite(probe) \
            or probe < 0:
        raise ValueError(f"the rounding probe must be a non-negative finite number, got {probe!r}")
    return float(factor) * float(probe)


def has_events(activations: str) -> bool:
    """Whether a set made under the activation convention ``activations`` records event probes: the ggml-cpu
    ones, whose forward rounds values to fp16 and to 8-bit codes where a float32 engine rounds from nearby."""
    return str(activations).split("/")[0] == "ggml-cpu"


def event_bound(probe: float, *, factor: float = EVENT_FACTOR) -> float:
    """The bound a base's event probe gives (``conformance.generate.bases.event_probe``: the logits' change when
    the input embeddings move by EVENT_ULPS float32 ulps under the set's ggml-cpu convention): ``factor`` x
    ``probe``. Measured against llama.cpp at the published widths, its worst row sits at 0.8x..1.3x the probe
    (docs/quantised.md, "One-unit events"); ``factor`` covers that spread."""
    return probe_bound(probe, factor=factor)


def recorded_probes(manifest: dict, key: str = "rounding_probes") -> dict[str, float]:
    """The probes a set's manifest records per base under ``key`` (the oracle's consistency entry in
    provenance.cross_checks): ``rounding_probes`` (empty for sets that needed none or predate them) or
    ``event_probes`` (sets made under a ggml-cpu convention since issue 49's event grading)."""
    out: dict[str, float] = {}
    provenance = manifest.get("provenance") if isinstance(manifest, dict) else None
    checks = provenance.get("cross_checks", []) if isinstance(provenance, dict) else []
    for entry in checks if isinstance(checks, list) else []:
        probes = entry.get(key) if isinstance(entry, dict) else None
        if isinstance(probes, dict):
            for b, v in probes.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
                    out[str(b)] = max(out.get(str(b), 0.0), float(v))
    return out


def consistency_bound(cfg, n: int, logits) -> float:
    """``logit_bound`` for a base of ``n`` tokens whose logits are ``logits`` (their ``logit_scale``)."""
    return logit_bound(cfg, n, logit_scale(logits))


# ----------------------------------------------------------------------------------------------
# the towers and the audio features (verify_set(recompute=True): soft tokens, merged embeddings, features)


def _encoder_layer(width: int, intermediate: int, heads: int, head_dim: int, keys: int) -> int:
    """One pre- and post-normed attention + MLP layer, counted as ``layer_units`` counts a decoder layer."""
    attention = width + width + 2 * head_dim + 2 * keys + heads * head_dim + width
    mlp = width + width + intermediate + width
    return attention + mlp + ELEMENTWISE


def vision_units(vcfg, patches: int) -> int:
    """The path sum of the vision tower (``refimpl.vision.VisionConfig``) over ``patches`` patches: the
    patch embedding (length 3 p^2), every encoder layer (attention over all the image's patches), the
    pooling (k^2 patches), the norm and the projection into the text width."""
    P, d = _length(patches), vcfg.hidden_size
    layer = _encoder_layer(d, vcfg.intermediate_size, vcfg.num_attention_heads, vcfg.head_dim, P)
    return vcfg.patch_dim + 4 + vcfg.num_hidden_layers * layer + vcfg.pooling_kernel_size ** 2 + 2 * d + 4


def unified_vision_units(vcfg) -> int:
    """The path sum of Gemma 4 Unified's vision embedder (``refimpl.unified.UnifiedVisionConfig``), per
    patch: the first LayerNorm over 3 M^2 values, the dense layer, two more LayerNorms over E (the
    position rows added before the last), the weightless RMSNorm and the projection into the text width."""
    C, E = vcfg.patch_dim, vcfg.mm_embed_dim
    return (C + 4) + C + 2 * (E + 4) + 2 + E + E + 4


def unified_audio_units(acfg) -> int:
    """The path sum of Gemma 4 Unified's audio embedder (``refimpl.unified.UnifiedAudioConfig``): the
    weightless RMSNorm over A samples and the projection."""
    A = acfg.audio_embed_dim
    return A + A + 4


def audio_units(acfg, frames: int) -> int:
    """The path sum of the audio tower (``refimpl.audio.AudioConfig``) over ``frames`` feature frames: the
    two 3 x 3 subsampling convolutions with their channel norms and the input projection, every conformer
    layer (two macaron MLPs of width 4D, local attention over its context of C keys, the light
    convolution, the output norm), the output projection and the projection into the text width."""
    _length(frames)
    d, (c0, c1) = acfg.hidden_size, acfg.subsampling_conv_channels
    subsampling = 9 + c0 + 9 * c0 + c1 + acfg.proj_in_dim
    ffn = d + d + 4 * d + d
    lconv = d + d + acfg.conv_kernel_size + d + d
    layer = 2 * ffn + _encoder_layer(d, 0, acfg.num_attention_heads, acfg.head_dim, acfg.context_size) - 4 * d \
        + lconv + d
    P = acfg.output_proj_dims
    return subsampling + acfg.num_hidden_layers * layer + d + P + P + 4


def feature_units(n_fft: int) -> int:
    """The path sum of the log-mel features: the window, the FFT (log2 n_fft butterfly stages of a few u
    each, on sum |x|), the magnitude, the mel filter bank (sums of up to n_fft / 2 + 1 terms) and the log
    (whose absolute error is the relative error of its argument)."""
    return 2 + 4 * max(1, int(math.log2(max(2, n_fft)))) + 4 + n_fft // 2 + 1 + 4


def tensor_bound(units: float, scale: float, rows: int = 1, *, safety: float = SAFETY) -> float:
    """Two float64 evaluations of a tensor of ``rows`` rows whose path sum is ``units`` and whose largest
    |value| is ``scale``: 2 x safety x u x units x max(1, scale) x length_factor(rows), as ``logit_bound``."""
    return 2.0 * safety * UNIT_ROUNDOFF * float(units) * max(1.0, float(scale)) * length_factor(max(1, int(rows)))
