"""The PLE-fold trap's engines (docs/bug-classes.md, "The PLE-fold trap"): the numpy engine's per-layer inputs with
the two PLE scales folded away as llama.cpp's PLE simplification folds them, twice wrongly and once right; listed
with the rest of the zoo in ``mutants.py`` (the wrong folds in ``MUTANTS``, the right one in ``REWRITES``)."""

from __future__ import annotations

import math

import numpy as np

from refimpl.ops import linear
from refimpl.schedule import rms_norm

from .planting import planted

__all__ = ["PleFoldEpsKept", "PleFoldEpsOverS", "PleFoldRight"]


def _ple_folded(eps_of):
    """An Engine.per_layer_inputs with the two PLE scales folded away, as llama.cpp's PLE simplification does
    (docs/bug-classes.md, the PLE-fold trap): the context projection not multiplied by s = H^-1/2, its RMSNorm's
    eps ``eps_of(eps, s)`` instead (RMSNorm(s y; eps) = RMSNorm(y; eps / s^2)), and the 2^-1/2 of the sum moved
    into the norm weight and the table rows' sqrt(P)."""

    def per_layer_inputs(self, x0: np.ndarray, ids: np.ndarray) -> np.ndarray:
        T, H = x0.shape
        L, P = self.cfg.num_hidden_layers, self.cfg.hidden_size_per_layer_input
        y = linear(x0, self.w["per_layer_model_projection.weight"]).reshape(T, L, P)  # [T, L, P], no H^-1/2
        ctx = rms_norm(y, self.w["per_layer_projection_norm.weight"] * 2**-0.5, eps_of(self.eps, H**-0.5))
        return ctx + self.ple_table_rows(ids).reshape(T, L, P) * (math.sqrt(P) * 2**-0.5)
    return per_layer_inputs


PleFoldEpsKept = planted(
    "ple-fold-eps-kept", "The PLE context's H^-1/2 folded into its RMSNorm but the eps kept (RMSNorm(y; eps), not eps "
                         "H): wrong only where that context is near eps (the PLE-fold trap).",
    engine={"per_layer_inputs": _ple_folded(lambda eps, s: eps)})

PleFoldEpsOverS = planted(
    "ple-fold-eps-over-s", "The PLE context's H^-1/2 folded into its RMSNorm with eps / s instead of eps / s^2 (eps "
                           "sqrt(H), not eps H): wrong only where that context is near eps (the PLE-fold trap).",
    engine={"per_layer_inputs": _ple_folded(lambda eps, s: eps / s)})

#: the fold done right (eps / s^2): the same function, rounded otherwise; passes at exact-f64 (in mutants.REWRITES)
PleFoldRight = planted(
    "ple-fold-right", "The PLE context's H^-1/2 folded into its RMSNorm's eps as eps / s^2 = eps H, the 2^-1/2 into "
                      "the norm weight and sqrt(P): the same function (llama.cpp's fold done right).",
    engine={"per_layer_inputs": _ple_folded(lambda eps, s: eps / s**2)})
