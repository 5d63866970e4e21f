"""The report files of ``conformance check``: the JSON report, JUnit XML, the Markdown summary, the HTML page
and a GitHub Actions job summary, written once the run has a verdict, and written too when the run cannot
start or go on (a broken fixture set, a backend that cannot be loaded or opened): the error is then the
reports' one entry, so that CI shows it rather than "no test results". Before the first case, the JSON report
and the JUnit XML already hold an "unfinished" run, which stays should the process end before the verdict."""

from __future__ import annotations

import datetime as _dt
import os
import sys
from typing import Any, Callable

from ..check.results import RunResult, aborted_run
from ..report import printable, write_json, write_junit
from ..report.markdown import append_summary, write_summary
from .common import EXIT_USAGE, err, silence_stdout

__all__ = ["Reports"]

UNFINISHED = ("the run did not finish: the process ended before the verdict (a crash, a kill, or a backend that "
              "ended the process); this report was written before the first case")


class Reports:
    """The report paths of one check run (None: not asked for; ``-``: standard output)."""

    def __init__(self, args, argv: list[str], paths: dict[str, str | None], html: Callable | None = None):
        self.args, self.argv, self.paths, self.html = args, list(argv), paths, html
        self.started = _dt.datetime.now(_dt.timezone.utc)
        self.backend: dict[str, Any] = {"name": args.backend, "capabilities": {}, "options": {}}
        self.profile = None

    @property
    def to_stdout(self) -> bool:
        return "-" in self.paths.values()

    def _writers(self, result: RunResult, final: bool):
        p = self.paths
        yield p.get("json"), lambda path: write_json(result, path, argv=self.argv), "JSON report"
        yield p.get("junit"), lambda path: write_junit(result, path, self.args.junit_properties), "JUnit XML"
        if not final:
            return
        yield p.get("summary"), lambda path: write_summary(result, path), "Markdown summary"
        if self.html is not None:
            yield p.get("html"), lambda path: self.html(result, path), "HTML report"
        yield os.environ.get("GITHUB_STEP_SUMMARY") or None, lambda path: append_summary(result, path), ("the job "
                                                                                                         "summary")

    def unfinished(self, backend: dict[str, Any], profile) -> None:
        """Before the first case: the JSON report and JUnit XML files say the run did not finish."""
        self.backend, self.profile = backend, profile
        result = aborted_run(backend, profile, [], "unfinished", UNFINISHED, self.started)
        for path, write, _ in self._writers(result, final=False):
            if path not in (None, "-"):
                try:
                    write(path)
                except OSError:
                    pass  # said at the end, when the real report cannot be written either

    def aborted(self, reason: str, message: str) -> int:
        """Write every report of a run that could not start or go on; its exit code."""
        result = aborted_run(self.backend, self.profile, [], reason, message, self.started,
                             select=getattr(self.args, "k", None))
        return self.write(result) or result.exit_code

    def write(self, result: RunResult) -> int:
        """Write every report asked for, files first, standard output last (a reader that stops early loses
        nothing that went to a file); 0, or EXIT_USAGE when one could not be written (said on stderr)."""
        failed = 0
        for path, write, what in sorted(self._writers(result, final=True), key=lambda w: w[0] == "-"):
            if path is None:
                continue
            try:
                written = write(path)
            except BrokenPipeError:
                silence_stdout()
                continue
            except OSError as e:
                err(f"cannot write the {what} {path}: {e.strerror or e}")
                failed = EXIT_USAGE
                continue
            if path != "-":
                sys.stderr.write(printable(f"wrote {what} {written}") + "\n")
        return failed
