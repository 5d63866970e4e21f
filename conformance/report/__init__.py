"""Reports of a check run, machine-readable first: the versioned JSON report and its schema
(``json_report``, ``schemas/report-v1.json``), JUnit XML (``junit``), the console summary and progress bar
(``console``), the Markdown scoreboard of several reports (``scoreboard``), and ``printable`` (``text``) for
text that comes from backends and sets. Reads ``conformance.check``'s result records.

    from conformance.report import write_json, write_junit, console_summary, validate
"""

from .console import ProgressBar, colorize, console_summary, exit_line, failure_details, is_tty, use_color, verdict_line
from .json_report import SCHEMA_PATH, clean, load_schema, to_json, validate, versions, write_json, write_output
from .junit import junit_tree, write_junit
from .text import printable

__all__ = ["SCHEMA_PATH", "ProgressBar", "clean", "colorize", "console_summary", "exit_line", "failure_details",
           "is_tty", "use_color", "verdict_line",
           "junit_tree", "load_schema", "printable", "to_json", "validate", "versions", "write_json", "write_junit",
           "write_output"]
