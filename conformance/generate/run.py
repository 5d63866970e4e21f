"""``generate_set``: the only writer of fixture sets. Plans one job per base, runs the missing ones
(``executors``), keeps finished results in the partial-run directory (``partial``), assembles the set
and publishes it atomically. docs/fixtures.md and docs/distributed-generation.md."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from refimpl.errors import check_choice
from refimpl.gguf_io import is_gguf
from refimpl.model import VISION_MASK_RULES, Gemma4
from refimpl.synth import PRESETS
from refimpl.threads import cores
from refimpl.tokenizer import Tokenizer
from refimpl.unified import is_unified

from ..sets.case import (
    DECODE_STEPS,
    GENERATION_BASE,
    GENERATION_STEPS,
    PROMPT_CONTINUATION,
    PROMPT_PREFIX,
    RANDOM_BASES,
    Case,
)
from ..sets.checkpoint import checkpoint_record
from ..sets.format import (
    NAME_RE,
    SEMVER_RE,
    STORAGES,
    SYNTHETIC_FILES,
    FixtureError,
    checkpoint_files,
    hash_files,
    sha256_file,
)
from ..sets.head import SUMMARY_LEAVES, RebuiltLogits
from . import executors, partial
from .bases import bos_id, ordinary_ids
from .checks import check_activations, cross_check_entries, oracle_checks
from .context import check_bases, context_record
from .jobs import JobContext, job_versions
from .matrix import annotate, generate_cases, generate_image_cases, random_base_length
from .media import (
    AUDIO_TEXT,
    IMAGE_TEXT,
    AudioSide,
    VisionSide,
    audio_sources,
    has_audio_tower,
    has_vision_tower,
    image_sources,
    media_order,
)
from .mtp import SCENARIOS, MediaPrompt, checked_drafter, media_prompts, mtp_drafter, mtp_matrix
from .progress import IN_PROCESS, StageLog, Write, held_bound
from .prompts import chat_ids, encode_prompt, prompt_entries
from .video import VideoSide, video_jobs
from .write import write_set

# chunked prefill + decode vs full forward inside the oracle (float64): per base the larger of this floor (the
# miniatures' fixed bound) and the float64 rounding bound of the base (conformance.sets.bounds, docs/profiles.md)
CONSISTENCY_BOUND = 1e-9


CHAT_PROMPT = "What does the sliding window attention cache keep?"  # base G when the model has a tokenizer


G_RANDOM_PROMPT = 16  # base G prompt length when the model has no tokenizer


CASE_KINDS = ("auto", "text", "images", "audio", "videos", "mtp", "all")  # generate_set(cases=...); auto = all


Progress = Callable[[int, int, str], None]


# cross_check(model_dir, bases, base_logits) -> {"implementation", "agreement", "detail"} | [...] | None
# (None: the check could not run, e.g. its packages are missing, and nothing is recorded)
CrossCheck = Callable[[Path, Mapping[str, np.ndarray], Mapping[str, np.ndarray]], Any]


def publish_path(out: str | Path) -> Path:
    """Where the set for ``out`` is published, absolute: ``out`` itself, or for a symbolic link to an
    existing directory the directory it points to (a rename cannot replace a link). ValueError for a
    dangling link: found before any work, not when the finished set cannot be renamed into place."""
    absolute = Path(os.path.abspath(out))
    if absolute.is_symlink():
        if not absolute.exists():
            raise ValueError(f"{out} is a symbolic link to {os.readlink(absolute)}, which does not exist; remove "
                             "the link or choose another --out")
        return Path(os.path.realpath(absolute))
    return absolute


def media_key(items) -> list | None:
    """The given images or clips as the run key sees them: a file by its content's sha256 (not its name or
    path, which the manifest records: the same file given another way resumes the same run), an array by
    its shape, dtype and digest."""
    if items is None:
        return None
    out = []
    for item in items:
        if isinstance(item, (str, Path)):
            p = Path(item)
            out.append({"file_sha256": sha256_file(p) if p.is_file() else None})
        else:
            a = np.ascontiguousarray(np.asarray(item))
            out.append({"array": list(a.shape), "dtype": str(a.dtype),
                        "sha256": hashlib.sha256(a.tobytes()).hexdigest()})
    return out


def count_by_base(cases: Iterable[Case]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in cases:
        counts[c.base] = counts.get(c.base, 0) + 1
    return counts


def _checked_identity(out: Path, model_dir: Any, preset: str | None, seed: Any, version: Any, name: Any) -> str:
    """The set's name (default: the preset's, else ``out``'s), after checking the model, seed and version."""
    if (model_dir is None) == (preset is None):
        raise ValueError("give exactly one of a model directory (--model) and a synthetic preset (--preset)")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not isinstance(version, str) or not SEMVER_RE.match(version):
        raise ValueError(f"version {version!r} is not a semantic version (MAJOR.MINOR.PATCH, e.g. 1.0.0)")
    name = name if name is not None else (preset if preset is not None else out.name)
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"set name {name!r} must be letters, digits, '.', '_' or '-' (and start with a letter "
                         "or digit)")
    return name


