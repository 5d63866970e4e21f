"""``conformance selftest``."""

from __future__ import annotations

import re
import sys
from typing import Any, Sequence

from .. import selftest as st
from ..check.results import CaseResult
from ..report import ProgressBar, is_tty, printable
from .common import (
    EXIT_BACKEND,
    EXIT_FIXTURE,
    UsageError,
    compile_k,
    err,
    guarded,
    load_fixture_sets,
    output_path,
    write_stdout,
)


class _SelftestProgress:
    """Progress for selftest.run_selftest: the bar on a terminal, one line per backend otherwise."""

    def __init__(self, enabled: bool):
        self.bar = ProgressBar(sys.stderr, tty=is_tty(sys.stderr), enabled=enabled)

    def __call__(self, done: int, total: int, label: str, result: Any) -> None:
        if result is None or isinstance(result, CaseResult):
            if self.bar.tty:
                self.bar(done, total, label)
            return
        if isinstance(result, st.ControlResult):
            v = result.verdict
            state = "ERROR" if result.error else ("pass" if result.passed else "FAILED")
            extra = f" (first failing: {v.first_case} [{v.check}])" if v.killed else ""
            line = (f"control {result.backend} at {result.profile}: {state}, {v.cases_run - v.failing_cases}/"
                    f"{v.cases_run} cases pass{extra} ({result.duration:.1f}s)")
        elif isinstance(result, st.MutantResult):
            if result.error is not None:
                state = f"ERROR {result.error}"
            elif result.rewrite is not None:
                rv = result.verdicts[st.CONTROL_PROFILE]
                state = (f"FAILED at {rv.profile} ({rv.failing_cases} cases; first {rv.first_case} [{rv.check}])"
                         if rv.killed else f"passes at {rv.profile} ({rv.cases_run} cases)")
            elif result.killed:
                case, check = result.caught_by
                mark = "" if result.matching else " (not a matching check)"
                state = f"killed by {check}{mark} ({result.verdict.failing_cases} cases; first {case})"
            else:
                state = "SURVIVED"
            kind = "rewrite" if result.rewrite is not None else "mutant"
            line = f"{kind} {result.name} [{result.bug_class}]: {state} ({result.duration:.1f}s)"
        else:  # pragma: no cover
            return
        self.bar.message(line)

    def close(self) -> None:
        self.bar.close()


def cmd_selftest(args, argv: Sequence[str]) -> int:
    pattern = compile_k(args)
    json_path = output_path("--json", args.json)
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    try:
        mutant_pattern = re.compile(args.mutant) if args.mutant is not None else None
    except re.error as e:
        raise UsageError(f"--mutant: not a valid regular expression ({e}): {args.mutant!r}") from None

    sets = load_fixture_sets(args)
    if sets is None:
        return EXIT_FIXTURE

    try:
        every = st.load_mutants()
    except ImportError as e:
        err(f"the mutants (conformance.selftest.mutants) cannot be imported: {type(e).__name__}: {e}")
        return EXIT_BACKEND
    mutants = st.select_mutants(every, mutant_pattern)
    equivalents = st.select_equivalents(st.load_equivalents(), mutant_pattern)
    rewrites = st.select_equivalents(st.load_rewrites(), mutant_pattern)
    if not mutants and not equivalents and not rewrites:
        raise UsageError(f"--mutant {args.mutant!r} matches none of the {len(every)} mutants: "
                         + ", ".join(m.name for m in every))

    bar = _SelftestProgress(enabled=not args.quiet)
    control, note = st.default_control()
    result, failed = guarded(bar, lambda: st.run_selftest(sets, mutants, select=pattern, progress=bar,
                                                           equivalents=equivalents, rewrites=rewrites,
                                                           control=control,
                                                           control_note=note, workers=args.workers))
    if failed is not None:
        return failed

    if json_path is not None:
        path = st.write_json(result, json_path, argv=list(argv))
        if json_path != "-":
            sys.stderr.write(f"wrote JSON report {path}\n")
    summary = printable(st.console_summary(result, breaks_width=None if args.verbose else 48)) + "\n"
    if json_path == "-":
        sys.stderr.write(summary)
    else:
        write_stdout(summary)  # a closed pipe changes nothing: the verdict is the exit code
    return result.exit_code


