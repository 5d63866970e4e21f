"""A diagnosis line for every failed case: from the pattern of failing rows and checks, inside the case and
across the cases of its set, the likely bug classes of docs/bug-classes.md (at most three, the likeliest
first).

The classes named are the rows of docs/bug-classes.md's summary table (``CLASSES``). The rules, each a
pattern and what it points at:

* degenerate output, named before anything else: every failing row constant (all zeros, one value), the
  returned rows of a case one row repeated, or the same row in every failed case of a set, while the oracle's
  rows differ: the output was never computed for that input (an unfilled buffer, a result not copied back, a
  stub, a cached response), so the identity and closeness failures say nothing about the model;
* most failing rows nearest another oracle row (``identity``): B1, a shifted row;
* logits beyond the final softcap: B2, the softcap missing on those rows;
* only decode rows fail, the prefill's rows pass: B2 (the single-row head), B7 (the cache a pruned prefill
  left), B4 (positions across calls);
* only rows of the pieces after the first: B4, positions or masks across calls;
* the ranking of every failing row is the oracle's, only the values differ: B2, the head's scale or softcap;
* only the hidden-state rows, or only MTP cases: the MTP classes (M1 for the hidden rows);
* across the set: only multi-sequence cases fail (B5, B6); only cases with micro-batches (B7, B4); only the
  embeddings entry (B10); only image or audio prompts (trap 17, B10, Unified U1-U14 or the audio tower);
  every case that returns a subset of rows fails while the full forward passes, on a KV-shared model (B7);
* otherwise, failures across entry points: a forward-pass mistake (traps 1-12), which ``conformance
  explain`` locates to a layer and sub-block.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

__all__ = ["CLASSES", "diagnose_set", "summary_class"]

# the rows of docs/bug-classes.md's summary table a diagnosis names, with what each is
CLASSES = {
    "B1": "a row shifted or misindexed",
    "B2": "the head in the single-row path (softcap, scale)",
    "B4": "chunked prefill: positions or masks across calls",
    "B5": "sequence state leaking between sequences",
    "B6": "sequence offsets in a batched prefill",
    "B7": "rows pruned before the KV-shared layers misaligned",
    "B10": "the embeddings entry's convention or scale",
    "traps 1-12": "a forward-pass mistake (conformance explain names the layer)",
    "trap 17": "multimodal per-layer inputs or vision masks",
    "audio tower": "the audio tower (mm trap 24, mm §9)",
    "unified U1-U14": "Gemma 4 Unified's vision masks or embedders",
    "mtp M1-M13": "the MTP drafter, its rounds, or the hidden-state output",
    "mtp M14": "the MTP drafter after an image or audio prompt: its first state, its positions",
    "mtp M15": "batched MTP: drafter state or rows shared between the sequences of a batch",
    "degenerate": "output not computed for the input: zeros, a constant, one row for every row or case",
}
FAILED = ("fail", "xfail")


def summary_class(bug_class: str) -> str:
    """The summary-table row of a mutant's bug class ("trap 3" -> "traps 1-12", "unified U6" -> "unified
    U1-U14", "mtp M4" -> "mtp M1-M13", "mtp M14" itself, "mm §9" -> "audio tower")."""
    m = re.fullmatch(r"trap (\d+)", bug_class)
    if m is not None and int(m.group(1)) <= 12:
        return "traps 1-12"
    if bug_class.startswith("unified"):
        return "unified U1-U14"
    if bug_class in ("mtp M14", "mtp M15"):
        return bug_class
    if bug_class.startswith("mtp"):
        return "mtp M1-M13"
    if bug_class.startswith("mm"):
        return "audio tower"
    return bug_class


def _failing(c) -> list[dict]:
    return [r for r in c.rows if r.get("status") == "fail"]


def _is_media(c) -> bool:
    return "image" in c.features or "audio" in c.features or "video" in c.features


def _media_classes(cases, unified: bool) -> list[str]:
    if unified:
        return ["unified U1-U14", "trap 17", "B10"]
    if all("audio" in c.features for c in cases):
        return ["audio tower", "B10", "trap 17"]
    return ["trap 17", "B10", "unified U1-U14"]


def _logits_rows(c) -> list[dict]:
    return [r for r in c.rows if not r["label"].endswith(" hidden") and r.get("metrics")]


