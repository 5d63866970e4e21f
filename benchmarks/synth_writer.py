"""The published-shape synthesiser's writer, side by side in one run: `refimpl synth --preset P --layers N`
written three ways: every tensor drawn and encoded in the writer's thread with the one-pass bf16 rounding (the
commit before), the same with the rounding in cache-sized blocks (refimpl.safetensors_io.f32_to_bf16 now), and the
next tensors drawn on the oracle's threads (now: ahead = threads(), each tensor from its own generator). The
three files are hashed and must be equal (the bytes depend on neither).

    python benchmarks/synth_writer.py --preset 31b --layers 2 --dir /tmp/synth-bench [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from refimpl import safetensors_io, synth
from refimpl.threads import threads


def one_pass_bf16(x: np.ndarray) -> np.ndarray:
    """f32_to_bf16 of the commit before: whole-array uint32 temporaries."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        rounded = np.where(nan, (u >> 16) | 0x0040, rounded)
    return rounded.astype(np.uint16)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def timed_write(preset: str, layers: int, out: Path, ahead: int, blocked: bool) -> tuple[float, str, int]:
    """Seconds to write the checkpoint with ``ahead`` tensors drawn ahead (the bf16 rounding blocked or one
    pass), its weights' sha256 and size."""
    real, rounding = synth.threads, safetensors_io.f32_to_bf16
    synth.threads = lambda: ahead
    if not blocked:
        safetensors_io.f32_to_bf16 = one_pass_bf16
    try:
        start = time.perf_counter()
        synth.write_published_checkpoint(preset, 0, out, layers=layers, overwrite=True)
        seconds = time.perf_counter() - start
    finally:
        synth.threads, safetensors_io.f32_to_bf16 = real, rounding
    weights = out / "model.safetensors"
    return seconds, sha256(weights), weights.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="e2b", choices=sorted(synth.PUBLISHED))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/synth-bench", help="where the checkpoints are written (removed after)")
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    base = Path(args.dir)
    now = threads()
    rows = {}
    try:
        runs = (("before: one-pass rounding, ahead 0", 0, False), ("blocked rounding, ahead 0", 0, True),
                (f"now: blocked, ahead {now}", now, True))
        for label, ahead, blocked in runs:
            seconds, digest, size = timed_write(args.preset, args.layers, base / label.split(":")[0], ahead, blocked)
            rows[label] = {"ahead": ahead, "blocked_rounding": blocked, "seconds": round(seconds, 2),
                           "sha256": digest, "bytes": size}
            print(f"{args.preset} cut to {args.layers} layers, {label}: {seconds:.1f} s, {size / 2**30:.2f} GiB")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    before, _, after = rows.values()
    same = len({row["sha256"] for row in rows.values()}) == 1
    print(f"same bytes: {same}; now {before['seconds'] / after['seconds']:.2f}x before")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "layers": args.layers, "cores": os.cpu_count(),
                                               "threads": now, "runs": rows, "same_bytes": same}, indent=1) + "\n")
    if not same:
        raise SystemExit("the checkpoints differ")


if __name__ == "__main__":
    main()
