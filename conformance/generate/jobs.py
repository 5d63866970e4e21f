"""One generation job per base, the worker side: everything expensive for that base (the greedy continuation
of G and P<k>, the image or audio tower and merge of I<k> / S<k>, the full float64 forward with its MoE
router margins, the KV-cache consistency check), written into the partial-run directory; only small
metadata comes back. ``spec`` is what the planner (``conformance.generate.run``) sends: small and picklable."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from refimpl.context import check_context
from refimpl.model import Gemma4
from refimpl.tokenizer import Tokenizer

from ..sets.bounds import consistency_bound, has_events, probe_bound
from ..sets.format import FixtureError, versions
from ..sets.head import summaries_of
from .bases import base_rows_of, event_probe, greedy, ordinary_ids, rounding_probe, text_consistency
from .context import OVERRIDE
from .media import AudioSide, VisionSide, make_media_base, media_consistency
from .partial import JOBS, RESULT, write_result
from .progress import Sink, emit, stage
from .video import VideoSide, make_video_base

# tests only: "BASE:fail" makes that base's job raise, "BASE:hang" makes it sleep (to be killed)
FAULT_ENV = "GEMMA4_CONFORMANCE_TEST_FAULT"


def job_versions() -> dict[str, str]:
    """The versions a job's numbers depend on (every worker must match the parent)."""
    v = versions()
    return {k: v[k] for k in ("conformance_version", "refimpl_version", "numpy_version")}


def where() -> str:
    """This worker, for error messages: the Dask worker address, or host and pid."""
    if "distributed" in sys.modules:
        with contextlib.suppress(Exception):
            return f"{sys.modules['distributed'].get_worker().address} ({socket.gethostname()})"
    return f"{socket.gethostname()} pid {os.getpid()}"


class JobContext:
    """What a worker keeps between jobs of one run: the model (memory-mapped weights), tokenizer,
    random-id pool and the towers, each loaded on first use."""

    def __init__(self, model_dir: Path, model=None, vision: VisionSide | None = None, audio: AudioSide | None = None,
                 vision_mask: str = "sliding-clamped", activations: str = "none", device: str | None = None):
        self.model_dir = model_dir
        self.model = model if model is not None else Gemma4(model_dir, vision_mask=vision_mask,
                                                             activations=activations, device=device)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self._lock = threading.Lock()
        self._pool = None
        self._vision, self._audio, self._video = vision, audio, None

    def _once(self, attr: str, make):
        """The attribute ``attr``, made by ``make()`` on first use (one thread at a time)."""
        with self._lock:
            if getattr(self, attr) is None:
                setattr(self, attr, make())
            return getattr(self, attr)

    @property
    def pool(self):
        return self._once("_pool", lambda: ordinary_ids(self.tokenizer, self.model.cfg.vocab_size))

    @property
    def vision(self) -> VisionSide:
        return self._once("_vision", lambda: VisionSide(self.model_dir))

    @property
    def audio(self) -> AudioSide:
        return self._once("_audio", lambda: AudioSide(self.model_dir))

    @property
    def video(self) -> VideoSide:
        return self._once("_video", lambda: VideoSide(self.model_dir))


_CONTEXTS: dict[tuple[str, str], JobContext] = {}
_CONTEXTS_LOCK = threading.Lock()


def job_context(model_dir: str, key: str, vision_mask: str = "sliding-clamped",
                activations: str = "none", device: str | None = None) -> JobContext:
    """The worker's context for a run (one kept: a new run's model replaces the last one); ``device``: the run's
    (its oracle's: a Dask worker on a GPU machine runs it there; None, this worker's REFIMPL_DEVICE)."""
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get((model_dir, key))
        if ctx is None:
            path = Path(model_dir)
            if not (path.is_dir() and (path / "config.json").is_file()) and not path.is_file():  # or a GGUF file
                raise FixtureError(f"worker {where()} cannot see the model directory {model_dir}; the model and "
                                   "--out's parent must be on storage every worker mounts at the same absolute path")
            _CONTEXTS.clear()
            ctx = _CONTEXTS[(model_dir, key)] = JobContext(path, vision_mask=vision_mask, activations=activations,
                                                           device=device)
        return ctx


# what run_job returns of a job's metadata (small: never the arrays)
RETURNED = ("base", "tokens", "seconds", "worker", "consistency", "consistency_bound", "rounding_probe",
            "event_probe")


def media_base(ctx: JobContext, side, spec: dict):
    """The image, audio or video base of a job (``conformance.generate.media.MediaBase``): its sources, towers and
    merged inputs."""
    if spec["kind"] == "video":
        return make_video_base(ctx.model, side, ctx.pool, spec["bos"], spec["seed"], spec["b_index"])
    sources = {int(k): tuple(v) for k, v in spec["sources"].items()}
    return make_media_base(ctx.model, side, ctx.pool, spec["bos"], spec["seed"], sources, spec["b_index"],
                           n_sources=spec["n_sources"])


