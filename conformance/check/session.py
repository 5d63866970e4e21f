"""A backend opened on fixture sets, one set at a time, and the one loop over their cases that every face of
the harness shares (``conformance check``, the pytest plugin, the self-test, explain).

``Selection`` is a run's sets and the cases chosen of each. ``Checkpoints`` materialises each set's checkpoint
once in a working directory (synthetic sets regenerate theirs from preset and seed, external sets are checked
where they are) and keeps each set's ``SetContext``: what grading its cases needs. ``Session`` opens a
backend on one set (closing the one before) and runs the chosen cases of each set through the per-case work
a face supplies (``CaseWork``): ``session.run(plan, work)``.
"""

from __future__ import annotations

import functools
import re
import time
from collections import ChainMap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from refimpl.assistant import Drafter
from refimpl.config import load_config
from refimpl.errors import RefimplError
from refimpl.model import Gemma4
from refimpl.synth import write_checkpoint
from refimpl.tokenizer import Tokenizer

from ..protocol.types import Backend, BackendError, claims, required_capabilities
from ..sets.bounds import logit_scale
from ..sets.case import row_groups
from ..sets.fixture_set import FixtureSet
from ..sets.format import MANIFEST, FixtureError, sha256_file
from ..sets.integrity import load_set
from .calls import Calls
from .guard import CallInfo
from .hidden import OracleHidden
from .requests import Embedder, build_request
from .results import SetInfo
from .select import CaseFilter


class NoCasesSelected(Exception):
    """No case of the fixture sets matched the selection (exit code 5)."""


def compile_select(select: str | re.Pattern | None) -> re.Pattern | None:
    """Compile a -k regex; ValueError with a readable message when invalid."""
    if select is None or isinstance(select, re.Pattern):
        return select
    try:
        return re.compile(select)
    except re.error as e:
        raise ValueError(f"-k: not a valid regular expression ({e}): {select!r}") from None


class Selection:
    """The fixture sets of a run (paths or loaded ``FixtureSet``s; each loaded and verified: FixtureError)
    and the cases ``select`` chooses of each: a ``CaseFilter`` (-k expression, --match regex), or a regular
    expression searched in the case id. ``select`` records it (the report's "select")."""

    def __init__(self, sets: Iterable, select: CaseFilter | str | re.Pattern | None = None):
        if isinstance(select, CaseFilter):
            take, self.select = select, select.describe()
        else:
            pattern = compile_select(select)
            self.select = None if pattern is None else CaseFilter(regex=pattern.pattern).describe()

            def take(case, name: str, pattern=pattern) -> bool:
                return pattern is None or pattern.search(case.id) is not None
        self.sets = [s if isinstance(s, FixtureSet) else load_set(Path(s)) for s in sets]
        self.chosen = [[c for c in fs.cases if take(c, str(fs.manifest.get("name", "")))] for fs in self.sets]
        self.total = sum(len(c) for c in self.chosen)
        if self.total == 0:
            what = self.select or "the selection"
            n_all = sum(len(fs.cases) for fs in self.sets)
            raise NoCasesSelected(f"no case selected: {what} matched none of the {n_all} cases of "
                                  f"{len(self.sets)} fixture set(s)")

    def infos(self) -> list[SetInfo]:
        """One SetInfo per set, for the report."""
        out = []
        for fs, chosen in zip(self.sets, self.chosen, strict=True):
            m = fs.manifest
            out.append(SetInfo(
                name=str(m.get("name", Path(fs.path).name)), version=str(m.get("version", "")),
                path=str(fs.path), manifest_sha256=sha256_file(Path(fs.path) / MANIFEST),
                model=_model_summary(m), cases_total=len(fs.cases), cases_selected=len(chosen),
            ))
        return out


def _model_summary(manifest: dict) -> dict[str, Any]:
    model = manifest.get("model")
    if not isinstance(model, dict):
        return {}
    keep = {}
    for k, v in model.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            keep[k] = v
    return keep


