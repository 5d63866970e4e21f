"""``conformance``: the conformance gate's command line (check, list, generate, verify, selftest,
scoreboard).

    conformance check --backend NAME|module:attr [--fixtures DIR ...] [--profile P]
                      [--expectations FILE | --no-shipped-expectations] [-k REGEX]
                      [--json FILE] [--junit-xml FILE] [--backend-option KEY=VALUE ...] [-q] [-v]
    conformance list backends|cases|profiles [--fixtures DIR ...] [-k REGEX]
    conformance generate (--model DIR | --preset NAME [--seed N]) [--prompts FILE.jsonl] --out DIR
                         [--name N] [--version V] [--cases auto|text|images|audio|all] [--image FILE ...]
                         [--audio FILE.wav ...] [--workers N | --cluster ADDRESS]
    conformance verify DIR ... [--recompute]
    conformance selftest [--fixtures DIR ...] [--mutant REGEX] [-k REGEX] [--json FILE] [-q]
    conformance scoreboard REPORT.json ... [--out FILE.md | --into PAGE.md] [--title T]

Exit codes: 0 all selected cases pass (xfail, skipped and not-claimed allowed); 1 some case is fail,
error or xpass; 2 usage error (bad arguments, bad expectations file, unknown profile, bad regex);
3 fixture integrity error; 4 backend error (cannot be found, loaded or opened); 5 no case run (-k
matched no case, or every selected case is not claimed or skipped). User errors print one
``conformance: error:`` line, never a traceback. See docs/conformance.md.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from .report import printable
from .runner import interrupt_signal, stop_signals

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_FIXTURE, EXIT_BACKEND, EXIT_EMPTY = 0, 1, 2, 3, 4, 5
EXIT_PIPE = 141  # standard output was closed early (128 + SIGPIPE); check and selftest keep their verdict
PROG = "conformance"


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


def _err(msg: str) -> None:
    sys.stderr.write(printable(f"{PROG}: error: {msg}") + "\n")
    sys.stderr.flush()


def _warn(msg: str) -> None:
    sys.stderr.write(printable(f"{PROG}: warning: {msg}") + "\n")
    sys.stderr.flush()


def _silence_stdout() -> None:
    """After a broken pipe: point standard output at /dev/null, so that the interpreter's last flush at
    exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _stdout(text: str) -> bool:
    """Print ``text`` on standard output; False (and standard output silenced) if the pipe is closed."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
        return True
    except BrokenPipeError:
        _silence_stdout()
        return False


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so main() returns the exit code."""

    def error(self, message: str):  # noqa: D401
        raise UsageError(f"{message}\n{self.format_usage().strip()}")


# ----------------------------------------------------------------------------------------------
# argument helpers


def _parse_option(text: str) -> tuple[str, Any]:
    from .registry import parse_option

    try:
        return parse_option(text)
    except ValueError as e:
        raise UsageError(f"--backend-option {e}") from None


def _compile(regex: str | None) -> re.Pattern | None:
    if regex is None:
        return None
    try:
        return re.compile(regex)
    except re.error as e:
        raise UsageError(f"-k: not a valid regular expression ({e}): {regex!r}") from None


def _set_paths(dirs: Sequence[str] | None) -> list[Path]:
    """--fixtures arguments as fixture-set directories; a directory holding sets expands to them."""
    from .fixtures import bundled_sets

    if not dirs:
        paths = [Path(p) for p in bundled_sets()]
        if not paths:
            raise UsageError("no bundled fixture sets are installed; pass --fixtures DIR")
        return paths
    out: list[Path] = []
    for d in dirs:
        p = Path(d)
        if not p.exists():
            raise UsageError(f"--fixtures: no such directory: {d}")
        if not p.is_dir():
            raise UsageError(f"--fixtures: not a directory: {d}")
        if (p / "manifest.json").exists():
            out.append(p)
            continue
        subs = sorted(s for s in p.iterdir() if s.is_dir() and (s / "manifest.json").exists())
        out.extend(subs if subs else [p])  # an empty directory: load_set says what is missing
    return out


