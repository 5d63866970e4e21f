"""Hugging Face transformers' Gemma 4 text model as an independent float64 reference.

Loading Gemma 4 in float64 (``dtype=torch.float64``) is not enough to get float64
results: ``transformers/models/gemma4/modeling_gemma4.py`` computes several steps
in float32 on purpose, whatever the model dtype. This module removes those float32
steps, changing precision only (every formula is the one transformers uses), so
that HF can be compared with a true float64 NumPy implementation at ~1e-12.

The float32 spots in transformers 5.24 and what this module does about them:

* ``Gemma4RMSNorm.forward`` upcasts with ``.float()`` (input and weight), which
  for a float64 input is a downcast.            -> patched by :func:`float64_exact`
* ``eager_attention_forward`` (module-level function of modeling_gemma4, the
  one ``Gemma4TextAttention.forward`` falls back to for "eager") runs
  ``softmax(..., dtype=torch.float32)``.        -> patched by :func:`float64_exact`
* ``Gemma4TextRouter.forward`` runs the router softmax with
  ``dtype=torch.float32``, so the top-k weights are float32.
                                                -> patched by :func:`float64_exact`
* ``Gemma4TextRotaryEmbedding.forward`` computes the RoPE angles as
  ``position_ids.float() * inv_freq.float()``.  -> patched by :func:`float64_exact`
* The RoPE buffers ``<layer_type>_inv_freq`` / ``<layer_type>_original_inv_freq``
  are built with float32 ``arange`` and ``pow`` and stay float32 after
  ``.double()`` / ``from_pretrained(dtype=float64)``.
                                                -> recomputed by :func:`recompute_float64_buffers`
* ``Gemma4TextScaledWordEmbedding.embed_scale`` (main table: sqrt(hidden_size);
  per-layer table: sqrt(hidden_size_per_layer_input)) is a buffer that is only
  as exact as the dtype it was created in (``Gemma4ForCausalLM(cfg).double()``
  leaves the float32-rounded value).            -> recomputed by :func:`recompute_float64_buffers`

Checked and left alone (already exact in float64): ``masking_utils`` builds the
eager additive mask in ``inputs_embeds.dtype`` (``torch.finfo(float64).min``, so
masked probabilities are exactly 0); the "eager" experts path
(``Gemma4TextExperts.forward``) and ``GELUTanh`` compute in the input dtype;
``DynamicCache`` (including the sliding-window layers) stores float64 tensors;
``logits_to_keep`` only slices. The SDPA / flash / flex attention
integrations are not used: :func:`load_hf_causal_lm` forces
``attn_implementation="eager"`` (SDPA would be a different kernel) and
``experts_implementation="eager"`` (the default ``grouped_mm`` refuses float64).

The patched functions are line-by-line copies of the transformers 5.24.0 code
with only the dtype changed, and they only act on float64 inputs (anything else
is handed to the original). Because they are copies, :func:`float64_exact`
first checks that the installed originals are the exact sources they were copied
from (sha256 of ``inspect.getsource``) and raises if transformers changed them.

Public API::

    load_hf_causal_lm(model_dir, dtype="float64", exact=True) -> Gemma4ForCausalLM
    hf_logits(model, ids, exact=True) -> np.ndarray [T, V] float64
    hf_logits_incremental(model, ids, chunks, exact=True) -> np.ndarray [T, V] float64
    hf_trace(model, ids, exact=True) -> {layer_index: np.ndarray [T, top_k]}
    float64_exact()                  # context manager: the runtime patches
    recompute_float64_buffers(model) # the buffer fix (load_hf_causal_lm does it)

Import this module only where torch and transformers are installed (tests should
``pytest.importorskip("transformers")`` first). For tiny checkpoints call
``torch.set_num_threads(1)`` in the test session: with the default OpenMP threads,
a busy 2-core machine made each forward 50-100x slower (seconds instead of ms).
This module leaves the thread count alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import transformers
import transformers.models.gemma4.modeling_gemma4 as _mg
import transformers.models.gemma4_unified.modeling_gemma4_unified as _mu
from torch import nn
from transformers import DynamicCache, Gemma4ForCausalLM
from transformers.modeling_rope_utils import dynamic_rope_update

from conformance.backends.transformers.backend import TransformersBackend
from conformance.backends.transformers.loading import load_gemma4_causal_lm

__all__ = [
    "load_hf_causal_lm",
    "hf_logits",
    "hf_logits_incremental",
    "hf_trace",
    "float64_exact",
    "recompute_float64_buffers",
]

_F64 = torch.float64


# ---------------------------------------------------------------------------
# float64 versions of the float32 spots (copies of transformers 5.24.0, dtype only)
# ---------------------------------------------------------------------------
# Each replacement hands non-float64 inputs to the original, so a float32 / bf16
# model behaves exactly as in stock transformers even inside float64_exact().

_ORIG_RMSNORM_FORWARD = _mg.Gemma4RMSNorm.forward
_ORIG_ROTARY_FORWARD = _mg.Gemma4TextRotaryEmbedding.forward
_ORIG_EAGER_ATTENTION = _mg.eager_attention_forward
_ORIG_ROUTER_FORWARD = _mg.Gemma4TextRouter.forward


def _rmsnorm_forward_f64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # Original: self._norm(hidden_states.float()) and self.weight.float().
    if hidden_states.dtype != _F64:
        return _ORIG_RMSNORM_FORWARD(self, hidden_states)
    normed_output = self._norm(hidden_states)
    if self.with_scale:
        normed_output = normed_output * self.weight.to(_F64)
    return normed_output.type_as(hidden_states)


@dynamic_rope_update
def _rotary_forward_f64_core(self, x, position_ids, layer_type):
    # Original: position_ids[..., None].float() * inv_freq.to(dtype=torch.float).
    inv_freq = getattr(self, f"{layer_type}_inv_freq")
    attention_scaling = getattr(self, f"{layer_type}_attention_scaling")

    freqs = position_ids[..., None].to(_F64) * inv_freq.to(device=x.device, dtype=_F64)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling

    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _rotary_forward_f64(self, x, position_ids, layer_type):
    if x.dtype != _F64:
        return _ORIG_ROTARY_FORWARD(self, x, position_ids, layer_type)
    return _rotary_forward_f64_core(self, x, position_ids, layer_type)


def _eager_attention_forward_f64(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float | int = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Original: nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).
    if query.dtype != _F64:
        return _ORIG_EAGER_ATTENTION(
            module, query, key, value, attention_mask,
            dropout=dropout, scaling=scaling, softcap=softcap, **kwargs,
        )
    if scaling is None:
        scaling = module.head_dim**-0.5

    key_states = _mg.repeat_kv(key, module.num_key_value_groups)
    value_states = _mg.repeat_kv(value, module.num_key_value_groups)

    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling

    if softcap is not None:
        attn_weights = attn_weights / softcap
        attn_weights = torch.tanh(attn_weights)
        attn_weights = attn_weights * softcap
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask

    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=_F64).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


def _router_forward_f64(self, hidden_states: torch.Tensor):
    # Original: nn.functional.softmax(expert_scores, dim=-1, dtype=torch.float32).
    if hidden_states.dtype != _F64:
        return _ORIG_ROUTER_FORWARD(self, hidden_states)
    hidden_states = self.norm(hidden_states)
    hidden_states = hidden_states * self.scale * self.scalar_root_size

    expert_scores = self.proj(hidden_states)  # [B*S, E]
    router_probabilities = nn.functional.softmax(expert_scores, dim=-1, dtype=_F64)

    top_k_weights, top_k_index = torch.topk(
        router_probabilities,
        k=self.config.top_k_experts,
        dim=-1,
    )  # both [B*S, K]

    top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
    top_k_weights = top_k_weights * self.per_expert_scale[top_k_index]

    return router_probabilities, top_k_weights, top_k_index


# the float64 copies by name, for other modules that carry verbatim copies of these functions
# (modeling_gemma4_unified: tests/hf_unified_reference.py)
rmsnorm_forward_f64 = _rmsnorm_forward_f64
rotary_forward_f64 = _rotary_forward_f64
eager_attention_forward_f64 = _eager_attention_forward_f64

# (owner, attribute, original, replacement, sha256 of the original's source in transformers 5.24.0)
_PATCHES: list[tuple[object, str, Callable, Callable, str]] = [
    (_mg.Gemma4RMSNorm, "forward", _ORIG_RMSNORM_FORWARD, _rmsnorm_forward_f64,
     "7db79da21ac2d7247b3bfaa8134eec6e49ae23d729d12a495d1010127911c4be"),
    (_mg.Gemma4TextRotaryEmbedding, "forward", _ORIG_ROTARY_FORWARD, _rotary_forward_f64,
     "06ec09d340f9e670650a8428863e05012bf243c46b7c1dc301a5939f2fdd8ee5"),
    (_mg, "eager_attention_forward", _ORIG_EAGER_ATTENTION, _eager_attention_forward_f64,
     "587d5b52cc6f75078b7bb7a4fa056f5c1ff74e2f5c22d1a6ad161f3282d1671f"),
    (_mg.Gemma4TextRouter, "forward", _ORIG_ROUTER_FORWARD, _router_forward_f64,
     "2b4fec00897659a79f13c1cb581e0e0b6a9fe7db0801263b97bfa49369db629f"),
]


def _source_sha256(fn: Callable) -> str:
    return hashlib.sha256(inspect.getsource(inspect.unwrap(fn)).encode()).hexdigest()


def _check_sources() -> None:
    """Raise if transformers' code behind a patched function is not what was copied."""
    changed = []
    for owner, attr, original, _, expected in _PATCHES:
        if _source_sha256(original) != expected:
            changed.append(f"{getattr(owner, '__name__', owner)}.{attr}")
    if changed:
        raise RuntimeError(
            "tests/hf_reference.py patches copies of transformers 5.24.0 code, but the installed "
            f"transformers {transformers.__version__} has different source for: {', '.join(changed)}. "
            "Re-read modeling_gemma4.py, update the float64 copies and their sha256 in _PATCHES."
        )


