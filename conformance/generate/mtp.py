"""The MTP matrix of a set whose checkpoint has an assistant (drafter): bases M0, M1, ... and their cases.

Each MTP base is a scenario: a prompt, the drafts per round and a pattern of acceptances. The pattern is
fixed by teacher forcing (``refimpl.mtp.assisted_greedy(forced=...)``): a round that should accept a of its
k drafts verifies the next a tokens of plain greedy decoding, then tokens that differ from it, so every
engine sees the same rounds whatever its drafter says. Per scenario and convention (``refimpl.mtp``):

* a ``rounds`` case (white box): the forced rounds, graded on every draft step's logits, every verification
  row, the acceptance and the output;
* a ``generate`` case (black box): the oracle's own assisted run, graded on its drafts and acceptance per
  round and on the output (plain greedy decoding).

Stored in ``mtp.safetensors`` (``conformance.sets.format``), as states whose logits are rebuilt through the
heads when the set is used (a draft step of a real checkpoint is 262144 logits, its drafter state 256 numbers):
the tokens (prompt, then plain greedy's), the prompt's final-norm hidden rows, every round's verification
rows (the same under every convention: the forced drafts are) and, per convention, every draft step's
final-normed drafter state.

**After media** (MEDIA_SCENARIOS, spec M14): a target with a vision (audio) tower gets one more scenario whose
prompt is the image base I0's (audio base S0's) up to its decode steps, text, a block and text; its cases name
that base (``MtpCase.media``), so a request carries the base's embeddings, blocks and media inputs, and the
image (audio) cases of the same base tell a target's media bug from a drafter's. Positions count the soft
tokens (``refimpl.mtp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from refimpl.assistant import Drafter
from refimpl.context import check_context
from refimpl.generate import greedy_generate, greedy_generate_inputs
from refimpl.model import Gemma4
from refimpl.mtp import CONVENTIONS, DEFAULT_CONVENTION, MtpRun, assisted_greedy
from refimpl.multimodal import MultimodalInputs
from refimpl.synth import ASSISTANT_DIR

from ..sets.case import DECODE_STEPS, MTP_PREFIX, Case, MtpCase, MtpRoundCase
from ..sets.format import DRAFTER_FILES, FixtureError, hash_files

__all__ = ["BATCH", "MEDIA_SCENARIOS", "OVERRIDE", "SCENARIOS", "MediaPrompt", "MtpMatrix", "batched_cases",
           "checked_drafter", "generate_mtp", "media_prompts", "mtp_drafter", "mtp_matrix"]

OVERRIDE = "--allow-beyond-context (generate_set(allow_beyond_context=True))"


@dataclass(frozen=True)
class Scenario:
    name: str  # the case feature naming it
    prompt_length: Callable[[int], int]  # of the window W
    num_drafts: int
    max_new_tokens: int
    pattern: tuple[int, ...]  # drafts accepted by round r (cycled; at most the round's k)
    note: str


SCENARIOS = (
    Scenario("short-prompt", lambda W: max(2, W // 2 - 1), 3, 12, (1, 3, 0, 2),
             "a prompt shorter than W - 1: a partial acceptance, a full one, a rejection of all"),
    Scenario("long-prompt", lambda W: 2 * W - 1, 3, 12, (3, 0, 1, 2),
             "a prompt longer than W + 2: the sliding keys each convention hands over differ"),
    Scenario("one-draft", lambda W: 3, 1, 8, (0, 1, 1, 0), "k = 1 rounds"),
    Scenario("first-round", lambda W: W + 3, 3, 4, (2,),
             "max_new_tokens = k + 1: the first round right after the prompt is the whole run"),
)
# MTP after media (gemma4-unified-and-mtp-spec.md M14): the prompt is an image (audio) base's prompt, every
# position before its decode steps (text, a block, text); prompt_length is not used
MEDIA_SCENARIOS = {
    "image": Scenario("image-prompt", lambda W: 0, 3, 12, (2, 0, 3, 1),
                      "after an image prompt: the drafter reads the target's K/V of the image block and the state of "
                      "the text after it; positions count the soft tokens"),
    "audio": Scenario("audio-prompt", lambda W: 0, 3, 12, (0, 2, 1, 3),
                      "after an audio prompt: the same, the block causal"),
}


# batched MTP (gemma4-unified-and-mtp-spec.md M15): the text bases drafting concurrently, prompts of different lengths
BATCH = ("M0", "M1", "M3")


@dataclass(frozen=True)
class MediaPrompt:
    """The prompt of an MTP-after-media scenario: the first ``length`` positions of a media base."""

    kind: str  # "image" or "audio" (a key of MEDIA_SCENARIOS)
    base: str  # the media base (I0, S0)
    ids: list[int]  # its prompt ids, placeholders in
    inputs: MultimodalInputs  # the oracle's inputs of those positions


@dataclass
class MtpMatrix:
    cases: list[Case]
    tensors: dict[str, np.ndarray]  # mtp.safetensors
    manifest: dict  # the manifest's "mtp" record, drafter aside


def _margins(logits: np.ndarray) -> tuple[float, ...]:
    top = -np.sort(-np.asarray(logits, dtype=np.float64), axis=-1)[:, :2]
    return tuple(float(m) for m in top[:, 0] - top[:, 1])


def _forced(greedy: list[int], scenario: Scenario, vocab: int, eos: set[int]) -> list[list[int]]:
    """The drafts of each round that make it accept the scenario's pattern (``greedy``: plain greedy output); the
    rejected ones are never an id of ``eos`` (the end-of-sequence ids, and after media the placeholder ids)."""
    forced, out = [], 1  # tokens of the output produced so far (the first comes from the prefill)
    while out < len(greedy):
        budget = scenario.max_new_tokens - out
        k = min(scenario.num_drafts, budget - 1)
        a = min(scenario.pattern[len(forced) % len(scenario.pattern)], max(k, 0), len(greedy) - out)
        drafts = list(greedy[out:out + a])
        wrong = greedy[out + a] if out + a < len(greedy) else 0
        while len(drafts) < k:
            wrong = (wrong + 1) % vocab
            while wrong in eos:
                wrong = (wrong + 1) % vocab
            drafts.append(wrong)
        forced.append(drafts[:max(k, 0)])
        out += min(a, k) + 1
    return forced


def _rounds(run: MtpRun) -> tuple[MtpRoundCase, ...]:
    return tuple(MtpRoundCase(r.token, r.drafts, r.accepted, r.draft_argmax,
                              _margins(r.draft_logits) if len(r.drafts) else (), _margins(r.verify_logits))
                 for r in run.rounds)


def _stack(arrays: list[np.ndarray], width: int) -> np.ndarray:
    arrays = [a for a in arrays if a.shape[0]]
    return np.concatenate(arrays) if arrays else np.empty((0, width))


def _plain_greedy(target: Gemma4, prompt: list[int], n: int, inputs: MultimodalInputs | None) -> list[int]:
    """Plain greedy decoding of ``n`` tokens after ``prompt`` (with its media ``inputs``), stopping at EOS."""
    run = greedy_generate(target, prompt, n) if inputs is None else greedy_generate_inputs(target, inputs, n)
    return list(run.tokens)


def generate_mtp(name: str, target: Gemma4, drafter: Drafter, seed: int,
                 progress: Callable[[str], None] | None = None, media: Sequence[MediaPrompt] = ()) -> MtpMatrix:
    """The MTP bases and cases of a set (module doc); ``media``: the prompts of the MTP-after-media scenarios
    (bases after the text ones). FixtureError when an assisted run of the oracle does not reproduce plain
    greedy decoding (the oracle would be broken)."""
    cfg = target.cfg
    W, V, H = cfg.sliding_window, cfg.vocab_size, cfg.hidden_size
    eos = set(cfg.eos_token_ids)
    rng = np.random.default_rng(seed + 2027)
    drawable = np.array([t for t in range(3, V) if t not in eos])
    centroid = drafter.acfg.use_ordered_embeddings
    cases, tensors, scenarios, solo = [], {}, {}, {}
    for i, (sc, mp) in enumerate([(sc, None) for sc in SCENARIOS] + [(MEDIA_SCENARIOS[m.kind], m) for m in media]):
        base = f"{MTP_PREFIX}{i}"
        inputs = None if mp is None else mp.inputs
        prompt = [int(t) for t in rng.choice(drawable, sc.prompt_length(W))] if mp is None else list(mp.ids)
        greedy = _plain_greedy(target, prompt, sc.max_new_tokens, inputs)
        forced = _forced(greedy, sc, V, eos | set(() if inputs is None else inputs.placeholders))
        if inputs is None:
            _, hidden = target.forward_rows(prompt, rows="all")
        else:
            _, hidden = target.forward_rows(inputs.ids, rows="all", embeddings=inputs.embeddings,
                                            vision_blocks=inputs.vision_blocks)
        tensors[f"{base}/tokens"] = np.asarray(prompt + greedy, dtype=np.int64)
        tensors[f"{base}/prompt_hidden"] = hidden
        for convention in CONVENTIONS:
            kv, pos = convention.split("/")
            for mode in ("rounds", "generate"):
                run = assisted_greedy(target, drafter, prompt, sc.max_new_tokens, sc.num_drafts, convention,
                                      forced=forced if mode == "rounds" else None, inputs=inputs)
                if list(run.output) != greedy:
                    raise FixtureError(f"{name}: the oracle's assisted run of {base} ({mode}, {convention}) produced "
                                       f"{list(run.output)}, not plain greedy decoding {greedy}")
                if mode == "rounds":
                    tensors[f"{base}/draft/{convention}"] = _stack([r.draft_states for r in run.rounds],
                                                                   drafter.cfg.hidden_size)
                    if convention == DEFAULT_CONVENTION:
                        tensors[f"{base}/verify_hidden"] = _stack([r.verify_hidden for r in run.rounds], H)
                accepted = [r.accepted for r in run.rounds]
                features = ["mtp", f"mtp-{mode}", sc.name, f"kv-{kv}", f"position-{pos}"]
                if any(a < len(r.drafts) for a, r in zip(accepted, run.rounds, strict=True)):
                    features.append("rejection")
                if any(r.drafts and a == len(r.drafts) for a, r in zip(accepted, run.rounds, strict=True)):
                    features.append("full-acceptance")
                if len(prompt) + len(greedy) > W:
                    features.append("beyond-window")
                if centroid:
                    features.append("centroid-head")
                if mp is not None:
                    features += ["mtp-after-media", {"image": "vision", "audio": "audio"}[mp.kind]]
                spec = MtpCase(mode, convention, sc.num_drafts, sc.max_new_tokens, _rounds(run), tuple(greedy),
                               None if mp is None else mp.base)
                cases.append(Case(id=f"{name}/mtp/{mode}/{base}/{convention}", kind="mtp", base=base,
                                  length=len(prompt), features=tuple(features), mtp=spec))
                solo[base, mode, convention] = cases[-1]
        scenarios[base] = {"scenario": sc.name, "prompt_length": len(prompt), "num_drafts": sc.num_drafts,
                           "max_new_tokens": sc.max_new_tokens, "forced_drafts": [len(f) for f in forced],
                           "note": sc.note, **({"media": mp.base} if mp is not None else {})}
        if progress is not None:
            progress(f"MTP base {base}: {sc.name}, {len(prompt)} + {len(greedy)} tokens, {len(CONVENTIONS)} "
                     "conventions")
    cases += batched_cases(name, solo)
    manifest = {"conventions": list(CONVENTIONS), "default_convention": DEFAULT_CONVENTION, "bases": scenarios,
                "batch": list(BATCH),
                "drafter_store_layers": drafter.store_layers(cfg),
                "drafter_head": "centroid" if centroid else "dense"}
    return MtpMatrix(cases, tensors, manifest)


def media_prompts(target: Gemma4, sides: Mapping[str, Any], bases: Mapping[str, list[int]],
                  soft: Mapping[str, list[np.ndarray]], allow_beyond_context: bool) -> list[MediaPrompt]:
    """The prompts of the MTP-after-media scenarios: per kind whose side (``sides``: "image" -> VisionSide, "audio"
    -> AudioSide, or None) the set has, its first base (I0, S0: ``bases`` its ids, ``soft`` its blocks' soft
    tokens) up to its decode steps. ContextLimitError when the scenario's tokens pass the context (unless
    allowed)."""
    out = []
    for kind, side in sides.items():
        if side is None:
            continue
        base = next(iter(side.texts))  # I0 / S0
        n = len(bases[base]) - DECODE_STEPS
        full = side.merge(target, bases[base], soft[base])
        if not allow_beyond_context:
            check_context(target.cfg, n + MEDIA_SCENARIOS[kind].max_new_tokens,
                          f"the MTP base after {kind} ({base}'s prompt and new tokens)", OVERRIDE)
        inputs = MultimodalInputs(full.ids[:n], full.embeddings[:n],
                                  None if full.vision_blocks is None else full.vision_blocks[:n], full.placeholders)
        out.append(MediaPrompt(kind, base, list(bases[base][:n]), inputs))
    return out


def batched_cases(name: str, solo: Mapping[tuple[str, str, str], Case]) -> list[Case]:
    """Batched MTP (spec M15): per mode and convention, one case running the BATCH bases' solo cases concurrently
    (prompts of 3, 2W - 1 and W + 3 tokens, 3 drafts a round, budgets of 12, 12 and 4 tokens), each sequence
    graded against its solo rows."""
    out = []
    for mode in ("rounds", "generate"):
        for convention in CONVENTIONS:
            parts = [solo[b, mode, convention] for b in BATCH]
            features = sorted({f for c in parts for f in c.features} | {"mtp-batch"})
            out.append(Case(id=f"{name}/mtp/{mode}/batch-{'+'.join(BATCH)}/{convention}", kind="mtp",
                            base=parts[0].base, length=parts[0].length, features=tuple(features),
                            sequences=tuple((c.base, c.length, s, 0) for s, c in enumerate(parts)),
                            mtp_batch=tuple(c.mtp for c in parts)))
    return out


def checked_drafter(drafter, preset: str | None) -> Path | None:
    """generate_set's ``drafter`` argument, resolved (ValueError for a preset, which brings its own, or a
    directory without config.json)."""
    if drafter is None:
        return None
    if preset is not None:
        raise ValueError("a synthetic preset brings its own assistant; --drafter is for an external checkpoint")
    drafter = Path(drafter).resolve()
    if not (drafter / "config.json").is_file():
        raise ValueError(f"{drafter}: not a checkpoint directory (no config.json) for --drafter")
    return drafter


def mtp_drafter(src: Path, synthetic: bool, drafter: Path | None, cases: str) -> Path | None:
    """The assistant the MTP matrix uses: ``drafter``, or a preset's own beside its checkpoint; None when the
    set gets no MTP matrix (``cases`` other than auto, all, mtp; ValueError for ``mtp`` without one)."""
    found = drafter if drafter is not None else (
        src / ASSISTANT_DIR if synthetic and (src / ASSISTANT_DIR / "config.json").is_file() else None)
    if cases == "mtp" and found is None:
        raise ValueError(f"cases='mtp' writes the MTP matrix only, which needs an assistant checkpoint: give --drafter "
                         f"DIR (or a preset with an assistant); {src} has none beside it")
    return found if cases in ("auto", "all", "mtp") else None


def mtp_matrix(name: str, target: Gemma4, drafter_dir: Path | None, seed: int, progress, *,
               synthetic: bool, media: Sequence[MediaPrompt] = ()) -> MtpMatrix | None:
    """``generate_mtp`` with the drafter recorded for the manifest (its path, relative for a preset's, and the
    sha256 of its files); None without a drafter."""
    if drafter_dir is None:
        return None
    mtp = generate_mtp(name, target, Drafter(drafter_dir), seed, progress=progress, media=media)
    mtp.manifest["drafter"] = {"path": ASSISTANT_DIR if synthetic else str(drafter_dir),
                               "sha256": hash_files(drafter_dir, DRAFTER_FILES)}
    return mtp
