"""``conformance explain``: re-run cases with traces and name where the backend first leaves the oracle."""

from __future__ import annotations

import json
import sys

from ..check.policy import PolicyError, check_profile_name, resolve_policy
from ..explain import ReportError, console_lines, explain, explain_json, failed_in_report, plot_explanations
from ..explain.plot import INSTALL, PlotError, plot_available
from ..protocol.types import BackendError
from ..registry import load_backend
from ..report import ProgressBar, is_tty, printable
from ..report.html import write_explain_html
from .common import (
    EXIT_BACKEND,
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    backend_option,
    compile_k,
    err,
    guarded,
    load_fixture_sets,
    model_dir_arg,
    needs_logits,
    output_path,
    shutdown_backend,
    write_stdout,
)

__all__ = ["cmd_explain"]


def _outputs(args) -> tuple[str | None, str | None, str | None]:
    """(--json, --plot, --html) checked before any work: writable paths, and matplotlib there for --plot."""
    json_path = output_path("--json", args.json)
    plot_path = output_path("--plot", args.plot)
    html_path = output_path("--html", getattr(args, "html", None))
    if plot_path == "-":
        raise UsageError("--plot needs a file name (a PNG), not standard output")
    if html_path == "-":
        raise UsageError("--html needs a file name (an HTML page), not standard output")
    if plot_path is not None and not plot_available():
        raise UsageError(INSTALL)
    return json_path, plot_path, html_path


def _write(path: str, write) -> bool:
    """Run ``write()`` (which returns the path written, None for standard output); one error line and False when
    it cannot."""
    try:
        done = write()
        if done is not None:
            sys.stderr.write(printable(f"wrote {done}") + "\n")
        return True
    except PlotError as e:
        err(str(e))
    except OSError as e:
        err(f"cannot write {path}: {e.strerror or e}")
    return False


def _write_json(path: str, results, backend, profile) -> str | None:
    text = json.dumps(explain_json(results, backend, profile), indent=1, allow_nan=False) + "\n"
    if path == "-":
        write_stdout(text)
        return None
    with open(path, "w") as f:
        f.write(text)
    return path


def cmd_explain(args) -> int:
    pattern = compile_k(args)
    options = dict(backend_option(o) for o in args.backend_option or [])
    try:
        check_profile_name(args.profile)
    except PolicyError as e:
        raise UsageError(str(e)) from None
    json_path, plot_path, html_path = _outputs(args)
    ids = None
    if args.from_report is not None:
        try:
            ids, report_sets = failed_in_report(args.from_report)
        except ReportError as e:
            raise UsageError(str(e)) from None
        if not ids:
            err(f"--from: the report {args.from_report} has no failed case to explain")
            return EXIT_OK
        if not args.fixtures:
            args.fixtures = report_sets or None
    model = model_dir_arg(args.model)
    sets = load_fixture_sets(args)
    if sets is None:
        return 3
    try:
        backend = load_backend(args.backend, **options)
    except BackendError as e:
        err(str(e))
        return EXIT_BACKEND
    try:
        profile = resolve_policy(backend, args.profile, shipped=False).profile
    except PolicyError as e:
        err(str(e))
        return EXIT_BACKEND
    if (why := needs_logits(backend, "explain")) is not None:
        err(why)
        shutdown_backend(backend)
        return EXIT_BACKEND
    if not backend.capabilities.traces and not args.quiet:
        sys.stderr.write(printable(f"backend {backend.name!r} serves no traces (capability traces): only its logits "
                                   "are compared, and no point inside the model can be named") + "\n")
    bar = ProgressBar(sys.stderr, tty=is_tty(sys.stderr), enabled=not args.quiet)
    results, failed = guarded(bar, lambda: explain(
        backend, sets, profile, select=pattern, ids=ids, model=model, rehash=args.rehash,
        progress=lambda done, total, case: bar(done, total, case, None)))
    if failed is not None:
        return failed
    code = EXIT_FAIL if any(r.status in ("diverges", "error") for r in results) else EXIT_OK
    written = [_write(json_path, lambda: _write_json(json_path, results, backend, profile))
               if json_path is not None else True,
               _write(plot_path, lambda: plot_explanations(results, plot_path))
               if plot_path is not None else True,
               _write(html_path, lambda: write_explain_html(
                   results, html_path, backend=backend.name, profile=profile.name)) if html_path is not None else True]
    text = printable("\n".join(console_lines(results, verbose=args.verbose))) + "\n"
    if json_path == "-":
        sys.stderr.write(text)
    else:
        write_stdout(text)
    return code if all(written) else EXIT_USAGE
