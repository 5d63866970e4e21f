"""Hashing a sharded checkpoint for a set's run key and integrity check (conformance.sets.checkpoint), side by
side in one run: the shards one after another (before) and on up to ``cores()`` threads at once
(``DigestCache.sha256_all``, now); the same digests. The files are written first and read once before timing,
so both read from the page cache (the cold-disk case is bounded by the disk, not measured here); ``rehash``:
the digest cache is not used.

    python benchmarks/digests.py [--shards 4] [--mib 512] [--repeat 3] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from conformance.sets import checkpoint
from conformance.sets.checkpoint import DigestCache
from refimpl.threads import cores


def timed(files: list[Path], workers: int, repeat: int) -> tuple[float, list[str]]:
    real = checkpoint.cores
    checkpoint.cores = lambda: workers
    try:
        best, digests = float("inf"), []
        for _ in range(repeat):
            start = time.perf_counter()
            digests = DigestCache(rehash=True, path=Path(os.devnull)).sha256_all(files)
            best = min(best, time.perf_counter() - start)
        return best, digests
    finally:
        checkpoint.cores = real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--mib", type=int, default=512, help="size of each shard")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="where the shards are written (default: a temporary directory)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        files = [Path(tmp) / f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors" for i in range(args.shards)]
        block = os.urandom(1 << 20)
        for f in files:
            with open(f, "wb") as out:
                for _ in range(args.mib):
                    out.write(block)
        timed(files, 1, 1)  # into the page cache
        before, want = timed(files, 1, args.repeat)
        now, got = timed(files, min(args.shards, cores()), args.repeat)
    assert got == want, "the digests differ"
    gib = args.shards * args.mib / 1024
    result = {"shards": args.shards, "mib_each": args.mib, "cores": cores(), "one_after_another_s": round(before, 3),
              "side_by_side_s": round(now, 3), "speedup": round(before / now, 2),
              "gib_per_s": {"before": round(gib / before, 2), "now": round(gib / now, 2)}}
    print(f"{args.shards} shards of {args.mib} MiB on {cores()} cores: one after another {before:.2f} s "
          f"({gib / before:.2f} GiB/s), side by side {now:.2f} s ({gib / now:.2f} GiB/s): x{before / now:.2f}, "
          "the same digests")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