def _checked_choices(model_dir: Any, store: str, vision_mask: str, activations: str, cases: str) -> Path | None:
    """The model directory (or GGUF file) resolved, after checking the options that are choices."""
    check_choice("store", store, STORAGES, error=ValueError)
    check_choice("vision_mask", vision_mask, VISION_MASK_RULES, error=ValueError)
    check_activations(activations, model_dir)
    check_choice("cases", cases, CASE_KINDS, error=ValueError)
    if model_dir is None:
        return None
    model_dir = Path(model_dir).resolve()
    if not model_dir.is_dir() and not (model_dir.is_file() and is_gguf(model_dir)):
        raise ValueError(f"{model_dir}: not a directory or a GGUF file")
    return model_dir


def _check_bases_asked(cases: str, entries: list, images: Any, audio: Any) -> None:
    """Prompts, images and audio only where the case kinds asked for write bases of them."""
    if cases == "images" and entries:
        raise ValueError("prompts make text bases, but cases='images' writes the image matrix only; use cases='all'")
    if images is not None and cases in ("text", "audio"):
        raise ValueError(f"images were given, but cases={cases!r} writes no image base; use cases='all' or 'images'")
    if audio is not None and cases in ("text", "images"):
        raise ValueError(f"audio was given, but cases={cases!r} writes no audio base; use cases='all' or 'audio'")
    if cases == "audio" and entries:
        raise ValueError("prompts make text bases, but cases='audio' writes the audio matrix only; use cases='all'")
    if cases == "videos" and (entries or images is not None or audio is not None):
        raise ValueError("cases='videos' writes the video matrix only (bases V0, V1 of synthetic videos): no prompts, "
                         "images or audio")


def _check_executor(workers: Any, cluster: Any) -> None:
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if cluster is not None and workers is not None:
        raise ValueError("give either workers (local processes) or cluster (a Dask scheduler address), not both")
    if cluster is not None and (not isinstance(cluster, str) or not cluster.strip()):
        raise ValueError(f"cluster must be a Dask scheduler address such as tcp://host:8786, got {cluster!r}")


