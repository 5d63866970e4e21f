"""The quantisation mutants: an engine of quantised checkpoints with one known dequantisation or activation bug
planted, and the table of which the gate kills at the tight profile and which the old approach (the engine's rows
against the unquantised oracle at ``q4`` / ``q8``) misses.

The engine is the oracle backend (``RefimplBackend``) opened on the quantised set's own checkpoint under the set's
activation convention, whose weights then read through a planted store (``GGUFStore.decode`` /
``MlxStore.decode`` replaced) or convert activations by a planted rule (``Gemma4Weights.activation_rule``). The
unplanted engine is the control: it computes the quantised oracle exactly. Each mutant names the stored types it
breaks; it runs on the bundled quantised sets that hold such a tensor:

* ``e2b-mini-q4-0``: llama.cpp's own Q4_0 file of e2b-mini (Q4_0, 11 F16 tensors, one Q8_0), under
  ``ggml-cpu/x86/gelu-table``; reference ``e2b-mini``;
* ``e2b-256-mini-q4km``: its Q4_K_M file of e2b-256-mini (Q4_K, Q6_K), under ``ggml-cpu/x86/f16-kv/gelu-table``;
  reference ``e2b-256-mini``;
* ``e2b-mini-mlx-q4``: mlx-lm's 4-bit, group size 32 directory of e2b-mini; reference ``e2b-mini``.

Tight profile: the set's own (``ggml-cpu`` for a set made under ggml's convention, ``fp32`` otherwise, scaled to
the set as the check scales it). The old approach grades the same rows against the reference set's oracle at
``q4`` (``q8`` for an 8-bit set), on the cases whose rows the two sets' prompts share (a generation base continues
each model's own greedy choice); it catches a mutant only where the control passes and the mutant fails.

    python -m conformance.selftest.quant [--mutant REGEX] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from refimpl.ggml_act import QK_K, VEC_DOT_TYPE, activation_values, quantize_q8_k
from refimpl.ggml_blocks import f16_field, planes, scale_min_k4
from refimpl.gguf_store import GGUFStore
from refimpl.mlx_quant import QuantSpec, dequantize
from refimpl.mlx_store import MlxStore

from ..backends.refimpl_backend import RefimplBackend
from ..check.cases import asked
from ..check.grading import grade_case
from ..check.guard import CallInfo
from ..check.policy import case_profile
from ..check.profiles import PROFILES
from ..check.requests import response_groups
from ..check.session import Checkpoints, Session, Work
from ..sets import bundled_set, load_set
from ..sets.case import row_groups, shared_prefix

__all__ = ["PAIRS", "QUANT_MUTANTS", "QuantMutant", "QuantResult", "quant_selftest"]

#: (the quantised bundled set, its unquantised reference)
PAIRS = (("e2b-mini-q4-0", "e2b-mini"), ("e2b-256-mini-q4km", "e2b-256-mini"), ("e2b-mini-mlx-q4", "e2b-mini"))


# ----------------------------------------------------------------------------------------------
# planted decoders: (the store's decode, its arguments) -> values


class PlantedGGUF(GGUFStore):
    """A GGUF store whose tensors of ``types`` decode through ``rule(store, raw, info, n)``."""

    types: frozenset[str]
    rule: Callable[..., np.ndarray]
    only: str | None = None  # one tensor only (its oracle name), else every tensor of ``types``

    def decode(self, raw: np.ndarray, info, n: int) -> np.ndarray:
        if info.dtype in self.types and (self.only is None or info.name == self.only):
            return self.rule(self, raw, info, n)
        return super().decode(raw, info, n)


class PlantedMlx(MlxStore):
    """An MLX store whose quantised modules decode through ``rule(words, scales, biases, spec)``."""

    rule: Callable[..., np.ndarray]

    def decode(self, words: np.ndarray, scales: np.ndarray, biases: np.ndarray | None, spec) -> np.ndarray:
        return self.rule(words, scales, biases, spec)


def _q4_0_nibbles_swapped(store, raw, info, n):
    """Q4_0 with each block's two halves swapped: the high nibbles read as elements 0-15, the low as 16-31."""
    return GGUFStore.decode(store, raw, info, n).reshape(-1, 2, 16)[:, ::-1].reshape(-1)


def _q4_k(raw: np.ndarray, shift: int = 0, dmin_sign: float = -1.0) -> np.ndarray:
    """Q4_K decoded as ggml does (refimpl.ggml_blocks.q4_k), with the sub-blocks' 6-bit scales and mins taken
    ``shift`` sub-blocks on, and the min term added with ``dmin_sign``."""
    blocks = raw.reshape(-1, 144)
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, m = scale_min_k4(blocks[:, 4:16])
    sc, m = np.roll(sc, -shift, axis=1), np.roll(m, -shift, axis=1)
    q = planes(blocks[:, 16:144].reshape(-1, 32), 2, 4).reshape(-1, 256)
    return (d * np.repeat(sc, 32, axis=1) * q + dmin_sign * dmin * np.repeat(m, 32, axis=1)).reshape(-1)


