"""How `conformance generate` scales over local worker processes.

    python benchmarks/generate_scaling.py (--preset NAME | --model DIR) [--prompts 16] [--prompt-tokens 1000]
                                          [--workers 1,2] [--no-all-cores] [--json OUT.json]

Writes a prompts file of ``--prompts`` token prompts (``--prompt-tokens`` ids each, drawn from
``numpy default_rng(0)`` over the synthetic tokenizer's ordinary range), then times, one after the
other on the same machine, ``conformance generate ... --prompts FILE --workers k`` for every k of
``--workers`` (each into its own new directory, timed from process start to the published set):

- the **single worker** (k = 1): one process computing every job, with one BLAS thread
  (``OPENBLAS_NUM_THREADS=1``): the resources each of the k workers gets when k equals the cores;
- k > 1: k worker processes; `generate` gives each ``cores // k`` BLAS threads.

and reports ``T_k / (T_1 / k)`` (1.0 is perfect scaling; the target is at most 1.3), checks that every
run wrote the same cases and the same logits (the largest difference between runs is reported: OpenBLAS
rounds large products differently with another thread count, at about 1e-13), and, for context, also
times ``--workers 1`` with every core's BLAS threads (``T_1 all cores``; ``--no-all-cores`` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def write_prompts(path: Path, n: int, tokens: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for k in range(n):
            ids = [2] + [int(t) for t in rng.integers(5, 512, tokens - 1)]
            f.write(json.dumps({"id": f"p{k}", "tokens": ids}) + "\n")


def contents(out: Path) -> tuple[bytes, dict[str, np.ndarray]]:
    """(cases.json without its float annotations, every stored array) of a set."""
    sys.path.insert(0, str(ROOT))
    from refimpl.safetensors_io import TensorStore

    cases = json.loads((out / "cases.json").read_text())["cases"]
    ids = json.dumps([c["id"] for c in cases]).encode()
    arrays = {}
    for f in sorted(out.glob("base-*.safetensors")):
        store = TensorStore(f)
        arrays.update({f"{f.name}/{name}": store.get(name) for name in store.names if name != "top_ids"})
    return ids, arrays


def largest_difference(a, b) -> float:
    if a[0] != b[0] or set(a[1]) != set(b[1]):
        return float("inf")
    return max(float(np.max(np.abs(a[1][k] - b[1][k]), initial=0.0)) for k in a[1])


def run(source: list[str], prompts: Path, out: Path, workers: int, threads: int | None) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if threads is not None:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(threads)
    cmd = [sys.executable, "-m", "conformance.cli", "generate", *source, "--prompts", str(prompts), "--out", str(out),
           "--workers", str(workers), "-q"]
    print(f"  {' '.join(cmd[3:])}" + (f"  (BLAS threads {threads})" if threads else ""), file=sys.stderr, flush=True)
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"generate failed (exit {done.returncode}): {done.stderr.strip()}")
    print(f"    {elapsed:.1f} s", file=sys.stderr, flush=True)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="a refimpl synthetic preset (e.g. e2b-mini)")
    src.add_argument("--model", help="a checkpoint directory")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--workers", default=None, help="comma-separated k values (default: 1 and every power of 2 up to "
                                                    "the cores)")
    ap.add_argument("--no-all-cores", action="store_true",
                    help="skip the context run of --workers 1 with every core's BLAS threads")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    ks = ([int(k) for k in args.workers.split(",")] if args.workers
          else sorted({1, *[2**i for i in range(1, 8) if 2**i <= cores()], cores()}))
    if 1 not in ks:
        ks = [1, *ks]
    source = ["--preset", args.preset] if args.preset else ["--model", str(Path(args.model).resolve())]
    command = ["python", "benchmarks/generate_scaling.py", *(argv if argv is not None else sys.argv[1:])]
    result: dict = {"command": " ".join(command),
                    "cores": cores(), "source": source, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                    "runs": {}}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        prompts = Path(tmp, "prompts.jsonl")
        write_prompts(prompts, args.prompts, args.prompt_tokens)
        first = None
        worst = 0.0
        for k in [*ks] + ([] if args.no_all_cores else ["all"]):
            out = Path(tmp, f"run-{k}", "set")  # one set name: case ids begin with it
            out.parent.mkdir()
            if k == "all":
                result["t1_all_cores_s"] = run(source, prompts, out, 1, cores())
            else:
                result["runs"][str(k)] = {"seconds": run(source, prompts, out, k, 1 if k == 1 else None)}
            got = contents(out)
            result["jobs"] = len(json.loads((out / "manifest.json").read_text())["bases"])  # one job per base
            first = first or got
            worst = max(worst, largest_difference(first, got))
            shutil.rmtree(out)
        result["max_abs_difference_between_runs"] = worst
    t1 = result["runs"]["1"]["seconds"]
    lines = [f"{' '.join(source)}, {args.prompts} prompts of {args.prompt_tokens} tokens ({result['jobs']} jobs), "
             f"{cores()} cores; largest difference between the runs' logits: "
             f"{result['max_abs_difference_between_runs']:.1e}", "",
             "| workers k | time (s) | T_k / (T_1 / k) |", "|---|---|---|"]
    for k in ks:
        r = result["runs"][str(k)]
        r["ratio_to_ideal"] = r["seconds"] / (t1 / k)
        lines.append(f"| {k} | {r['seconds']:.1f} | {r['ratio_to_ideal']:.2f} |")
    if "t1_all_cores_s" in result:
        lines.append(f"| 1, all {cores()} cores' BLAS threads | {result['t1_all_cores_s']:.1f} | |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines))
    return 0 if result["max_abs_difference_between_runs"] < 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