def generate_set(out: str | Path, *, model_dir: str | Path | None = None, preset: str | None = None, seed: int = 0,
                 prompts=None, name: str | None = None, version: str = "1.0.0", progress: Progress | None = None,
                 cross_check: CrossCheck | None = None, command: str | None = None, cases: str = "auto",
                 images=None, audio=None, workers: int | None = None, cluster: str | None = None,
                 store: str = "hidden", vision_mask: str = VISION_MASK_RULES[0],
                 drafter: str | Path | None = None, stages: Write | None = None,
                 allow_beyond_context: bool = False, activations: str = "none") -> Path:
    """Write a fixture set to ``out``: the only writer. Refuses an existing ``out`` (an empty directory is allowed). The
    work is split into one job per base (docs/distributed-generation.md), run in parallel, and resumable: every finished
    job's result is kept in ``<out.parent>/.<out.name>.partial/`` (with the synthetic checkpoint of a ``preset``) until
    the set is published, so a run that fails or is killed is resumed by running it again with the same arguments (a
    partial directory of other arguments raises PartialRunMismatch, a FixtureError). The set is published atomically
    (renamed into place) only when every job is done and assembly succeeded; the partial directory is then removed. A
    failure before any job finished leaves nothing behind.

    ``workers``: local processes (default: the cores this process may run on; 1 runs everything in this process).
    ``cluster``: the address of a Dask distributed scheduler (e.g. ``tcp://host:8786``) whose workers run the jobs
    instead; they must see the model directory and ``out``'s parent at the same absolute paths. Not both. Whatever the
    executor, the set is the same, byte for byte (the manifest's provenance aside).

    Exactly one of ``model_dir`` (an external checkpoint: recorded by each file's size and sha256, the absolute path as
    provenance; never copied) and ``preset`` (a ``refimpl synth`` preset, regenerated from ``seed`` when the set is
    used). ``prompts``: a JSONL path or a list of entries (see ``load_prompts``) -> bases P0, P1, ... ``progress(done,
    total, label)`` is called as work completes (``label`` e.g. ``"base A: 48 tokens, 14 cases, 0.3 s"``, or ``"base A:
    done in an earlier run"``). ``stages(line)``: a line per stage of every job and per base its consistency against its
    bound (``progress``). ``allow_beyond_context``: bases past the checkpoint's context are generated and recorded, not
    refused (``context``). ``cross_check(model_dir, bases, base_logits)`` compares another implementation (entries are
    recorded only when it returns some). ``command`` is recorded as the generator command line (default: this process's
    argv). ``store``: "hidden" (default: per row the float64 hidden state and a summary; the logits are rebuilt through
    the checkpoint's head when the set is used, docs/fixtures.md) or "logits" (also the full float64 logits, so the set
    can be read without its checkpoint: N x V x 8 bytes per base). ``drafter``: an MTP assistant for ``model_dir`` (a
    preset with one has its own): the MTP matrix too (conformance.generate.mtp; cases auto, all or mtp), the drafter
    recorded by its files' sha256. ``vision_mask``: the rule the oracle opens vision blocks with on "vision" checkpoints
    (refimpl.model.VISION_MASK_RULES; default "sliding-clamped"), recorded in the manifest. ``activations``: the
    oracle's activation convention (refimpl.ggml_act.CONVENTIONS; other than none for a GGUF file only). ``cases``:
    "text" (the text matrix), "images" (the image matrix only: image bases I0, I1), "audio" (the audio matrix only:
    audio bases S0, S1), "videos" (the video matrix only: video bases V0, V1 of synthetic videos, each frame a vision
    block; conformance.generate.video), "mtp" (the MTP matrix only: MTP bases M0, M1, ...), "all" or "auto" (the text
    matrix plus the image and audio matrices the checkpoint's towers allow; the video matrix only when asked).
    ``images``: the images of the image bases (file paths or uint8 [h, w, 3] arrays; default: synthetic images from
    ``seed``); ``audio``: the clips of the audio bases (WAV paths or float arrays at 16 kHz; default: synthetic
    clips). With image or audio bases, ``cross_check`` is also given
    ``images={base: [ProcessedImage, ...]}`` and/or ``audio={base: [AudioFeatures, ...]}``.

    Errors: ValueError for bad arguments (PromptError, a ValueError, for bad prompts, naming the line;
    conformance.generate.executors.ClusterError, a ValueError, when the cluster cannot be used), refimpl's RefimplError
    when the oracle cannot load the checkpoint, FixtureError when ``out`` exists or the set cannot be made (the oracle
    is not self-consistent, a cross check returned garbage, a partial run of other arguments is in the way),
    PartialRunBusy (a FixtureError) at once when another run is generating ``out`` (one run per ``out``:
    conformance.generate.partial.RunLock, taken before any work), and refimpl's ContextLimitError (a RefimplError)
    before any forward for a base past the context, and ValueError for an ``out`` that is a dangling symbolic link (a
    link to an existing empty directory is followed: the set is published there).
    """
    out = Path(out)
    name = _checked_identity(out, model_dir, preset, seed, version, name)
    target = publish_path(out)
    _refuse_existing(out, target)
    entries = prompt_entries(prompts)  # validate before any work
    model_dir = _checked_choices(model_dir, store, vision_mask, activations, cases)
    drafter = checked_drafter(drafter, preset)
    _check_bases_asked(cases, entries, images, audio)
    _check_executor(workers, cluster)

    target.parent.mkdir(parents=True, exist_ok=True)
    with partial.RunLock.acquire(target):  # PartialRunBusy at once while another run writes this set
        _refuse_existing(out, target)  # published by a run that held the lock until just now
        dask = executors.DaskCluster(cluster) if cluster is not None else None  # ClusterError before any work
        try:
            return _generate(out, target, model_dir=model_dir, preset=preset, seed=seed, entries=entries, name=name,
                             version=version, progress=progress, cross_check=cross_check, command=command,
                             cases=cases, images=images, audio=audio, store=store, vision_mask=vision_mask,
                             drafter=drafter, stages=stages, allow_beyond_context=allow_beyond_context,
                             workers=workers if workers is not None else cores(), dask=dask, activations=activations)
        finally:
            if dask is not None:
                dask.close()


