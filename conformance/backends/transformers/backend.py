"""Hugging Face transformers (PyTorch) as a conformance backend.

It drives ``transformers.Gemma4ForCausalLM`` (``Gemma4ForConditionalGeneration`` for an image-text or
audio-text checkpoint) the way a serving stack built on transformers does, and claims every capability
of the protocol, image and audio prompts included (``audio_tower`` too, except in float64: see below). Three
modules share the work: the request handling (validation, micro-batches, one cache per sequence id, decode) is
``conformance.protocol.serving.CachedBackend``'s; ``conformance.backends.transformers.inputs`` maps each request
kind to transformers' arguments (``logits_to_keep``, ``inputs_embeds``, the per-layer inputs,
``mm_token_type_ids``, the towers' soft tokens); ``conformance.backends.transformers.loading`` loads the
checkpoint (both layouts, Gemma 4 Unified, safetensors only). This module holds the backend's options and
state, the forward and its traces:

* traces (``request.trace``; the points of ``conformance.protocol.trace``): forward hooks on the text
  model's modules, installed for one forward and removed after it (:meth:`TransformersBackend._tracing`):
  ``embed`` the input of decoder layer 0 (a forward pre-hook: ``inputs_embeds``, soft tokens merged), per
  layer ``attn_out`` / ``ffn_out`` / ``ple_add`` the outputs of ``post_attention_layernorm`` /
  ``post_feedforward_layernorm`` (on MoE layers after the expert branch is added) /
  ``post_per_layer_input_norm``, ``router.experts`` the top-k indices of ``router``, ``residual`` the
  layer's output (``layer_scalar`` applied), ``final_norm`` the output of the final ``norm``. Each keeps
  the forward's output rows; a layer after ``_maybe_slice_kv_shared_inputs`` sees only the last ``k``
  positions, so a row is taken at its offset from the end.

Options (``--backend-option KEY=VALUE``):

``dtype``   ``"float32"`` (default), ``"float64"``, ``"bfloat16"``. transformers' float64 is not a
            pure float64 model: RMSNorm, the attention softmax (eager), the RoPE angles and the MoE
            router softmax stay float32 (see tests/hf_reference.py), so float64 is graded with the
            ``fp32`` profile like float32; bfloat16 with ``bf16``. Logits come back as float32
            (float64 for the float64 model).
``attn``    ``"eager"`` (default) or ``"sdpa"`` (``attn_implementation``).
``device``  ``"auto"`` (default: CUDA when ``torch.cuda.is_available()``, else CPU), ``"cpu"``,
            ``"cuda"`` or ``"cuda:N"``.
``experts`` ``"auto"`` (default: ``"eager"`` for float64, which ``grouped_mm`` refuses, and for
            float32 on CUDA, where torch's grouped GEMM takes bfloat16 only; transformers' default,
            ``grouped_mm``, otherwise), ``"eager"``, ``"grouped_mm"``, ``"batched_mm"``
            (``experts_implementation`` of the MoE blocks).
``threads`` ``None`` (default: leave torch's thread count alone) or an int for
            ``torch.set_num_threads`` (process-wide; 1 is fastest for the tiny synthetic sets).
``image_tower`` ``"off"`` (default: the image soft tokens the request's embeddings carry) or ``"on"``
            (Gemma 4 Unified only: transformers' own vision embedder,
            ``Gemma4UnifiedModel.get_image_features``, computes them from ``request.image_inputs``, the
            padded 48-pixel patches and positions; claims ``image_tower``). Named in the backend's name.
``audio_tower`` ``"auto"`` (default: ``"on"`` except for float64, where transformers' audio tower does not
            run), ``"on"`` (compute the audio soft tokens with transformers' audio tower from
            ``request.audio_inputs``; claims ``audio_tower``), ``"off"`` (use the soft tokens the
            request's embeddings carry). Named in the backend's name when not ``"auto"``.

Measured on the bundled sets (260 cases, CPU, torch 2.13.0+cpu, transformers 5.24.0; worst row
max_abs against the float64 oracle):

==================  =======  ==========================  ===============================
dtype / attn        profile  result                      worst max_abs
==================  =======  ==========================  ===============================
float32 / eager     fp32     260 pass                    3.1e-4 (e2b-mini full/B/T19 r11)
float32 / sdpa      fp32     260 pass                    3.5e-4 (same row)
float64 / eager     fp32     260 pass                    2.6e-4 (e4b-mini full/B/T19 r15)
float64 / sdpa      fp32     260 pass                    9.6e-5 (same row)
bfloat16 / eager    bf16     231 pass, 29 known failure  12.1 (26b-a4b-mini, router flip)
bfloat16 / sdpa     bf16     241 pass, 19 known failure  12.1 (same)
==================  =======  ==========================  ===============================

float64 is float32-close only, because of its float32 spots (sdpa computes the attention softmax in
float64, one spot fewer than eager, hence its smaller error). With those spots made float64
(tests/hf_reference.py) the backend passes all 260 cases at ``exact-f64`` (worst 1.6e-12), so its
caches, index tensors and micro-batches add nothing. The bf16 failures are MoE router near-ties and
ill-conditioned per-layer-input norms that a stock bf16 forward over the whole base reproduces row for
row; they are listed, with their causes, in expectations files per device, because bf16 rounding is
kernel-specific (``conformance/backends/transformers/expectations/transformers-bfloat16-{eager,sdpa}-{cpu,cuda}.json``,
picked by :func:`shipped_expectations`; CUDA measured on an H200). On a busy 2-core machine torch's
default threads made a full run 10-20x slower than ``threads=1`` (90-220 s instead of 8-13 s).

The name shows the configuration: ``transformers-float32-eager`` (plus ``-experts-<impl>`` when
``experts`` is given explicitly); the device, versions and the path taken are in every case's
``executed`` record.

    conformance check --backend transformers
    conformance check --backend transformers --backend-option dtype=bfloat16 --backend-option attn=sdpa
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import DynamicCache, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

from refimpl.errors import check_choice

from ...protocol.serving import CachedBackend
from ...protocol.types import BackendError, Capabilities, Request, Response
from .inputs import RequestMapping
from .loading import (
    DTYPES,
    WHO,
    checkpoint_layout,
    has_audio,
    has_vision,
    is_unified,
    load_gemma4_causal_lm,
    load_gemma4_conditional_generation,
    load_gemma4_unified,
    resolve_device,
)
from .mtp import CONVENTION as MTP_CONVENTION
from .mtp import assisted_generate, load_assistant

__all__ = ["ATTN_IMPLEMENTATIONS", "AUDIO_TOWER_OPTIONS", "EXPECTATIONS_DIR", "EXPERTS_IMPLEMENTATIONS",
           "SequenceState", "TransformersBackend", "shipped_expectations"]

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
EXPERTS_IMPLEMENTATIONS = ("auto", "eager", "grouped_mm", "batched_mm")
AUDIO_TOWER_OPTIONS = ("auto", "on", "off")
IMAGE_TOWER_OPTIONS = ("off", "on")
# CUDA TF32: "off" (default) turns it off for matmuls and cuDNN convolutions (the audio tower's
# subsampling Conv2d), so float32 means float32; "torch" keeps torch's defaults (matmuls off,
# convolutions on: on an H200 that moves the audio soft tokens by ~0.1 and fails the fp32 profile)
TF32_OPTIONS = ("off", "torch")
EXPECTATIONS_DIR = Path(__file__).resolve().parent / "expectations"


def shipped_expectations(name: str, device: torch.device) -> Path | None:
    """The expectations file shipped for a configuration: ``<name>-<device type>.json`` (reduced-precision
    rounding is kernel-specific, so e.g. the bf16 known failures measured on CPU apply to CPU only), else
    ``<name>.json``, else None. ``-image-tower-on`` is not part of the file name: computing the image soft
    tokens with transformers' own embedder changes no recorded divergence (measured on 12b-mini)."""
    name = name.removesuffix("-image-tower-on")
    for candidate in (EXPECTATIONS_DIR / f"{name}-{device.type}.json", EXPECTATIONS_DIR / f"{name}.json"):
        if candidate.is_file():
            return candidate
    return None


