"""Compact storage: a row's logits are a pure function of its final hidden state and the checkpoint's head.

A set stored as ``hidden`` keeps, per base, the float64 residual stream before the final norm ``[N, H]``
and, per row, its summary (``row_summary``): the top-k token ids and logits, the log-sum-exp and the
top-1/top-2 margin. At check time ``RebuiltLogits`` rebuilds the float64 logits of a base through the
checkpoint's head (final norm, tied embedding, softcap; ``refimpl.model.Gemma4.head``), once per base
per run, and compares them with the stored summary: a checkpoint whose head does not reproduce the set
is a FixtureError (exit 3), never a backend failure. docs/fixtures.md has the format, docs/profiles.md
the rounding bound ``head_bound``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from refimpl.arrays import to_host
from refimpl.errors import RefimplError

from .format import FixtureError

TOP_K = 16  # token ids and logits kept per row
SUMMARY_LEAVES = ("top_ids", "top_logits", "lse", "margin")
U = 2.0 ** -53  # unit roundoff of float64
ROW_BLOCK_BYTES = 1 << 28  # rows of logits checked at a time: at most 256 MiB of float64
SUMMARY_BLOCK_BYTES = 1 << 25  # rows of logits summarised at a time (summaries_of): 32 MiB of float64
SUMMARY_THREADS = 8  # at most this many blocks summarised at once
IN_MEMORY_BYTES = 1 << 28  # a rebuilt base larger than this lives in a memory-mapped file under the workdir


def logsumexp(z: np.ndarray) -> np.ndarray:
    """log sum_v exp(z[r, v]) per row, float64: z [R, V] -> [R]."""
    m = np.max(z, axis=-1)
    return m + np.log(np.sum(np.exp(z - m[:, None]), axis=-1))


def row_summary(logits: np.ndarray, k: int = TOP_K) -> dict[str, np.ndarray]:
    """The stored summary of rows of logits [R, V]: top_ids [R, k] (descending logit, ties by lower id),
    top_logits [R, k], lse [R] and margin [R] (top-1 minus top-2 logit)."""
    z = np.asarray(logits, dtype=np.float64)
    k = min(k, z.shape[-1])
    part = np.argpartition(-z, k - 1, axis=-1)[:, :k] if k < z.shape[-1] else np.tile(np.arange(z.shape[-1]),
                                                                                      (z.shape[0], 1))
    vals = np.take_along_axis(z, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    ids = np.take_along_axis(part, order, axis=-1).astype(np.int64)
    top = np.take_along_axis(vals, order, axis=-1)
    margin = top[:, 0] - top[:, 1] if k > 1 else np.full(z.shape[0], np.inf)
    return {"top_ids": ids, "top_logits": top, "lse": logsumexp(z), "margin": margin}


def summaries_of(logits: np.ndarray, k: int = TOP_K) -> dict[str, np.ndarray]:
    """``row_summary`` of a whole base [N, V], a block of rows at a time (memory maps stay lazy), the blocks on
    the machine's cores (NumPy's partition and reductions let go of the GIL). Each row's summary is its own
    (the same whatever the blocking or thread): 256 rows of a 262k vocabulary in 0.57 s on two cores against
    1.02 s for 256 MiB blocks on one thread (benchmarks/summaries.py)."""
    step = max(1, SUMMARY_BLOCK_BYTES // (8 * max(1, logits.shape[-1])))
    starts = range(0, logits.shape[0], step)
    with ThreadPoolExecutor(max(1, min(SUMMARY_THREADS, os.cpu_count() or 1, len(starts)))) as pool:
        parts = list(pool.map(lambda s: row_summary(np.asarray(logits[s:s + step]), k), starts))
    return {leaf: np.concatenate([p[leaf] for p in parts]) for leaf in SUMMARY_LEAVES}


def embedding_row_norm(model) -> float:
    """The largest Euclidean norm of a row of the checkpoint's head (the tied embedding or lm_head)."""
    V, chunk, best = model.cfg.vocab_size, 8192, 0.0
    for start in range(0, V, chunk):
        rows = model.weights.head_rows(start, min(V, start + chunk))
        best = max(best, float(np.sqrt(np.max(np.sum(rows * rows, axis=-1)))))
    return best


def head_bound(model, hidden: np.ndarray, e_norm: float) -> float:
    """How far two float64 evaluations of the head on the same hidden states may differ (other BLAS
    kernels or blockings), per logit: each logit is softcap(y . e_v) with y = rms_norm(x) * w. The dot
    product of length H has error at most gamma_H |y| . |e_v| <= (H u / (1 - H u)) |y|_2 |e_v|_2
    (Higham, Thm 3.5, and Cauchy-Schwarz); the norm adds about (H + 4) u relative to y, which the same
    factor covers again; the softcap is 1-Lipschitz and rounds to a few ulps of the cap. Two evaluations:
    twice that. docs/profiles.md."""
    cfg = model.cfg
    H = cfg.hidden_size
    x = np.asarray(hidden, dtype=np.float64)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    w = np.asarray(to_host(model.weights["norm.weight"]), dtype=np.float64)
    y_norm = float(np.max(np.sqrt(np.sum((x / np.sqrt(ms + cfg.rms_norm_eps) * w) ** 2, axis=-1)))) if len(x) else 0.0
    gamma = (H + 8) * U / (1 - (H + 8) * U)
    cap = cfg.final_logit_softcapping or 0.0
    return 2.0 * (2.0 * gamma * y_norm * e_norm + 8 * U * cap)