def _output_path(flag: str, value: str | None) -> str | None:
    """A report path (--json, --junit-xml) checked before the run: ``-`` (standard output), or a file
    in an existing directory that can be written."""
    if value is None or value == "-":
        return value
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{flag}: {value} is a directory; give a file name (or - for standard output)")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{flag}: the directory {parent} does not exist (create it first, or give - for "
                         "standard output)")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag}: {value} cannot be written (permission denied)")
    return value


def _timeout(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return seconds


def _profiles() -> dict[str, Any]:
    from .profiles import PROFILES

    return dict(PROFILES)


# ----------------------------------------------------------------------------------------------
# check


def _load_sets(args):
    """The fixture sets named by --fixtures (default: the bundled ones), verified; None after printing
    the integrity error."""
    from .fixtures import FixtureError
    from .runner import load_sets

    try:
        return load_sets(_set_paths(args.fixtures))
    except FixtureError as e:
        _err(f"fixture integrity: {e}")
        return None


def _guarded(bar, work):
    """Run ``work()`` under a progress bar: (result, None), or (None, exit code) with one error line for
    an empty selection, a broken fixture set or a backend that cannot be loaded."""
    from .backend import BackendError
    from .fixtures import FixtureError
    from .runner import NoCasesSelected

    try:
        return work(), None
    except (NoCasesSelected, FixtureError, BackendError) as e:
        bar.close()
        if isinstance(e, NoCasesSelected):
            _err(str(e))
            return None, EXIT_EMPTY
        if isinstance(e, FixtureError):
            _err(f"fixture integrity: {e}")
            return None, EXIT_FIXTURE
        _err(str(e))
        return None, EXIT_BACKEND
    finally:
        bar.close()


def _load_checked_backend(args, options: dict[str, Any]):
    """The backend of --backend: in this process, or with --isolate in a child process behind the
    protocol server (BackendError if it cannot be loaded)."""
    from .registry import load_backend

    if not args.isolate:
        return load_backend(args.backend, **options)
    from .backends.subprocess_backend import IsolatedBackend

    # no limit on a run unless --case-timeout sets one; the child's start includes importing the engine
    return IsolatedBackend(args.backend, options, timeout=1e9, startup_timeout=300.0)


def cmd_check(args, argv: Sequence[str]) -> int:
    from .backend import BackendError
    from .expectations import ExpectationsError, load as load_expectations
    from .report import ProgressBar, console_summary, is_tty, write_json, write_junit
    from .runner import run

    pattern = _compile(args.k)
    options = dict(_parse_option(o) for o in args.backend_option or [])
    profiles = _profiles()
    if args.profile is not None and args.profile not in profiles:
        raise UsageError(f"unknown profile {args.profile!r}; choose one of {', '.join(profiles)}")
    json_path = _output_path("--json", args.json)
    junit_path = _output_path("--junit-xml", args.junit_xml)
    if json_path == "-" and junit_path == "-":
        raise UsageError("--json - and --junit-xml - cannot both go to standard output")
    expectations = None
    if args.expectations:
        try:
            expectations = load_expectations(args.expectations)
        except ExpectationsError as e:
            raise UsageError(str(e)) from None

    sets = _load_sets(args)
    if sets is None:
        return EXIT_FIXTURE

    try:
        backend = _load_checked_backend(args, options)
    except BackendError as e:
        _err(str(e))
        return EXIT_BACKEND
    profile_name = args.profile or backend.capabilities.default_profile
    if profile_name not in profiles:
        _err(f"backend {backend.name!r} declares default_profile {profile_name!r}, which is not a known "
             f"profile ({', '.join(profiles)}); pass --profile")
        return EXIT_BACKEND
    profile = profiles[profile_name]
    if expectations is None and not args.no_shipped_expectations:
        shipped = getattr(backend, "expectations_file", None)
        if shipped is not None:
            try:
                expectations = load_expectations(shipped)
            except ExpectationsError as e:
                _err(f"backend {backend.name!r} ships a broken expectations file: {e}")
                return EXIT_BACKEND
            if not args.quiet:
                sys.stderr.write(printable(f"using the expectations shipped with backend {backend.name!r}: "
                                           f"{shipped} ({len(expectations.entries)} entries; "
                                           "--no-shipped-expectations to ignore)") + "\n")
    if expectations is not None and expectations.backend and expectations.backend != backend.name:
        _warn(f"the expectations file is for backend {expectations.backend!r}, running {backend.name!r}")

    bar = ProgressBar(sys.stderr, tty=is_tty(sys.stderr), enabled=not args.quiet)
    result, failed = _guarded(bar, lambda: run(backend, sets, profile, expectations, pattern, bar,
                                               backend_options=options, case_timeout=args.case_timeout))
    if failed is not None:
        return failed

    code = result.exit_code
    if result.interrupted is not None:
        _err(f"{result.interrupted['message']}; writing the report of the {len(result.cases)} finished "
             f"case{'s' if len(result.cases) != 1 else ''}")
    # files first, standard output last: a reader that stops early loses nothing that went to a file
    writers = ((json_path, lambda p: write_json(result, p, argv=list(argv)), "JSON report"),
               (junit_path, lambda p: write_junit(result, p), "JUnit XML"))
    for path, write, what in sorted(writers, key=lambda w: w[0] == "-"):
        if path is None:
            continue
        try:
            written = write(path)
        except BrokenPipeError:
            _silence_stdout()
            continue
        except OSError as e:
            _err(f"cannot write the {what} {path}: {e.strerror or e}")
            code = code or EXIT_USAGE
            continue
        if path != "-":
            sys.stderr.write(printable(f"wrote {what} {written}") + "\n")
    summary = printable(console_summary(result, verbose=args.verbose)) + "\n"
    if "-" in (json_path, junit_path):  # standard output carries the report: the summary goes to stderr
        sys.stderr.write(summary)
    else:
        _stdout(summary)
    return code


# ----------------------------------------------------------------------------------------------
# list


def cmd_list(args) -> int:
    if args.what == "backends":
        from .registry import available_backends

        found = available_backends()
        if not found:
            print("(no registered backends; give a Python object as module:attr)")
        w = max((len(n) for n in found), default=0)
        for name, target in found.items():
            print(f"{name.ljust(w)}  {target}")
        return EXIT_OK
    if args.what == "profiles":
        for name, p in _profiles().items():
            desc = getattr(p, "description", "")
            print(f"{name}: {desc}")
            print(f"    max_abs {p.max_abs:g}, max_rel {p.max_rel:g}, nmse {p.nmse:g}, cosine >= 1-{1 - p.cosine_min:.3g}, "
                  f"kl_max {p.kl_max:g}, kl_mean {p.kl_mean:g}, delta_p {p.delta_p:g}, "
                  f"top-{p.topk} overlap {p.topk_overlap_min:g}, tie_margin {p.tie_margin:g}, "
                  f"identity_ratio {p.identity_ratio:g}")
        return EXIT_OK
    # cases
    from .fixtures import FixtureError
    from .runner import entry_point, load_sets

    pattern = _compile(args.k)
    try:
        sets = load_sets(_set_paths(args.fixtures))
    except FixtureError as e:
        _err(f"fixture integrity: {e}")
        return EXIT_FIXTURE
    n = 0
    for fs in sets:
        for c in fs.cases:
            if pattern is not None and not pattern.search(c.id):
                continue
            n += 1
            print(printable(f"{c.id}  [{entry_point(c)}] {','.join(c.features)}"))
    sys.stderr.write(f"{n} case(s) in {len(sets)} fixture set(s)\n")
    return EXIT_OK if n else EXIT_EMPTY


# ----------------------------------------------------------------------------------------------
# generate / verify


class _GenerateProgress:
    """Progress for fixtures.generate_set: accepts (message), (done, total) or (done, total, message)."""

    def __init__(self, enabled: bool):
        from .report import ProgressBar, is_tty

        self.bar = ProgressBar(sys.stderr, tty=is_tty(sys.stderr), enabled=enabled)

    def __call__(self, *args, **kwargs) -> None:
        nums = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        texts = [str(a) for a in args if isinstance(a, str)] + [str(v) for v in kwargs.values() if isinstance(v, str)]
        text = " ".join(texts)
        if len(nums) >= 2:
            done, total = nums[0], nums[1]
            if self.bar.tty:
                self.bar(done, total, text)
            else:
                self.bar.message(f"[{done}/{total}] {text}".rstrip())
        elif text:
            self.bar.message(text)

    def close(self) -> None:
        self.bar.close()


def _resume_hint(out: str) -> str:
    """' (N finished bases are kept in DIR; ...)' when a failed generate left a partial run, else ''."""
    from .fixtures import publish_path
    from .parallel import PartialRun, partial_dir

    try:
        path = partial_dir(publish_path(out))
    except ValueError:
        return ""
    try:
        n = len(PartialRun(path, "", {}, False).finished()) if path.is_dir() else 0
    except OSError:
        n = 0
    return (f" ({n} finished base{'s' if n != 1 else ''} kept in {path}; run the same command again to resume)"
            if n else "")


def cmd_generate(args) -> int:
    from .fixtures import FixtureError, PartialRunBusy, PartialRunMismatch, generate_set

    if (args.model is None) == (args.preset is None):
        raise UsageError("give exactly one of --model DIR or --preset NAME")
    if args.model is not None and args.seed is not None:
        raise UsageError("--seed applies to --preset only")
    if args.workers is not None and args.cluster is not None:
        raise UsageError("--workers and --cluster exclude each other: --cluster runs the jobs on the Dask "
                         "cluster's workers")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    if args.prompts is not None and not Path(args.prompts).is_file():
        raise UsageError(f"--prompts: no such file: {args.prompts}")
    if args.model is not None and not Path(args.model).is_dir():
        raise UsageError(f"--model: no such directory: {args.model}")
    for flag, paths in (("--image", args.image), ("--audio", args.audio)):
        for path in paths or ():
            if not Path(path).is_file():
                raise UsageError(f"{flag}: no such file: {path}")
    out_path = Path(args.out)
    if out_path.exists() and not (out_path.is_dir() and not any(out_path.iterdir())):
        raise UsageError(f"--out: {args.out} already exists; a fixture set is never overwritten "
                         "(choose a new directory, e.g. with a new version)")
    progress = _GenerateProgress(enabled=not args.quiet)
    kw: dict[str, Any] = {"model_dir": args.model, "preset": args.preset, "seed": args.seed or 0,
                          "prompts": args.prompts, "name": args.name, "progress": progress,
                          "cases": args.cases, "images": args.image or None, "audio": args.audio or None,
                          "workers": args.workers, "cluster": args.cluster}
    if args.version is not None:
        kw["version"] = args.version
    try:
        out = generate_set(args.out, **kw)
    except (PartialRunMismatch, PartialRunBusy) as e:
        progress.close()
        raise UsageError(str(e)) from None
    except FixtureError as e:
        progress.close()
        _err(f"{e}{_resume_hint(args.out)}")
        return EXIT_FIXTURE
    except (ValueError, FileExistsError, OSError) as e:
        progress.close()
        raise UsageError(f"{e}{_resume_hint(args.out)}") from None
    except KeyboardInterrupt as e:
        progress.close()
        _err(f"interrupted{_resume_hint(args.out)}")
        return 128 + interrupt_signal(e)
    except Exception as e:  # noqa: BLE001 - refimpl errors (bad checkpoint, bad prompts) are user errors
        progress.close()
        from refimpl.errors import RefimplError

        if isinstance(e, RefimplError):
            raise UsageError(f"{e}{_resume_hint(args.out)}") from None
        raise
    progress.close()
    print(f"wrote fixture set {out}")
    return EXIT_OK


def cmd_verify(args) -> int:
    from .fixtures import verify_set

    bad = 0
    for d in args.dirs:
        p = Path(d)
        if not p.is_dir():
            problems = [f"no such directory: {d}"]
        elif args.recompute:
            problems = list(verify_set(p, recompute=True))
        else:
            problems = list(verify_set(p))
        if problems:
            bad += 1
            print(f"{d}: {len(problems)} problem(s)")
            for prob in problems:
                print(printable(f"  - {prob}"))
        else:
            print(f"{d}: ok")
    return EXIT_FIXTURE if bad else EXIT_OK


# ----------------------------------------------------------------------------------------------
# selftest


class _SelftestProgress:
    """Progress for selftest.run_selftest: the bar on a terminal, one line per backend otherwise."""

    def __init__(self, enabled: bool):
        from .report import ProgressBar, is_tty

        self.bar = ProgressBar(sys.stderr, tty=is_tty(sys.stderr), enabled=enabled)

    def __call__(self, done: int, total: int, label: str, result: Any) -> None:
        from .runner import CaseResult
        from .selftest import ControlResult, MutantResult

        if result is None or isinstance(result, CaseResult):
            if self.bar.tty:
                self.bar(done, total, label)
            return
        if isinstance(result, ControlResult):
            v = result.verdict
            state = "ERROR" if result.error else ("pass" if result.passed else "FAILED")
            extra = f" (first failing: {v.first_case} [{v.check}])" if v.killed else ""
            line = (f"control {result.backend} at {result.profile}: {state}, {v.cases_run - v.failing_cases}/"
                    f"{v.cases_run} cases pass{extra} ({result.duration:.1f}s)")
        elif isinstance(result, MutantResult):
            if result.error is not None:
                state = f"ERROR {result.error}"
            elif result.killed:
                case, check = result.caught_by
                mark = "" if result.matching else " (not a matching check)"
                state = f"killed by {check}{mark} ({result.verdict.failing_cases} cases; first {case})"
            else:
                state = "SURVIVED"
            line = f"mutant {result.name} [{result.bug_class}]: {state} ({result.duration:.1f}s)"
        else:  # pragma: no cover
            return
        self.bar.message(line)

    def close(self) -> None:
        self.bar.close()


def cmd_selftest(args, argv: Sequence[str]) -> int:
    from . import selftest as st

    pattern = _compile(args.k)
    json_path = _output_path("--json", args.json)
    try:
        mutant_pattern = re.compile(args.mutant) if args.mutant is not None else None
    except re.error as e:
        raise UsageError(f"--mutant: not a valid regular expression ({e}): {args.mutant!r}") from None

    sets = _load_sets(args)
    if sets is None:
        return EXIT_FIXTURE

    try:
        every = st.load_mutants()
    except ImportError as e:
        _err(f"the mutants (conformance.mutants) cannot be imported: {type(e).__name__}: {e}")
        return EXIT_BACKEND
    mutants = st.select_mutants(every, mutant_pattern)
    equivalents = st.select_equivalents(st.load_equivalents(), mutant_pattern)
    if not mutants and not equivalents:
        raise UsageError(f"--mutant {args.mutant!r} matches none of the {len(every)} mutants: "
                         + ", ".join(m.name for m in every))

    bar = _SelftestProgress(enabled=not args.quiet)
    result, failed = _guarded(bar, lambda: st.run_selftest(sets, mutants, select=pattern, progress=bar,
                                                           equivalents=equivalents))
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
        _stdout(summary)  # a closed pipe changes nothing: the verdict is the exit code
    return result.exit_code


def cmd_scoreboard(args) -> int:
    from .scoreboard import ScoreboardError, load_report, render

    try:
        text = render([load_report(p) for p in args.reports], title=args.title)
    except ScoreboardError as e:
        raise UsageError(str(e)) from None
    if args.into:
        from .scoreboard import embed

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


# ----------------------------------------------------------------------------------------------
# parser and main


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Conformance gate for Gemma 4 inference engines against the exact "
                                       "float64 refimpl oracle. See docs/conformance.md.")
    sub = p.add_subparsers(dest="command", metavar="{check,list,generate,verify,selftest,scoreboard}", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser("check", help="run the fixture sets' cases on a backend and grade them",
                       description="Run the selected cases of the fixture sets on a backend and grade every "
                                   "returned logits row against the oracle's float64 rows. Exit codes: 0 pass, "
                                   "1 fail/error/xpass, 2 usage, 3 fixture integrity, 4 backend, 5 no case run.")
    c.add_argument("--backend", required=True, metavar="NAME|module:attr",
                   help="a registered backend name (see 'conformance list backends') or module:attr")
    c.add_argument("--fixtures", nargs="+", action="extend", metavar="DIR",
                   help="fixture set directories, or directories holding sets (default: the bundled sets)")
    c.add_argument("--profile", metavar="P", help="grading profile (default: the backend's default_profile)")
    c.add_argument("--expectations", metavar="FILE", help="expectations file (JSON, or TOML for *.toml); "
                   "default: the file the backend ships for its configuration, if any")
    c.add_argument("--no-shipped-expectations", action="store_true",
                   help="grade without the expectations file the backend ships")
    c.add_argument("-k", metavar="REGEX", help="run only the cases whose id matches REGEX (re.search)")
    c.add_argument("--json", metavar="FILE", help="write the JSON report (schema v1); - for standard output")
    c.add_argument("--junit-xml", metavar="FILE", help="write a JUnit XML report; - for standard output")
    c.add_argument("--backend-option", action="append", metavar="KEY=VALUE",
                   help="keyword argument for the backend's class or factory (repeatable)")
    c.add_argument("--isolate", action="store_true",
                   help="run a Python backend in a child process behind the subprocess protocol: a backend that "
                        "exits, crashes or hangs costs one case (an error) and the child is restarted")
    c.add_argument("--case-timeout", type=_timeout, metavar="SECONDS",
                   help="a case whose request takes longer is an error (check 'timeout'); a backend in a child "
                        "process (--isolate, subprocess, llama-cpp) is restarted, an in-process one ends the run")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    c.add_argument("-v", "--verbose", action="store_true", help="details of every failing case, not only the first")

    ls = sub.add_parser("list", help="list backends, cases or profiles")
    ls.add_argument("what", choices=("backends", "cases", "profiles"))
    ls.add_argument("--fixtures", nargs="+", action="extend", metavar="DIR",
                    help="fixture sets for 'list cases' (default: the bundled sets)")
    ls.add_argument("-k", metavar="REGEX", help="only the cases whose id matches REGEX")

    g = sub.add_parser("generate", help="generate a fixture set with the oracle (the only writer of goldens)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a checkpoint directory (config.json, safetensors, tokenizer)")
    src.add_argument("--preset", metavar="NAME", help="a refimpl synthetic preset (see 'refimpl synth')")
    g.add_argument("--seed", type=int, default=None, help="weights seed for --preset (default 0)")
    g.add_argument("--prompts", metavar="FILE.jsonl", help="extra bases from your prompts (one JSON object a line)")
    g.add_argument("--cases", choices=("auto", "text", "images", "audio", "all"), default="auto",
                   help="which case matrix: text, images (image prompts: bases I0, I1), audio (audio prompts: bases "
                        "S0, S1), or all (text plus what the checkpoint's towers allow; auto, the default, is the same)")
    g.add_argument("--image", action="append", metavar="FILE",
                   help="an image for the image bases (repeat for more; PNG/PPM natively, other formats with "
                        "pillow); default: synthetic images")
    g.add_argument("--audio", action="append", metavar="FILE.wav",
                   help="a 16 kHz WAV clip for the audio bases (repeat for more); default: synthetic clips")
    g.add_argument("--out", required=True, metavar="DIR", help="the new set's directory (must not exist)")
    g.add_argument("--name", metavar="N", help="set name (default: the preset or model directory name)")
    g.add_argument("--version", metavar="V", help="set version, semver (default 1.0.0)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, metavar="N",
                       help="local worker processes, one job (base) each at a time (default: the CPU count; 1 runs "
                            "everything in this process)")
    where.add_argument("--cluster", metavar="ADDRESS",
                       help="run the jobs on a Dask distributed cluster: its scheduler's address, e.g. "
                            "tcp://host:8786 (needs gemma4-conformance[cluster]; the model and --out's parent must be "
                            "on storage every worker sees at the same path; docs/distributed-generation.md)")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress output")

    v = sub.add_parser("verify", help="check fixture sets' schema and sha256 digests")
    v.add_argument("dirs", nargs="+", metavar="DIR")
    v.add_argument("--recompute", action="store_true",
                   help="also recompute every base's logits with the oracle (slow for real checkpoints)")

    st = sub.add_parser("selftest", help="check that the gate kills a deliberately broken engine per bug class",
                        description="Run the harness on the unmutated numpy-engine (the control, which must pass "
                                    "every case at exact-f64) and on its mutants (one planted bug each), graded "
                                    "at fp32 (the verdict) and at bf16 and q8 (for information), and print which "
                                    "mutants are killed and by which check. Exit codes: 0 every mutant killed at "
                                    "fp32 by a check that matches its bug, 1 a survivor, a non-matching kill, a "
                                    "broken mutant or a failing control, 2 usage, 3 fixture integrity, 4 backend, "
                                    "5 no case selected. "
                                    "See docs/bug-classes.md.")
    st.add_argument("--fixtures", nargs="+", action="extend", metavar="DIR",
                    help="fixture set directories, or directories holding sets (default: the bundled sets)")
    st.add_argument("--mutant", metavar="REGEX", help="only the mutants whose name matches REGEX (re.search), "
                                                     "or whose bug class is REGEX")
    st.add_argument("-k", metavar="REGEX", help="run only the cases whose id matches REGEX (re.search)")
    st.add_argument("--json", metavar="FILE", help="write the self-test table as JSON")
    st.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    st.add_argument("-v", "--verbose", action="store_true", help="do not wrap the 'breaks' column")

    sb = sub.add_parser("scoreboard", help="a Markdown table of several check reports, one column per run",
                        description="Read JSON reports written by 'conformance check --json' and print a "
                                    "Markdown scoreboard: per run, per entry point and per feature, passed/graded "
                                    "with the worst max_abs and KL, then every case that deviates and why.")
    sb.add_argument("reports", nargs="+", metavar="REPORT.json")
    where = sb.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="FILE.md", help="write to FILE.md instead of standard output")
    where.add_argument("--into", metavar="PAGE.md", help="replace the text between the lines "
                       "'<!-- scoreboard:begin -->' and '<!-- scoreboard:end -->' of PAGE.md")
    sb.add_argument("--title", default="Conformance scoreboard", help="the page title")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help / --version
            return int(e.code or 0) if not isinstance(e.code, str) else EXIT_USAGE
        commands = {"check": lambda: cmd_check(args, argv), "list": lambda: cmd_list(args),
                    "generate": lambda: cmd_generate(args), "verify": lambda: cmd_verify(args),
                    "selftest": lambda: cmd_selftest(args, argv), "scoreboard": lambda: cmd_scoreboard(args)}
        if args.command not in commands:
            raise UsageError(f"unknown command {args.command!r}")
        with stop_signals():  # SIGTERM and SIGHUP end a command as Ctrl-C does
            return commands[args.command]()
    except UsageError as e:
        _err(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        _err(f"interrupted by {e.args[0] if e.args else 'SIGINT'}")
        return 128 + interrupt_signal(e)
    except BrokenPipeError:  # a reader that quit early: the output is incomplete, never a pass
        _silence_stdout()
        return EXIT_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
