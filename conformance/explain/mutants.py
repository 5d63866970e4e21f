"""The self-test of ``conformance explain`` and of the check's diagnosis line: for each mutant of the zoo,
run the check on a set that kills it, take its first failing case, and ask

* the diagnosis: is the mutant's bug class (its row of docs/bug-classes.md's summary table) among the at most
  three classes the diagnosis line names?
* explain (for a mutant whose bug sits at a point of the model, ``Mutant.where``): is the first point where
  the mutant leaves the floor the layer and sub-block where its code changed?

    python -m conformance.explain.mutants [--mutant REGEX] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

from refimpl.config import TextConfig, load_config

from ..check.diagnosis import summary_class
from ..check.profiles import PROFILES
from ..check.runner import run
from ..check.session import materialise
from ..selftest.mutants import MUTANTS, Mutant
from ..sets.bundled import bundled_sets
from ..sets.integrity import load_set
from .run import explain

__all__ = ["MutantFinding", "expected_point", "locate"]

DEFAULT_SET = "all-features"  # the set of the mutants that every set can kill


def expected_point(where: str, cfg: TextConfig) -> str:
    """A ``Mutant.where`` resolved to a trace point of the checkpoint of ``cfg``."""
    if "@" not in where:
        return where
    sub, rule = where.split("@")
    layers = cfg.layers
    if rule.isdigit():
        i = int(rule)
    elif rule == "full":
        i = next(k for k, s in enumerate(layers) if not s.is_sliding)
    elif rule == "sliding":
        i = next(k for k, s in enumerate(layers) if s.is_sliding)
    elif rule in ("shared", "shared-1"):
        i = cfg.first_shared_layer - (rule == "shared-1")
    elif rule == "keqv":
        i = next(k for k, s in enumerate(layers) if s.k_eq_v)
    elif rule == "wrong-source":
        def first_of(kind: bool) -> int:
            return next(k for k, s in enumerate(layers) if s.owns_kv and s.is_sliding == kind)
        i = next(k for k, s in enumerate(layers) if not s.owns_kv and s.kv_source != first_of(s.is_sliding))
    else:
        raise ValueError(f"unknown layer rule {rule!r} in {where!r}")
    return f"layers.{i}.{sub}"


@dataclass
class MutantFinding:
    mutant: str
    bug_class: str
    set: str
    case: str | None
    diagnosis: str | None
    diagnosis_names_class: bool
    expected_point: str | None  # None: not a point of the model
    found_point: str | None
    found_rows: list[str] | None
    located: bool | None  # None when not a point

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _named_classes(diagnosis: str | None) -> list[str]:
    """The classes a diagnosis line names (after "Likely")."""
    if not diagnosis or "Likely " not in diagnosis:
        return []
    tail = diagnosis.rsplit("Likely ", 1)[1]
    return [part.split(" (")[0].strip() for part in tail.split("; ")]


def locate(m: Mutant, sets: dict, profile=PROFILES["fp32"]) -> MutantFinding:
    """Check ``m`` on its first kill set (``all-features`` when any set kills it), then explain its first
    failing case."""
    name = m.kill_sets[0] if m.kill_sets else DEFAULT_SET
    fs = sets[name]
    result = run(m.backend(), [fs], profile)
    first = result.first_failure()
    want = summary_class(m.bug_class)
    if first is None:
        return MutantFinding(m.name, m.bug_class, name, None, None, False, None, None, None, None)
    named = _named_classes(first.diagnosis)
    finding = MutantFinding(m.name, m.bug_class, name, first.id, first.diagnosis, want in named[:3], None, None,
                            None, None)
    if m.where is None:
        return finding
    explained = explain(m.backend(), [fs], profile, select=f"^{re.escape(first.id)}$")[0]
    found = explained.first_divergence
    with tempfile.TemporaryDirectory() as tmp:
        finding.expected_point = expected_point(m.where, load_config(materialise(fs, tmp)))
    finding.found_point = None if found is None else found["point"]
    finding.found_rows = None if found is None else found["rows"]
    finding.located = finding.found_point == finding.expected_point
    return finding


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.explain.mutants", description=__doc__)
    parser.add_argument("--mutant", metavar="REGEX", help="only the mutants whose name matches")
    parser.add_argument("--json", metavar="OUT", help="write the findings as JSON")
    args = parser.parse_args(argv)
    sets = {fs.manifest["name"]: fs for fs in (load_set(p) for p in bundled_sets())}
    chosen = [m for m in MUTANTS if args.mutant is None or re.search(args.mutant, m.name)]
    findings = []
    for m in chosen:
        f = locate(m, sets)
        findings.append(f)
        where = "-" if f.located is None else ("named" if f.located else f"MISSED (found {f.found_point})")
        print(f"{m.name:<32} {f.bug_class:<12} diagnosis {'ok' if f.diagnosis_names_class else 'MISSED':<6} "
              f"explain {where:<10} expected {f.expected_point or '-'}", flush=True)
    points = [f for f in findings if f.located is not None]
    print(f"explain named the point of {sum(f.located for f in points)} of {len(points)} mutants with a point; "
          f"the diagnosis named the class of {sum(f.diagnosis_names_class for f in findings)} of {len(findings)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([f.to_json() for f in findings], fh, indent=1)
    return 0 if all(f.diagnosis_names_class for f in findings) else 1


if __name__ == "__main__":
    sys.exit(main())
