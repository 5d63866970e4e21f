"""mlx-lm (Apple's MLX) as a conformance backend: ``conformance check --backend mlx-lm``.

The checkpoint is loaded with mlx-lm's own loader (``mlx_lm.utils.load_model``: its ``gemma4_text``
model for ``Gemma4ForCausalLM``, its ``gemma4`` wrapper for ``Gemma4ForConditionalGeneration``, its
``sanitize()``), weights are cast the way ``mlx_lm.convert --dtype`` casts them, and every request
is served through mlx-lm's own prompt caches (``mlx_lm.models.cache.make_prompt_cache(model)``:
``KVCache`` for full-attention layers, ``RotatingKVCache(max_size=sliding_window)`` for sliding
layers; KV-shared layers read their source layer's K/V inside the model), exactly as
``mlx_lm.generate`` drives them: a prompt in steps that continue the cache, then one token per call.
The request handling (validation, micro-batches, one prompt cache per sequence id, interleaved
decode) is ``conformance.protocol.serving.CachedBackend``'s; this module supplies the mlx-lm forward.

What mlx-lm does not do, and how this backend handles it:

* **Config keys.** mlx-lm reads only the legacy ``global_head_dim`` / ``num_global_key_value_heads``
  (not transformers 5.23+'s ``per_layer_config``) and has its own defaults for absent keys
  (``use_double_wide_mlp=True``, ``num_kv_shared_layers=20``, a 4:1 ``layer_types`` pattern, a
  262144-token ``vocab_size`` at the top of a conditional config, ...). ``open`` derives every key
  mlx-lm reads from ``refimpl.config`` (the spec's derivation) and, where the checkpoint's
  config.json lacks one or states it in a form mlx-lm reads differently, hands mlx-lm the derived
  value through ``load_model(model_config=...)`` (mlx-lm's own override; nothing is written to the
  checkpoint directory). The patch is kept in ``config_patch`` and named in every ``executed``.
  After loading, the built model's geometry (per-layer type, head dim, KV heads, K=V, KV source,
  FFN width, RoPE frequencies, window, softcap, PLE, MoE) is checked against refimpl's derivation:
  a checkpoint mlx-lm cannot represent is a ``BackendError``, never a silently different model.
* **Rows.** mlx-lm's model computes the logits of every row of a call; the requested rows are
  selected from them (``executed["rows"]`` says so). Micro-batches are separate forwards that
  continue the cache, as mlx-lm's ``prefill_step_size`` does.
* **Input embeddings.** ``Model.__call__(inputs, cache, input_embeddings=...)`` takes raw
  ``E[ids]`` (it multiplies by sqrt(H) itself) and, given the ids too, looks the per-layer
  embeddings up by id; the backend passes both (convention ``"raw"``).
* **Traces** (capability ``traces``). mlx-lm's model has no hooks; a traced forward is the same
  ``Model.__call__`` with some of its modules replaced, for that call only, by functions that call them
  unchanged and keep an input or output (``MlxLmBackend._tapped``), so every point is the engine's own
  array. Every point of ``conformance.protocol.trace`` maps exactly and is served (``ple_add`` on
  checkpoints with per-layer inputs, ``router.experts`` on MoE ones); a forward without ``trace`` runs
  untouched.
* **dtype.** ``float32`` (default, profile ``fp32``), ``bfloat16`` and ``float16`` (profile
  ``bf16``). ``float64`` is not offered: on the CPU build mlx's fast kernels (rms_norm, rope,
  scaled_dot_product_attention) and tanh/softmax compute in float32 whatever the array dtype (a
  float64 model lands at float32 accuracy, ~1e-4 on these presets), and ``gather_mm`` (the MoE
  experts) accepts only float32. For the same reason MoE checkpoints do not run in bfloat16 or
  float16 on the CPU build (``[GatherMM::eval] Currently only supports float32``): see the shipped
  expectations files ``conformance/backends/mlx_lm/expectations/mlx-lm-*.json`` (used on the CPU device only), which
  also hold the bfloat16 tolerance of the e2b-mini set (bf16 rounding on an ill-conditioned preset;
  transformers in bf16 exceeds the same bounds).

    conformance check --backend mlx-lm [--backend-option dtype=bfloat16]
"""

from __future__ import annotations

import contextlib
import io
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx  # the registry turns a missing mlx into an install hint (the 'mlx' extra)
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from refimpl.errors import check_choice
from refimpl.legacy_keys import legacy_text_keys

