"""Grade the hidden-state rows of a case: the final-norm hidden state a backend returns beside each logits
row (``Response.hidden`` / ``decode_hidden``, capability ``hidden_states``) against the oracle's.

The oracle's rows are the final norm of the set's stored residual stream (``OracleHidden``). A returned row
passes when it is the requested row (row identity over the base's hidden rows, as for logits: the nearest
oracle row is the requested one, and its neighbours at least ``identity_ratio`` times farther) and close:
NMSE and cosine within the profile's logits thresholds (both scale-free: an error in the hidden state moves
the logits by about the same relative amount). A failure has check ``hidden`` (missing rows, wrong width,
non-finite values, not close) or ``hidden_identity`` (a shifted row).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from refimpl.arrays import to_host
from refimpl.model import Gemma4

from ..sets.case import mtp_groups, solo_cases
from . import metrics as M
from .grading import RowResult, empty_metrics, finite_or_none, real_array, show_threshold, show_value
from .profiles import Profile
from .requests import sequence_response

__all__ = ["OracleHidden", "grade_hidden", "hidden_groups"]


class OracleHidden(Mapping):
    """Base id -> the oracle's final-norm hidden rows [N, H] (float64), made on first use from the set's
    stored residual stream through the checkpoint's final norm (``Gemma4.final_norm`` of ``oracle()``, the
    set's oracle). Empty for a set that stores no hidden states (schema 1)."""

    def __init__(self, stored: Mapping[str, np.ndarray], oracle: Callable[[], Gemma4]):
        self._stored, self._oracle, self._done = stored, oracle, {}

    def __getitem__(self, base: str) -> np.ndarray:
        if base not in self._done:
            self._done[base] = to_host(self._oracle().final_norm(np.asarray(self._stored[base], dtype=np.float64)))
        return self._done[base]

    def __iter__(self):
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)

    def __contains__(self, base) -> bool:  # without computing the rows
        return base in self._stored


def hidden_groups(case, groups, response) -> tuple[list, list[Any]]:
    """(the groups that have hidden rows, the response's hidden rows of each): ``row_groups(case)``'s logits
    rows, then its decode group(s); for an MTP case the prompt's row and every round's verification rows
    (draft steps have none)."""
    if case.kind == "mtp" and case.mtp_batch:  # each sequence's, as its solo case's
        picked, rows, at = [], [], 0
        for s, solo in enumerate(solo_cases(case)):
            n = len(mtp_groups(solo))
            p, r = hidden_groups(solo, groups[at:at + n], sequence_response(response, s))
            picked, rows, at = picked + p, rows + r, at + n
        return picked, rows
    if case.kind == "mtp":
        mtp = response.mtp
        verify = [] if mtp is None else (mtp.verify_hidden or [])
        picked = [groups[0]] + [g for g in groups[1:] if g[0].endswith(" verify")]
        return picked, [response.hidden] + [verify[r] if r < len(verify) else None for r in range(len(picked) - 1)]
    out: list[Any] = [response.hidden]
    dh = response.decode_hidden
    n_decode = (len(case.sequences) if case.kind == "multi" and any(d for *_, d in case.sequences)
                else (1 if case.decode_len > 0 else 0))
    if case.kind == "multi":
        out += [None if dh is None or s >= len(dh) else dh[s] for s in range(n_decode)]
    elif n_decode:
        out.append(dh)
    return list(groups), out


def _fail(res: RowResult, check: str, message: str) -> None:
    res.status, res.check, res.message = "fail", check, f"{res.label}: {message}"


def _grade_row(res: RowResult, got: np.ndarray, rows: np.ndarray, position: int, profile: Profile) -> None:
    ref = np.asarray(rows[position], dtype=np.float64)
    if got.shape[-1] != ref.shape[-1]:
        return _fail(res, "hidden", f"width {got.shape[-1]} != the oracle's hidden size {ref.shape[-1]}")
    if not np.isfinite(got).all():
        j = int(np.flatnonzero(~np.isfinite(got))[0])
        return _fail(res, "hidden", f"{int(np.count_nonzero(~np.isfinite(got)))} non-finite value(s); first at "
                                    f"dimension {j}: {got[j]}")
    nearest, ratio = M.row_identity(got, rows, position)
    nm, cs = float(M.nmse(got, ref)), float(M.cosine(got, ref))
    diff = np.abs(got - ref)
    m = res.metrics
    m.update(max_abs=finite_or_none(diff.max()), nmse=finite_or_none(nm), cosine=finite_or_none(cs),
             identity_nearest=int(nearest), identity_ratio=finite_or_none(ratio))
    if nearest != position:
        return _fail(res, "hidden_identity", f"identity: the hidden row is nearest to oracle row {nearest}, not "
                                             f"{position}: a shifted or misindexed row (nmse {show_value(nm)})")
    if not nm <= profile.nmse:
        j = int(np.argmax(diff))
        return _fail(res, "hidden", f"nmse {show_value(nm)} > {show_threshold(profile.nmse)} (cosine {cs:.9f}; max_abs "
                                    f"{show_value(diff[j])} at dimension {j}: got {got[j]:.7g}, oracle {ref[j]:.7g})")
    if not cs >= profile.cosine_min:
        return _fail(res, "hidden", f"cosine {cs:.9f} < {profile.cosine_min:.9f} (nmse {show_value(nm)})")
    if ratio < profile.identity_ratio:
        return _fail(res, "hidden_identity", f"identity ratio {show_value(ratio)} < "
                                             f"{show_threshold(profile.identity_ratio)}: the neighbouring rows are not "
                                             "clearly farther")
    res.status, res.check = "pass", None
    res.message = f"{res.label}: ok (nmse {show_value(nm)}, max_abs {show_value(m['max_abs'])})"


def grade_hidden(groups: Sequence[tuple[str, Sequence[Any]]], got: Sequence[Any],
                 oracle: Mapping[str, np.ndarray], profile: Profile) -> list[RowResult]:
    """One RowResult per returned row of ``groups`` (``row_groups(case)``), labelled "<row> hidden"."""
    out: list[RowResult] = []
    for gi, (gname, specs) in enumerate(groups):
        arr = got[gi] if gi < len(got) else None
        problem = None
        if arr is None:
            problem = f"no hidden rows returned for group '{gname}' (expected {len(specs)})"
        else:
            arr, bad = real_array(f"{gname} hidden", arr)
            if bad is not None:
                problem = bad
            elif arr.ndim != 2 or arr.shape[0] != len(specs):
                problem = f"hidden rows of group '{gname}' have shape {tuple(arr.shape)}, expected [{len(specs)}, H]"
        for ri, spec in enumerate(specs):
            res = RowResult(label=f"{spec.label} hidden", position=int(spec.position), status="fail", check=None,
                            metrics=empty_metrics(), top_ref=[], top_got=[], message="")
            out.append(res)
            if problem is not None:
                _fail(res, "hidden", problem)
            else:
                _grade_row(res, arr[ri], oracle[spec.base], spec.position, profile)
    return out