def _f16_as_bf16(store, raw, info, n):
    """The 2-byte values read as bfloat16 (the upper half of a float32) instead of IEEE half."""
    return (raw.view("<u2").astype("<u4") << 16).view("<f4").astype(np.float64)


def _q8_k_scale_positive(x: np.ndarray, weight_type: str, path: str = "x86") -> np.ndarray:
    """ggml's activation values, with Q8_K's block scale taken as |d| (the codes keep iscale = -127 / max's sign)."""
    if VEC_DOT_TYPE.get(weight_type) != "Q8_K":
        return activation_values(x, weight_type, path)
    codes, d = quantize_q8_k(x)
    return (codes.reshape(*d.shape, QK_K) * np.abs(d)[..., None]).reshape(np.shape(x))


def _mlx_bias_dropped(words, scales, biases, spec: QuantSpec) -> np.ndarray:
    """s * q, the affine bias beta left out."""
    return dequantize(words, scales, None if biases is None else np.zeros_like(biases), spec)


def _mlx_group_size_doubled(words, scales, biases, spec: QuantSpec) -> np.ndarray:
    """The group size read as twice the stored one: each scale and bias of the first half of the columns taken
    for a group of 2 g elements."""
    half = scales.shape[-1] // 2
    s2 = np.repeat(np.asarray(scales)[..., :half], 2, axis=-1)
    b2 = None if biases is None else np.repeat(np.asarray(biases)[..., :half], 2, axis=-1)
    return dequantize(words, s2, b2, spec)


# ----------------------------------------------------------------------------------------------
# the mutant backends


class QuantMutant(RefimplBackend):
    """The control: the oracle backend on a quantised checkpoint under the set's activation convention."""

    mutant = "control"
    store: type | None = None  # the planted store class for the checkpoint's format, or None
    rule: Callable | None = None  # the planted activation rule, or None
    path: str | None = None  # the planted kernel path, or None

    def __init__(self, activations: str = "none"):
        super().__init__(activations=activations)
        self.name = f"quant-mutant/{self.mutant}"

    def open(self, model_dir: Path) -> None:
        super().open(model_dir)
        weights = self.model.weights
        fmt = next((c for c in (GGUFStore, MlxStore) if self.store is not None and issubclass(self.store, c)), None)
        if fmt is not None and isinstance(weights.store, fmt):  # a checkpoint of the format it plants in
            weights.store = self.store(weights.store.model_dir)
        if self.rule is not None:
            weights.activation_rule = self.rule
        if self.path is not None and weights.activation_path is not None:
            weights.activation_path = self.path


def _planted_gguf(name: str, types: set[str], rule, only: str | None = None) -> type:
    return type(name, (PlantedGGUF,), {"types": frozenset(types), "rule": staticmethod(rule), "only": only})


def _planted_mlx(name: str, rule) -> type:
    return type(name, (PlantedMlx,), {"rule": staticmethod(rule)})


class Q40NibblesSwapped(QuantMutant):
    """Q4_0: each block's low and high nibbles swapped (element j read from the high nibble of byte j)"""

    mutant, store = "q4_0-nibbles-swapped", _planted_gguf("Q40Swapped", {"Q4_0"}, _q4_0_nibbles_swapped)


class KQuantScaleMinOffByOne(QuantMutant):
    """Q4_K: every sub-block takes the next sub-block's 6-bit scale and min (get_scale_min_k4 off by one)"""

    mutant = "k-quant-scale-min-off-by-one"
    store = _planted_gguf("Q4KShift", {"Q4_K"}, lambda store, raw, info, n: _q4_k(raw, shift=1))


class KQuantDminSign(QuantMutant):
    """Q4_K: the min term added instead of subtracted (dmin's sign)"""

    mutant = "k-quant-dmin-sign"
    store = _planted_gguf("Q4KDmin", {"Q4_K"}, lambda store, raw, info, n: _q4_k(raw, dmin_sign=1.0))


class WrongTypeF16AsBf16(QuantMutant):
    """One F16 tensor (layer 0's per_layer_projection) dequantised as BF16, the other 2-byte type"""

    mutant = "one-tensor-wrong-type"
    store = _planted_gguf("F16AsBf16", {"F16"}, _f16_as_bf16, only="model.layers.0.per_layer_projection.weight")


