"""Row summaries of a real-size base (conformance.sets.head.summaries_of), side by side in one run: the stored
summary (top-k ids and logits, log-sum-exp, margin) of R rows of a 262,144-token vocabulary, summarised in
256 MiB blocks on one thread (before) and in 32 MiB blocks on the machine's cores (summaries_of now); both give
the same arrays, bit for bit (each row's summary is its own). Beside it the base's logit scale
(conformance.sets.bounds.logit_scale, the largest finite |logit|): a masked |x| per 128 MiB block (before) against
the block's max and min, the mask only where a block has a non-finite value (now); the same value.

    python benchmarks/summaries.py --rows 256 [--vocab 262144] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

from conformance.sets.bounds import logit_scale
from conformance.sets.head import SUMMARY_LEAVES, row_summary, summaries_of


def serial_256mib(z: np.ndarray) -> dict:
    step = max(1, (1 << 28) // (8 * z.shape[-1]))
    parts = [row_summary(z[s:s + step]) for s in range(0, z.shape[0], step)]
    return {leaf: np.concatenate([p[leaf] for p in parts]) for leaf in SUMMARY_LEAVES}


def scale_masked(z: np.ndarray) -> float:
    step, best = max(1, (1 << 24) // z.shape[1]), 1.0
    for s in range(0, z.shape[0], step):
        block = z[s:s + step]
        best = max(best, float(np.max(np.abs(block), where=np.isfinite(block), initial=0.0)))
    return best


def best_of(fn, z: np.ndarray, repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(z)
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    z = np.random.default_rng(0).standard_normal((args.rows, args.vocab))
    before, a = best_of(serial_256mib, z, args.repeat)
    now, b = best_of(summaries_of, z, args.repeat)
    same = all(np.array_equal(a[k], b[k]) for k in SUMMARY_LEAVES)
    scale_before, s0 = best_of(scale_masked, z, args.repeat)
    scale_now, s1 = best_of(logit_scale, z, args.repeat)
    result = {"rows": args.rows, "vocab": args.vocab, "cores": os.cpu_count(), "serial_256mib_s": round(before, 3),
              "summaries_of_s": round(now, 3), "speedup": round(before / now, 2), "identical": same,
              "logit_scale_masked_s": round(scale_before, 3), "logit_scale_s": round(scale_now, 3),
              "logit_scale_same": s0 == s1}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
