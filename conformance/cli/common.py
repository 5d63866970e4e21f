"""What every command of the command line shares: exit codes, one-line errors, standard output that a
closed pipe cannot turn into a pass, report paths checked before a run, and the fixture-set arguments."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from refimpl.arrays import DEVICE_ENV, DEVICES, array_module
from refimpl.errors import InputError
from refimpl.gguf_io import is_gguf

from ..check.runner import load_sets
from ..check.select import CaseFilter, SelectError
from ..check.session import NoCasesSelected
from ..protocol.types import BackendError
from ..registry import parse_option
from ..report import printable
from ..sets import FixtureError, set_paths

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_FIXTURE, EXIT_BACKEND, EXIT_EMPTY = 0, 1, 2, 3, 4, 5


EXIT_WORKER_LOST = 6  # generate: a worker process, Dask worker or the Dask scheduler was lost; finished bases kept


EXIT_PIPE = 141  # standard output was closed early (128 + SIGPIPE); check and selftest keep their verdict


PROG = "conformance"


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


def err(msg: str) -> None:
    sys.stderr.write(printable(f"{PROG}: error: {msg}") + "\n")
    sys.stderr.flush()


def warn(msg: str) -> None:
    sys.stderr.write(printable(f"{PROG}: warning: {msg}") + "\n")
    sys.stderr.flush()


def silence_stdout() -> None:
    """After a broken pipe: point standard output at /dev/null, so that the interpreter's last flush at
    exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def write_stdout(text: str) -> bool:
    """Print ``text`` on standard output; False (and standard output silenced) if the pipe is closed."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
        return True
    except BrokenPipeError:
        silence_stdout()
        return False


class Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so main() returns the exit code."""

    def error(self, message: str):
        raise UsageError(f"{message}\n{self.format_usage().strip()}")


def backend_option(text: str) -> tuple[str, Any]:
    try:
        return parse_option(text)
    except ValueError as e:
        raise UsageError(f"--backend-option {e}") from None


K_HELP = ("only the cases this pytest-style expression selects: words (a substring of the case id, or a feature tag, "
          "kind, entry point or set name) joined by and, or, not and parentheses, e.g. 'last and not embeddings'")
MATCH_HELP = "only the cases whose id matches this regular expression (re.search)"


def add_device(parser, what: str = "the oracle") -> None:
    """--device: where the oracle runs (REFIMPL_DEVICE for the command, ``oracle_device``)."""
    parser.add_argument("--device", choices=DEVICES, default=None,
                        help=f"where {what} runs: cpu (NumPy; the default, or REFIMPL_DEVICE's) or cuda (CuPy on a "
                             "GPU, the same float64 formulas; pip install 'gemma4-conformance[cuda12]' or '[cuda13]'; "
                             "docs/refimpl.md, 'GPU'). A backend under test keeps its own device")


@contextlib.contextmanager
def oracle_device(device: str | None):
    """REFIMPL_DEVICE = ``device`` while a command runs, so that every oracle it builds (in this process and in
    its worker processes) takes it; checked first: no CuPy or no GPU is a UsageError (one line, exit 2) before
    anything is read or written. None leaves the environment as it is."""
    if device is None:
        yield
        return
    try:
        array_module(device)
    except InputError as e:
        raise UsageError(str(e)) from None
    before = os.environ.get(DEVICE_ENV)
    os.environ[DEVICE_ENV] = device
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DEVICE_ENV, None)
        else:
            os.environ[DEVICE_ENV] = before


def add_selection(parser) -> None:
    """-k EXPRESSION and --match REGEX (conformance.check.select)."""
    parser.add_argument("-k", metavar="EXPRESSION", help=K_HELP)
    parser.add_argument("--match", metavar="REGEX", help=MATCH_HELP)


def compile_k(args) -> CaseFilter | None:
    """The case filter of -k and --match (None: every case); UsageError for an unreadable one."""
    try:
        chosen = CaseFilter(args.k, getattr(args, "match", None))
    except SelectError as e:
        raise UsageError(str(e)) from None
    return None if chosen.empty else chosen