from ...check.profiles import PROFILES
from ...protocol.serving import CachedBackend
from ...protocol.types import BackendError, Capabilities, Request, Response
from ..mlx_common import GeometryCheck, read_configs, same, text_geometry, text_key_patch, versions

__all__ = ["MlxLmBackend", "DTYPES", "config_patch", "EXPECTATIONS_DIR"]

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_PROFILE = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}
EXPECTATIONS_DIR = Path(__file__).resolve().parent / "expectations"
_MISSING = object()


def _versions() -> dict[str, str]:
    return versions("mlx", "mlx-lm")


def _mlx_text_keys(cfg) -> dict[str, Any]:
    """The value of every text-config key mlx-lm's ``gemma4_text.ModelArgs`` reads, derived from a
    ``refimpl.config.TextConfig`` (which resolves both serialisations and every default): the legacy
    serialisation's keys (``refimpl.legacy_keys.legacy_text_keys``). Geometry mlx-lm cannot express (e.g.
    per-layer overrides that differ within a type) is caught by _verify_geometry."""
    return legacy_text_keys(cfg)


def config_patch(raw: dict, cfg) -> dict[str, dict[str, Any]]:
    """The keys to hand mlx-lm so it builds the model refimpl derives from ``raw`` (a parsed
    config.json) and ``cfg`` (its ``TextConfig``).

    Returns ``{key: {"was": value or "absent", "now": derived value}}``; keys of the text section
    are plain names, the conditional layout's top-level ``vocab_size`` is ``"<top>.vocab_size"``.
    A key is patched when config.json lacks it, or states it in a form mlx-lm reads differently
    (``per_layer_config`` instead of the legacy keys; a last layer that is not full attention,
    which transformers and refimpl force to full).
    """
    text = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    patch = text_key_patch(text, _mlx_text_keys(cfg))
    if text is not raw:  # conditional: mlx-lm's gemma4.ModelArgs copies the TOP-level vocab_size down
        have = raw.get("vocab_size", _MISSING)
        if have is _MISSING or not same(have, cfg.vocab_size):
            patch["<top>.vocab_size"] = {"was": "absent" if have is _MISSING else have, "now": cfg.vocab_size}
    return patch


def _model_config(raw: dict, patch: dict[str, dict[str, Any]]) -> dict | None:
    """``load_model(model_config=...)`` for a patch (mlx-lm does ``config.update(model_config)``)."""
    if not patch:
        return None
    conditional = isinstance(raw.get("text_config"), dict)
    text_patch = {k: v["now"] for k, v in patch.items() if not k.startswith("<top>.")}
    out: dict[str, Any] = {}
    if conditional:
        if text_patch:
            out["text_config"] = {**raw["text_config"], **text_patch}
        if "<top>.vocab_size" in patch:
            out["vocab_size"] = patch["<top>.vocab_size"]["now"]
    else:
        out.update(text_patch)
    return out


