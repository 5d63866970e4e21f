"""Fixture sets stored as full logits against compact sets (hidden states + row summaries), side by side.

    python benchmarks/fixtures.py (--model DIR | --preset e2b [--layers N]) [--workers W] [-k REGEX]
                                  [--backend refimpl] [--backend transformers:dtype=float32 ...] [--json OUT]

With ``--preset``, first writes the synthetic checkpoint (``refimpl synth --preset P [--layers N]``; not
timed as part of the comparison). Then, one after the other on the same machine and checkpoint:

1. ``conformance generate --model CKPT --cases text --store logits`` and ``--store hidden`` (the default
   text matrix: bases A, B, C, G), each timed from process start to the published set; the size of each
   set on disk (all files, and per base file).
2. For every ``--backend`` (default: refimpl): ``conformance check --backend B --fixtures SET -k REGEX``
   on each of the two sets, timed; and from the JSON report the sum of the cases' backend durations
   (the backend's own forward passes). The difference between the two check times is what rebuilding
   the logits through the checkpoint's head costs at check time (once per base used by the selection).

Prints a Markdown table and writes the numbers as JSON (``--json``). Exit 1 when the two sets do not
hold the same cases or a check does not pass (exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PYTHONUNBUFFERED="1")


def timed(cmd: list[str], what: str) -> tuple[float, subprocess.CompletedProcess]:
    print(f"  {what}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    print(f"    {elapsed:.1f} s (exit {done.returncode})", file=sys.stderr, flush=True)
    return elapsed, done


def sizes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(d.iterdir())}


def backend_args(spec: str) -> list[str]:
    """'transformers:dtype=float32,device=cuda' -> --backend transformers --backend-option dtype=float32 ..."""
    name, _, opts = spec.partition(":")
    out = ["--backend", name]
    for o in filter(None, opts.split(",")):
        out += ["--backend-option", o]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint directory")
    src.add_argument("--preset", help="a refimpl synth preset (e.g. e2b: the published E2B shapes)")
    ap.add_argument("--layers", type=int, help="with --preset: keep the first N layers (refimpl synth --layers)")
    ap.add_argument("--workers", type=int, default=None, help="conformance generate --workers (default: the CPU count)")
    ap.add_argument("-k", default="/(full|last)/", help="the cases checked (default: %(default)s)")
    ap.add_argument("--backend", action="append", metavar="NAME[:OPT=V,...]",
                    help="a backend to check both sets with (repeat; default: refimpl)")
    ap.add_argument("--profile", action="append", metavar="BACKEND=PROFILE",
                    help="the profile for a backend's checks, e.g. transformers=fp32 (default: the backend's own)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    backends = args.backend or ["refimpl"]
    profiles = dict(p.split("=", 1) for p in args.profile or ())
    py = [sys.executable, "-m"]
    command = ["python", "benchmarks/fixtures.py", *(argv if argv is not None else sys.argv[1:])]
    result: dict = {"command": " ".join(command),
                    "cores": os.cpu_count(), "select": args.k, "generate": {}, "check": {}}
    ok = True
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        if args.preset:
            ckpt = Path(tmp, "ckpt")
            cmd = py + ["refimpl.cli", "synth", "--preset", args.preset, "--out", str(ckpt)] + \
                (["--layers", str(args.layers)] if args.layers else [])
            seconds, done = timed(cmd, "checkpoint")
            if done.returncode != 0:
                raise SystemExit(f"refimpl synth failed: {done.stderr.strip()[-2000:]}")
            result["checkpoint"] = {"preset": args.preset, "layers": args.layers, "synth_s": seconds}
        else:
            ckpt = Path(args.model).resolve()
            result["checkpoint"] = {"model": str(ckpt)}
        result["checkpoint"]["bytes"] = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
        sets = {}
        for store in ("logits", "hidden"):
            out = Path(tmp, store, "set")  # one set name: case ids begin with it
            cmd = py + ["conformance.cli", "generate", "--model", str(ckpt), "--cases", "text", "--store", store,
                        "--out", str(out), "-q"] + (["--workers", str(args.workers)] if args.workers else [])
            seconds, done = timed(cmd, f"generate --store {store}")
            if done.returncode != 0:
                raise SystemExit(f"generate --store {store} failed: {done.stderr.strip()[-2000:]}")
            files = sizes(out)
            m = json.loads((out / "manifest.json").read_text())
            result["generate"][store] = {"seconds": seconds, "bytes": sum(files.values()), "files": files,
                                         "rows": sum(b["length"] for b in m["bases"].values()),
                                         "cases": m["cases"],
                                         "consistency": m["provenance"]["cross_checks"][0]["agreement"]}
            sets[store] = out
        same = (sets["logits"] / "cases.json").read_text() == (sets["hidden"] / "cases.json").read_text()
        result["same_cases"] = same
        ok &= same
        for spec in backends:
            name = spec.partition(":")[0]
            for store, path in sets.items():
                report = Path(tmp, f"report-{name}-{store}.json")
                cmd = py + ["conformance.cli", "check", *backend_args(spec), "--fixtures", str(path), "-k", args.k,
                            "--json", str(report)] + (["--profile", profiles[name]] if name in profiles else [])
                seconds, done = timed(cmd, f"check {spec} on the {store} set")
                r = json.loads(report.read_text()) if report.is_file() else {}
                cases = r.get("cases", [])
                result["check"].setdefault(spec, {})[store] = {
                    "seconds": seconds, "exit": done.returncode, "cases": len(cases),
                    "profile": (r.get("profile") or {}).get("name"),
                    "by_status": (r.get("summary") or {}).get("by_status"),
                    "backend_seconds": sum(c.get("duration") or 0.0 for c in cases)}
                ok &= done.returncode == 0
                if done.returncode != 0:
                    print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
    g = result["generate"]
    lines = [f"checkpoint: {result['checkpoint']}; {result['cores']} cores; {g['hidden']['rows']} base rows, "
             f"{g['hidden']['cases']} cases; same cases: {same}", "",
             "| storage | generate (s) | set size (MB) | per row (KB) |", "|---|---|---|---|"]
    for store in ("logits", "hidden"):
        lines.append(f"| {store} | {g[store]['seconds']:.1f} | {g[store]['bytes'] / 1e6:.2f} | "
                     f"{g[store]['bytes'] / g[store]['rows'] / 1e3:.1f} |")
    result["compact_fraction"] = g["hidden"]["bytes"] / g["logits"]["bytes"]
    lines += [f"\ncompact / full-logits size: {100 * result['compact_fraction']:.3f} %", "",
              f"| backend | set | check -k {args.k} (s) | cases | backend forward passes (s) | exit |",
              "|---|---|---|---|---|---|"]
    for spec, by in result["check"].items():
        for store, c in by.items():
            lines.append(f"| {spec} | {store} | {c['seconds']:.1f} | {c['cases']} | {c['backend_seconds']:.1f} | "
                         f"{c['exit']} |")
        by["rebuild_overhead_s"] = by["hidden"]["seconds"] - by["logits"]["seconds"]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
