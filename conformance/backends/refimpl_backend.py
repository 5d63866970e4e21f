"""The ``refimpl`` oracle as a conformance backend.

It serves every request kind the way an engine would (micro-batches through a KV cache, only the
requested rows through the LM head, one cache per sequence id, decode one token at a time: the
request handling of ``conformance.protocol.serving.CachedBackend``) but with the exact float64
forward of ``refimpl.model.Gemma4``. Against the bundled fixture sets it must pass every case with
the ``exact-f64`` profile; it is the harness's own self-check.

``RefimplBackend(dtype="float32")`` (or ``RefimplFloat32Backend()``) runs every weight and
activation in float32, which makes it a stand-in for a float32 engine (default profile ``fp32``);
``embed_scale="bf16"`` uses sqrt(H) rounded to bfloat16 as some engines do.

    conformance check --backend refimpl
    conformance check --backend conformance.backends.refimpl_backend:RefimplFloat32Backend
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from refimpl import Gemma4, KVCache, RefimplError
from refimpl.arrays import DEVICES, to_host
from refimpl.assistant import Drafter
from refimpl.config_fields import read_config_json
from refimpl.errors import check_choice
from refimpl.frontends import audio_front_end, image_front_end
from refimpl.ggml_act import CONVENTIONS as ACTIVATION_CONVENTIONS
from refimpl.gguf_io import is_gguf
from refimpl.model import VISION_MASK_RULES, Trace
from refimpl.mtp import CONVENTIONS, assisted_greedy, run_rounds
from refimpl.multimodal import MultimodalInputs, llm_input_ids, load_multimodal_tokens

from ..protocol.serving import CachedBackend, block_token_problem
from ..protocol.trace import FINAL, split_point
from ..protocol.types import BackendError, Capabilities, MtpResponse, Request, Response

__all__ = ["RefimplBackend", "RefimplFloat32Backend"]


def check_options(who: str, dtype: str, embed_scale: str) -> tuple[str, str]:
    """Validate the NumPy backends' options; returns (dtype name, embed_scale)."""
    dt = np.dtype(dtype)
    if dt not in (np.float64, np.float32):
        raise ValueError(f"{who}: dtype must be 'float64' or 'float32', got {dtype!r}")
    if embed_scale not in ("exact", "bf16"):
        raise ValueError(f"{who}: embed_scale must be 'exact' or 'bf16', got {embed_scale!r}")
    return dt.name, embed_scale


def all_capabilities(default_profile: str) -> Capabilities:
    """Every capability of the protocol, with scaled embeddings (the NumPy backends claim all)."""
    return Capabilities(
        full_forward=True, last_plain=True, last_seq_id=True, last_embeddings=True,
        embedding_convention="scaled", interior_rows=True, output_rows=True, ubatch=True,
        chunked_prefill=True, multi_sequence=True, decode=True, image_prompts=True, audio_prompts=True,
        audio_tower=True, image_tower=True, video_prompts=True, hidden_states=True, mtp=True, mtp_generate=True,
        mtp_media=True, mtp_batch=True, mtp_conventions=",".join(CONVENTIONS), traces=True,
        default_profile=default_profile,
        weight_formats="safetensors,mlx-affine,gguf",  # the oracle reads MLX's affine checkpoints and GGUF files
    )


def protocol_points(trace: Trace, rows: Sequence[int]) -> dict[str, np.ndarray]:
    """The points of an oracle ``Trace`` that the protocol's trace vocabulary names, at ``rows`` of the call."""
    out = {}
    for name, value in trace.tensors.items():
        try:
            split_point(name)
        except ValueError:
            continue  # the oracle's own extras (the per-layer inputs, the router's margin)
        out[name] = value[list(rows)]
    return out