class SetContext:
    """What grading the cases of one opened fixture set needs: bases, oracle logits, embedder, tokenizer, and
    for a set with MTP cases the assistant checkpoint (``drafter``). ``oracle()``: the set's oracle
    (``Checkpoints.oracle``), built on first use and shared by the embedder and the hidden rows."""

    def __init__(self, fs, model_dir: Path, convention: str, base_logits, drafter: Path | None = None,
                 mtp_rows: tuple[dict, dict] = ({}, {}), *, oracle: Callable[[], Gemma4]):
        self.fs = fs
        self.name = str(fs.manifest.get("name", Path(fs.path).name))
        self.model_dir = model_dir
        self.drafter = drafter
        self.bases = fs.bases()
        mtp_logits, mtp_hidden = mtp_rows
        # stored, or rebuilt through the checkpoint's head on first use; the MTP bases' rows first
        self.base_logits = ChainMap(mtp_logits, base_logits) if mtp_logits else base_logits
        self._scales: dict[str, float] = {}  # base -> its logit scale (logit_scale)
        self.embed = Embedder(oracle, convention)
        self.media = fs.media(convention)
        self.pieces = token_pieces(model_dir)
        # a set made from a quantised checkpoint needs a backend that opens that format (weight_formats), and one
        # made under an activation convention other than none a backend that follows it
        fmt = (fs.manifest.get("model", {}).get("quantisation") or {}).get("format")
        self.weight_needs = [] if fmt is None else [f"weight_formats={fmt}"]
        if (activations := fs.activations) != "none":
            self.weight_needs.append(f"activation_conventions={activations}")
        # final-norm rows: the MTP bases' as stored, the others made on first use from the residual stream
        self.base_hidden = ChainMap(mtp_hidden, OracleHidden(fs.hidden_states(), oracle))

    def prepare(self, cases, note: Callable[[str], None] | None = None) -> None:
        """The oracle logits of every base ``cases`` grade, made now: a set stored as hidden states has them
        rebuilt here (FixtureError, exit 3, when the checkpoint's head does not reproduce the set), never in
        the middle of grading a backend's answer. ``note(text)`` is told of each base being rebuilt."""
        for b in sorted({r.base for c in cases for _, rows in row_groups(c) for r in rows}):
            if b in self.bases:
                if note is not None and self.fs.storage == "hidden":
                    note(f"{self.name}: rebuilding base {b}'s logits ({len(self.bases[b])} rows) through the "
                         "checkpoint's head")
                self.base_logits[b]

    def claimable(self, case, claimed: dict) -> bool:
        """Whether the backend claims what ``case`` needs (decode aside, which is dropped when unclaimed).
        A case whose request cannot be built counts as claimable: running it reports the harness error."""
        try:
            need = required_capabilities(build_request(case, self.bases, self.embed, self.media, self.drafter))
            need += self.weight_needs
        except Exception:  # noqa: BLE001 - running it reports the harness error
            return True
        return all(claims(claimed, n) for n in need if n != "decode")

    @functools.cached_property
    def text_config(self):
        """The checkpoint's text config (``refimpl.config.TextConfig``), read once."""
        return load_config(self.model_dir)

    def logit_scale(self, base: str) -> float:
        """The largest finite |logit| of a base's oracle rows (at least 1), computed once per base."""
        if base not in self._scales:
            self._scales[base] = logit_scale(self.base_logits[base])
        return self._scales[base]


def token_pieces(model_dir: Path) -> Callable[[list[int]], list[str] | None]:
    """A function mapping token ids to tokenizer pieces (None when the checkpoint has no tokenizer)."""
    try:
        tok = Tokenizer.from_dir(model_dir)
    except Exception:  # noqa: BLE001 - pieces are a nicety; never fail the run over them
        tok = None

    def pieces(ids: list[int]) -> list[str] | None:
        if tok is None:
            return None
        out = []
        for i in ids:
            try:
                out.append(tok.piece(int(i)) if 0 <= int(i) < tok.vocab_size else f"<id {int(i)}>")
            except Exception:  # noqa: BLE001 - a piece is cosmetic: the id instead
                out.append(f"<id {int(i)}>")
        return out

    return pieces


def materialise(fs, workdir: str | Path, *, model: str | Path | None = None, rehash: bool = False) -> Path:
    """The checkpoint of the set ``fs`` (``FixtureSet.model_dir``), a synthetic one regenerated under ``workdir``
    from its preset and seed (``refimpl.synth.write_checkpoint``) when it is not already there;
    FixtureError when it does not match the set."""
    return Path(fs.model_dir(Path(workdir), model=model, rehash=rehash, write=write_checkpoint))


