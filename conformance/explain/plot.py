"""``conformance explain --plot``: the error of every traced point and row as a heat map (matplotlib, the
optional ``plot`` extra, imported only here and only when asked for)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from .run import CaseExplanation

__all__ = ["INSTALL", "PlotError", "plot_available", "plot_explanations"]

SHORT = {"embed": "emb", "attn_out": "attn", "ffn_out": "ffn", "ple_add": "ple", "residual": "res",
         "final_norm": "norm", "logits": "logits"}


INSTALL = "--plot needs matplotlib: pip install 'gemma4-conformance[plot]'"


class PlotError(Exception):
    """The picture cannot be made (matplotlib missing, or nothing to draw)."""


def plot_available() -> bool:
    """Whether matplotlib can be imported (looked up, not imported: the command line asks before any work)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a broken entry in sys.modules
        return False


def _label(point) -> str:
    short = SHORT.get(point.sub, point.sub)
    return short if point.layer is None else f"{point.layer}.{short}"


def plot_explanations(results: list[CaseExplanation], path: str | Path, max_cases: int = 4) -> Path:
    """Draw up to ``max_cases`` traced cases (those that diverge first), one panel each: columns the points in
    forward order, rows the case's rows labelled with their role, colour log10 of the error; the floor is the
    colour bar's mark and the first divergence is boxed. Returns the path written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(INSTALL) from None
    drawn = sorted((r for r in results if r.comparison is not None and r.comparison.points),
                   key=lambda r: r.status != "diverges")[:max_cases]
    if not drawn:
        raise PlotError("--plot: no case was compared point by point, nothing to draw")
    heights = [max(1.6, 0.32 * len(r.comparison.rows) + 1.3) for r in drawn]
    width = max(8.0, 0.2 * max(len(r.comparison.points) for r in drawn) + 3.0)
    fig, axes = plt.subplots(len(drawn), 1, figsize=(width, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, r in zip(axes[:, 0], drawn, strict=True):
        c = r.comparison
        err = np.array([p.errors for p in c.points if p.sub != "router.experts"]).T  # [rows, points]
        points = [p for p in c.points if p.sub != "router.experts"]
        with np.errstate(divide="ignore"):
            img = np.log10(np.clip(err, 1e-36, None))
        im = ax.imshow(np.ma.masked_invalid(img), aspect="auto", cmap="magma", vmin=-34, vmax=max(1.0, np.nanmax(img)),
                       interpolation="nearest")
        ax.set_xticks(range(len(points)), [_label(p) for p in points], rotation=90, fontsize=7)
        ax.set_yticks(range(len(c.rows)), [f"{a} ({b})" for a, b in zip(c.rows, c.roles, strict=True)], fontsize=7)
        first = c.first_divergence
        title = f"{r.id}: " + ("within the floor" if first is None else
                               f"first divergence {first['point']} ({first['what']})")
        ax.set_title(title, fontsize=8, loc="left")
        if first is not None:
            x = next(k for k, p in enumerate(points) if p.name == first["point"])
            for y, label in enumerate(c.rows):
                if label in first["rows"]:
                    ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="cyan", linewidth=1.2))
        bar = fig.colorbar(im, ax=ax, pad=0.01)
        bar.set_label("log10 error", fontsize=7)
        bar.ax.axhline(np.log10(c.floor), color="cyan", linewidth=1.5)
        bar.ax.tick_params(labelsize=6)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
