"""The quantisation loss on the same rows (``conformance loss``): a quantised set against the unquantised set of
the same model, and an engine against both (docs/quantised.md, "The quantisation loss")."""

from .compare import COMPARISONS, CaseLoss, LossError, LossRun, Thresholds, loss_run, pair_cases, row_losses, summarise

__all__ = ["COMPARISONS", "CaseLoss", "LossError", "LossRun", "Thresholds", "loss_run", "pair_cases", "row_losses",
           "summarise"]
