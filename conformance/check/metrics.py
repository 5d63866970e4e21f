"""Per-row metrics between a backend's logits and the oracle's: small pure NumPy functions.

Every function works in float64 and reduces over the last axis (the vocabulary), so it takes one row
``[V]`` or a stack of rows ``[..., V]`` and returns a scalar or an array of the leading shape.
``ref`` is always the oracle's row (float64), ``got`` the backend's. All inputs here are assumed
finite; the grader checks non-finite values first and passes only finite columns (see
``conformance/grading.py``). Notation below: ``a = got``, ``b = ref``, sums over the vocabulary.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = [
    "as_f64",
    "max_abs",
    "argmax_abs",
    "max_rel",
    "nmse",
    "cosine",
    "log_softmax",
    "softmax",
    "kl",
    "delta_p",
    "top1",
    "top1_margin",
    "topk_ids",
    "topk_overlap",
    "row_digest",
    "row_distances",
    "row_identity",
    "IDENTITY_FLOOR",
]

#: floor on the distance to the requested row in ``row_identity``: an exact match gives a ratio of
#: about neighbour_distance / 1e-300, huge but finite (so JSON-serialisable).
IDENTITY_FLOOR = 1e-300


def as_f64(x) -> np.ndarray:
    """``x`` as a float64 array (no copy when it already is one)."""
    return np.asarray(x, dtype=np.float64)


def max_abs(got, ref) -> np.ndarray:
    """``max_j |a_j - b_j|``."""
    return np.max(np.abs(as_f64(got) - as_f64(ref)), axis=-1)


def argmax_abs(got, ref) -> np.ndarray:
    """The vocabulary index of ``max_abs`` (lowest index on ties)."""
    return np.argmax(np.abs(as_f64(got) - as_f64(ref)), axis=-1)


def max_rel(got, ref, floor: float = 1.0) -> np.ndarray:
    """``max_j |a_j - b_j| / max(|b_j|, floor)``: relative error with a floored denominator, so
    logits near zero do not blow it up (with ``floor`` 1 it never exceeds ``max_abs``)."""
    got, ref = as_f64(got), as_f64(ref)
    return np.max(np.abs(got - ref) / np.maximum(np.abs(ref), floor), axis=-1)


def nmse(got, ref) -> np.ndarray:
    """``sum (a - b)^2 / sum b^2`` (the llama.cpp test-backend-ops / test-llama-archs NMSE, with the
    reference in the denominator). A zero reference row gives ``inf`` unless ``a == b`` (then 0)."""
    got, ref = as_f64(got), as_f64(ref)
    num = np.sum((got - ref) ** 2, axis=-1)
    den = np.sum(ref**2, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, np.inf, 0.0))
    return out


def cosine(got, ref) -> np.ndarray:
    """``sum a b / (|a| |b|)``; by convention 1 when both rows are zero, 0 when only one is."""
    got, ref = as_f64(got), as_f64(ref)
    na = np.linalg.norm(got, axis=-1)
    nb = np.linalg.norm(ref, axis=-1)
    dot = np.sum(got * ref, axis=-1)
    den = na * nb
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(den > 0, dot / np.where(den > 0, den, 1.0), np.where((na == 0) & (nb == 0), 1.0, 0.0))
    return np.clip(out, -1.0, 1.0)


def log_softmax(x) -> np.ndarray:
    """``x_j - logsumexp(x)``, with ``logsumexp(x) = m + log sum exp(x - m)``, ``m = max x``."""
    x = as_f64(x)
    m = np.max(x, axis=-1, keepdims=True)
    return x - (m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True)))


def softmax(x) -> np.ndarray:
    """``exp(log_softmax(x))``."""
    return np.exp(log_softmax(x))


def kl(ref, got) -> np.ndarray:
    """``KL(P || Q) = sum_j p_j (log p_j - log q_j)`` with ``P = softmax(ref)``, ``Q = softmax(got)``.

    Note the argument order: the oracle first. Exact over the whole vocabulary (no entry is skipped,
    unlike llama.cpp's perplexity tool, which drops base log-probs below -16). Computed stably: with
    ``e = b - a`` (the logit difference) the identity
    ``log p - log q = e - log sum_j p_j exp(-e_j)`` gives
    ``KL = sum p e + log sum p exp(-e)``, invariant to a constant shift of ``e``. After centring,
    ``e' = e - sum p e``, it is evaluated as ``sum p e' + log1p(sum p expm1(-e'))``, which keeps full
    relative precision when the rows agree to rounding (KL ~ var_p(e) / 2 down to ~1e-30) and falls
    back to a log-sum-exp for rows so different that ``exp(-e')`` would overflow. Tiny negative
    results from rounding are clipped to 0.
    """
    ref, got = as_f64(ref), as_f64(got)
    lp = log_softmax(ref)
    p = np.exp(lp)
    p = p / np.sum(p, axis=-1, keepdims=True)
    e = ref - got
    e = e - np.sum(p * e, axis=-1, keepdims=True)
    first = np.sum(p * e, axis=-1)
    neg = -e
    big = np.max(neg, axis=-1) > 600.0
    with np.errstate(over="ignore", invalid="ignore"):
        small_path = np.log1p(np.sum(p * np.expm1(np.minimum(neg, 600.0)), axis=-1))
    # log sum p exp(-e') = logsumexp(lp - e'), for rows where exp would overflow
    w = lp + neg
    m = np.max(w, axis=-1, keepdims=True)
    lse_path = (m + np.log(np.sum(np.exp(w - m), axis=-1, keepdims=True)))[..., 0]
    out = first + np.where(big, lse_path, small_path)
    return np.maximum(out, 0.0)


def delta_p(ref, got) -> np.ndarray:
    """``|q_t - p_t|`` where ``t = argmax(ref)`` (lowest id on ties) is the oracle's top token,
    ``P = softmax(ref)`` and ``Q = softmax(got)`` (llama.cpp's Δp, taken on the oracle's choice
    instead of the dataset's next token, and as an absolute value)."""
    ref, got = as_f64(ref), as_f64(got)
    t = np.argmax(ref, axis=-1)[..., None]
    p = np.take_along_axis(softmax(ref), t, axis=-1)[..., 0]
    q = np.take_along_axis(softmax(got), t, axis=-1)[..., 0]
    return np.abs(q - p)


def _nan_to_neg_inf(x) -> np.ndarray:
    x = as_f64(x)
    nan = np.isnan(x)
    return np.where(nan, -np.inf, x) if nan.any() else x


def top1(x) -> np.ndarray:
    """``argmax x`` (lowest id on ties; NaN counts as -inf)."""
    return np.argmax(_nan_to_neg_inf(x), axis=-1)


def top1_margin(x) -> np.ndarray:
    """``x_(1) - x_(2)``: the largest minus the second largest logit of a row (0 on an exact tie;
    ``inf`` for a row of one entry)."""
    x = as_f64(x)
    if x.shape[-1] < 2:
        return np.full(x.shape[:-1], np.inf)
    two = -np.partition(-x, 1, axis=-1)[..., :2]
    return two[..., 0] - two[..., 1]


def topk_ids(x, k: int) -> np.ndarray:
    """The ids of the ``k`` largest entries of each row, largest first; ties go to the lower id
    (the order of a stable sort on ``-x``). NaN counts as -inf. Returns int64 ``[..., min(k, V)]``."""
    x = _nan_to_neg_inf(x)
    V = x.shape[-1]
    k = min(int(k), V)
    if k <= 0:
        return np.zeros(x.shape[:-1] + (0,), dtype=np.int64)
    flat = x.reshape(-1, V)
    out = np.empty((flat.shape[0], k), dtype=np.int64)
    for r, row in enumerate(flat):
        if V <= 4 * k or V <= 64:
            out[r] = np.argsort(-row, kind="stable")[:k]
            continue
        kth = np.partition(row, V - k)[V - k]  # the k-th largest value
        cand = np.flatnonzero(row >= kth)  # every id tied with it is kept, in id order
        order = np.argsort(-row[cand], kind="stable")
        out[r] = cand[order[:k]]
    return out.reshape(x.shape[:-1] + (k,))


def topk_overlap(ids_ref, ids_got) -> float:
    """``|ids_ref ∩ ids_got| / len(ids_ref)`` for one row's top-k id lists (1.0 for empty lists)."""
    a = [int(i) for i in ids_ref]
    if not a:
        return 1.0
    return len(set(a) & {int(i) for i in ids_got}) / len(a)


def row_digest(row) -> int:
    """48 bits of a BLAKE2b hash of a row's float64 bytes: equal for the very same row, an integer that JSON and
    a float64 hold exactly."""
    data = np.ascontiguousarray(row, dtype=np.float64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=6).digest(), "big")


def row_distances(row, rows, chunk: int = 64) -> np.ndarray:
    """``d_n = || row - rows[n] ||_2`` for every row ``n`` of ``rows`` ``[N, V]`` (computed as a
    direct difference, in chunks of ``chunk`` rows, so exact matches give exactly 0)."""
    row = as_f64(row)
    N = rows.shape[0]
    d = np.empty(N, dtype=np.float64)
    for s in range(0, N, chunk):
        block = as_f64(rows[s : s + chunk])
        d[s : s + chunk] = np.sqrt(np.sum((block - row) ** 2, axis=-1))
    return d


def row_identity(row, rows, position: int, floor: float = IDENTITY_FLOOR,
                 row_sq_norms: np.ndarray | None = None, approx_sq_dist: np.ndarray | None = None) -> tuple[int, float]:
    """Which oracle row a returned row is, and how clearly.

    ``rows`` are the oracle's rows ``[N, V]`` of the base the row should come from, ``position`` the
    requested index. Returns ``(nearest, ratio)``: ``nearest = argmin_n d_n`` (L2, lowest index on
    ties) and ``ratio = min(d_{i-1}, d_{i+1}) / max(d_i, floor)`` for ``i = position``; at the ends
    only the neighbour that exists is used, and for ``N == 1`` the ratio is ``inf``. A correct row
    has ``nearest == position`` and a large ratio; a row taken from ``i ± 1`` (B1: shifted index) has
    ``nearest == i ± 1`` and a ratio near 0, however close adjacent rows are to each other.

    Distances that decide the answer (rows i-1, i, i+1 and the few nearest candidates) are direct
    differences, so exact matches give exactly 0. For larger bases the candidates are found first
    with ``|a|^2 + |b_n|^2 - 2 a.b_n`` (one matrix-vector product; ``row_sq_norms`` = ``sum rows^2``
    per row may be passed in to reuse it across calls, or ``approx_sq_dist`` [N], those squared
    distances already computed, e.g. for a whole group with one matrix product).
    """
    row = as_f64(row)
    N = rows.shape[0]
    i = int(position)
    if N <= 8:
        cand = list(range(N))
    else:
        approx = approx_sq_dist
        if approx is None:
            if row_sq_norms is None:
                row_sq_norms = np.concatenate(
                    [np.sum(as_f64(rows[s : s + 64]) ** 2, axis=-1) for s in range(0, N, 64)])
            dots = np.concatenate([as_f64(rows[s : s + 64]) @ row for s in range(0, N, 64)])
            approx = row_sq_norms - 2.0 * dots + float(row @ row)
        nearby = {j for j in (i - 1, i, i + 1) if 0 <= j < N}
        cand = sorted(set(np.argsort(approx, kind="stable")[:4].tolist()) | nearby)
    d = row_distances(row, as_f64(rows[np.array(cand)]))
    exact = dict(zip(cand, d.tolist(), strict=True))
    nearest = min(cand, key=lambda n: (exact[n], n))
    neigh = [exact[j] for j in (i - 1, i + 1) if 0 <= j < N]
    if not neigh:
        return nearest, float("inf")
    return nearest, float(min(neigh) / max(exact[i], floor))