class Checkpoints:
    """Each fixture set's checkpoint, materialised once under ``workdir``, and its SetContext per embedding
    convention. ``model_dir`` raises FixtureError when a checkpoint does not match its set (exit 3).
    ``model`` (``--model DIR``): where every external set's checkpoint is (default: each set's recorded
    path); synthetic sets ignore it and regenerate theirs. ``rehash``: read every checkpoint file again
    instead of trusting the digest cache."""

    def __init__(self, workdir: str | Path, *, model: str | Path | None = None, rehash: bool = False,
                 drafter: str | Path | None = None):
        self.workdir = Path(workdir)
        self.model = model
        self.drafter = drafter
        self.rehash = rehash
        self._dirs: dict[int, Path] = {}
        self._contexts: dict[tuple[int, str], SetContext] = {}
        self._logits: dict[int, Any] = {}
        self._mtp: dict[int, tuple[dict, dict]] = {}
        self._oracles: dict[tuple[Path, str], Gemma4] = {}

    def oracle(self, model_dir: Path, activations: str = "none") -> Gemma4:
        """The oracle of a checkpoint (float64, the exact sqrt(H), the bundled sets' vision mask; the set's
        activation convention), built once and shared by everything that grades its sets: the rows rebuilt
        through its head, the embeddings entry's inputs, the hidden rows, the MTP rows, explain's oracle
        backend. RefimplError when it cannot be read."""
        key = (Path(model_dir), activations)
        if key not in self._oracles:
            self._oracles[key] = Gemma4(key[0], activations=activations)
        return self._oracles[key]

    def model_dir(self, fs) -> Path:
        key = id(fs)
        if key not in self._dirs:
            given = self.model if fs.manifest["model"]["kind"] == "external" else None
            model_dir = materialise(fs, self.workdir / f"set{len(self._dirs)}", model=given, rehash=self.rehash)
            if fs.manifest["model"].get("quantisation") is not None:
                # a quantised checkpoint is read by the oracle before any backend: one it cannot decode is the
                # set's problem (exit 3), not the backend's
                try:
                    self.oracle(model_dir, fs.activations)
                except RefimplError as e:
                    raise FixtureError(f"{fs.path}: the set's quantised checkpoint cannot be read by the oracle: "
                                       f"{e}") from None
            self._dirs[key] = model_dir
        return self._dirs[key]

    def oracle_logits(self, fs):
        """The set's oracle logits, once per set: stored, or rebuilt from its hidden states through the
        checkpoint's head (conformance.sets.head.RebuiltLogits) under the workdir."""
        key = id(fs)
        if key not in self._logits:
            model = None
            if fs.storage == "hidden":
                try:
                    model = self.oracle(self.model_dir(fs), fs.activations)
                except RefimplError as e:
                    raise FixtureError(f"{fs.path}: the set stores hidden states, and rebuilding its logits needs "
                                       f"the checkpoint's head, which the oracle cannot read: {e}") from None
            self._logits[key] = fs.oracle_logits(model, self.workdir / f"rebuilt{len(self._logits)}")
        return self._logits[key]

    def mtp_rows(self, fs, model_dir: Path, drafter: Path | None) -> tuple[dict, dict]:
        """The set's MTP rows (``FixtureSet.mtp_rows``), their logits rebuilt through the target's and the
        drafter's heads, once per set; FixtureError when either checkpoint cannot be read."""
        key = id(fs)
        if key not in self._mtp:
            self._mtp[key] = ({}, {})
            if fs.has_mtp():
                try:
                    self._mtp[key] = fs.mtp_rows(self.oracle(model_dir, fs.activations), Drafter(drafter))
                except RefimplError as e:
                    raise FixtureError(f"{fs.path}: the set's MTP rows are rebuilt through the target's and the "
                                       f"drafter's heads, which the oracle cannot read: {e}") from None
        return self._mtp[key]

    def context(self, fs, convention: str) -> SetContext:
        key = (id(fs), convention)
        if key not in self._contexts:
            model_dir = self.model_dir(fs)
            drafter = fs.drafter_dir(model_dir, drafter=self.drafter, rehash=self.rehash)
            self._contexts[key] = SetContext(fs, model_dir, convention, self.oracle_logits(fs), drafter,
                                             self.mtp_rows(fs, model_dir, drafter),
                                             oracle=lambda: self.oracle(model_dir, fs.activations))
        return self._contexts[key]


# where a run's time goes (Session.timings, seconds): the checkpoint made or checked (a synthetic set's
# regenerated, an external one's digests), the oracle's rows rebuilt through its head (a set stored as hidden
# states), the backend opened on it, the backend's requests (the cases' durations), the grading and diagnosis
PHASES = ("checkpoint", "rebuild", "open", "backend", "grade")


class CaseWork(Protocol):
    """What a face of the harness does with each case of a set (``Session.run_set``): the CLI runner and the
    pytest plugin run and grade it, the self-test grades one answer at several profiles, explain compares
    traces."""

    def case(self, ctx: SetContext, case) -> Any:
        """The case's work, on the backend opened on its set (or not opened, when it claims no case of it)."""

    def record(self, result: Any) -> None:
        """The case's result, once the case is no longer in flight (an interrupt from here on leaves it
        reported)."""

    def start(self, ctx: SetContext, chosen: list) -> None:
        """Called once the backend is open on the set, before its first case (``--concurrency``'s prefetch)."""

    def done(self, ctx: SetContext, results: list) -> None:
        """After the set's last case, or when the run stops in the middle of it: its results so far."""