def fixture_paths(dirs: Sequence[str] | None) -> list[Path]:
    """--fixtures arguments as fixture-set directories; a directory holding sets expands to them."""
    try:
        return set_paths(dirs, "--fixtures")
    except ValueError as e:
        raise UsageError(str(e)) from None


def output_path(flag: str, value: str | None) -> str | None:
    """A report path (--json, --junit-xml, --html, ...) checked before the run: ``-`` (standard output), or a
    file in an existing directory that can be written: opened for appending (which changes nothing in it) and, if
    it was not there, removed again, so that /sys, /proc and read-only mounts fail here, before any case runs."""
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
    if path.exists() and not path.is_file():
        return value  # a device or a named pipe: opening it here could block or consume it
    existed = path.exists()
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise UsageError(f"{flag}: {value} cannot be written ({e.strerror or e})") from None
    if not existed:
        path.unlink(missing_ok=True)
    return value


def concurrency_count(value: str) -> int:
    """An argparse type: how many requests at a time, an integer in [1, 256]."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 256, got {value!r}")
    return n


def positive_seconds(value: str) -> float:
    """An argparse type: a finite positive number of seconds."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return seconds


def refuse_gguf(value: str | None, flag: str = "--drafter") -> None:
    """UsageError for a GGUF file given as the MTP drafter of a set (sets record the drafter as a checkpoint
    directory; the oracle itself reads a drafter GGUF: refimpl.assistant.Drafter)."""
    if value is not None and is_gguf(value):
        raise UsageError(f"{flag} {value}: a GGUF file; a set's MTP drafter is a checkpoint directory (config.json "
                         "and safetensors); the oracle reads a drafter GGUF with refimpl.assistant.Drafter")


def model_dir_arg(value: str | None, flag: str = "--model") -> str | None:
    """--model DIR (or --drafter DIR) of check and verify: an existing directory, or for --model the GGUF file a
    set was made from (UsageError otherwise), or None."""
    if value is not None and flag == "--model" and Path(value).is_file() and is_gguf(value):
        return value
    if flag != "--model":
        refuse_gguf(value, flag)
    if value is not None and not Path(value).is_dir():
        raise UsageError(f"{flag}: no such directory: {value}")
    return value


def load_fixture_sets(args, on_error: Callable[[str, str], None] | None = None):
    """The fixture sets named by --fixtures (default: the bundled ones), verified; None after printing
    the integrity error (and handing it to ``on_error(reason, message)``, for the reports)."""

    try:
        return load_sets(fixture_paths(args.fixtures))
    except FixtureError as e:
        err(f"fixture integrity: {e}")
        if on_error is not None:
            on_error("fixture", f"fixture integrity: {e}")
        return None


def guarded(bar, work, on_error: Callable[[str, str], None] | None = None):
    """Run ``work()`` under a progress bar: (result, None), or (None, exit code) with one error line for
    an empty selection, a broken fixture set or a backend that cannot be loaded (handed to ``on_error(reason,
    message)`` too, for the reports)."""

    try:
        return work(), None
    except (NoCasesSelected, FixtureError, BackendError) as e:
        bar.close()
        if isinstance(e, NoCasesSelected):
            reason, code, message = "empty", EXIT_EMPTY, str(e)
        elif isinstance(e, FixtureError):
            reason, code, message = "fixture", EXIT_FIXTURE, f"fixture integrity: {e}"
        else:
            reason, code, message = "backend", EXIT_BACKEND, str(e)
        err(message)
        if on_error is not None:
            on_error(reason, message)
        return None, code
    finally:
        bar.close()


def needs_logits(backend, command: str) -> str | None:
    """Why ``command`` (explain, loss: they compare whole logits rows) cannot run ``backend``: one that answers
    top-k logprobs (a server); None for any other."""
    if not getattr(getattr(backend, "capabilities", None), "top_logprobs", False):
        return None
    return (f"backend {backend.name!r} answers top-k logprobs, not logits (capability top_logprobs): {command} "
            "compares whole logits rows; conformance check grades its rows")


def shutdown_backend(backend) -> None:
    """End a backend's engine process now (the subprocess protocol's ``shutdown``, a grace period, then a kill)
    rather than whenever the backend object is collected; an in-process backend has nothing to end."""
    shutdown = getattr(backend, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - the verdict is made; ending the engine cannot change it
            pass
