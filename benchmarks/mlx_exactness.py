"""The exactness table of MLX's affine format: the oracle's float64 values against ``mlx.core.dequantize``.

    python benchmarks/mlx_exactness.py [--rows 256] [--cols 1024] [--out OUT.json]

For every width (2, 3, 4, 5, 6, 8 bits), group size (32, 64, 128) and weight dtype (float32, float16,
bfloat16): a [rows, cols] matrix of N(0, 0.02) weights quantised by ``mx.quantize``, decoded by
``refimpl.mlx_quant.dequantize`` (float64: s * q + beta from the stored scales and biases) and by
``mx.dequantize`` (in the weight dtype). Columns: the share of elements where mlx's value is not the float64
value rounded once to its dtype; the largest difference in units of eps (|s q| + |w|), eps the dtype's unit
roundoff (mlx rounds s * q, then the sum: at most one such unit); whether every code decoded lies in [0, 2^b).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx

from refimpl.mlx_quant import BITS, GROUP_SIZES, QuantSpec, dequantize

EPS = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded once to ``dtype`` (through mlx's own cast), back in float64."""
    return np.array(mx.array(x.astype(np.float64).astype(np.float32)).astype(getattr(mx, dtype)).astype(mx.float32),
                    dtype=np.float64) if dtype != "float32" else x.astype(np.float32).astype(np.float64)


def row(bits: int, group: int, dtype: str, rows: int, cols: int, seed: int) -> dict:
    w = np.random.default_rng(seed).normal(0, 0.02, (rows, cols)).astype(np.float32)
    w = mx.array(w).astype(getattr(mx, dtype))
    words, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    theirs = np.array(mx.dequantize(words, scales, biases, group_size=group, bits=bits).astype(mx.float32),
                      dtype=np.float64)
    s, b = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (scales, biases))
    ours = dequantize(np.array(words), s, b, QuantSpec(bits, group))
    once = rounded(ours, dtype)
    sq = ours - np.repeat(b, group, axis=1)  # s * q, exact
    unit = EPS[dtype] * np.maximum(np.abs(sq) + np.abs(ours), np.finfo(np.float32).tiny)
    return {"bits": bits, "group_size": group, "dtype": dtype,
            "not_rounded_once": float(np.mean(theirs != once)),
            "max_error_in_roundings": float(np.max(np.abs(theirs - ours) / unit)),
            "exact_codes": bool(np.array_equal(np.rint(sq / np.repeat(s, group, axis=1)),
                                               np.clip(np.rint(sq / np.repeat(s, group, axis=1)), 0, (1 << bits) - 1)))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = [row(b, g, d, args.rows, args.cols, 7 * b + g) for d in EPS for b in BITS for g in GROUP_SIZES]
    print(f"{'dtype':<9} {'bits':>4} {'group':>5} {'mlx != fl(exact)':>17} "
          f"{'max |mlx - exact| / eps(|sq|+|w|)':>34} {'codes in range':>15}")
    for r in out:
        print(f"{r['dtype']:<9} {r['bits']:>4} {r['group_size']:>5} {r['not_rounded_once']:>17.4f} "
              f"{r['max_error_in_roundings']:>34.3f} {str(r['exact_codes']):>15}")
    if args.out:
        Path(args.out).write_text(json.dumps({"mlx": mx.__version__, "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