@contextlib.contextmanager
def float64_exact() -> Iterator[None]:
    """Within the block, Gemma 4 computes float64 inputs entirely in float64.

    Swaps ``Gemma4RMSNorm.forward``, ``Gemma4TextRotaryEmbedding.forward``,
    ``Gemma4TextRouter.forward`` and the module-level ``eager_attention_forward``
    of ``transformers.models.gemma4.modeling_gemma4`` for copies whose only change
    is float32 -> float64, and restores whatever was there on exit (nesting is
    fine). Nothing outside modeling_gemma4 is touched; non-float64 inputs go to
    the original functions. Pair it with :func:`recompute_float64_buffers`: the
    RoPE forward multiplies by the ``inv_freq`` buffer as it is.
    """
    _check_sources()
    with patched(_PATCHES):
        yield


@contextlib.contextmanager
def audited_float64_exact(patches, audited, who: str) -> Iterator[None]:
    """:func:`float64_exact` plus ``patches`` (tuples as for :func:`patched`, with the sha256 of each
    original's source), after checking that neither a patched original nor an ``audited`` function
    (``(function, sha256)`` pairs read for float32 spots and left alone) changed source. ``who`` names
    the test file that holds the copies, for the error."""
    changed = [f"{getattr(owner, '__name__', owner)}.{attr}" for owner, attr, orig, _, sha in patches
               if _source_sha256(orig) != sha]
    changed += [fn.__qualname__ for fn, sha in audited if _source_sha256(fn) != sha]
    if changed:
        raise RuntimeError(
            f"{who} was written against transformers 5.24.0, but the source of {', '.join(changed)} changed; "
            "re-read modeling_gemma4.py for float32 spots and update the copies/sha256"
        )
    with float64_exact(), patched(patches):
        yield