def _refuse_existing(out: Path, target: Path) -> None:
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise FixtureError(f"{out} already exists; fixture sets are never overwritten (choose another --out, or "
                           "remove it first)")


class _Steps:
    """The progress of a run: ``steps(label)`` after each unit of work, ``done`` of ``total``."""

    def __init__(self, progress: Progress | None):
        self.progress, self.done, self.total = progress, 0, 0

    def __call__(self, label: str) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, label)


@dataclass
class _Plan:
    """What a run makes: one job per base in the set's order ({"base", "cost", "info" (text bases), "spec"}),
    the text cases per base (for progress), the modalities in use."""

    jobs: list[dict] = field(default_factory=list)
    text_cases: dict[str, int] = field(default_factory=dict)
    with_text: bool = False
    vision: VisionSide | None = None
    audio: AudioSide | None = None
    video: VideoSide | None = None

    def add(self, common: dict, base: str, kind: str, cost: float, info: dict | None = None, **spec) -> None:
        self.jobs.append({"base": base, "cost": cost, "info": info,
                          "spec": {**common, "base": base, "kind": kind, **spec}})


@dataclass
class _Assembled:
    """The finished jobs read back: per base its ids, manifest description, hidden states, row summaries,
    logits (stored as logits only) and router margins; the media blocks of the image and audio bases; the
    worst consistency of the KV cache, and per base its consistency and the bound it is held to."""

    bases: dict[str, list[int]] = field(default_factory=dict)
    info: dict[str, dict] = field(default_factory=dict)
    hidden: dict[str, np.ndarray] = field(default_factory=dict)
    summaries: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    logits: dict[str, np.ndarray] = field(default_factory=dict)
    margins: dict[str, np.ndarray] = field(default_factory=dict)
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    audio_spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    videos: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # video bases: (first block, frames)
    worst: float = 0.0
    consistency: dict[str, tuple[float, float]] = field(default_factory=dict)  # base -> (observed, bound)
    probes: dict[str, float] = field(default_factory=dict)  # base -> rounding probe, where one was measured
    event_probes: dict[str, float] = field(default_factory=dict)  # base -> event probe (ggml-cpu conventions)


def _model_and_key(model_dir: Path | None, preset: str | None, seed: int, vision_mask: str,
                   activations: str) -> tuple[Gemma4 | None, dict[str, Any]]:
    """(the oracle of an external checkpoint, None for a preset: made in the partial run; the model's part of
    the run key). An external checkpoint is keyed by content (sha256 and size of each file, digests cached);
    its path is provenance only."""
    if preset is not None:
        return None, {"kind": "synthetic", "preset": preset, "seed": seed, "dtype": "f32"}
    model = Gemma4(model_dir, vision_mask=vision_mask, activations=activations)  # float64; RefimplError: bad
    return model, {"kind": "external", **checkpoint_record(*checkpoint_files(model_dir))}


