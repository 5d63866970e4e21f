"""The context limit of a generated set: every base must fit in the checkpoint's context
(``max_position_embeddings``, ``refimpl.context``), or the run says that it may go beyond
(``generate_set(allow_beyond_context=True)``, ``conformance generate --allow-beyond-context``), which the
manifest then records (``oracle.beyond_context``). The text bases and the MTP scenarios are checked by the
planner before any job runs; an image or audio base, whose length is known only after its preprocessing, by
its job before its forward (``conformance.generate.jobs``)."""

from __future__ import annotations

from refimpl.config import TextConfig
from refimpl.context import beyond_context, check_context

from ..sets.case import MTP_PREFIX, PROMPT_PREFIX
from .mtp import OVERRIDE, SCENARIOS


def _what(base: str, info: dict, length: int) -> str:
    """The start of the refusal of a text base of ``length`` positions (``info``: its manifest entry)."""
    if base.startswith(PROMPT_PREFIX) and "where" in info:
        prompt = info["prompt_length"]
        if length == prompt:
            return f"{info['where']} (base {base}): the prompt is {prompt} tokens long"
        return (f"{info['where']} (base {base}): the prompt is {prompt} tokens long and with its "
                f"{length - prompt}-token greedy continuation the base is {length}")
    return f"the built-in base {base} ({info.get('source', 'text')}) is {length} tokens long"


def mtp_lengths(cfg: TextConfig) -> dict[str, int]:
    """The positions of each MTP base: its scenario's prompt and new tokens."""
    return {f"{MTP_PREFIX}{k}": s.prompt_length(cfg.sliding_window) + s.max_new_tokens for k, s in enumerate(SCENARIOS)}


def check_bases(cfg: TextConfig, jobs: list[dict], with_mtp: bool, allow: bool) -> None:
    """Refuse (refimpl's ContextLimitError) a text base of the plan's ``jobs`` or, ``with_mtp``, an MTP base past
    the context, unless ``allow``; hands ``allow`` to every job (the image and audio bases are checked there)."""
    for q in jobs:
        q["spec"]["allow_beyond_context"] = allow
        if q["info"] is not None and not allow:
            check_context(cfg, q["info"]["length"], _what(q["base"], q["info"], q["info"]["length"]), OVERRIDE)
    for b, n in (mtp_lengths(cfg).items() if with_mtp and not allow else ()):
        check_context(cfg, n, f"the MTP base {b} is {n} tokens long", OVERRIDE)


def context_record(cfg: TextConfig, lengths: dict[str, int]) -> dict:
    """The manifest's record of a run allowed beyond the context: the limit and the bases past it (``lengths``:
    base -> positions)."""
    return {"max_position_embeddings": cfg.max_position_embeddings,
            "bases": {b: n for b, n in lengths.items() if beyond_context(cfg, n)}}
