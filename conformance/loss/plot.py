"""``conformance loss --plot``: the loss of every row and case as a picture (matplotlib, the optional ``plot``
extra, imported only here and only when asked for)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .compare import COMPARISONS, LossRun

__all__ = ["plot_loss"]

COLOURS = {"quantisation": "tab:blue", "engine-vs-reference": "tab:orange", "engine-vs-quantised": "tab:green"}
KL_FLOOR = 1e-12  # rows that agree exactly sit here on the log axes


def plot_loss(run: LossRun, path: str | Path) -> Path:
    """Two panels: the distribution of every row's KL per comparison (the share of rows at or below each KL,
    log axis), and each case's mean KL (log axis) in the report's case order. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in COMPARISONS if n in run.rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names:
        kl = np.sort(np.maximum(run.rows[name]["kl"], KL_FLOOR))
        share = np.arange(1, len(kl) + 1) / len(kl)
        t = run.total[name]
        left.step(kl, share, where="post", color=COLOURS[name],
                  label=f"{name} (mean {t['kl_mean']:.3g}, same top-1 {t['top1_same_pct']:.1f}%)")
        xs = [i for i, c in enumerate(run.cases) if name in c.loss]
        ys = [max(run.cases[i].loss[name]["kl_mean"], KL_FLOOR) for i in xs]
        right.plot(xs, ys, "o", ms=3, color=COLOURS[name], label=name)
    left.set_xscale("log")
    left.set_xlabel(f"KL(reference || compared) of a row (rows at or below {KL_FLOOR:g} drawn there)")
    left.set_ylabel("share of rows at or below")
    left.legend(fontsize=8, loc="lower right")
    left.grid(alpha=0.3)
    right.set_yscale("log")
    right.set_xlabel("case (report order)")
    right.set_ylabel("mean KL of the case's rows")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    q, r = run.quantised, run.reference
    fig.suptitle(f"{q['name']} against {r['name']}" + (f"; engine {run.backend}" if run.backend else ""))
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