def _matrix(name: str, cfg: Any, got: Any, plan: Any) -> list:
    """The text, image and audio cases of the set's bases, annotated with each row's top-2 margin."""
    matrix = (generate_cases(name, cfg, got.bases) if plan.with_text else []) + \
        (generate_image_cases(name, cfg, got.bases, got.spans) if plan.vision else []) + \
        (generate_image_cases(name, cfg, got.bases, got.audio_spans, kind="audio") if plan.audio else []) + \
        (generate_image_cases(name, cfg, got.bases, got.spans, kind="video") if plan.video else [])
    top2 = {b: s["margin"] for b, s in got.summaries.items()}
    return [annotate(c, top2, got.margins or None) for c in matrix]


def _generate(out: Path, out_abs: Path, *, model_dir: Path | None, preset: str | None, seed: int, entries: list[dict],
              name: str, version: str, progress: Progress | None, cross_check: CrossCheck | None, command: str | None,
              cases: str, images, audio, workers: int, dask, store: str, vision_mask: str,
              drafter: Path | None = None, stages: Write | None = None, allow_beyond_context: bool = False,
              activations: str = "none") -> Path:
    """generate_set after argument checks, under the run's lock: plan the jobs, run the missing ones, assemble,
    publish to ``out_abs`` (publish_path(out))."""
    t0 = time.perf_counter()
    model, model_key = _model_and_key(model_dir, preset, seed, vision_mask, activations)
    # the run key: what the results depend on, never how a path was spelled (docs/distributed-generation.md)
    arguments = {"model": model_key, "cases": cases, "name": name, "version": version, "store": store,
                 "prompts": [{k: e[k] for k in ("kind", "value", "id", "chat")} for e in entries],
                 "images": media_key(images), "audio": media_key(audio), **job_versions(),
                 **({"vision_mask": vision_mask} if vision_mask != VISION_MASK_RULES[0] else {}),
                 **({"activations": activations} if activations != "none" else {})}
    run = partial.PartialRun.open(out_abs, arguments)
    steps = _Steps(progress)
    staging = None
    try:
        if preset is not None:
            src, reused = run.synthetic_model(preset, seed)
            model_info = {**model_key, "sha256": hash_files(src, SYNTHETIC_FILES)}
            model = Gemma4(src, vision_mask=vision_mask)
        else:
            src, reused, model_info = model_dir, False, {"kind": "external", "path": str(model_dir), **model_key}
            if callable(quantisation := getattr(model.weights.store, "quantisation", None)):
                model_info["quantisation"] = {**quantisation(), "activations": activations}  # types, convention
        drafter_dir = mtp_drafter(src, preset is not None, drafter, cases)
        plan = _plan(run, src, model, seed, entries, name, cases, images, audio, store, mtp=drafter_dir is not None)
        check_bases(model.cfg, plan.jobs, drafter_dir is not None, allow_beyond_context)  # before any forward
        steps.total = (1 if preset is not None else 0) + len(plan.jobs) + (1 if cross_check is not None else 0) + 1 + \
            (len(SCENARIOS) + (plan.vision is not None) + (plan.audio is not None) if drafter_dir is not None else 0)
        if preset is not None:
            steps("model: reused from an earlier run" if reused else "model")
        log = StageLog(stages, plan.jobs, CONSISTENCY_BOUND, t0)
        _run_pending(run, plan, src, model, name, workers, dask, steps, log)
        results = {q["base"]: run.result(q["base"]) for q in plan.jobs}
        got = _assemble(run, plan, results)
        checks = oracle_checks(got, plan.with_text)
        if cross_check is not None:
            oracle = got.logits or RebuiltLogits(model, got.hidden, got.summaries, run.path, "the set being generated")
            checks += cross_check_entries(cross_check, src, got, results, oracle)
            steps("cross check")
        cfg = model.cfg
        set_cases = _matrix(name, cfg, got, plan)
        mtp = mtp_matrix(name, model, drafter_dir, seed, steps, synthetic=preset is not None,
                         media=_media_prompts(model, plan, got, results, drafter_dir, allow_beyond_context))
        set_cases += mtp.cases if mtp is not None else []
        staging = run.staging()
        staged = staging / "set"
        staged.mkdir()
        beyond = None
        if allow_beyond_context:
            mtp_bases = mtp.manifest["bases"] if mtp is not None else {}
            beyond = context_record(cfg, {**{b: len(ids) for b, ids in got.bases.items()},
                                          **{b: i["prompt_length"] + i["max_new_tokens"]
                                             for b, i in mtp_bases.items()}})
        with partial.full_disk_named(run.path):
            write_set(staged, got, results, set_cases, plan, cfg, name=name, version=version, checks=checks,
                       command=command, model_info=model_info, store=store, vision_mask=vision_mask, mtp=mtp,
                       beyond=beyond)
        steps("write")
        try:
            os.replace(staged, out_abs)
        except OSError as e:
            raise FixtureError(f"{out}: cannot move the finished set into place ({e}); was it created "
                               "meanwhile?") from None
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if run.created and not run.finished():
            run.remove()  # nothing worth keeping: leave nothing behind
        raise
    run.remove()  # published: the partial run is done
    return out


