"""Where one oracle forward spends its time: cProfile of ``Gemma4.forward`` on a real-shape checkpoint.

    python benchmarks/profile_forward.py --model DIR [--rows last|all] [--weight-cache 0|all] [--repeat 2] [--top 40]
                                         [--device cpu|cuda]

Runs one untimed forward (it pulls the checkpoint into the page cache, and with ``--weight-cache all``
fills the cache), ``--repeat`` timed ones, then one under cProfile, on ``--tokens`` ids of
``benchmarks/prefill.py``'s prompt. Prints the times, then the ``--top`` functions by own time and the
refimpl functions by cumulative time. The times of the pool's threads are counted where Python's
profiler sees them (Python 3.12 counts them in the calls they run), so read the cumulative times of
the model's steps (``layer``, ``attention_block``, ``ffn_block``, ``logits_of``) as wall-clock shares
of the forward and the own times as where the work is. With ``--device cuda`` the GPU works while Python goes
on: the own times are the time to launch the kernels, and a wait for the device shows up where a value comes
back to the host (a finiteness check's ``bool``, ``get``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import refimpl  # noqa: E402,F401  (first: OpenBLAS's thread timeout)
from refimpl.model import Gemma4  # noqa: E402 - after sys.path and refimpl
from refimpl.threads import threads  # noqa: E402 - after sys.path and refimpl

sys.path.insert(0, str(ROOT / "benchmarks"))
from prefill import prompt_ids  # noqa: E402 - after sys.path and refimpl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (e.g. from refimpl synth --preset e2b)")
    ap.add_argument("--rows", choices=("last", "all"), default="last")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--weight-cache", default="0", help="the oracle's weight cache: 0 (streamed) or all")
    ap.add_argument("--repeat", type=int, default=2, help="timed forwards before the profiled one")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        ap.error(f"--model: {args.model} is not a checkpoint directory (no config.json)")
    if args.tokens < 1 or args.repeat < 0 or args.top < 1:
        ap.error("--tokens and --top must be at least 1, --repeat at least 0")
    ids = prompt_ids(args.tokens)
    model = Gemma4(args.model, weight_cache=args.weight_cache, device=args.device)
    t = time.perf_counter()
    model.forward(ids, rows=args.rows)
    first = time.perf_counter() - t
    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        model.forward(ids, rows=args.rows)
        times.append(time.perf_counter() - t)
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    model.forward(ids, rows=args.rows)
    profile.disable()
    profiled = time.perf_counter() - t
    best = f"{min(times):.3f} s" if times else "-"
    print(f"{Path(args.model).name}: rows {args.rows}, {args.tokens} tokens, weight cache {args.weight_cache}, "
          f"threads {threads()}, device {args.device}: first {first:.2f} s, best {best}, profiled {profiled:.3f} s")
    for order, restrict in (("tottime", ()), ("cumtime", ("refimpl",))):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(order).print_stats(*restrict, args.top)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
