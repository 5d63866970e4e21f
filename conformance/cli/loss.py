"""``conformance loss``: the quantisation loss on the same rows (a quantised set against the unquantised set of the
same model; with --backend, the engine against both)."""

from __future__ import annotations

import json
import sys

from ..check.runner import load_sets
from ..explain.plot import INSTALL, plot_available
from ..loss import LossError, Thresholds, loss_run
from ..loss.plot import plot_loss
from ..loss.report import console_lines, loss_json, loss_markdown
from ..protocol.types import BackendError
from ..registry import load_backend
from ..report import ProgressBar, is_tty, printable
from ..sets.format import FixtureError
from .common import (
    EXIT_BACKEND,
    EXIT_FIXTURE,
    EXIT_USAGE,
    UsageError,
    backend_option,
    compile_k,
    err,
    fixture_paths,
    model_dir_arg,
    needs_logits,
    output_path,
    shutdown_backend,
    write_stdout,
)

__all__ = ["add_loss_options", "cmd_loss"]


def add_loss_options(p) -> None:
    p.add_argument("--fixtures", required=True, metavar="DIR", help="the quantised set (made from the quantised "
                   "checkpoint, e.g. generate --model FILE.gguf)")
    p.add_argument("--reference", required=True, metavar="DIR",
                   help="the unquantised set of the same model with the same cases (for a QAT checkpoint: the set "
                        "of its QAT bf16 checkpoint, not of the original model; docs/quantised.md)")
    p.add_argument("--backend", metavar="NAME|module:attr",
                   help="also run the quantised set's cases on this backend and compare its rows with both oracles")
    p.add_argument("--backend-option", action="append", metavar="KEY=VALUE",
                   help="keyword argument for the backend's class or factory (repeatable)")
    p.add_argument("--model", metavar="DIR", help="the quantised set's checkpoint, where it is not at the "
                   "recorded path")
    p.add_argument("--json", metavar="FILE", help="write the JSON report; - for standard output")
    p.add_argument("--summary-md", metavar="FILE", help="write the report as Markdown; - for standard output")
    p.add_argument("--plot", metavar="OUT.png", help="draw the loss of every row and case (needs matplotlib: the "
                   "plot extra)")
    for flag, what in (("--max-kl", "mean KL over every row"), ("--max-kl-p99", "99th percentile of the rows' KL"),
                       ("--min-top1", "percent of rows whose top-1 token is the reference's"),
                       ("--max-dp-rms", "RMS of the rows' delta_p")):
        p.add_argument(flag, type=float, metavar="X", help=f"a limit on the {what}, for every comparison against "
                       "the reference: any limit makes the report a verdict (exit 1 when one is exceeded)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")


def _outputs(args) -> tuple[str | None, str | None, str | None]:
    json_path, md_path = output_path("--json", args.json), output_path("--summary-md", args.summary_md)
    plot_path = output_path("--plot", args.plot)
    if json_path == "-" and md_path == "-":
        raise UsageError("only one of --json and --summary-md can go to standard output (-)")
    if plot_path == "-":
        raise UsageError("--plot needs a file name (a PNG), not standard output")
    if plot_path is not None and not plot_available():
        raise UsageError(INSTALL.replace("--plot", "loss --plot"))
    return json_path, md_path, plot_path


def _one_set(flag: str, path: str):
    sets = load_sets(fixture_paths([path]))
    if len(sets) != 1:
        raise UsageError(f"{flag} {path}: names {len(sets)} fixture sets; give one set's directory")
    return sets[0]


def _write(path: str | None, text: str) -> bool:
    if path is None:
        return True
    if path == "-":
        write_stdout(text)
        return True
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        err(f"cannot write {path}: {e.strerror or e}")
        return False
    sys.stderr.write(printable(f"wrote {path}") + "\n")
    return True


def cmd_loss(args, argv: list[str] | None = None) -> int:
    chosen = compile_k(args)
    json_path, md_path, plot_path = _outputs(args)
    limits = Thresholds(args.max_kl, args.max_kl_p99, args.min_top1, args.max_dp_rms)
    options = dict(backend_option(o) for o in args.backend_option or [])
    if options and args.backend is None:
        raise UsageError("--backend-option needs --backend")
    model = model_dir_arg(args.model)
    try:
        quantised, reference = _one_set("--fixtures", args.fixtures), _one_set("--reference", args.reference)
    except FixtureError as e:
        err(f"fixture integrity: {e}")
        return EXIT_FIXTURE
    backend = None
    if args.backend is not None:
        try:
            backend = load_backend(args.backend, **options)
        except BackendError as e:
            err(str(e))
            return EXIT_BACKEND
        if (why := needs_logits(backend, "loss")) is not None:
            err(why)
            shutdown_backend(backend)
            return EXIT_BACKEND
    bar = ProgressBar(sys.stderr, tty=is_tty(sys.stderr), enabled=not args.quiet)
    try:
        run = loss_run(quantised, reference, backend, model=model, thresholds=limits,
                       select=None if chosen is None else (lambda case: chosen(case, quantised.name)),
                       progress=lambda done, total, case: bar(done, total, case, None))
    except LossError as e:
        raise UsageError(str(e)) from None
    except FixtureError as e:
        err(f"fixture integrity: {e}")
        return EXIT_FIXTURE
    except BackendError as e:
        err(str(e))
        return EXIT_BACKEND
    finally:
        bar.close()
        shutdown_backend(backend)  # an engine process ends now (the subprocess protocol)
    written = [_write(json_path, json.dumps(loss_json(run, argv), indent=1, allow_nan=False) + "\n"),
               _write(md_path, loss_markdown(run))]
    if plot_path is not None:
        sys.stderr.write(printable(f"wrote {plot_loss(run, plot_path)}") + "\n")
    text = printable("\n".join(console_lines(run))) + "\n"
    if "-" in (json_path, md_path):
        sys.stderr.write(text)
    else:
        write_stdout(text)
    return run.exit_code if all(written) else EXIT_USAGE