def _media_prompts(model, plan: _Plan, got: _Assembled, results: Mapping[str, partial.JobResult],
                   drafter_dir: Path | None, allow: bool) -> list[MediaPrompt]:
    """The MTP-after-media prompts of a set with a drafter: its first image and audio bases' (soft tokens read
    back from their jobs)."""
    if drafter_dir is None:
        return []
    soft = {b: [results[b].array(f"media.{j}.soft_tokens") for j in range(len(spans))]
            for b, spans in {**got.spans, **got.audio_spans}.items()}
    return media_prompts(model, {"image": plan.vision, "audio": plan.audio}, got.bases, soft, allow)


def _plan(run: partial.PartialRun, src: Path, model, seed: int, entries: list[dict], name: str, cases: str,
          images, audio, store: str, mtp: bool = False) -> _Plan:
    """One job per base, in the set's order; the parent only draws ids and encodes prompts. ``mtp`` (the set gets
    an MTP matrix): with cases 'mtp', the first image and audio base too, the prompts of MTP after media."""
    tokenizer = Tokenizer.from_dir(src)
    cfg = model.cfg
    vision_tower, audio_tower = has_vision_tower(src), has_audio_tower(src)
    if cases in ("images", "videos") and not vision_tower:
        raise ValueError(f"cases={cases!r} needs {cases[:-1]} bases, but {src} has no vision tower (config.json has "
                         "no vision_config); use cases='text'")
    if cases == "audio" and not audio_tower:
        raise ValueError(f"cases={cases!r} needs audio bases, but {src} has no audio tower (config.json has no "
                         "audio_config); use cases='text'")
    if images is not None and not vision_tower:
        raise ValueError(f"images were given, but {src} has no vision tower (config.json has no vision_config)")
    if audio is not None and not audio_tower:
        raise ValueError(f"audio was given, but {src} has no audio tower (config.json has no audio_config)")
    plan = _Plan(with_text=cases in ("text", "all", "auto"))
    with_images = cases == "images" or (cases in ("all", "auto") and vision_tower)
    with_audio = cases == "audio" or (cases in ("all", "auto") and audio_tower)
    only_first = cases == "mtp"  # the media bases of the MTP matrix only (MEDIA_SCENARIOS)
    with_images = with_images or (only_first and mtp and vision_tower)
    with_audio = with_audio or (only_first and mtp and audio_tower)
    prompt_ids = [encode_prompt(p, tokenizer, cfg.vocab_size, src) for p in entries]
    bos = bos_id(cfg, tokenizer)
    common = {"key": run.key, "partial": str(run.path), "model_dir": str(src), "seed": seed, "bos": bos,
              "vision_mask": model.vision_mask, "activations": model.activations,
              "device": model.device,  # (a Dask worker's own REFIMPL_DEVICE is not the run's)
              "store": store}

    if plan.with_text:
        pool = ordinary_ids(tokenizer, cfg.vocab_size)
        n = random_base_length(cfg)
        for k, b in enumerate(RANDOM_BASES):
            rng = np.random.default_rng([seed, k])
            plan.add(common, b, "text", 3.0 * n, {"source": "random", "length": n,
                                                  "rng": f"numpy default_rng([{seed}, {k}])"},
                     ids=[bos] + [int(t) for t in rng.choice(pool, n - 1)], greedy=0)
        if tokenizer is not None:
            prompt = chat_ids(tokenizer, src, [{"role": "user", "content": CHAT_PROMPT}], "base G")
            source = {"source": "chat", "text": CHAT_PROMPT}
        else:
            rng = np.random.default_rng([seed, len(RANDOM_BASES)])
            prompt = [bos] + [int(t) for t in rng.choice(pool, G_RANDOM_PROMPT - 1)]
            source = {"source": "random", "rng": f"numpy default_rng([{seed}, {len(RANDOM_BASES)}])"}
        steps = GENERATION_STEPS
        plan.add(common, GENERATION_BASE, "text", 4.0 * (len(prompt) + steps),
                 {**source, "length": len(prompt) + steps, "prompt_length": len(prompt),
                  "continuation": f"greedy, {steps} tokens"}, ids=[int(t) for t in prompt], greedy=steps)
        for k, (ids, p) in enumerate(zip(prompt_ids, entries, strict=True)):
            steps = PROMPT_CONTINUATION
            plan.add(common, f"{PROMPT_PREFIX}{k}", "text", 4.0 * (len(ids) + steps),
                     {"source": "prompt", "length": len(ids) + steps, "prompt_length": len(ids),
                      "continuation": f"greedy, {steps} tokens",
                      "where": p["where"], **({"id": p["id"]} if p["id"] else {}), "kind": p["kind"]},
                     ids=[int(t) for t in ids], greedy=steps)
        lengths = {q["base"]: q["info"]["length"] for q in plan.jobs}
        plan.text_cases = count_by_base(generate_cases(name, cfg, {b: [0] * L for b, L in lengths.items()}))
    _plan_media(plan, common, src, seed, images, audio, with_images, with_audio, only_first)
    if cases == "videos":
        plan.video = VideoSide(src)
        for b, cost, b_index in video_jobs(plan.video):
            plan.add(common, b, "video", cost, b_index=b_index)
    return plan