# ----------------------------------------------------------------------------------------------
# the backend


class SequenceState:
    """One sequence's state: its ``DynamicCache`` and the ``mm_token_type_ids`` of every token the cache
    holds (1 at image tokens, 3 at audio tokens, 0 elsewhere). transformers' vision mask reads the block ids by absolute
    position (``blockwise_overlay`` indexes them with the kv position, and a sliding cache layer's keys
    start at ``kv_offset`` > 0), so a forward continuing the cache passes them from the sequence's start,
    as ``Gemma4ForConditionalGeneration.prepare_inputs_for_generation`` does for a prefill chunk."""

    __slots__ = ("cache", "token_types")

    def __init__(self, cache: DynamicCache):
        self.cache = cache
        self.token_types: list[int] = []


class TransformersBackend(RequestMapping, CachedBackend):
    """``transformers.Gemma4ForCausalLM`` (``Gemma4ForConditionalGeneration`` for image-text and audio-text
    checkpoints) behind the backend protocol (``conformance.protocol.Backend``).

    Options: ``dtype`` ("float32", "float64", "bfloat16"), ``attn`` ("eager", "sdpa"), ``device``
    ("auto", "cpu", "cuda", "cuda:N"), ``experts`` ("auto", "eager", "grouped_mm", "batched_mm"),
    ``threads`` (None or an int >= 1), ``audio_tower`` ("auto", "on", "off"), ``tf32`` ("off", "torch";
    CUDA only), ``image_tower`` ("off", "on": Gemma 4 Unified's image soft tokens from transformers'
    own embedder). See the module docstring.
    """

    who = "transformers backend"

    def __init__(self, dtype: str = "float32", attn: str = "eager", device: str = "auto",
                 experts: str = "auto", threads: int | None = None, audio_tower: str = "auto", tf32: str = "off",
                 image_tower: str = "off"):
        super().__init__()
        for option, value, choices in (("dtype", dtype, DTYPES), ("attn", attn, ATTN_IMPLEMENTATIONS),
                                       ("experts", experts, EXPERTS_IMPLEMENTATIONS)):
            check_choice(option, value, choices, who=WHO, error=ValueError)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"transformers backend: threads must be None or an integer >= 1, got {threads!r}")
        for option, value, choices in (("audio_tower", audio_tower, AUDIO_TOWER_OPTIONS),
                                       ("image_tower", image_tower, IMAGE_TOWER_OPTIONS)):
            check_choice(option, value, choices, who=WHO, error=ValueError)
        self.image_tower = image_tower == "on"
        self.tf32 = check_choice("tf32", tf32, TF32_OPTIONS, who=WHO, error=ValueError)
        self.dtype = dtype
        self.torch_dtype = DTYPES[dtype]
        self.attn = attn
        self.device = resolve_device(device)
        if experts == "auto":
            # grouped_mm refuses float64 everywhere, and on CUDA takes bfloat16 only (torch's
            # _grouped_mm_cuda checks); None keeps transformers' default (grouped_mm)
            cuda_f32 = dtype == "float32" and self.device.type == "cuda"
            self.experts = "eager" if dtype == "float64" or cuda_f32 else None
        else:
            self.experts = experts
        self.threads = threads
        # transformers 5.24's audio tower does not run in float64 (Gemma4AudioAttention computes q/k/v in
        # float32, then multiplies by float64 parameters: "expected scalar type Float but found Double"),
        # so a float64 model takes the soft tokens the request gives unless told otherwise
        self.audio_tower = audio_tower == "on" or (audio_tower == "auto" and dtype != "float64")
        self.name = (f"transformers-{dtype}-{attn}" + ("" if experts == "auto" else f"-experts-{experts}")
                     + ("" if audio_tower == "auto" else f"-audio-tower-{audio_tower}")
                     + ("" if tf32 == "off" else f"-tf32-{tf32}")
                     + ("" if image_tower == "off" else "-image-tower-on"))
        self.capabilities = Capabilities(
            full_forward=True, last_plain=True, last_seq_id=True, last_embeddings=True,
            embedding_convention="scaled", interior_rows=True, output_rows=True, ubatch=True,
            chunked_prefill=True, multi_sequence=True, decode=True, image_prompts=True, audio_prompts=True,
            audio_tower=self.audio_tower, image_tower=self.image_tower, video_prompts=True, hidden_states=True,
            mtp_generate=True, mtp_media=self.image_tower and self.audio_tower,  # (generate runs its own towers)
            mtp_conventions=MTP_CONVENTION, traces=True, default_profile="bf16" if dtype == "bfloat16" else "fp32",
        )
        self.expectations_file = shipped_expectations(self.name, self.device)
        self.model: Gemma4ForCausalLM | Gemma4ForConditionalGeneration | None = None
        self.layout: str | None = None
        self.vision = False  # the checkpoint has a vision tower: Gemma4ForConditionalGeneration
        self.audio = False  # the checkpoint has an audio tower: Gemma4ForConditionalGeneration
        self.unified = False  # a Gemma 4 Unified checkpoint: Gemma4Unified{ForConditionalGeneration,ForCausalLM}
        self.text_config: Any = None
        self.text_model: Any = None  # the Gemma4TextModel (per-layer inputs)
        self.image_token_id: int | None = None
        self.video_token_id: int | None = None
        self.audio_token_id: int | None = None
        self._model_dir: Path | None = None
        self._cache_kw = "cache"
        self._device_info: dict[str, Any] = {}

    # -- protocol -------------------------------------------------------------------------------

    def open(self, model_dir: Path) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        self.layout, raw = checkpoint_layout(model_dir)
        self.vision, self.audio = has_vision(raw), has_audio(raw)
        self.unified = is_unified(raw)
        if self.image_tower and not (self.unified and self.vision):
            raise BackendError(f"transformers backend: image_tower=on computes the image soft tokens with Gemma 4 "
                               f"Unified's vision embedder (get_image_features); {model_dir} is not a Gemma 4 Unified "
                               "checkpoint with a vision_config")
        loader = (load_gemma4_unified if self.unified else
                  load_gemma4_conditional_generation if self.conditional else load_gemma4_causal_lm)
        try:
            self.model = loader(model_dir, self.torch_dtype, attn_implementation=self.attn,
                                experts_implementation=self.experts, device=self.device)
        except torch.cuda.OutOfMemoryError as exc:  # pragma: no cover - needs a GPU
            raise BackendError(f"transformers backend: {model_dir} does not fit on {self.device}: {exc}") from exc
        self._model_dir = Path(model_dir)
        self.text_config = self.model.config.get_text_config()
        # the text model: under model.language_model when a conditional class was loaded (an image-text or
        # audio-text Gemma 4, or any conditional-layout Gemma 4 Unified), else model.model
        wraps_text = self.conditional or (self.unified and self.layout == "conditional")
        self.text_model = self.model.model.language_model if wraps_text else self.model.model
        self.image_token_id = int(self.model.config.image_token_id) if self.vision else None
        self.video_token_id = int(self.model.config.video_token_id) if self.vision else None
        self.audio_token_id = int(self.model.config.audio_token_id) if self.audio else None
        params = inspect.signature(type(self.model).forward).parameters
        # transformers 5.24 renamed past_key_values -> cache (the old name is deprecated until 5.40)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._device_info = {}
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            if self.tf32 == "off":
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
            self._device_info = {"gpu": torch.cuda.get_device_name(self.device),
                                 "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                                 "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32)}

    def close(self) -> None:
        self.model = None
        self.drafters = {}
        self.layout = None
        self.vision = self.audio = self.unified = False
        self.text_config = self.text_model = self.image_token_id = self.audio_token_id = self._model_dir = None
        self.video_token_id = None
        self._states = {}
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.empty_cache()

    def run(self, request: Request) -> Response:
        """CachedBackend's request handling, under ``torch.inference_mode()``; MTP requests (mode ``generate``)
        through transformers' own assisted generation (``conformance.backends.transformers.mtp``)."""
        with torch.inference_mode():
            if request.kind == "mtp":
                return self._mtp(request)
            return super().run(request)

    def _mtp(self, request: Request) -> Response:
        drafter = self.own_mtp_drafter(request, MTP_CONVENTION, "transformers' own assisted generation",
                                       lambda path: load_assistant(path, self.torch_dtype, self.attn, self.device))
        self._hidden = [] if request.hidden else None
        media = bool(request.images or request.audio)  # MTP after media: generate runs its own towers on them
        try:  # the prompt's last row (and its hidden state) from a forward of its own
            logits, _ = self._forward_rows(self._forward(
                request.tokens, [len(request.tokens) - 1], self._new_state(), request.embeddings if media else None,
                request.images, request.audio, request.audio_inputs, image_inputs=request.image_inputs))
            hidden = self._take_hidden(1)
        finally:
            self._hidden = None
        mtp, notes = assisted_generate(self.model, drafter, request, self.pad_token_id,
                                       self._generate_media(request) if media else {})
        return Response(logits, None, self._executed("mtp", **notes), hidden=hidden, mtp=mtp)

    # -- engine hooks ---------------------------------------------------------------------------

    @property
    def out_dtype(self):
        return np.float64 if self.dtype == "float64" else np.float32

    @property
    def conditional(self) -> bool:
        """Whether the open checkpoint runs as ``Gemma4ForConditionalGeneration`` (a vision or audio tower)."""
        return self.vision or self.audio

    @property
    def vision_masks(self) -> bool:
        """Whether transformers builds block masks on this checkpoint: a ``Gemma4ForConditionalGeneration``
        whose text config says ``use_bidirectional_attention == "vision"`` (``Gemma4Model.forward`` then
        calls ``create_masks_for_vision_model`` when given ``mm_token_type_ids``; only types 1 and 2 form
        blocks, so audio tokens, type 3, stay causal)."""
        return self.conditional and self.text_config.use_bidirectional_attention == "vision"

    @property
    def ple(self) -> bool:
        """Whether the text model has per-layer inputs (Gemma 4 Unified never has)."""
        return bool(getattr(self.text_config, "hidden_size_per_layer_input", 0)) and not self.unified

    @property
    def pad_token_id(self) -> int:
        """The id whose per-layer-input row image and audio positions take (``text_config.pad_token_id``, as in
        ``Gemma4Model.forward``; 0 when the config has none)."""
        pad = self.text_config.pad_token_id
        return 0 if pad is None else int(pad)

    def _new_state(self) -> SequenceState:
        return SequenceState(DynamicCache(config=self.model.config))

    def _state_len(self, state: SequenceState) -> int:
        return state.cache.get_seq_length()

    def _numpy(self, logits: torch.Tensor) -> np.ndarray:
        out = logits.detach()
        if out.dtype not in (torch.float32, torch.float64):
            out = out.float()  # bfloat16 -> float32 on the way out
        return out.cpu().numpy()

    @contextlib.contextmanager
    def _tracing(self, rows: list[int], T: int):
        """While tracing (``self._trace`` is not None): forward hooks on the text model for one ``T``-token
        forward, yielding the dict they fill, point name -> numpy [len(rows), ...] at ``rows``; the hooks are
        removed on exit. Otherwise yields None and hooks nothing.

        A hooked tensor covers the forward's ``S`` positions, ``S == T`` or, in the KV-shared layers after
        ``_maybe_slice_kv_shared_inputs`` (integer ``logits_to_keep``), the last ``S`` (= the output rows):
        row ``r`` is at ``r - (T - S)``."""
        if self._trace is None:
            yield None
            return
        trace: dict[str, np.ndarray] = {}

        def keep(name: str, x: torch.Tensor) -> None:
            x = x.detach().reshape(-1, x.shape[-1])  # [1, S, D] (the router's indices: [S, k]) -> [S, D]
            at = torch.tensor([r - (T - x.shape[0]) for r in rows], dtype=torch.long, device=x.device)
            x = x.index_select(0, at)
            trace[name] = x.cpu().numpy() if not x.is_floating_point() else self._numpy(x)

        def on_output(name: str, pick=lambda out: out):
            return lambda module, args, out: keep(name, pick(out))

        model = self.text_model
        hooks = [model.layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: keep("embed", args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True)]
        for i, layer in enumerate(model.layers[:self.text_config.num_hidden_layers]):
            p = f"layers.{i}."
            hooks += [layer.post_attention_layernorm.register_forward_hook(on_output(p + "attn_out")),
                      layer.post_feedforward_layernorm.register_forward_hook(on_output(p + "ffn_out")),
                      layer.register_forward_hook(on_output(p + "residual"))]
            if getattr(layer, "router", None) is not None:  # MoE: (probabilities, top-k weights, top-k index)
                hooks.append(layer.router.register_forward_hook(on_output(p + "router.experts", lambda out: out[2])))
            if getattr(layer, "post_per_layer_input_norm", None) is not None:  # per-layer inputs
                hooks.append(layer.post_per_layer_input_norm.register_forward_hook(on_output(p + "ple_add")))
        hooks.append(model.norm.register_forward_hook(on_output("final_norm")))
        try:
            yield trace
        finally:
            for hook in hooks:
                hook.remove()

    def _forward(self, tokens: Sequence[int], rows: list[int], state: SequenceState,
                 embeddings: np.ndarray | None = None, images: Sequence[tuple[int, int]] = (),
                 audio: Sequence[tuple[int, int]] = (), audio_inputs: Sequence = (),
                 logits_to_keep: Any = None, image_inputs: Sequence = ()) -> tuple:
        """One forward of ``tokens`` continuing the cache of ``state``; returns (logits of ``rows``
        [R, V], notes: ``{"logits_to_keep": the logits_to_keep used, in JSON form}``, plus
        ``mm_token_type_ids`` (how many were passed) and ``mask_function`` (the one ``Gemma4Model.forward``
        picks with them) when they were passed). A forward with no output row still runs every layer and writes the
        cache
        (logits_to_keep = an empty index tensor). With hidden states asked, a third element: the final norm's
        output at ``rows``; with traces asked (:meth:`_tracing`), a fourth: the trace of ``rows``.

        Image blocks (``images``, with ``embeddings``): the per-layer inputs' token part is looked up at
        ``pad_token_id`` in the blocks; on an image-text model every embeddings forward of a sequence
        that holds an image token passes ``mm_token_type_ids`` from the sequence's start (decode steps,
        which come without embeddings, pass none, as ``generate`` does).

        Audio blocks (``audio``, with ``embeddings`` and ``audio_inputs``): likewise (type 3, pad row),
        and with ``audio_tower`` on, the blocks' rows of ``inputs_embeds`` are replaced by the soft tokens
        of transformers' own audio tower (:meth:`_audio_soft_tokens`); notes ``audio_soft_tokens`` (where
        they came from) and ``audio_rows_max_abs`` (max |tower - given rows|)."""
        T = len(tokens)
        id_list = [int(t) for t in tokens]
        types = self._token_types(id_list, images, audio)
        ids = torch.tensor([id_list], dtype=torch.long, device=self.device)
        if logits_to_keep is None:
            logits_to_keep, shown = self._logits_to_keep(rows, T)
        else:
            shown = logits_to_keep
        notes: dict[str, Any] = {"logits_to_keep": shown}
        kwargs: dict[str, Any] = {self._cache_kw: state.cache, "use_cache": True, "logits_to_keep": logits_to_keep}
        token_types = state.token_types + types
        if embeddings is None:
            kwargs["input_ids"] = ids
        else:
            kwargs.update(self._embeddings_kwargs(ids, embeddings, images, audio, audio_inputs, image_inputs, types,
                                                  token_types, notes))
        if self._hidden is not None:
            kwargs["output_hidden_states"] = True  # hidden_states[-1]: the final norm's output (capture_outputs)
        before = state.cache.get_seq_length()
        with self._tracing(rows, T) as trace:
            out = self.model(**kwargs)
        after = state.cache.get_seq_length()
        if after != before + T:
            raise RuntimeError(f"transformers backend: the cache holds {after} tokens after a {T}-token forward "
                               f"from {before}")
        state.token_types = token_types
        logits = out.logits[0]
        if logits.shape != (len(rows), self.vocab_size):
            raise RuntimeError(f"transformers backend: logits_to_keep={shown!r} gave logits of shape "
                               f"{tuple(logits.shape)}, expected {(len(rows), self.vocab_size)}")
        hidden = self._numpy(out.hidden_states[-1][0, rows]) if self._hidden is not None else None
        if trace is not None:
            return self._numpy(logits), notes, hidden, trace
        if hidden is not None:
            return self._numpy(logits), notes, hidden
        return self._numpy(logits), notes

    def _forward_all(self, tokens: Sequence[int], state: SequenceState) -> tuple:
        """The full forward: ``logits_to_keep=0`` (all rows)."""
        return self._forward(tokens, list(range(len(tokens))), state, logits_to_keep=0)

    def _executed(self, path: str, **extra) -> dict[str, Any]:
        return {"path": path, "engine": f"transformers {transformers.__version__}, torch {torch.__version__}",
                "model": type(self.model).__name__, "layout": self.layout, "dtype": self.dtype,
                "attn_implementation": self.attn,
                "experts_implementation": getattr(self.model.config, "_experts_implementation", None),
                **({"audio_attn_implementation": self.model.config.audio_config._attn_implementation}
                   if self.audio else {}),
                "device": str(self.device), **self._device_info, "cache": "DynamicCache", "fresh_state": True,
                **extra}