class OtherKernelPath(QuantMutant):
    """Q8_0 activations quantised by the reference path's rule (1/d, ties away) where the x86 kernels run"""

    mutant, path = "other-kernel-path-rounding", "ref"


class Q8KScalePositive(QuantMutant):
    """Q8_K activations: the block scale taken positive (|d|), the codes keeping -127/max's sign"""

    mutant, rule = "q8_k-scale-positive", staticmethod(_q8_k_scale_positive)


class MlxBiasDropped(QuantMutant):
    """MLX affine: the bias beta of every group dropped (s * q)"""

    mutant, store = "mlx-bias-dropped", _planted_mlx("MlxNoBias", _mlx_bias_dropped)


class MlxGroupSizeMisread(QuantMutant):
    """MLX affine: the group size read as twice the stored one"""

    mutant, store = "mlx-group-size-misread", _planted_mlx("MlxGroup2", _mlx_group_size_doubled)


@dataclass(frozen=True)
class QuantMutantSpec:
    backend_class: type
    needs: tuple[str, ...]  # the stored types (GGUF) or format (mlx-affine) a set must hold for it to apply
    activations: bool = False  # needs a set made under ggml's activation convention
    equivalent: str | None = None  # why no profile can see it on the bundled sets (measured), or None

    @property
    def name(self) -> str:
        return self.backend_class.mutant

    @property
    def breaks(self) -> str:
        return self.backend_class.__doc__.strip().splitlines()[0]


QUANT_MUTANTS = (
    QuantMutantSpec(Q40NibblesSwapped, ("Q4_0",)),
    QuantMutantSpec(KQuantScaleMinOffByOne, ("Q4_K",)),
    QuantMutantSpec(KQuantDminSign, ("Q4_K",)),
    QuantMutantSpec(WrongTypeF16AsBf16, ("F16",)),
    QuantMutantSpec(OtherKernelPath, ("Q4_0", "Q8_0", "Q5_0"), activations=True,
                    equivalent="the x86 and reference Q8_0 quantisers part only where x * 127 / amax and x / (amax / "
                               "127) round to either side of a half-way point, or on an exact tie: on the bundled "
                               "prompts no activation lands there (every row of every base equal, measured), so "
                               "the mutant computes the control's forward; tests/oracle/quantised/test_ggml_act.py "
                               "tells the two rules apart on drawn blocks of exact ties"),
    QuantMutantSpec(Q8KScalePositive, ("Q4_K", "Q6_K"), activations=True),
    QuantMutantSpec(MlxBiasDropped, ("mlx-affine",)),
    QuantMutantSpec(MlxGroupSizeMisread, ("mlx-affine",)),
)


# ----------------------------------------------------------------------------------------------
# the run


@dataclass
class QuantResult:
    mutant: str
    breaks: str
    set: str
    tight: str  # the tight profile's name
    killed: bool  # a case fails at the tight profile
    checks: dict[str, int]  # the failing checks at the tight profile, counted over cases
    cases: int  # the cases graded
    old_profile: str
    old_cases: int  # the cases the old approach grades (their rows shared by both sets' prompts)
    old_failed: int  # of those, failed against the reference at old_profile
    old_control_failed: int  # the control's failures there
    control_failed: int  # the control's failures at the tight profile (0: the kills mean something)
    equivalent: str | None = None

    @property
    def old_caught(self) -> bool:
        """The old approach tells the mutant from the control: the control passes it, the mutant does not."""
        return self.old_control_failed == 0 and self.old_failed > 0

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "old_caught": self.old_caught}


def stored_kinds(fs) -> set[str]:
    """The stored types of a quantised set's checkpoint (GGUF), or its format (mlx-affine)."""
    q = fs.manifest["model"].get("quantisation") or {}
    if q.get("format") == "gguf":
        return {t["type"] for t in q.get("tensors", {}).values()}
    return {q["format"]} if q.get("format") else set()


def old_profile(fs) -> str:
    """q8 for an 8-bit set, else q4."""
    q = fs.manifest["model"]["quantisation"]
    if q["format"] == "gguf":
        main = Counter(t["type"] for t in q["tensors"].values() if t["type"][0] in "QI").most_common(1)
        return "q8" if main and main[0][0].startswith("Q8") else "q4"
    bits = {t.get("bits") for t in q.get("tensors", {}).values()}
    return "q8" if bits == {8} else "q4"