def _plan_media(plan: _Plan, common: dict, src: Path, seed: int, images, audio, with_images: bool, with_audio: bool,
                only_first: bool) -> None:
    """The image and audio jobs of ``_plan`` (``only_first``: I0 and S0 only, the prompts of MTP after media)."""
    unified = is_unified(src)
    if with_images:
        plan.vision = VisionSide(src)
        sources = image_sources(images, seed, unified)
        for b_index, (b, texts) in enumerate(list(IMAGE_TEXT.items())[:1 if only_first else None]):
            which = media_order(b_index, len(texts) - 1, len(sources))
            m = len(which) * plan.vision.settings.max_soft_tokens  # an upper bound: the tower runs before the merge
            plan.add(common, b, "image", 3.0 * (sum(texts) + DECODE_STEPS + m) + 2.0 * m, b_index=b_index,
                     n_sources=len(sources), sources={k: sources[k] for k in sorted(set(which))})
    if with_audio:
        plan.audio = AudioSide(src)
        clips = audio_sources(audio, seed, plan.audio.sampling_rate, unified)
        for wave, rate, _ in clips:
            plan.audio.check(wave, rate)  # a wrong rate is a usage error: before any job
        for b_index, (b, texts) in enumerate(list(AUDIO_TEXT.items())[:1 if only_first else None]):
            which = media_order(b_index, len(texts) - 1, len(clips))
            m = sum(25.0 * clips[k][0].shape[0] / clips[k][1] for k in which)  # ~25 soft tokens a second
            plan.add(common, b, "audio", 3.0 * (sum(texts) + DECODE_STEPS + m) + 2.0 * m, b_index=b_index,
                     n_sources=len(clips), sources={k: clips[k] for k in sorted(set(which))})


