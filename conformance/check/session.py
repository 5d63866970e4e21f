"""A backend opened on fixture sets, one set at a time: the one loop every runner of cases shares
(``conformance check``, the self-test, the pytest plugin).

``Checkpoints`` materialises each set's checkpoint once in a working directory (synthetic sets regenerate
theirs from preset and seed, external sets are checked where they are) and keeps each set's
``SetContext``: what grading its cases needs. ``Session`` opens a backend on one set (closing the one
before), so that ``enter(fs)`` is all a runner calls before running that set's cases, and ``close()``
after the last.
"""

from __future__ import annotations

import functools
import re
from collections import ChainMap
from pathlib import Path
from typing import Any, Callable, Iterable

from refimpl.assistant import Drafter
from refimpl.config import load_config
from refimpl.errors import RefimplError
from refimpl.model import Gemma4
from refimpl.tokenizer import Tokenizer

from ..protocol.types import Backend, BackendError, claims, required_capabilities
from ..sets.bounds import logit_scale, recorded_probes
from ..sets.case import row_groups
from ..sets.fixture_set import FixtureSet
from ..sets.format import MANIFEST, FixtureError, sha256_file
from ..sets.integrity import load_set
from .hidden import OracleHidden
from .profiles import scaled
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
    for a set with MTP cases the assistant checkpoint (``drafter``)."""

    def __init__(self, fs, model_dir: Path, convention: str, base_logits, drafter: Path | None = None,
                 mtp_rows: tuple[dict, dict] = ({}, {})):
        self.fs = fs
        self.name = str(fs.manifest.get("name", Path(fs.path).name))
        self.model_dir = model_dir
        self.drafter = drafter
        self.bases = fs.bases()
        mtp_logits, mtp_hidden = mtp_rows
        # stored, or rebuilt through the checkpoint's head on first use; the MTP bases' rows first
        self.base_logits = ChainMap(mtp_logits, base_logits) if mtp_logits else base_logits
        self._scales: dict[str, float] = {}  # base -> its logit scale (logit_scale)
        self.embed = Embedder(model_dir, convention)
        self.media = fs.media(convention)
        self.pieces = token_pieces(model_dir)
        # final-norm rows: the MTP bases' as stored, the others made on first use from the residual stream
        self.base_hidden = ChainMap(mtp_hidden, OracleHidden(fs.hidden_states(), model_dir))

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
        except Exception:  # noqa: BLE001 - running it reports the harness error
            return True
        return all(claims(claimed, n) for n in need if n != "decode")

    def profile_for(self, profile, case):
        """``profile`` as it grades ``case``: a rounding-scaled profile (exact-f64; ``profiles.scaled``)
        with its thresholds scaled to this set's model, the longest base the case reads, the largest
        logit scale of those bases and the largest rounding probe the set records for them (checkpoints
        that amplify rounding beyond the first-order model); a fixed profile, or one whose floor is above
        its rounding (every miniature), as it is."""
        if getattr(profile, "scaling", "fixed") == "fixed":
            return profile
        bases = sorted({r.base for _, rows in row_groups(case) for r in rows
                        if r.base.split("@")[0] in self.bases})  # an MTP base's rows: scaled by its length
        if not bases:
            return profile
        n = max(len(self.bases[b.split("@")[0]]) for b in bases)
        probes = recorded_probes(self.fs.manifest)
        probe = max((probes[b] for b in bases if b in probes), default=None)
        return scaled(profile, self.text_config, n, max(self.logit_scale(b) for b in bases), probe)

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

    def model_dir(self, fs) -> Path:
        key = id(fs)
        if key not in self._dirs:
            given = self.model if fs.manifest["model"]["kind"] == "external" else None
            self._dirs[key] = Path(fs.model_dir(self.workdir / f"set{len(self._dirs)}", model=given,
                                                rehash=self.rehash))
        return self._dirs[key]

    def oracle_logits(self, fs):
        """The set's oracle logits, once per set: stored, or rebuilt from its hidden states through the
        checkpoint's head (conformance.sets.head.RebuiltLogits) under the workdir."""
        key = id(fs)
        if key not in self._logits:
            model = None
            if fs.storage == "hidden":
                try:
                    model = Gemma4(self.model_dir(fs))
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
                    self._mtp[key] = fs.mtp_rows(Gemma4(model_dir), Drafter(drafter))
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
                                             self.mtp_rows(fs, model_dir, drafter))
        return self._contexts[key]


class Session:
    """``backend`` opened on one set at a time. ``calls`` makes the backend's calls (default: the backend
    itself; ``conformance.check.runner`` passes one that enforces the case timeout), with ``open`` and
    ``close`` like the backend's."""

    def __init__(self, backend: Backend, checkpoints: Checkpoints, calls: Any = None):
        self.backend = backend
        self.calls = calls if calls is not None else backend
        self.checkpoints = checkpoints
        self.current = None  # the fixture set the backend is open on

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
        try:
            self.calls.open(Path(ctx.model_dir))
        except (BackendError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # cannot open: the run stops (exit 4)
            raise BackendError(f"backend {getattr(self.backend, 'name', '?')!r} could not open "
                               f"{fs.manifest.get('name', fs.path)} ({ctx.model_dir}): "
                               f"{type(exc).__name__}: {exc}") from exc
        self.current = fs
        return ctx

    def close(self) -> None:
        """Close the backend on its set, if open; a failing close does not hide the results."""
        if self.current is None:
            return
        self.current = None
        try:
            self.calls.close()
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 - closing must not mask the run's result
            pass