class MlxLmBackend(CachedBackend):
    """mlx-lm behind the backend protocol (``conformance.protocol.Backend``).

    Options: ``dtype`` ("float32" default, "bfloat16", "float16"): the compute and weight dtype,
    weights cast with mlx as ``mlx_lm.convert --dtype`` does; ``default_profile`` (default "fp32"
    for float32, "bf16" for bfloat16 and float16); ``quantize`` (``"<bits>:<group size>"``, e.g. "4:32", or
    ``"mixed_3_6:32"`` for one of mlx-lm's mixed recipes): quantise an unquantised checkpoint at open with
    mlx-lm's own ``quantize_model``, as ``mlx_lm.convert -q`` does, to grade the quantised engine against the
    unquantised oracle (default profile q4 up to 4 bits, else q8). A checkpoint already quantised is loaded
    as it is, whatever this option says (no requantisation).
    """

    who = "mlx-lm backend"

    def __init__(self, dtype: str = "float32", default_profile: str | None = None, quantize: str | None = None):
        super().__init__()
        self.quantize = None if quantize is None else _quantize_option(quantize)
        hint = (" (float64 is not offered: mlx's CPU fast kernels compute in float32 and its gather_mm, used by "
                "MoE, accepts float32 only)") if dtype in ("float64", "f64") else ""
        check_choice("option dtype", dtype, DTYPES, who="mlx-lm backend", error=ValueError, hint=hint)
        if default_profile is None:
            default_profile = DEFAULT_PROFILE[dtype] if quantize is None else (
                "q4" if self.quantize[0] in (2, 3, 4) or isinstance(self.quantize[0], str) else "q8")

        check_choice("option default_profile", default_profile, PROFILES, who="mlx-lm backend", error=ValueError)
        self.dtype = dtype
        self.name = f"mlx-lm-{dtype}" + ("" if quantize is None else f"-q{quantize.replace(':', '-g')}")
        self.capabilities = Capabilities(
            full_forward=True, last_plain=True, last_seq_id=True, last_embeddings=True,
            embedding_convention="raw", interior_rows=True, output_rows=True, ubatch=True,
            chunked_prefill=True, multi_sequence=True, decode=True, traces=True, default_profile=default_profile,
            weight_formats="safetensors,mlx-affine",  # mlx-lm loads a quantised directory as QuantizedLinear layers
        )
        # the shipped expectations were measured on (and are about) mlx's CPU build
        shipped = EXPECTATIONS_DIR / f"{self.name}.json"
        on_cpu = mx.default_device().type == mx.cpu
        self.expectations_file = shipped if (on_cpu and shipped.is_file()) else None
        self.text_config = None  # refimpl.config.TextConfig of the open checkpoint
        self.config_patch: dict[str, dict[str, Any]] = {}
        self.load_info: dict[str, Any] = {}
        self.unsupported: str | None = None
        self._prompt_cache: dict[str, int] = {}  # cache class -> layers, as make_prompt_cache(model) builds it

    # -- protocol -------------------------------------------------------------------------------

    def open(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        cfg, raw = read_configs(model_dir, "mlx-lm")
        patch = config_patch(raw, cfg)
        try:
            model, _ = load_model(model_dir, model_config=_model_config(raw, patch))
        except Exception as exc:  # whatever mlx-lm raises, name the loader and the directory
            raise BackendError(f"mlx-lm backend: mlx_lm.utils.load_model cannot load {model_dir}: "
                               f"{type(exc).__name__}: {exc}") from exc
        stored = sorted({str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())})
        target = getattr(mx, self.dtype)
        cast_predicate = getattr(model, "cast_predicate", lambda _: True)
        # what mlx_lm.convert --dtype does: every floating parameter to the dtype
        model.update(_cast(model.parameters(), target, cast_predicate))
        if self.quantize is not None and "quantization" not in raw:
            model = _quantized(model, raw, *self.quantize)
        mx.eval(model.parameters())
        self.model = model
        self.text_config = cfg
        self.config_patch = patch
        try:
            self._verify_geometry()
            self.unsupported = self._warm_up()
        except BaseException:
            self.close()
            raise
        caches = self._cache_kinds()
        self.load_info = {
            "loader": "mlx_lm.utils.load_model", "model_class": f"{type(model).__module__}.{type(model).__name__}",
            "architecture": cfg.architecture, "serialisation": cfg.serialisation,
            "stored_dtypes": stored, "dtype": self.dtype, "versions": _versions(),
            "config_patch": patch, "caches": caches, "unsupported": self.unsupported,
            "quantization": raw.get("quantization") if "quantization" in raw else (
                None if self.quantize is None else {"quantized_at_open": ":".join(map(str, self.quantize))}),
        }
        self._prompt_cache = {kind: caches.count(kind) for kind in dict.fromkeys(caches)}

    def close(self) -> None:
        self.model = None
        self.text_config = None
        self.unsupported = None
        self._prompt_cache = {}
        self._states = {}

    def run(self, request: Request) -> Response:
        """CachedBackend's request handling (a fresh prompt cache per request), unless this checkpoint
        cannot run at all in this dtype on this device (``unsupported``, found at open)."""
        if self.unsupported:
            raise RuntimeError(self.unsupported)
        return super().run(request)

    # -- checks at open -------------------------------------------------------------------------

    def _text_model(self):
        """mlx-lm's gemma4_text.Model (inside the gemma4 wrapper for the conditional layout)."""
        return getattr(self.model, "language_model", self.model)

    def _warm_up(self) -> str | None:
        """One single-token forward through a throwaway prompt cache: mlx compiles its kernels on the
        first call (seconds), and a dtype the CPU build cannot run shows here. Returns None, or why
        every request on this checkpoint will fail (MoE in bfloat16/float16: see the module doc)."""
        try:
            self._call([self.text_config.bos_token_id or 0], make_prompt_cache(self.model))
        except RuntimeError as exc:
            if self.text_config.enable_moe_block and self.dtype != "float32" and "GatherMM" in str(exc):
                return (f"mlx-lm backend: this checkpoint has MoE blocks, whose experts mlx-lm runs through "
                        f"mx.gather_mm (SwitchGLU); mlx {_versions()['mlx']} on {mx.default_device()} runs "
                        f"gather_mm in float32 only ({exc}), so mlx-lm cannot run this model in {self.dtype} "
                        f"on this device; use dtype=float32")
            raise BackendError(f"mlx-lm backend: a one-token forward of the loaded model fails: "
                               f"{type(exc).__name__}: {exc}") from exc
        return None

    def _cache_kinds(self) -> list[str]:
        return [type(c).__name__ for c in make_prompt_cache(self.model)]

    def _verify_geometry(self) -> None:
        """The built mlx-lm model must be the model refimpl derives from config.json."""
        cfg = self.text_config
        lm = self._text_model()
        inner = lm.model
        check = GeometryCheck("mlx-lm")
        text_geometry(check, inner, cfg, softcap=lm.final_logit_softcapping, tied=lm.tie_word_embeddings,
                      owns_kv=lambda attn: attn.has_kv)
        problems = check.problems
        if problems:
            raise BackendError("mlx-lm backend: mlx-lm builds a different model than the checkpoint's "
                               "config.json describes (mlx-lm cannot express this configuration): "
                               + "; ".join(problems))

    # -- engine hooks ---------------------------------------------------------------------------

    @property
    def out_dtype(self):
        return np.float32

    def _new_state(self) -> list:
        return make_prompt_cache(self.model)

    def _state_len(self, state: list) -> int:
        return int(state[0].offset)

    def _call(self, tokens: Sequence[int], cache: list, embeddings: np.ndarray | None = None) -> mx.array:
        """One mlx-lm forward continuing ``cache``: logits of every row, [T, V]; the cache is evaluated
        afterwards, as mlx_lm.generate does after each prefill step."""
        ids = mx.array([[int(t) for t in tokens]], dtype=mx.int32)
        kwargs = {}
        if embeddings is not None:
            kwargs["input_embeddings"] = mx.array(np.asarray(embeddings, dtype=np.float32)[None]).astype(
                getattr(mx, self.dtype))
        logits = self.model(ids, cache=cache, **kwargs)[0]
        mx.eval(logits, [c.state for c in cache])
        return logits

    @staticmethod
    def _rows(logits: mx.array, rows: Sequence[int]) -> np.ndarray:
        """The requested rows as float32 NumPy (bfloat16/float16 widen exactly)."""
        if not rows:
            return np.empty((0, logits.shape[-1]), dtype=np.float32)
        picked = logits[mx.array([int(r) for r in rows], dtype=mx.int32)].astype(mx.float32)
        return np.array(picked)

    def _forward(self, tokens: Sequence[int], rows: list[int], state: list,
                 embeddings: np.ndarray | None = None) -> tuple:
        """mlx-lm computes every row of the call (its K/V enter the prompt cache ``state``); the
        requested ``rows`` are selected from its logits. When the request asks for traces, the same call
        runs tapped (``_tapped``) and the trace of ``rows`` comes fourth (no hidden states: third None)."""
        if self._trace is None:
            return self._rows(self._call(tokens, state, embeddings), rows), {}
        with self._tapped() as taps:
            logits = self._call(tokens, state, embeddings)
        trace = {name: _take(value, rows) for name, value in taps.items()} if rows else {}
        return self._rows(logits, rows), {}, None, trace

    @contextmanager
    def _tapped(self):
        """While the context is open, mlx-lm's forward records every trace point (conformance.protocol.trace)
        in the dict it yields, point -> [1, T, ...] over every row of the call: each module named below is
        replaced, as the item of its parent module, by a function that calls it unchanged and keeps its
        input or output; the originals are put back on exit. What is recorded is the arrays mlx-lm itself
        computes and goes on with, so the traced values are the engine's:

        * ``embed``, ``layers.{i-1}.residual``: the input of layer i's ``input_layernorm`` (the decoder input
          ``E[ids] * embed_scale``; the stream a layer returns, ``layer_scalar`` applied);
        * ``layers.{L-1}.residual``, ``final_norm``: the input and output of the final ``norm``;
        * ``attn_out``, ``ffn_out``, ``ple_add``: the outputs of ``post_attention_layernorm``,
          ``post_feedforward_layernorm`` (on MoE layers applied to the dense and the normed expert branch's
          sum: the whole term added) and ``post_per_layer_input_norm`` (layers with per-layer inputs);
        * ``router.experts``: the first output of the MoE ``router`` (its top-k indices)."""
        inner = self._text_model().model
        taps: dict[str, mx.array] = {}
        swapped: list[tuple[Any, str, Any]] = []

        def tap(parent, key: str, takes_input: str | None = None, output: str | None = None) -> None:
            module = parent[key]

            def call(x, *args, **kwargs):
                out = module(x, *args, **kwargs)
                if takes_input:
                    taps[takes_input] = x
                if output:
                    taps[output] = out[0] if isinstance(out, tuple) else out
                return out

            swapped.append((parent, key, module))
            parent[key] = call  # a Module is a dict of its children: the call resolves self.<key> to this

        for i, layer in enumerate(inner.layers):
            p = f"layers.{i}."
            tap(layer, "input_layernorm", takes_input=f"layers.{i - 1}.residual" if i else "embed")
            tap(layer, "post_attention_layernorm", output=p + "attn_out")
            tap(layer, "post_feedforward_layernorm", output=p + "ffn_out")
            if layer.enable_moe:
                tap(layer, "router", output=p + "router.experts")
            if layer.get("post_per_layer_input_norm") is not None:
                tap(layer, "post_per_layer_input_norm", output=p + "ple_add")
        tap(inner, "norm", takes_input=f"layers.{len(inner.layers) - 1}.residual", output="final_norm")
        try:
            yield taps
        finally:
            for parent, key, module in swapped:
                parent[key] = module

    def _executed(self, path: str, **extra) -> dict[str, Any]:
        out = {"path": path, "dtype": self.dtype, "fresh_state": True,
               "cache": "mlx_lm.models.cache.make_prompt_cache(model)", "prompt_cache": self._prompt_cache,
               "rows": "every row computed by the mlx-lm forward; requested rows selected from its logits",
               "config_patch": self.config_patch, **extra}
        return out

    def _notes(self, request: Request) -> dict[str, Any]:
        """full: the rows returned; last: the rows computed and how embeddings went in; multi: whether
        decode was interleaved."""
        if request.kind == "full":
            return {"rows_returned": len(request.tokens)}
        if request.kind == "last":
            notes: dict[str, Any] = {"rows_computed": len(request.tokens)}
            if request.entry == "embeddings":
                notes["input_embeddings"] = ("raw E[ids] as Model(ids, input_embeddings=...); mlx-lm scales by "
                                             "sqrt(H) and looks the per-layer embeddings up by the ids")
            return notes
        if request.kind == "multi":
            return {"interleaved_decode": bool(request.decode)}
        return {}


