"""The block sizes of ``refimpl/threads.py`` and the bf16 decoding, swept on one machine.

    python benchmarks/blocks.py --model DIR --what rowwise|decode [--threads 8,16]

``--what rowwise``: the row-wise steps of ``refimpl.schedule`` on the shapes of a 512-token E2B prefill
(GeGLU on [512, 6144], the norms on [512, 1536] and [512, 8, 256], softmax on [1, 8, 512, 512], RoPE on
[512, 8, 256]; a plain addition for scale), on one thread, then with ``ROWWISE_BLOCK`` 2^15, 2^16, 2^17
and block growth x1, x2, x4 (``scaled``) on each ``--threads`` count: best of 5, in ms.

``--what decode``: ``TensorStore.read`` of 32,768 rows of the checkpoint's LM head into a kept buffer
(decoding to memory, as for a product of many rows) and ``Gemma4Weights.product`` of one row with the
same rows (the streamed matrix-vector product), on 1 thread and each ``--threads`` count, with
``DECODE_BLOCK`` = ``STREAM_VALUES`` 2^16, 2^17, 2^18, block growth x1, x2, x4, and two ways of decoding
bf16: ``widen`` (``decode_block``: one shift that widens to uint32, then the conversion) and ``3pass``
(widen, shift in place, convert: the earlier decoder), in G values/s.

Module constants are set for the sweep (nothing is written). A checkpoint from ``refimpl synth --preset
e2b [--layers 10]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import refimpl  # noqa: E402,F401  (first: OpenBLAS's thread timeout)

# isort: split
import numpy as np  # noqa: E402 - after sys.path and refimpl

from refimpl import safetensors_io as sio  # noqa: E402 - after sys.path and refimpl
from refimpl import schedule, threads  # noqa: E402 - after sys.path and refimpl
from refimpl import weights as weights_module  # noqa: E402 - after sys.path and refimpl
from refimpl.model import Gemma4  # noqa: E402 - after sys.path and refimpl

sys.path.insert(0, str(ROOT / "benchmarks"))
from prefill import best_of  # noqa: E402 - after sys.path and refimpl


def best_ms(fn, repeat: int = 5) -> float:
    """The shortest of ``repeat`` calls after a warm-up one, in ms."""
    return 1e3 * best_of(fn, repeat, warm_up=True)


def set_growth(factor: int) -> None:
    """Blocks ``factor`` times their base at every thread count (``scaled`` as each module imported it)."""
    def grown(base: int) -> int:
        return base * factor
    threads.scaled = sio.scaled = weights_module.scaled = grown


def decode_three_passes(src: np.ndarray, dtype: str, dst: np.ndarray, scratch: np.ndarray) -> None:
    """The earlier decoder: widen to uint32, shift in place, convert."""
    if dtype != "BF16":
        np.copyto(dst, src)
        return
    bits = scratch[:src.size]
    np.copyto(bits, src)
    np.left_shift(bits, 16, out=bits)
    np.copyto(dst, bits.view(np.float32))


def sweep_rowwise(counts: list[int]) -> None:
    rng = np.random.default_rng(1)
    T = 512
    g, u, h = rng.standard_normal((T, 6144)), rng.standard_normal((T, 6144)), rng.standard_normal((T, 1536))
    q, scores = rng.standard_normal((T, 8, 256)), rng.standard_normal((1, 8, T, T))
    cos, sin, hw = rng.standard_normal((T, 128)), rng.standard_normal((T, 128)), rng.standard_normal(1536)
    steps = {"geglu [512,6144]": lambda: schedule.geglu(g, u),
             "rms_norm [512,1536]": lambda: schedule.rms_norm(h, hw, 1e-6),
             "rms_norm [512,8,256]": lambda: schedule.rms_norm(q, None, 1e-6),
             "softmax [1,8,512,512]": lambda: schedule.softmax(scores, axis=-1),
             "apply_rope [512,8,256]": lambda: schedule.apply_rope(q, cos, sin), "add [512,1536]": lambda: h + h}
    for name, fn in steps.items():
        with threads.use_threads(1):
            line = f"{name:24s} 1 thread {best_ms(fn):.2f} ms;"
        for block in (1 << 15, 1 << 16, 1 << 17):
            threads.ROWWISE_BLOCK = block
            for factor in (1, 2, 4):
                set_growth(factor)
                for n in counts:
                    with threads.use_threads(n):
                        line += f" 2^{block.bit_length() - 1}x{factor}/{n}: {best_ms(fn):.2f}"
        print(line, flush=True)


def sweep_decode(model: str, counts: list[int]) -> None:
    m = Gemma4(model)
    w, store = m.weights, m.weights.store
    rows = 32768
    buf = np.empty((rows, m.cfg.hidden_size))
    x = np.random.default_rng(1).standard_normal((1, m.cfg.hidden_size))
    for variant, decode in (("3pass", decode_three_passes), ("widen", sio.decode_block)):
        sio.decode_block = decode
        for block in (1 << 16, 1 << 17, 1 << 18):
            sio.DECODE_BLOCK = weights_module.STREAM_VALUES = block
            for factor in (1, 2, 4):
                set_growth(factor)
                line = f"decode {variant:6s} 2^{block.bit_length() - 1} x{factor}:"
                for n in [1, *counts]:
                    with threads.use_threads(n):
                        read = best_ms(lambda: store.read(w.head_name, 0, rows, out=buf), 3)
                        stream = best_ms(lambda: w.product(x, w.head_name, 0, rows), 3)
                    line += f"  {n}: read {buf.size / read / 1e6:.2f} stream {buf.size / stream / 1e6:.2f}"
                print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (needed for --what decode)")
    ap.add_argument("--what", choices=("rowwise", "decode"), required=True)
    ap.add_argument("--threads", default="8,16", help="comma-separated thread counts (default 8,16)")
    args = ap.parse_args(argv)
    try:
        counts = [int(n) for n in args.threads.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        ap.error(f"--threads: {args.threads!r} is not a list of positive integers")
    if args.what == "rowwise":
        sweep_rowwise(counts)
        return 0
    if args.model is None or not Path(args.model, "config.json").is_file():
        ap.error("--what decode needs --model, a checkpoint directory")
    sweep_decode(args.model, counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
