"""The dot-product table of ggml's CPU activation quantisation: libggml's own dot products against the float64
product of the exact weights with the emulated activations (refimpl/ggml_act.py), and with the activations as
they are.

    python benchmarks/ggml_dot_products.py [--rows 32] [--cols 4096] [--out OUT.json]

For each weight type: ``rows`` rows of N(0, 0.05) weights quantised by libggml (``ggml_quantize_chunk``; F16 by
a float16 cast), each against its own N(0, 1) float32 activation row; libggml's CPU dot product (the CPU
backend's ``from_float`` of the weight type's vec_dot_type, then ``vec_dot``: on x86 the SIMD kernels) against
(a) the float64 product of the exactly dequantised weights and ggml's activations decoded (path x86; Q4_1 / Q5_1
plus what ggml's min term adds, ``min_term_error``), (b) the
float64 product with the float32 activations unquantised. Columns: the largest |difference| over the rows in
units of sum |w| |x| of its row. Needs the library ``make llama-cpp`` builds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import libggml  # noqa: E402 - tests/libggml.py: ctypes on the built libggml

from refimpl.ggml_act import VEC_DOT_TYPE, activation_values, min_term_error  # noqa: E402
from refimpl.ggml_blocks import MIN_TYPES, TYPES, block_mins, dequantize  # noqa: E402

WEIGHT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")


def measure(name: str, rows: int, cols: int, rng: np.random.Generator) -> dict:
    ggml_type = next(t for t, bt in TYPES.items() if bt.name == name)
    emulated = plain = 0.0
    for _ in range(rows):
        x = rng.normal(0, 1, cols).astype(np.float32)
        w = rng.normal(0, 0.05, (1, cols)).astype(np.float32)
        raw = w.astype(np.float16).tobytes() if name == "F16" else libggml.quantize(w, ggml_type)[0].tobytes()
        exact, theirs = dequantize(raw, ggml_type, cols), libggml.vec_dot(raw, x, ggml_type)
        scale = float(np.abs(exact) @ np.abs(x.astype(np.float64)))
        ours = float(exact @ activation_values(x, name))
        if name in MIN_TYPES:  # Q4_1 / Q5_1: ggml's min term with Q8_1's s, beyond the exact one
            ours += float(block_mins(raw, ggml_type, cols) @ min_term_error(x))
        emulated = max(emulated, abs(ours - theirs) / scale)
        plain = max(plain, abs(float(exact @ x.astype(np.float64)) - theirs) / scale)
    return {"weights": name, "activations": VEC_DOT_TYPE[name], "emulated": emulated, "unquantised": plain}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--out")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    table = [measure(name, args.rows, args.cols, rng) for name in WEIGHT_TYPES]
    print(f"| weights | activations | emulated vs libggml | unquantised activations vs libggml |  ({args.rows} rows "
          f"of {args.cols}; max |diff| / sum |w||x|)")
    print("|---|---|---|---|")
    for r in table:
        print(f"| {r['weights']} | {r['activations']} | {r['emulated']:.1e} | {r['unquantised']:.1e} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": args.rows, "cols": args.cols, "table": table}, indent=1))


if __name__ == "__main__":
    main()
