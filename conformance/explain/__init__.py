"""``conformance explain``: where a backend first leaves the oracle, point by point inside the model
(``run.py``), and a picture of it (``plot.py``). See docs/conformance.md, "Explaining a failure"."""

from .plot import plot_explanations
from .run import CaseExplanation, ReportError, console_lines, explain, explain_json, failed_in_report, row_roles

__all__ = ["CaseExplanation", "ReportError", "console_lines", "explain", "explain_json", "failed_in_report",
           "plot_explanations", "row_roles"]