def _answers(backend, quantised, reference, tmp: str) -> tuple[dict[str, tuple], Any, Any]:
    """Every case of ``quantised`` the backend claims, run: ({case id: (the case as asked, its response groups, or
    the exception the backend raised)}, the quantised set's context, the reference's)."""
    checkpoints = Checkpoints(tmp)
    session = Session(backend, checkpoints)
    got: dict[str, tuple] = {}

    def one(ctx, case):
        case_asked, request, _, missing = asked(case, ctx, session.claimed)
        if missing and missing != ["decode"]:
            return None
        call = CallInfo.from_call(lambda: session.calls.run(request))
        got[case.id] = (case_asked, call.excinfo if call.failed else response_groups(case_asked, call.value))
        return None

    session.run([(quantised, [c for c in quantised.cases if c.kind != "mtp"])], Work(case=one))
    qctx = checkpoints.context(quantised, backend.capabilities.embedding_convention)
    rctx = checkpoints.context(reference, backend.capabilities.embedding_convention)
    return got, qctx, rctx


def _shared(case, prefix: dict[str, int]) -> bool:
    return all(s.position < prefix.get(s.base, 0) for _, g in row_groups(case) for s in g)


def _grades(got: dict[str, tuple], qctx, rctx, tight, old, prefix) -> tuple[Counter, int, int, int]:
    """(failing checks at the tight profile, cases graded, cases the old approach grades, of those failed)."""
    checks: Counter = Counter()
    old_cases = old_failed = 0
    for case, answer in got.values():
        groups = row_groups(case)
        if isinstance(answer, BaseException):
            checks["error"] += 1
            continue
        grade = grade_case(case, groups, answer, qctx.base_logits, case_profile(tight, qctx, case))
        if grade.status != "pass":
            checks[grade.check or "fail"] += 1
        if _shared(case, prefix):
            old_cases += 1
            old_failed += grade_case(case, groups, answer, rctx.base_logits, old).status != "pass"
    return checks, len(got), old_cases, old_failed


def quant_selftest(mutants=QUANT_MUTANTS, pairs=PAIRS, progress: Callable[[str], None] | None = None) -> list:
    """Every mutant on every bundled quantised set it applies to (``pairs``: set names), with the control's old-
    approach failures beside it: a list of ``QuantResult``."""
    out = []
    for qname, rname in pairs:
        quantised, reference = load_set(bundled_set(qname)), load_set(bundled_set(rname))
        kinds = stored_kinds(quantised)
        prefix = {b: shared_prefix(t, reference.bases().get(b)) for b, t in quantised.bases().items()}
        tight = PROFILES["ggml-cpu" if quantised.activations != "none" else "fp32"]
        old = PROFILES[old_profile(quantised)]
        with tempfile.TemporaryDirectory(prefix="quant-selftest-") as tmp:
            control, qctx, rctx = _answers(QuantMutant(quantised.activations), quantised, reference, tmp)
            control_checks, _, _, control_old = _grades(control, qctx, rctx, tight, old, prefix)
            for spec in mutants:
                if not kinds & set(spec.needs) or (spec.activations and quantised.activations == "none"):
                    continue
                if progress is not None:
                    progress(f"{spec.name} on {qname}")
                got, qctx, rctx = _answers(spec.backend_class(quantised.activations), quantised, reference, tmp)
                checks, n, old_cases, old_failed = _grades(got, qctx, rctx, tight, old, prefix)
                out.append(QuantResult(spec.name, spec.breaks, qname, tight.name, sum(checks.values()) > 0,
                                       dict(checks), n, old.name, old_cases, old_failed, control_old,
                                       sum(control_checks.values()), spec.equivalent))
    return out


def table(results: list) -> list[str]:
    """The Markdown table: mutant, set, killed at the tight profile (by which checks), the old approach."""
    lines = ["| mutant | set | tight profile | killed (failing cases by check) | old approach | caught by it |",
             "|---|---|---|---|---|---|"]
    for r in results:
        checks = ", ".join(f"{k} {v}" for k, v in sorted(r.checks.items())) or "-"
        old = f"`{r.old_profile}`: {r.old_failed}/{r.old_cases} fail (control {r.old_control_failed})"
        killed = "**yes**" if r.killed else ("no: equivalent on these prompts" if r.equivalent else "**no**")
        lines.append(f"| {r.mutant} | {r.set} | `{r.tight}` | {killed} ({checks}) | {old} | "
                     f"{'yes' if r.old_caught else '**missed**'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conformance.selftest.quant", description=__doc__.splitlines()[0])
    ap.add_argument("--mutant", help="only the mutants whose name matches this regular expression")
    ap.add_argument("--json", help="write the results as JSON")
    args = ap.parse_args(argv)
    chosen = [m for m in QUANT_MUTANTS if args.mutant is None or re.search(args.mutant, m.name)]
    results = quant_selftest(chosen, progress=lambda text: print(f"[quant-selftest] {text}", file=sys.stderr,
                                                                 flush=True))
    print("\n".join(table(results)))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n", encoding="utf-8")
    return 0 if all((r.killed or r.equivalent) and r.control_failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
