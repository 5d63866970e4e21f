"""How often a check run builds the oracle, and what it costs: one tree against another, side by side.

    python benchmarks/check_oracle_builds.py [--tree OTHER_CHECKOUT] [--fixtures fixtures/e2b-mini ...]
                                             [--repeat 3] [--out OUT.json]

For this checkout and each ``--tree`` (another checkout of the project, e.g. ``git worktree add /tmp/old REV``),
in a fresh child process with that tree first on ``sys.path``: ``conformance check --backend refimpl`` and
``conformance explain --backend numpy-engine`` on the given sets (default: every bundled set), counting the
models built (``refimpl.model.Gemma4``: the backend's own, one per set it opens, and the harness's) and the
weight readers opened (``refimpl.weights.Gemma4Weights``: every model opens one, and the harness used to open
more), with the wall time of each command. The trees alternate run by run, so that a slower minute of the
machine falls on both; the table shows each figure's minimum and median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import refimpl.model, refimpl.weights
counts = {"Gemma4": 0, "Gemma4Weights": 0}
def counting(cls, name):
    init = cls.__init__
    def __init__(self, *a, **k):
        counts[name] += 1
        init(self, *a, **k)
    cls.__init__ = __init__
counting(refimpl.model.Gemma4, "Gemma4")
counting(refimpl.weights.Gemma4Weights, "Gemma4Weights")
from conformance.cli import main
argv = json.loads(sys.argv[1])
t = time.perf_counter()
code = main(argv)
print(json.dumps({"exit": code, "seconds": time.perf_counter() - t, **counts}))
"""


def run_child(tree: Path, argv: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv)], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=1800)
    if out.returncode not in (0, 1):
        raise SystemExit(f"{tree}: {' '.join(argv[:3])} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], help="another checkout to compare (repeatable)")
    ap.add_argument("--fixtures", nargs="+", default=None, help="the sets (default: every bundled set)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    trees = [ROOT] + [Path(t).resolve() for t in args.tree]
    fixtures = [str(Path(f).resolve()) for f in args.fixtures] if args.fixtures else []
    sets = ["--fixtures", *fixtures] if fixtures else []
    commands = {"check": ["check", "--backend", "refimpl", *sets, "-q"],
                "explain": ["explain", "--backend", "numpy-engine", *sets, "-q", "-k", "embeddings or full"]}
    runs: dict[str, dict[str, list[dict]]] = {str(t): {c: [] for c in commands} for t in trees}
    for i in range(args.repeat):
        for tree in trees:
            for name, argv in commands.items():
                r = run_child(tree, argv)
                runs[str(tree)][name].append(r)
                print(f"run {i + 1}/{args.repeat} {tree} {name}: {r}", file=sys.stderr)
    print(f"{'tree':<40} {'command':<8} {'Gemma4':>7} {'weights':>8} {'min s':>7} {'median s':>9}")
    for tree, by in runs.items():
        for name, rs in by.items():
            secs = [r["seconds"] for r in rs]
            print(f"{tree:<40} {name:<8} {rs[0]['Gemma4']:>7} {rs[0]['Gemma4Weights']:>8} {min(secs):>7.2f} "
                  f"{statistics.median(secs):>9.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"fixtures": fixtures or "bundled", "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