class RefimplBackend(CachedBackend):
    """The exact NumPy oracle behind the backend protocol (``conformance.protocol.Backend``).

    Options: ``dtype`` ("float64" or "float32"), ``embed_scale`` ("exact" or "bf16"),
    ``default_profile`` (default: "exact-f64" for float64, "fp32" for float32), ``vision_mask``
    (refimpl.model.VISION_MASK_RULES; default "sliding-clamped", the bundled sets' rule), ``activations`` (the
    activation convention of its products, refimpl.ggml_act.CONVENTIONS: "none", the default, or ggml's CPU
    activation quantisation, "ggml-cpu/x86" / "ggml-cpu/ref" / "ggml-cpu/arm", on a GGUF checkpoint; declared as its one
    ``activation_conventions``), ``device`` ("cpu" or "cuda": the text decoder on CuPy; default REFIMPL_DEVICE's, else
    cpu: grading the GPU oracle against sets made on the CPU is ``--backend-option device=cuda``). ``oracle`` (Python
    only): a function that lends the model of a checkpoint directory instead of building one at ``open``, for
    a harness that already holds the set's oracle (explain); the float64, exact, default-mask backend only.
    """

    who = "refimpl backend"

    def __init__(self, dtype: str = "float64", embed_scale: str = "exact", default_profile: str | None = None,
                 vision_mask: str = "sliding-clamped", oracle: Callable[[Path], Gemma4] | None = None,
                 activations: str = "none", device: str | None = None):
        super().__init__()
        self.device = None if device is None else check_choice("device", device, DEVICES, who=self.who,
                                                               error=ValueError)
        self.dtype, self.embed_scale = check_options(self.who, dtype, embed_scale)
        self.vision_mask = check_choice("vision_mask", vision_mask, VISION_MASK_RULES, who=self.who, error=ValueError)
        self.activations = check_choice("activations", activations, ACTIVATION_CONVENTIONS, who=self.who,
                                        error=ValueError)
        if oracle is not None and activations != "none":
            raise ValueError(f"{self.who}: oracle lends the oracle of activations none")
        if oracle is not None and (self.dtype, embed_scale, vision_mask) != ("float64", "exact", "sliding-clamped"):
            raise ValueError(f"{self.who}: oracle lends the float64 oracle; it cannot serve dtype {self.dtype}, "
                             f"embed_scale {embed_scale}, vision_mask {vision_mask}")
        self.lent = oracle  # the harness's oracle, lent at open
        name = "refimpl" if self.dtype == "float64" else "refimpl-float32"
        self.name = (name if embed_scale == "exact" else f"{name}-bf16-scale") + (
            "" if activations == "none" else "-" + activations.replace("/", "-"))
        if default_profile is None:
            default_profile = "exact-f64" if self.dtype == "float64" and embed_scale == "exact" else "fp32"
        self.capabilities = replace(all_capabilities(default_profile), activation_conventions=activations)

    # -- protocol (run() is CachedBackend's) ----------------------------------------------------

    def open(self, model_dir: Path) -> None:
        try:
            if self.lent is not None:
                self.model = self.lent(model_dir)
            else:
                self.model = Gemma4(model_dir, dtype=self.dtype, embed_scale=self.embed_scale,
                                    vision_mask=self.vision_mask, activations=self.activations, device=self.device)
            self.tokens = load_multimodal_tokens(model_dir)
            raw = {} if is_gguf(model_dir) else read_config_json(model_dir)[1]  # a GGUF: the text model only
            self.vision = image_front_end(model_dir, self.dtype) if isinstance(raw.get("vision_config"), dict) else None
            self.audio = audio_front_end(model_dir, self.dtype) if isinstance(raw.get("audio_config"), dict) else None
        except (RefimplError, OSError) as exc:
            raise BackendError(f"refimpl backend cannot open {model_dir}: {exc}") from exc

    def close(self) -> None:
        self.model = None
        self.tokens = None
        self.vision = self.audio = None
        self._states = {}

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """Input embeddings in this backend's convention ("scaled"): E[ids] * sqrt(H), float64."""
        if self.model is None:
            raise RuntimeError("refimpl backend: embed() called before open()")
        return np.asarray(to_host(self.model.embed(self.model.check_ids(ids))), dtype=np.float64)

    # -- engine hooks ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.model.cfg.hidden_size

    @property
    def out_dtype(self):
        return self.model.dtype

    def _new_state(self):
        return KVCache()

    def _state_len(self, state) -> int:
        return state.length

    def _forward(self, tokens: Sequence[int], rows: list[int], state, embeddings=None,
                 images: Sequence[tuple[int, int]] = (), audio: Sequence[tuple[int, int]] = (),
                 audio_inputs: Sequence = (), image_inputs: Sequence = ()) -> tuple:
        """The oracle's forward continuing the KV cache ``state``: only ``rows`` go through the LM
        head; a forward with no row (``rows=[]``) still writes K/V for all its tokens. Image and audio
        blocks: their per-layer-input rows come from the pad id; on ``use_bidirectional_attention ==
        "vision"`` checkpoints the image blocks are the forward's vision blocks (audio stays causal).
        Image and audio soft tokens are computed here with the oracle's tower or embedder from
        ``image_inputs`` and ``audio_inputs`` (the given embeddings' media rows are replaced), so the
        stored soft tokens are checked too. When the request asks for traces, the forward records every point
        of ``refimpl.Trace`` that the protocol's vocabulary names (conformance.protocol.trace) at ``rows``."""
        ids, embeddings, blocks, notes = self._media_inputs(tokens, embeddings, images, audio, audio_inputs,
                                                            image_inputs)
        trace = Trace() if self._trace is not None else None
        logits, hidden = self.model.forward_rows(ids, rows=rows, cache=state, embeddings=embeddings,
                                                 vision_blocks=blocks, trace=trace)
        if trace is None:
            return logits, notes, hidden
        return logits, notes, hidden, {**protocol_points(trace, rows), FINAL: hidden}

    def _media_inputs(self, tokens: Sequence[int], embeddings, images: Sequence[tuple[int, int]],
                      audio: Sequence[tuple[int, int]], audio_inputs: Sequence, image_inputs: Sequence) -> tuple:
        """(llm ids, embeddings with the oracle's soft tokens, vision block ids or None, notes) of a call's tokens
        and media blocks (``_forward``)."""
        ids = np.asarray(tokens, dtype=np.int64)
        placeholder = np.zeros(ids.shape[0], dtype=bool)
        blocks, notes = None, {}
        t = self.tokens
        for what, spans, token, frame in (("image", images, t.image_token_id, t.video_token_id),
                                          ("audio", audio, t.audio_token_id, None)):
            for start, n in spans:
                if (why := block_token_problem(ids, start, n, what, token, frame)) is not None:
                    raise ValueError(f"{self.who}: {why}")
                placeholder[start:start + n] = True
        if images and self.model.cfg.use_bidirectional_attention == "vision":
            blocks = np.full(ids.shape[0], -1, dtype=np.int64)
            for b, (start, n) in enumerate(images):
                blocks[start:start + n] = b
        if images and image_inputs:
            embeddings = self._with_soft_tokens(np.array(embeddings, dtype=np.float64), images,
                                                [(i.pixel_values, i.positions) for i in image_inputs], self.vision,
                                                "image", "vision_config")
            notes["image_soft_tokens"] = f"refimpl vision {self.vision.kind}"
        elif images:
            notes["image_soft_tokens"] = "given (the request carries no image_inputs)"
        if audio:
            embeddings = self._with_soft_tokens(np.array(embeddings, dtype=np.float64), audio,
                                                [(c.features, c.mask) for c in audio_inputs], self.audio, "audio",
                                                "audio_config")
            notes["audio_soft_tokens"] = f"refimpl audio {self.audio.kind}"
        if placeholder.any():
            pad = self.model.cfg.pad_token_id if self.model.cfg.pad_token_id is not None else 0
            ids = llm_input_ids(ids, placeholder, pad)
        return ids, embeddings, blocks, notes

    def _with_soft_tokens(self, embeddings: np.ndarray, spans, inputs, front, what: str, key: str) -> np.ndarray:
        """``embeddings`` with each ``what`` block's rows replaced by the oracle's soft tokens of its
        input (``front.embed(*input)``: a refimpl.frontends front end)."""
        if front is None:
            raise ValueError(f"{self.who}: an {what} prompt, but the checkpoint has no {what} tower or embedder "
                             f"({key})")
        for (start, n), args in zip(spans, inputs, strict=True):
            soft = front.embed(*args)
            if soft.shape[0] != n:
                source = "clip" if what == "audio" else "image"
                raise ValueError(f"{self.who}: the {what} block ({start}, {n}) has {n} tokens but its {source} gives "
                                 f"{soft.shape[0]} soft tokens")
            embeddings[start:start + n] = soft
        return embeddings

    # -- MTP requests (the oracle's own round protocol, refimpl.mtp) ------------------------------

    def run(self, request: Request) -> Response:
        if request.kind == "mtp":
            if self.model is None:
                raise RuntimeError(f"{self.who}: run() called before open()")
            return self._mtp(request)
        return super().run(request)

    def _drafter(self, path: str | None) -> Drafter:
        """The assistant checkpoint at ``path``, loaded once per path."""
        if not path:
            raise ValueError(f"{self.who}: an mtp request needs the drafter's directory (request.drafter)")
        if getattr(self, "_drafters", None) is None:
            self._drafters: dict[str, Drafter] = {}
        if path not in self._drafters:
            try:
                self._drafters[path] = Drafter(path, dtype=self.dtype)
            except (RefimplError, OSError) as exc:
                raise ValueError(f"{self.who}: cannot load the drafter {path}: {exc}") from exc
        return self._drafters[path]

    def _mtp_batch(self, request: Request) -> Response:
        """A batched MTP request: the oracle runs each sequence alone (what each is graded against)."""
        if len(request.mtp_batch) != len(request.sequences):
            raise ValueError(f"{self.who}: {len(request.mtp_batch)} MTP requests for {len(request.sequences)} "
                             "sequences")
        solo = [self._mtp(Request(kind="mtp", tokens=tokens, drafter=request.drafter, mtp=spec, hidden=request.hidden))
                for tokens, spec in zip(request.sequences, request.mtp_batch, strict=True)]
        hidden = np.concatenate([r.hidden for r in solo]) if request.hidden else None
        return Response(np.concatenate([r.logits for r in solo]), None, self._executed(
            "mtp-batch", sequences=len(solo), each="the oracle's solo run",
            accepted=[r.mtp.accepted for r in solo]), hidden=hidden, mtp_batch=[r.mtp for r in solo])

    def _mtp(self, request: Request) -> Response:
        if request.mtp_batch:
            return self._mtp_batch(request)
        spec = request.mtp
        if spec is None:
            raise ValueError(f"{self.who}: an mtp request needs its MtpRequest (request.mtp)")
        if spec.convention not in CONVENTIONS:
            raise ValueError(f"{self.who}: unknown MTP convention {spec.convention!r}; one of {', '.join(CONVENTIONS)}")
        drafter = self._drafter(request.drafter)
        inputs, notes = None, {}
        if request.images or request.audio:  # MTP after media: the prompt's soft tokens from the oracle's towers
            if request.embeddings is None:
                raise ValueError(f"{self.who}: an MTP request after media needs the prompt's embeddings")
            ids, x, blocks, notes = self._media_inputs(request.tokens, request.embeddings, request.images,
                                                       request.audio, request.audio_inputs, request.image_inputs)
            inputs = MultimodalInputs(ids, np.asarray(x, dtype=np.float64), blocks, tuple(self.tokens.placeholders))
        try:
            if spec.mode == "rounds":
                run = run_rounds(self.model, drafter, request.tokens,
                                 [(r.token, r.drafts, r.accepted) for r in spec.rounds], spec.convention, inputs=inputs)
            else:
                run = assisted_greedy(self.model, drafter, request.tokens, spec.max_new_tokens, spec.num_drafts,
                                      spec.convention, inputs=inputs)
        except RefimplError as exc:
            raise ValueError(f"{self.who}: {exc}") from exc
        rounds = run.rounds
        white = spec.mode == "rounds"
        mtp = MtpResponse(
            output=run.output, accepted=[r.accepted for r in rounds],
            drafts=[r.draft_argmax if white else r.drafts for r in rounds],
            draft_logits=[r.draft_logits for r in rounds] if white else None,
            verify_logits=[r.verify_logits for r in rounds] if white else None,
            verify_hidden=[r.verify_hidden for r in rounds] if white and request.hidden else None)
        return Response(run.prefill_logits, None, self._executed(
            "mtp", mode=spec.mode, convention=spec.convention, rounds=len(rounds), **notes,
            positions=[r.position for r in rounds], keys={kind: [len(r.keys[kind]) for r in rounds]
                                                          for kind in (rounds[0].keys if rounds else {})}),
            hidden=run.prefill_hidden if request.hidden else None, mtp=mtp)

    def _executed(self, path: str, **extra) -> dict[str, Any]:
        return {"path": path, "dtype": self.dtype, "embed_scale": self.embed_scale, "fresh_state": True, **extra}

    def _notes(self, request: Request) -> dict[str, Any]:
        """full: the rows computed; last: a single row goes through the LM head."""
        if request.kind == "full":
            return {"rows": len(request.tokens)}
        if request.kind == "last":
            return {"single_row_head": True}
        return {}


class RefimplFloat32Backend(RefimplBackend):
    """The oracle run in float32 throughout: a stand-in for a float32 engine (profile ``fp32``)."""

    def __init__(self, embed_scale: str = "exact", default_profile: str | None = None,
                 vision_mask: str = "sliding-clamped"):
        super().__init__(dtype="float32", embed_scale=embed_scale, default_profile=default_profile,
                         vision_mask=vision_mask)