@contextlib.contextmanager
def patched(patches):
    """Set ``owner.attr = replacement`` for each ``(owner, attr, original, replacement, sha256)`` and
    restore whatever was there on exit."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, *_ in patches]
    try:
        for owner, attr, _, replacement, _ in patches:
            setattr(owner, attr, replacement)
        yield
    finally:
        for owner, attr, previous in saved:
            setattr(owner, attr, previous)


# ---------------------------------------------------------------------------
# buffers
# ---------------------------------------------------------------------------

def inv_freq_f64(rope_type: str, rope_params: dict, head_dim: int) -> torch.Tensor:
    """transformers' RoPE inverse frequencies, same formula, in float64."""
    base = float(rope_params["rope_theta"])
    if rope_type == "default":
        # Gemma4TextRotaryEmbedding.compute_default_rope_parameters
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=_F64) / head_dim))
    if rope_type == "proportional":
        # modeling_rope_utils._compute_proportional_rope_parameters
        factor = float(rope_params.get("factor", 1.0))
        rope_angles = int(rope_params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq = 1.0 / (base ** (torch.arange(0, 2 * rope_angles, 2, dtype=_F64) / head_dim))
        nope_angles = head_dim // 2 - rope_angles
        if nope_angles > 0:
            inv_freq = torch.cat((inv_freq, torch.zeros(nope_angles, dtype=_F64)))
        return inv_freq / factor
    raise NotImplementedError(f"float64 inv_freq for rope_type {rope_type!r}")


# the modules whose buffers transformers keeps in float32: Gemma 4's and Gemma 4 Unified's (verbatim copies)
ROTARY_CLASSES = (_mg.Gemma4TextRotaryEmbedding, _mu.Gemma4UnifiedTextRotaryEmbedding)
EMBEDDING_CLASSES = (_mg.Gemma4TextScaledWordEmbedding, _mu.Gemma4UnifiedTextScaledWordEmbedding)


def recompute_float64_buffers(model: nn.Module) -> nn.Module:
    """Recompute, in float64 from the config, the buffers transformers keeps in float32.

    * every ``Gemma4TextRotaryEmbedding`` (and Gemma 4 Unified's copy): ``<layer_type>_inv_freq`` and
      ``<layer_type>_original_inv_freq`` (default and proportional RoPE);
    * every ``Gemma4TextScaledWordEmbedding`` (and Unified's): ``embed_scale`` (sqrt(hidden_size)
      for ``embed_tokens``, sqrt(hidden_size_per_layer_input) for
      ``embed_tokens_per_layer``, both kept by the module as ``scalar_embed_scale``).

    Each new value is first checked against the old one (float32 accuracy), so a
    formula mismatch raises instead of silently changing the model. Idempotent;
    returns ``model``.
    """
    for name, module in model.named_modules():
        if isinstance(module, ROTARY_CLASSES):
            for layer_type, rope_type in module.rope_type.items():
                head_dim = module.config.per_layer_config[layer_type].head_dim
                new = inv_freq_f64(rope_type, module.config.rope_parameters[layer_type], head_dim)
                for attr in (f"{layer_type}_inv_freq", f"{layer_type}_original_inv_freq"):
                    old = getattr(module, attr)
                    if old.shape != new.shape or not torch.allclose(old.to(_F64), new, rtol=1e-6, atol=0):
                        raise RuntimeError(f"{name}.{attr}: float64 recomputation disagrees with transformers")
                    setattr(module, attr, new.to(old.device))
        elif isinstance(module, EMBEDDING_CLASSES):
            scale = float(module.scalar_embed_scale)
            old = float(module.embed_scale)
            if abs(old - scale) > 1e-6 * scale:
                raise RuntimeError(f"{name}.embed_scale {old} is not the scalar {scale}")
            module.embed_scale = torch.tensor(scale, dtype=_F64, device=module.embed_scale.device)
    return model


# ---------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------

def load_hf_causal_lm(model_dir, dtype: str | torch.dtype = "float64", exact: bool = True) -> Gemma4ForCausalLM:
    """Load a Gemma 4 checkpoint directory as an eval-mode ``Gemma4ForCausalLM`` (on the CPU).

    Always ``attn_implementation="eager"`` and ``experts_implementation="eager"``.
    With ``exact=True`` (requires float64) the RoPE / embed-scale buffers are
    recomputed in float64 (:func:`recompute_float64_buffers`).

    The loading itself is the transformers backend's loader,
    ``conformance.backends.transformers.loading.load_gemma4_causal_lm``, so the
    tests and the backend read checkpoints the same way. Two layouts are accepted:

    * a text checkpoint (config ``Gemma4TextConfig`` / model_type ``gemma4_text``,
      tensors ``model.*``): ``Gemma4ForCausalLM.from_pretrained`` as is;
    * a multimodal checkpoint (config ``Gemma4Config`` / ``Gemma4ForConditionalGeneration``,
      text under ``text_config``, tensors ``model.language_model.*``): only the text
      model is built, from ``config.text_config``, and the tensors are renamed
      with from_pretrained's ``key_mapping={"^model.language_model.": "model."}``.
      Vision / audio tensors are left unused. (Plain ``Gemma4ForCausalLM.from_pretrained``
      on such a directory does NOT work: it finds no weight under its names and
      silently returns a randomly initialised model; see the missing-keys check.)

    Raises (``conformance.protocol.BackendError``) if any weight of the text model is
    missing from the checkpoint (``lm_head.weight`` is tied to ``model.embed_tokens.weight``)
    or transformers cannot load it.
    """
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if exact and torch_dtype != _F64:
        raise ValueError("exact=True only makes sense with dtype float64")
    model = load_gemma4_causal_lm(model_dir, torch_dtype, attn_implementation="eager",
                                  experts_implementation="eager", device="cpu")
    if exact:
        recompute_float64_buffers(model)
    return model


# ---------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------

def _precision(exact: bool):
    return float64_exact() if exact else contextlib.nullcontext()


def _check_exact(model: nn.Module, exact: bool) -> None:
    if exact:
        if model.dtype != _F64:
            raise ValueError("exact=True needs a float64 model")
        recompute_float64_buffers(model)  # idempotent; covers models not built by load_hf_causal_lm


def _ids_tensor(model: nn.Module, ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor([list(map(int, ids))], dtype=torch.long, device=model.device)


def hf_logits(model: Gemma4ForCausalLM, ids: Sequence[int], exact: bool = True) -> np.ndarray:
    """Logits [T, V] (float64) of one full forward over ``ids`` (batch 1, no cache).

    ``exact=True`` runs under :func:`float64_exact` (and makes sure the buffers
    are float64); ``exact=False`` is stock transformers in the model's dtype.
    """
    _check_exact(model, exact)
    with torch.no_grad(), _precision(exact):
        out = model(input_ids=_ids_tensor(model, ids), use_cache=False)
    return out.logits[0].to(_F64).cpu().numpy()


def _cache_kwarg(model: nn.Module) -> str:
    # transformers 5.24 renamed past_key_values -> cache (the old name is deprecated until 5.40)
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hf_logits_incremental(
    model: Gemma4ForCausalLM, ids: Sequence[int], chunks: Sequence[int], exact: bool = True
) -> np.ndarray:
    """Run ``ids`` as consecutive pieces of sizes ``chunks`` through one DynamicCache.

    This is HF's chunked-prefill / decode path: every call passes only the new
    tokens plus the cache (``use_cache=True``), positions and masks are derived by
    transformers from the cache length. Returns the logits of every position,
    concatenated in order: [sum(chunks), V] float64. ``sum(chunks)`` must be
    ``len(ids)``; chunks of size 1 are decode steps.
    """
    chunks = [int(c) for c in chunks]
    if sum(chunks) != len(ids) or any(c <= 0 for c in chunks):
        raise ValueError(f"chunks {chunks} do not split {len(ids)} tokens")
    _check_exact(model, exact)
    ids_t = _ids_tensor(model, ids)
    cache_kw = _cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    pieces = []
    start = 0
    with torch.no_grad(), _precision(exact):
        for size in chunks:
            out = model(input_ids=ids_t[:, start:start + size], use_cache=True, **{cache_kw: cache})
            cache = getattr(out, cache_kw)
            pieces.append(out.logits[0].to(_F64).cpu().numpy())
            start += size
    return np.concatenate(pieces, axis=0)


def hf_trace(model: Gemma4ForCausalLM, ids: Sequence[int], exact: bool = True) -> dict[int, np.ndarray]:
    """Router choices of one full forward: {layer index: top-k expert indices [T, top_k]}.

    Recorded with forward hooks on the ``Gemma4TextRouter`` modules (output
    ``(router_probabilities, top_k_weights, top_k_index)``); indices are in
    ``torch.topk`` order (descending probability). Empty dict for a dense model.
    """
    _check_exact(model, exact)
    found: dict[int, np.ndarray] = {}
    handles = []
    for layer_idx, layer in enumerate(model.model.layers):
        router = getattr(layer, "router", None)
        if router is None:
            continue

        def hook(_module, _inputs, output, layer_idx=layer_idx):
            found[layer_idx] = output[2].detach().cpu().numpy().astype(np.int64)

        handles.append(router.register_forward_hook(hook))
    if not handles:
        return {}
    try:
        with torch.no_grad(), _precision(exact):
            model(input_ids=_ids_tensor(model, ids), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return dict(sorted(found.items()))


class ExactFloat64Backend(TransformersBackend):
    """The transformers backend in float64 with transformers' float32 spots made float64 (``float64_exact``,
    ``recompute_float64_buffers``): what the oracle must match to float64 rounding."""

    def __init__(self, **options):
        super().__init__(dtype="float64", **options)

    def open(self, model_dir):
        super().open(model_dir)
        recompute_float64_buffers(self.model)

    def run(self, request):
        with float64_exact():
            return super().run(request)