@dataclass
class Work:
    """A ``CaseWork`` made of functions: ``case(ctx, case)``; ``record(result)`` and ``done(ctx, results)``
    (nothing by default)."""

    case: Callable[[SetContext, Any], Any]
    done: Callable[[SetContext, list], None] = lambda ctx, results: None
    record: Callable[[Any], None] = lambda result: None


class Session:
    """``backend`` opened on one set at a time, and the one loop over the cases of a run's sets that every face
    of the harness shares (``conformance check``, the pytest plugin, the self-test, explain): it owns the
    claimed capabilities (``claimed``), the calls into the backend (``calls``: direct, or supervised under
    ``case_timeout``; see ``conformance.check.calls``), the case in flight, the time of each phase
    (``timings``) and the stop of a run (``stop``). Each face supplies its per-case work (``CaseWork``)."""

    def __init__(self, backend: Backend, checkpoints: Checkpoints, case_timeout: float | None = None):
        self.backend = backend
        self.calls = Calls(backend, case_timeout)
        self.claimed = backend.capabilities.to_dict()
        self.checkpoints = checkpoints
        self.current = None  # the fixture set the backend is open on
        self.in_flight: str | None = None  # the id of the case whose work is running
        self.stopped: dict | None = None  # why the run ended early (``stop``)
        self.timings = dict.fromkeys(PHASES, 0.0)

    def run(self, plan: Iterable[tuple[Any, list]], work: CaseWork, note: Callable[[str], None] | None = None) -> None:
        """Every (set, chosen cases) of ``plan`` through ``run_set``, until one stops the run; the backend
        closed after (unless a case's call is still in flight: an interrupted backend is never waited on)."""
        try:
            for fs, chosen in plan:
                if chosen:
                    self.run_set(fs, chosen, work, note)
                if self.stopped is not None:
                    break
        finally:
            self.close()

    def run_set(self, fs, chosen: list, work: CaseWork, note: Callable[[str], None] | None = None) -> list:
        """The work of each chosen case of ``fs``, in order; the results. The set's checkpoint is made and its
        oracle rows rebuilt first (``note(text)`` told of each rebuild); the backend is opened on the set
        only when it claims one of its cases (an image set for a text-only engine loads nothing)."""
        with self.clock("checkpoint"):
            ctx = self.context(fs)
        with self.clock("rebuild"):
            ctx.prepare(chosen, note)
        results: list = []
        try:
            if any(ctx.claimable(case, self.claimed) for case in chosen):
                with self.clock("open"):
                    self.enter(fs)
                start = getattr(work, "start", None)  # optional: the faces that send nothing ahead have none
                if callable(start):
                    start(ctx, chosen)
            for case in chosen:
                self.in_flight = case.id
                result = work.case(ctx, case)
                self.in_flight = None
                results.append(result)
                work.record(result)
                if self.stopped is not None:
                    break
        finally:  # also when the run is interrupted: the cases it finished keep their diagnoses
            work.done(ctx, results)
        return results

    def stop(self, record: dict) -> None:
        """End the run after the current case (``record``: the report's ``interrupted``)."""
        self.stopped = record

    def clock(self, phase: str) -> _Clock:
        """``with session.clock(phase):`` adds the block's wall time to ``timings[phase]``."""
        return _Clock(self.timings, phase)

    def context(self, fs) -> SetContext:
        """The set's context in the backend's embedding convention, without opening the backend."""
        return self.checkpoints.context(fs, self.backend.capabilities.embedding_convention)

    def enter(self, fs) -> SetContext:
        """Open the backend on ``fs`` (closing the set before); its SetContext. BackendError when it cannot be
        opened (any exception, SystemExit too; KeyboardInterrupt passes)."""
        ctx = self.context(fs)
        if self.current is fs:
            return ctx
        self.close()
        opened = CallInfo.from_call(lambda: self.calls.open(Path(ctx.model_dir)))
        if isinstance(opened.excinfo, BackendError):
            raise opened.excinfo
        if opened.failed:  # cannot open: the run stops (exit 4)
            raise BackendError(f"backend {getattr(self.backend, 'name', '?')!r} could not open "
                               f"{fs.manifest.get('name', fs.path)} ({ctx.model_dir}): {opened.text()}") \
                from opened.excinfo
        self.current = fs
        return ctx

    def close(self) -> None:
        """Close the backend on its set, if open and not in the middle of a call; a failing close does not hide
        the results."""
        if self.current is None or self.in_flight is not None:
            return
        self.current = None
        CallInfo.from_call(self.calls.close)  # closing must not mask the run's result


class _Clock:
    def __init__(self, timings: dict, phase: str):
        self.timings, self.phase = timings, phase

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.timings[self.phase] += time.perf_counter() - self.t0