def _same_row(rows: list[dict]) -> bool:
    """Whether the returned rows are one row (one digest), where the oracle's rows differ (their top tokens)."""
    digests = {(r.get("metrics") or {}).get("got_digest") for r in rows}
    return (len(rows) >= 2 and len(digests) == 1 and None not in digests
            and len({tuple(r.get("top_ref") or ()) for r in rows}) > 1)


def _repeated(rows: list[dict]) -> list[dict]:
    """The largest group of returned rows that are one row (one digest) where the oracle's rows differ."""
    groups: dict[int, list[dict]] = {}
    for r in rows:
        digest = (r.get("metrics") or {}).get("got_digest")
        if digest is not None:
            groups.setdefault(digest, []).append(r)
    best = max(groups.values(), key=len, default=[])
    return best if _same_row(best) else []


def _degenerate(c) -> str | None:
    """What makes a failed case's output degenerate (not computed for its input), or None."""
    bad = [r for r in _failing(c) if not r["label"].endswith(" hidden")]
    if not bad:
        return None
    if all((r.get("metrics") or {}).get("got_spread") == 0 for r in bad):
        values = {(r.get("metrics") or {}).get("got_max_abs") for r in bad}
        what = ("every logit 0" if values == {0.0} else
                f"every logit one value, |{next(iter(values)):.4g}|" if len(values) == 1 else "one value per row")
        return f"every failing row is constant ({what}; {len(bad)} row(s))"
    same = _repeated(_logits_rows(c))
    if 2 * len([r for r in same if r.get("status") == "fail"]) >= len(bad):
        return (f"{len(same)} of the returned rows are one row repeated ({same[0]['label']} is "
                f"{', '.join(r['label'] for r in same[1:3])}{', ...' if len(same) > 3 else ''}), where the oracle's "
                "rows differ: one output slot read for every row")
    return None


def _case_patterns(c, cap: float | None) -> list[tuple[str, list[str]]]:
    """(what the rows of one failed case show, the classes it points at), most specific first."""
    out: list[tuple[str, list[str]]] = []
    bad, rows = _failing(c), c.rows
    if c.kind == "mtp":
        media, batch = "mtp-after-media" in c.features, "mtp-batch" in c.features
        return [(f"{'a batched MTP case' if batch else 'an MTP case'}{' after media' if media else ''}" + (
            " whose request the backend could not serve" if c.status in ("error", "xfail") and c.error is not None
            else ""), ["mtp M15"] * batch + ["mtp M14"] * media + ["mtp M1-M13"])]
    if not bad:
        return out
    degenerate = _degenerate(c)
    if degenerate is not None:
        return [(degenerate, ["degenerate"])]
    logits_bad = [r for r in bad if not r["label"].endswith(" hidden")]
    shifted = [r for r in bad if r.get("check") in ("identity", "hidden_identity")]
    # a shift when most failing rows are other rows of the oracle; a few identity failures among many far-off
    # rows are the large error's doing, not a shift
    if shifted and 2 * len(shifted) >= len(bad):
        r = shifted[0]
        nearest = (r.get("metrics") or {}).get("identity_nearest")
        out.append((f"a shifted row: {r['label']} is nearest oracle row {nearest}",
                    ["B1"] if r.get("check") == "identity" else ["mtp M1-M13", "B1"]))
    if not logits_bad:
        out.append(("only the hidden-state rows fail, the logits pass", ["mtp M1-M13"]))
        return out
    if cap:
        beyond = [r for r in logits_bad if ((r.get("metrics") or {}).get("got_max_abs") or 0.0) > cap * (1 + 1e-6)]
        if beyond:
            worst = max(r["metrics"]["got_max_abs"] for r in beyond)
            out.append((f"logits beyond the final softcap on {len(beyond)} row(s) (|logit| up to {worst:.4g} > cap "
                        f"{cap:g}): the softcap is missing there", ["B2"]))
    logits_rows = [r for r in rows if not r["label"].endswith(" hidden")]
    decode_bad = all("decode" in r["label"] for r in logits_bad)
    prefill_rows = [r for r in logits_rows if "decode" not in r["label"]]
    if decode_bad and prefill_rows and all(r.get("status") == "pass" for r in prefill_rows):
        out.append((f"only the decode rows fail ({len(logits_bad)} of {len(logits_rows)}); the prefill's rows pass: "
                    "the single-row head, or the cache the prefill left",
                    ["B5", "B6", "B2"] if c.kind == "multi" else ["B2", "B7", "B4"]))
    pieces = [re.match(r"piece (\d+) ", r["label"]) for r in logits_bad]
    if pieces and all(p is not None and int(p.group(1)) > 0 for p in pieces):
        out.append(("only rows of the pieces after the first fail: positions or masks across calls", ["B4"]))
    if all(r.get("top_ref") and r.get("top_ref") == r.get("top_got") for r in logits_bad):
        out.append(("every failing row ranks the tokens as the oracle does, only the values differ: the head's "
                    "scale or softcap", ["B2", "traps 1-12"]))
    return out