def lse_bound(logit_bound: float, vocab: int, scale: float) -> float:
    """Two log-sum-exps of rows that differ by at most ``logit_bound`` per logit: lse is 1-Lipschitz in the
    max norm, and each one's sum of V terms rounds by at most gamma_V relative (log: gamma_V absolute),
    plus a few ulps of |lse| (``scale``)."""
    gamma = (vocab + 4) * U / (1 - (vocab + 4) * U)
    return logit_bound + 2.0 * (gamma + 4 * U * max(1.0, scale))


def summary_problem(rebuilt: np.ndarray, stored: Mapping[str, np.ndarray], bound: float, rows: range) -> str | None:
    """Why rebuilt logits [R, V] (rows ``rows`` of a base) do not reproduce the stored summary within
    ``bound`` per logit, else None: each stored top-k logit at its id, the rebuilt top-1 and k-th largest
    values (so no other token rose above the stored top-k), the log-sum-exp."""
    ids = np.asarray(stored["top_ids"][rows.start:rows.stop])
    top = np.asarray(stored["top_logits"][rows.start:rows.stop])
    lse = np.asarray(stored["lse"][rows.start:rows.stop])
    at = np.take_along_axis(rebuilt, ids, axis=-1)
    d = np.abs(at - top)
    if d.max(initial=0.0) > bound:
        r, j = np.unravel_index(int(np.argmax(d)), d.shape)
        return (f"row {rows.start + r}: token {int(ids[r, j])} (stored top-{j + 1}) has logit {at[r, j]:.17g}, the set "
                f"records {top[r, j]:.17g} (|diff| {d[r, j]:.3g} > bound {bound:.3g})")
    k = ids.shape[1]
    kth = -np.partition(-rebuilt, k - 1, axis=-1)[:, :k]
    kth.sort(axis=-1)
    kth = kth[:, ::-1]
    d = np.abs(kth - top)
    if d.max(initial=0.0) > bound:
        r, j = np.unravel_index(int(np.argmax(d)), d.shape)
        return (f"row {rows.start + r}: the rebuilt top-{j + 1} logit is {kth[r, j]:.17g}, the set records "
                f"{top[r, j]:.17g} (another token's logit moved; |diff| {d[r, j]:.3g} > bound {bound:.3g})")
    got = logsumexp(rebuilt)
    d = np.abs(got - lse)
    tol = lse_bound(bound, rebuilt.shape[-1], float(np.max(np.abs(lse), initial=1.0)))
    if d.max(initial=0.0) > tol:
        r = int(np.argmax(d))
        return (f"row {rows.start + r}: the rebuilt log-sum-exp is {got[r]:.17g}, the set records {lse[r]:.17g} "
                f"(|diff| {d[r]:.3g} > bound {tol:.3g}; a token outside the stored top-{k} changed)")
    return None


class RebuiltLogits(Mapping):
    """Base id -> [N, V] float64 logits rebuilt from the stored hidden states through ``model``'s head, on
    first access, once per base, and checked against the stored summaries (FixtureError, naming the base
    and row, when they differ beyond ``head_bound``). Bases larger than IN_MEMORY_BYTES are kept in a
    read-only memory-mapped file under ``workdir``. ``where`` names the set in messages."""

    def __init__(self, model, hidden: Mapping[str, np.ndarray], summaries: Mapping[str, Mapping[str, np.ndarray]],
                 workdir: str | Path, where: str):
        self.model, self.hidden, self.summaries = model, hidden, summaries
        self.workdir, self.where = Path(workdir), where
        self._done: dict[str, np.ndarray] = {}
        self._e_norm: float | None = None
        self.bounds: dict[str, float] = {}  # base -> the bound it was checked with

    def __iter__(self) -> Iterator[str]:
        return iter(self.hidden)

    def __len__(self) -> int:
        return len(self.hidden)

    def __getitem__(self, base: str) -> np.ndarray:
        if base not in self._done:
            if base not in self.hidden:
                raise KeyError(base)
            self._done[base] = self._rebuild(base)
        return self._done[base]

    def _rebuild(self, base: str) -> np.ndarray:
        x = self.hidden[base]
        N, V = x.shape[0], self.model.cfg.vocab_size
        if self._e_norm is None:
            self._e_norm = embedding_row_norm(self.model)
        bound = self.bounds[base] = head_bound(self.model, x, self._e_norm)
        if N * V * 8 <= IN_MEMORY_BYTES:
            out = np.empty((N, V), dtype=np.float64)
        else:
            self.workdir.mkdir(parents=True, exist_ok=True)
            path = self.workdir / f"rebuilt-{base}-{id(self):x}.npy"
            out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=(N, V))
        try:
            self.model.head(np.asarray(x, dtype=np.float64), out=out)  # each block of the head decoded once
        except RefimplError as e:  # e.g. NonFiniteError: a NaN in the head matrix
            raise FixtureError(f"{self.where}: base {base}: the checkpoint's head cannot rebuild the set's logits: "
                               f"{e}") from None
        step = max(1, ROW_BLOCK_BYTES // (8 * V))
        for s in range(0, N, step):
            rows = range(s, min(N, s + step))
            why = summary_problem(np.asarray(out[s:rows.stop]), self.summaries[base], bound, rows)
            if why is not None:
                raise FixtureError(f"{self.where}: base {base}: the checkpoint's head does not reproduce the set: "
                                   f"{why}; this checkpoint is not the one the set was made from")
        if isinstance(out, np.memmap):
            out.flush()
            out = np.load(out.filename, mmap_mode="r")
        else:
            out.flags.writeable = False
        return out