def _run_pending(run: partial.PartialRun, plan: _Plan, src: Path, model, name: str, workers: int, dask,
                 steps: _Steps, log: StageLog) -> None:
    """Run the jobs that are not done yet, longest first; their stages and consistency go to ``log``."""
    cfg = model.cfg

    def count_cases(base: str) -> int:
        if base in plan.text_cases:
            return plan.text_cases[base]
        r = run.result(base)
        kind = r.meta["kind"] if r.meta["kind"] in ("audio", "video") else "image"
        return len(generate_image_cases(name, cfg, {base: r.meta["ids"]}, {base: r.meta["spans"]}, kind=kind))

    def on_done(meta: dict) -> None:
        b = meta["base"]
        log.finished(meta)
        steps(f"base {b}: {meta['tokens']} tokens, {count_cases(b)} cases, {meta['seconds']:.1f} s")

    for q in plan.jobs:  # a damaged finished job (a truncated array, say) is named and computed again
        why = run.is_done(q["base"]) and run.damaged(q["base"])
        if why:
            run.discard(q["base"])
            log.note(f"base {q['base']}: its finished result is damaged ({why}); computing it again")
    pending = [q for q in plan.jobs if not run.is_done(q["base"])]
    pending.sort(key=lambda q: -q["cost"])  # stable: ties keep the set's order
    cached = [q["base"] for q in plan.jobs if q not in pending]
    log.plan(pending, cached, f"on the Dask cluster {dask.address}" if dask is not None else
             f"{min(workers, len(pending))} local worker process{'es' if min(workers, len(pending)) > 1 else ''}"
             if workers > 1 else IN_PROCESS)
    for b in cached:
        log.finished(run.result(b).meta, this_run=False)
        steps(f"base {b}: done in an earlier run")
    if pending and dask is not None:
        dask.check_workers([str(src), str(run.path / partial.JOBS)])
    context = None
    if pending and dask is None and workers <= 1:
        context = JobContext(src, model=model, vision=plan.vision, audio=plan.audio)
    executors.run_jobs([q["spec"] for q in pending], workers=workers, cluster=dask, on_done=on_done, context=context,
                       on_stage=log)


def _assemble(run: partial.PartialRun, plan: _Plan, results: Mapping[str, partial.JobResult]) -> _Assembled:
    """The finished jobs, read back in the set's order (every worker must have run this environment)."""
    mine = job_versions()
    for b, r in results.items():
        if r.meta.get("versions") != mine:
            raise FixtureError(f"base {b} was computed by worker {r.meta.get('worker')} with {r.meta.get('versions')}, "
                               f"but this process has {mine}; every worker must run the same environment "
                               f"(remove {run.path} and run again)")
    got = _Assembled()
    for q in plan.jobs:
        b, r = q["base"], results[q["base"]]
        got.bases[b] = [int(t) for t in r.meta["ids"]]
        if q["info"] is not None:
            got.info[b] = {**q["info"], "length": len(got.bases[b])}
        else:
            got.info[b] = r.meta["info"]
            (got.audio_spans if r.meta["kind"] == "audio" else got.spans)[b] = [(int(a), int(n)) for a, n in
                                                                               r.meta["spans"]]
            if r.meta.get("videos"):  # a video base: its frames are the vision blocks above
                got.videos[b] = [(int(a), int(n)) for a, n in r.meta["videos"]]
        got.hidden[b] = r.array("hidden")
        got.summaries[b] = {leaf: r.array(leaf) for leaf in SUMMARY_LEAVES}
        if r.has("logits"):
            got.logits[b] = r.array("logits")
        if r.has("router_margin"):
            got.margins[b] = r.array("router_margin")
        got.worst = max(got.worst, float(r.meta["consistency"]))
        got.consistency[b] = (float(r.meta["consistency"]), held_bound(r.meta, CONSISTENCY_BOUND))
        if r.meta.get("rounding_probe") is not None:
            got.probes[b] = float(r.meta["rounding_probe"])
        if r.meta.get("event_probe") is not None:
            got.event_probes[b] = float(r.meta["event_probe"])
    return got