def _set_patterns(failed: list, passed: list, kv_shared: bool, unified: bool) -> list[tuple[str, list[str]]]:
    """What the failed and passed cases of one set show together."""
    out: list[tuple[str, list[str]]] = []
    text = [c for c in failed if c.kind != "mtp"]
    if not text:
        return out
    firsts = [rows[0] for rows in map(_logits_rows, text) if rows]
    if len(text) >= 2 and len(firsts) == len(text) and _same_row(firsts):
        out.append((f"the same logits in every failed case of this set ({len(text)} cases), "
                    "whatever the prompt", ["degenerate"]))

    def only(pred, what: str, classes: list[str]) -> None:
        others = [c for c in passed if pred(c)] or [c for c in failed if pred(c)]
        if all(pred(c) for c in text) and others and any(not pred(c) for c in passed):
            out.append((f"only {what} fail in this set ({len(text)} case(s); the others pass)", classes))

    only(lambda c: c.kind == "multi", "multi-sequence cases", ["B5", "B6"])
    if all(_is_media(c) for c in text):  # also on a set of media prompts alone
        out.append((f"only image, video or audio prompts fail in this set ({len(text)} "
                    "case(s))", _media_classes(text, unified)))
    only(lambda c: c.entry == "last:embeddings" or _is_media(c), "cases given input embeddings",
         ["B10", "trap 17"])
    only(lambda c: "ubatch" in c.features, "cases with micro-batches", ["B7", "B4"])
    only(lambda c: "chunked" in c.features or "no-output-piece" in c.features, "chunked prefill cases", ["B4"])
    if kv_shared:
        only(lambda c: c.kind != "full", "cases that return a subset of the rows (the full forward passes), on "
                                          "a model with KV-shared layers,", ["B7", "B2"])
    return out


def _degenerate_first(patterns: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """A degenerate output hides every other pattern: the rows were not computed for the input."""
    degenerate = [p for p in patterns if p[1] == ["degenerate"]]
    return degenerate[:2] or patterns


def _line(patterns: list[tuple[str, list[str]]]) -> str:
    classes: list[str] = []
    for _, cls in patterns:
        for k in cls:
            if k not in classes:
                classes.append(k)
    if classes == ["degenerate"]:
        return ("degenerate output: " + "; ".join(text for text, _ in patterns[:2]) + ". Not a bug class of the model: "
                                                                                      "the backend's output was not "
                                                                                      "computed for this input (an "
                                                                                      "unfilled or zeroed buffer, a "
                                                                                      "result not copied back, a stub, "
                                                                                      "a cached response); fix that "
                                                                                      "first, nothing else can be read "
                                                                                      "from these rows")
    named = "; ".join(f"{k} ({CLASSES[k]})" for k in classes[:3])
    return "; ".join(text for text, _ in patterns[:2]) + f". Likely {named}"


def diagnose_set(results: Iterable, *, softcap: float | None, kv_shared: bool, unified: bool) -> None:
    """Set ``diagnosis`` on every failed case (fail, xfail; and an MTP case the backend raised on) of one set's
    results. Any other error carries its own message and traceback instead."""
    results = list(results)
    failed = [c for c in results if c.status in FAILED or (c.status == "error" and c.kind == "mtp" and c.check is None)]
    passed = [c for c in results if c.status in ("pass", "xpass")]
    across = _set_patterns(failed, passed, kv_shared, unified)
    cap = softcap if softcap and math.isfinite(softcap) else None
    for c in failed:
        patterns = _case_patterns(c, cap)
        if c.kind != "mtp":
            patterns = _degenerate_first(patterns + across)
        if not patterns:
            patterns = [("failures across entry points and features", ["traps 1-12"])]
        c.diagnosis = _line(patterns)