def run_job(spec: dict, context: JobContext | None = None, on_stage: Sink | None = None) -> dict:
    """Run one job (``spec`` from the planner: small and picklable) and write its result into the
    partial-run directory; returns small metadata only (RETURNED, never the arrays). Its stages are reported
    to ``on_stage``, else to this process's sink (``conformance.generate.progress``)."""
    t0 = time.perf_counter()
    job_dir = Path(spec["partial"]) / JOBS / spec["base"]
    if not job_dir.parent.is_dir():
        raise FixtureError(f"worker {where()} cannot see the partial-run directory {job_dir.parent.parent}; "
                           "--out's parent must be on storage every worker mounts at the same absolute path")
    if (job_dir / RESULT).is_file():  # finished meanwhile (a retried task)
        meta = json.loads((job_dir / RESULT).read_text(encoding="utf-8"))
        return {k: meta.get(k) for k in RETURNED}
    fault = os.environ.get(FAULT_ENV, "")
    if fault.partition(":")[0] == spec["base"]:
        if fault.endswith(":hang"):
            time.sleep(3600)
        if fault.endswith(":die"):  # the worker process dies (a Dask nanny starts it again)
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"base {spec['base']}: injected failure ({FAULT_ENV}={fault})")
    ctx = context if context is not None else job_context(spec["model_dir"], spec["key"],
                                                          spec.get("vision_mask", "sliding-clamped"),
                                                          spec.get("activations", "none"), spec.get("device"))
    model, kind, base = ctx.model, spec["kind"], spec["base"]
    emit({"base": base, "event": "start", "worker": where()}, on_stage)
    arrays: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if kind == "text":
        ids = [int(t) for t in spec["ids"]]
        if spec["greedy"]:
            with stage(base, "continuation", on_stage):
                ids = ids + greedy(model, ids, spec["greedy"])
        with stage(base, "forward", on_stage):
            hidden, logits, margin = base_rows_of(model, ids)
        with stage(base, "consistency", on_stage):
            worst = text_consistency(model, ids, logits)
    else:
        side = getattr(ctx, {"image": "vision", "audio": "audio", "video": "video"}[kind])  # built on first use
        with stage(base, "towers", on_stage):
            mb = media_base(ctx, side, spec)
        if not spec.get("allow_beyond_context"):  # the text bases were checked by the planner
            check_context(model.cfg, len(mb.ids), f"{kind} base {base} is {len(mb.ids)} tokens long", OVERRIDE)
        for j, (source, processed, soft) in enumerate(zip(mb.sources, mb.processed, mb.soft, strict=True)):
            arrays.update(side.arrays(j, source, processed, soft))
        extra.update(side.job_meta(mb.processed))
        ids = [int(t) for t in mb.ids]
        with stage(base, "forward", on_stage):
            hidden, logits, margin = base_rows_of(model, ids, mb.inputs)
        with stage(base, "consistency", on_stage):
            worst = media_consistency(model, mb, logits)
        arrays["embeddings"] = np.asarray(mb.inputs.embeddings, dtype=np.float64)
        extra.update({"spans": [[int(a), int(n)] for a, n in mb.spans], "info": mb.info, "n_media": len(mb.soft),
                      **({"videos": [[int(a), int(n)] for a, n in mb.videos]} if mb.videos else {})})
    bound = consistency_bound(model.cfg, len(ids), logits)  # float64 rounding for this base (docs/profiles.md)
    probe = None
    if not worst <= bound:  # beyond the first-order model: measure how much this checkpoint amplifies rounding
        with stage(base, "rounding probe", on_stage):
            probe = rounding_probe(model, ids, logits, None if kind == "text" else mb.inputs)
        bound = max(bound, probe_bound(probe))
    events = None
    if has_events(model.activations):  # what a float32 engine's one-unit roundings reach on this base
        with stage(base, "event probe", on_stage):
            events = event_probe(model, ids, logits, None if kind == "text" else mb.inputs)
    arrays["hidden"] = hidden
    arrays.update(summaries_of(logits))
    if spec.get("store", "logits") == "logits":
        arrays["logits"] = logits
    del logits
    if margin is not None:
        arrays["router_margin"] = margin
    seconds = time.perf_counter() - t0
    meta = {"key": spec["key"], "base": base, "kind": kind, "ids": ids, "tokens": len(ids), "consistency": worst,
            "consistency_bound": bound, "rounding_probe": probe, "event_probe": events,
            "seconds": round(seconds, 3), "worker": where(), "versions": job_versions(),
            "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"), **extra}
    write_result(job_dir, meta, arrays)
    emit({"base": base, "event": "end"}, on_stage)
    return {k: meta[k] for k in RETURNED}


