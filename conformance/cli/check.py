"""``conformance check``, ``conformance list`` and ``conformance scoreboard``."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ..backends.subprocess.client import IsolatedBackend
from ..check.policy import Policy, PolicyError, check_profile_name, load_given, resolve_policy
from ..check.profiles import PROFILES
from ..check.results import entry_point
from ..check.runner import load_sets, run
from ..protocol.types import BackendError
from ..registry import available_backends, load_backend, not_installed_note
from ..report import ProgressBar, colorize, console_summary, exit_line, is_tty, printable, use_color, verdict_line
from ..report.console import counts_line
from ..report.html import write_html
from ..report.scoreboard import ScoreboardError, embed, load_report, render
from ..sets import FixtureError
from .common import (
    EXIT_EMPTY,
    EXIT_FIXTURE,
    EXIT_OK,
    UsageError,
    backend_option,
    compile_k,
    err,
    fixture_paths,
    guarded,
    load_fixture_sets,
    model_dir_arg,
    output_path,
    shutdown_backend,
    warn,
    write_stdout,
)
from .reports import Reports


def _load_checked_backend(args, options: dict[str, Any]):
    """The backend of --backend: in this process, or with --isolate in a child process behind the
    protocol server (BackendError if it cannot be loaded)."""
    if not args.isolate:
        return load_backend(args.backend, **options)

    # no limit on a run unless --case-timeout sets one; the child's start includes importing the engine
    return IsolatedBackend(args.backend, options, timeout=1e9, startup_timeout=300.0)


def _paths(args) -> dict[str, str | None]:
    """The report paths, each checked (opened) before any work; at most one on standard output."""
    paths = {"json": output_path("--json", args.json), "junit": output_path("--junit-xml", args.junit_xml),
             "summary": output_path("--summary-md", args.summary_md), "html": output_path("--html", args.html)}
    if list(paths.values()).count("-") > 1:
        raise UsageError("only one of --json, --junit-xml, --summary-md and --html can go to standard output (-)")
    return paths


def _policy(args, backend, given) -> Policy:
    """The run's profile and expectations (``resolve_policy``): BackendError when the backend declares a default
    profile that is none or ships a broken expectations file; the shipped file named on standard error."""
    try:
        policy = resolve_policy(backend, args.profile, given, shipped=not args.no_shipped_expectations)
    except PolicyError as e:
        raise BackendError(str(e)) from None
    exp = policy.expectations
    if exp.shipped and not args.quiet:
        sys.stderr.write(printable(f"using the expectations shipped with backend {backend.name!r}: {exp.path} "
                                   f"({len(exp.entries)} entries; --no-shipped-expectations to ignore)") + "\n")
    return policy


def cmd_check(args, argv: Sequence[str]) -> int:
    pattern = compile_k(args)
    options = dict(backend_option(o) for o in args.backend_option or [])
    try:
        check_profile_name(args.profile)
        reports = Reports(args, argv, _paths(args), html=write_html)
        given = load_given(args.expectations)
    except PolicyError as e:
        raise UsageError(str(e)) from None
    model = model_dir_arg(args.model)
    drafter = model_dir_arg(args.drafter, "--drafter")
    with contextlib.suppress(FixtureError):  # a broken set (exit 3) is reported by load_fixture_sets below
        fixture_paths(args.fixtures)  # a usage error before any report is touched
    reports.unfinished({"name": args.backend, "capabilities": {}, "options": options},
                       PROFILES.get(args.profile) if args.profile else None)
    t0 = time.perf_counter()
    sets = load_fixture_sets(args, on_error=reports.aborted)
    if sets is None:
        return EXIT_FIXTURE
    load_time = time.perf_counter() - t0
    if model is not None and not any(fs.manifest["model"]["kind"] == "external" for fs in sets):
        warn("--model applies to external fixture sets only; every set given is synthetic (its checkpoint is "
             "regenerated from preset and seed)")
    try:
        backend = _load_checked_backend(args, options)
        policy = _policy(args, backend, given)
    except BackendError as e:
        err(str(e))
        return reports.aborted("backend", str(e))
    if args.concurrency is not None and not callable(getattr(backend, "prefetch", None)):
        msg = (f"--concurrency: backend {backend.name!r} takes one request at a time (a backend with prefetch, "
               "such as openai, sends them concurrently)")
        err(msg)
        shutdown_backend(backend)
        return reports.aborted("backend", msg)
    if policy.expectations.backend and policy.expectations.backend != backend.name:
        warn(f"the expectations file is for backend {policy.expectations.backend!r}, running {backend.name!r}")

    bar = ProgressBar(sys.stderr, tty=is_tty(sys.stderr), enabled=not args.quiet)
    result, failed = guarded(bar, lambda: run(backend, sets, policy.profile, policy.expectations, pattern, bar,
                                               backend_options=options, case_timeout=args.case_timeout,
                                               model=model, rehash=args.rehash, drafter=drafter,
                                               profile_named=policy.named, concurrency=args.concurrency),
                             on_error=reports.aborted)
    shutdown_backend(backend)
    if failed is not None:
        return failed
    result.timings["load"] = load_time
    if result.interrupted is not None:
        err(f"{result.interrupted['message']}; writing the report of the {len(result.cases)} finished "
             f"case{'s' if len(result.cases) != 1 else ''}")
    unwritten = reports.write(result)
    _print_summary(args, result, reports.to_stdout, unwritten)
    return unwritten or result.exit_code


def _print_summary(args, result, to_stdout: bool, unwritten: int) -> None:
    """The console summary (-q: the verdict line alone; -v still asks for everything), on standard error when
    standard output carries a report. A report that could not be written ends the summary with that, never
    with a pass."""
    text = verdict_line(result) if args.quiet and not args.verbose else console_summary(result, verbose=args.verbose)
    if unwritten:
        text = "\n".join(line for line in text.splitlines() if not line.startswith("exit "))
        text += f"\n{exit_line(unwritten)}: a report could not be written ({counts_line(result)})"
    stream = sys.stderr if to_stdout else sys.stdout
    summary = printable(text)
    summary = (colorize(summary) if use_color(stream) else summary) + "\n"
    if stream is sys.stderr:
        sys.stderr.write(summary)
    else:
        write_stdout(summary)


def cmd_list(args) -> int:
    if args.what == "backends":
        found = available_backends()
        if not found:
            print(f"(no registered backends{not_installed_note()}; give a Python object as module:attr)")
        w = max((len(n) for n in found), default=0)
        for name, target in found.items():
            print(f"{name.ljust(w)}  {target}")
        return EXIT_OK
    if args.what == "profiles":
        for name, p in dict(PROFILES).items():
            desc = getattr(p, "description", "")
            print(f"{name}: {desc}")
            print(f"    max_abs {p.max_abs:g}, max_rel {p.max_rel:g}, nmse {p.nmse:g}, cosine >= "
                  f"1-{1 - p.cosine_min:.3g}, kl_max {p.kl_max:g}, kl_mean {p.kl_mean:g}, delta_p {p.delta_p:g}, "
                  f"top-{p.topk} overlap {p.topk_overlap_min:g}, tie_margin {p.tie_margin:g}, identity_ratio "
                  f"{p.identity_ratio:g}")
        return EXIT_OK
    # cases

    pattern = compile_k(args)
    try:
        sets = load_sets(fixture_paths(args.fixtures))
    except FixtureError as e:
        err(f"fixture integrity: {e}")
        return EXIT_FIXTURE
    n = 0
    for fs in sets:
        for c in fs.cases:
            if pattern is not None and not pattern(c, str(fs.manifest.get("name", ""))):
                continue
            n += 1
            print(printable(f"{c.id}  [{entry_point(c)}] {','.join(c.features)}"))
    sys.stderr.write(f"{n} case(s) in {len(sets)} fixture set(s)\n")
    return EXIT_OK if n else EXIT_EMPTY


def cmd_scoreboard(args) -> int:
    try:
        text = render([load_report(p) for p in args.reports], title=args.title)
    except ScoreboardError as e:
        raise UsageError(str(e)) from None
    if args.into:
        page = Path(args.into)
        try:
            text = embed(page.read_text(encoding="utf-8"), text, where=str(page))
        except OSError as e:
            raise UsageError(f"--into {page}: cannot read it ({e.strerror or e})") from None
        except ScoreboardError as e:
            raise UsageError(str(e)) from None
        try:
            page.write_text(text, encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--into {page}: cannot write it ({e.strerror or e})") from None
        sys.stderr.write(f"updated the scoreboard in {page}\n")
    elif args.out:
        out = Path(args.out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text, encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--out {out}: cannot write it ({e.strerror or e})") from None
        sys.stderr.write(f"wrote scoreboard {out}\n")
    else:
        sys.stdout.write(text)
    return EXIT_OK