def _take(value: mx.array, rows: Sequence[int]) -> np.ndarray:
    """``rows`` of a recorded [1, T, ...] array as NumPy: floats as float32 (bfloat16/float16 widen
    exactly), integers (the router's expert indices) as they are."""
    picked = value[0][mx.array([int(r) for r in rows], dtype=mx.int32)]
    return np.array(picked.astype(mx.float32) if mx.issubdtype(picked.dtype, mx.floating) else picked)


def _quantize_option(value: str) -> tuple[int | str, int]:
    """(bits or a mixed recipe's name, group size) of the ``quantize`` option; ValueError when malformed."""
    what, _, group = str(value).partition(":")
    recipes = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
    ok = group.isdigit() and int(group) in (32, 64, 128) and (what in recipes or what in ("2", "3", "4", "5", "6", "8"))
    if not ok:
        raise ValueError(f"mlx-lm backend: option quantize must be '<bits>:<group size>' (bits 2, 3, 4, 5, 6 or 8, or "
                         f"one of {', '.join(recipes)}; group size 32, 64 or 128), got {value!r}")
    return (what if what in recipes else int(what)), int(group)


def _quantized(model, raw: dict, what: int | str, group: int):
    """``model`` quantised as ``mlx_lm.convert -q`` quantises it (mlx-lm's Gemma 4 predicate, or a mixed recipe)."""
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import quantize_model

    if isinstance(what, str):
        predicate = mixed_quant_predicate_builder(what, model, group)
        bits = None
    else:
        predicate, bits = None, what
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits per weight
        model, _ = quantize_model(model, dict(raw), group, bits, quant_predicate=predicate)
    return model


def _cast(params, dtype, cast_predicate):
    """Every floating parameter to ``dtype``, as ``mlx_lm.convert --dtype`` casts them."""

    def cast(path, v):
        if cast_predicate(path) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    return tree_map_with_path(cast, params)
