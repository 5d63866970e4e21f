"""The quantisation mutants (conformance/selftest/quant.py): the oracle backend on the bundled quantised sets' own
checkpoints with one dequantisation or activation bug planted. Every mutant but the one shown equivalent is
killed at the tight profile (ggml-cpu for the GGUF sets, fp32 for the MLX one) while the control passes there; the
old approach (the rows against the unquantised oracle at q4) tells a mutant from the control only where the
control passes it, which on the e2b-mini sets it does not (their Q4_0 and MLX 4-bit quantisation loss alone fails
q4). The whole table takes about 80 s on two cores (nine engine runs of 52 cases), built once for the module."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.cli import main
from conformance.selftest.quant import QUANT_MUTANTS, quant_selftest, table
from conformance.sets import bundled_set, load_set
from refimpl import Gemma4

CLOSENESS_OR_IDENTITY = {"max_abs", "max_rel", "nmse", "cosine", "kl", "kl_mean", "delta_p", "identity"}


@pytest.fixture(scope="module")
def results():
    """Every quantised mutant on every bundled quantised set it applies to, once for the module's tests: about
    60 s on two cores (each mutant answers its sets' cases and is graded at two profiles, as the command does)."""
    return quant_selftest()


def test_every_mutant_runs_where_its_types_are(results):
    where = {(r.mutant, r.set) for r in results}
    assert where == {("q4_0-nibbles-swapped", "e2b-mini-q4-0"), ("one-tensor-wrong-type", "e2b-mini-q4-0"),
                     ("other-kernel-path-rounding", "e2b-mini-q4-0"),
                     ("k-quant-scale-min-off-by-one", "e2b-256-mini-q4km"), ("k-quant-dmin-sign", "e2b-256-mini-q4km"),
                     ("q8_k-scale-positive", "e2b-256-mini-q4km"), ("mlx-bias-dropped", "e2b-mini-mlx-q4"),
                     ("mlx-group-size-misread", "e2b-mini-mlx-q4")}
    assert {m.name for m in QUANT_MUTANTS} == {m for m, _ in where}


def test_each_mutant_is_killed_at_the_tight_profile_and_the_control_passes(results):
    for r in results:
        assert r.control_failed == 0, r
        assert r.tight == ("fp32" if r.set == "e2b-mini-mlx-q4" else "ggml-cpu")
        if r.equivalent is None:
            assert r.killed and set(r.checks) <= CLOSENESS_OR_IDENTITY, r
        else:
            assert not r.killed, r


def test_the_old_approach_misses_what_its_control_fails(results):
    """On e2b-256-mini-q4km the control passes q4 against the unquantised oracle and every planted bug there fails
    it; on the e2b-mini sets the control fails nearly every case at q4, so the old approach catches nothing there."""
    for r in results:
        if r.set == "e2b-256-mini-q4km":
            assert r.old_control_failed == 0 and r.old_caught, r
        else:
            assert r.old_control_failed >= 0.9 * r.old_cases and not r.old_caught, r
    lines = table(results)
    assert lines[0].startswith("| mutant | set | tight profile |") and len(lines) == len(results) + 2


def test_the_other_kernel_path_is_equivalent_on_the_bundled_prompts():
    """The x86 and reference Q8_0 rules give the same forward on every base of e2b-mini-q4-0 (no activation lands
    on a half-way point or a tie): the mutant computes the control's rows, to rounding."""
    fs = load_set(bundled_set("e2b-mini-q4-0"))
    path = fs.model_record["path"]
    x86, ref = (Gemma4(path, activations=f"ggml-cpu/{p}/gelu-table") for p in ("x86", "ref"))
    for tokens in fs.bases().values():
        a, b = (m.forward([int(t) for t in tokens], rows="all") for m in (x86, ref))
        assert float(np.max(np.abs(a - b))) <= 1e-12 * float(np.max(np.abs(a)))


def test_a_mutant_is_a_backend_of_its_own(capsys):
    """A planted engine runs through conformance check by module:attr, and fails its set."""
    code = main(["check", "--backend", "conformance.selftest.quant:KQuantDminSign", "--backend-option",
                 "activations=ggml-cpu/x86/f16-kv/gelu-table", "--fixtures", str(bundled_set("e2b-256-mini-q4km")),
                 "--profile", "ggml-cpu", "-q"])
    assert code == 1 and "52 cases: 52 fail" in capsys.readouterr().out
