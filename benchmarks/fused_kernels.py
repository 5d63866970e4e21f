"""The GPU oracle with ``refimpl/device_kernels.py``'s fused kernels on and off, side by side in one process.

    python benchmarks/fused_kernels.py --model DIR [--rows last|all] [--tokens 512] [--repeat 4] [--json OUT]

One model on the GPU with every weight cached there (``weight_cache="all"``), one untimed forward (it fills
the cache and compiles the kernels), then ``--repeat`` rounds of two timed forwards, fused and unfused in turn
(unfused: the schedule runs ``ops.py``'s compositions, as on the CPU), each timed from a synchronised device
to a synchronised device. Prints the times (sorted), the best of each and the largest |logit difference| between
the two. Needs CuPy and a CUDA device (benchmarks/README.md, "fused_kernels.py").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import refimpl  # noqa: E402,F401  (first: OpenBLAS's thread timeout)
from refimpl import device_kernels  # noqa: E402 - after sys.path and refimpl
from refimpl.errors import InputError  # noqa: E402 - after sys.path and refimpl
from refimpl.model import Gemma4  # noqa: E402 - after sys.path and refimpl

sys.path.insert(0, str(ROOT / "benchmarks"))
from prefill import prompt_ids  # noqa: E402 - after sys.path and refimpl


def timed(model: Gemma4, ids: np.ndarray, rows: str, fused: bool) -> tuple[float, np.ndarray]:
    """One forward with the fused kernels on or off; (seconds, logits)."""
    sync = model.xp.cuda.Device().synchronize
    with device_kernels.switched(fused):
        sync()
        t = time.perf_counter()
        logits = model.forward(ids, rows=rows)
        sync()
    return time.perf_counter() - t, logits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (e.g. from refimpl synth --preset e2b)")
    ap.add_argument("--rows", choices=("last", "all"), default="last")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=4, help="rounds of one fused and one unfused forward")
    ap.add_argument("--json", metavar="OUT", help="write the numbers here")
    args = ap.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        ap.error(f"--model: {args.model} is not a checkpoint directory (no config.json)")
    if args.tokens < 1 or args.repeat < 1:
        ap.error("--tokens and --repeat must be at least 1")
    try:
        model = Gemma4(args.model, weight_cache="all", device="cuda")
    except InputError as e:
        print(f"fused_kernels.py: {e}", file=sys.stderr)
        return 2
    ids = prompt_ids(args.tokens)
    model.forward(ids, rows=args.rows)  # the cache filled, the kernels compiled
    times: dict[str, list[float]] = {"fused": [], "unfused": []}
    logits = {}
    for _ in range(args.repeat):
        for mode in times:
            seconds, logits[mode] = timed(model, ids, args.rows, mode == "fused")
            times[mode].append(seconds)
    result = {"model": args.model, "rows": args.rows, "tokens": args.tokens, "layers": model.cfg.num_hidden_layers,
              "gpu": model.xp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "times_s": {k: sorted(v) for k, v in times.items()},
              "best_s": {k: min(v) for k, v in times.items()},
              "max_abs_diff": float(np.max(np.abs(logits["fused"] - logits["unfused"])))}
    print(f"{Path(args.model).name}: {model.cfg.num_hidden_layers} layers, {args.tokens} tokens, rows {args.rows}, "
          f"{result['gpu']}, weight cache all")
    for mode, best in result["best_s"].items():
        print(f"  {mode:8s} best {best:.4f} s  (all: {', '.join(f'{t:.4f}' for t in result['times_s'][mode])})")
    print(f"  max |logit diff| fused vs unfused {result['max_abs_diff']:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
