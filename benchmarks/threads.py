"""The oracle's own steps (outside BLAS) on 1, 2, ... N threads, side by side in one process.

    python benchmarks/threads.py --model DIR [--threads 1,2,4,8,16] [--tokens 512] [--repeat 3] [--json OUT]

On a checkpoint with real shapes (``refimpl synth --preset e2b [--layers 10]``), for each thread count
(``refimpl.threads.use_threads``; BLAS keeps its own count, every core by default):

- ``decode``: ``TensorStore.read`` of 65,536 rows of the LM head, bf16 -> float64, into a buffer kept from
  run to run (the decoding of the weights a prefill multiplies whole), in G values/s;
- ``stream``: ``Gemma4Weights.product`` of one row with the same rows (the streamed matrix-vector product of
  a last-row prefill's KV-shared layers and head: decoding and multiplying a block at a time);
- the row-wise steps of ``refimpl.schedule`` on the shapes of a prefill of ``--tokens`` tokens (GELU on
  [T, I], the norms on [T, H] and [T, N, D], softmax on the attention scores [K, G, T, T], RoPE on
  [T, N, D]): the step in one call (``.whole``) and on row blocks, with the largest difference between
  the two (row blocks compute every element as one call does: 0 is expected);
- ``forward``: ``Gemma4.forward(rows="last")``, with the largest logit difference from the first count's.

Each time is the best of ``--repeat`` after one warm-up run. Prints a Markdown table; ``--json`` keeps it all.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import refimpl  # noqa: E402,F401  (first: OpenBLAS's thread timeout)

# isort: split
import numpy as np  # noqa: E402 - after sys.path and refimpl

from refimpl import schedule, threads  # noqa: E402 - after sys.path and refimpl
from refimpl.model import Gemma4, rope_cos_sin, rope_inv_freq  # noqa: E402 - after sys.path and refimpl

sys.path.insert(0, str(ROOT / "benchmarks"))
from prefill import best_of, machine, prompt_ids  # noqa: E402 - after sys.path and refimpl

HEAD_ROWS = 65_536


def step_inputs(m: Gemma4, T: int) -> dict[str, tuple]:
    """(step, args) of each @rowwise step at the shapes of a T-token prefill of m's first layers."""
    cfg = m.cfg
    rng = np.random.default_rng(0)
    layer = cfg.layers[0]
    N, D, H = cfg.num_attention_heads, layer.head_dim, cfg.hidden_size
    K = layer.num_kv_heads
    I = max(layer.ffn_width for layer in cfg.layers)  # noqa: E741 - I: the intermediate size, as in the spec's shapes
    scores = rng.standard_normal((K, N // K, T, T))
    scores[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = -np.inf  # causal
    cos, sin = rope_cos_sin(np.arange(T), rope_inv_freq(layer.rope, D))
    return {
        f"gelu_tanh [{T}, {I}]": (schedule.gelu_tanh, (rng.standard_normal((T, I)),)),
        f"rms_norm [{T}, {H}]": (schedule.rms_norm, (rng.standard_normal((T, H)), rng.standard_normal(H), 1e-6)),
        f"rms_norm [{T}, {N}, {D}]": (schedule.rms_norm, (rng.standard_normal((T, N, D)), rng.standard_normal(D),
                                                         1e-6)),
        f"softmax [{K}, {N // K}, {T}, {T}]": (schedule.softmax, (scores,)),
        f"apply_rope [{T}, {N}, {D}]": (schedule.apply_rope, (rng.standard_normal((T, N, D)), cos, sin)),
        f"softcap [{T}, 16384]": (schedule.softcap, (10 * rng.standard_normal((T, 16384)), 30.0)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default 1,2,4,... up to the cores)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-forward", action="store_true", help="skip the whole forward")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        ap.error(f"--model: {args.model} is not a checkpoint directory (no config.json)")
    n_cores = threads.cores()
    counts = ([int(c) for c in args.threads.split(",")] if args.threads else
              [c for c in (1, 2, 4, 8, 16, 32, 64) if c < n_cores] + [n_cores])
    m = Gemma4(args.model)
    w = m.weights
    head = w.head_name
    H = m.cfg.hidden_size
    rows = min(HEAD_ROWS, m.cfg.vocab_size)
    buf = np.empty((rows, H))
    y = np.random.default_rng(1).standard_normal((1, H))
    steps = step_inputs(m, args.tokens)
    ids = prompt_ids(args.tokens)
    result = {"command": " ".join(["python", "benchmarks/threads.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "model": str(Path(args.model).resolve()), "threads": counts, "rows": []}
    whole = {name: fn.whole(*a) for name, (fn, a) in steps.items()}
    whole_s = {name: best_of(lambda fn=fn, a=a: fn.whole(*a), args.repeat, warm_up=True)
               for name, (fn, a) in steps.items()}
    reference = None
    for n in counts:
        with threads.use_threads(n):
            row: dict = {"threads": n}
            s = best_of(lambda: w.store.read(head, 0, rows, np.float64, out=buf), args.repeat, warm_up=True)
            row["decode_g_values_per_s"] = rows * H / s / 1e9
            s = best_of(lambda: w.product(y, head, 0, rows), args.repeat, warm_up=True)
            row["stream_g_values_per_s"] = rows * H / s / 1e9
            row["steps"] = {}
            for name, (fn, a) in steps.items():
                got = fn(*a)
                diff = float(np.max(np.abs(np.nan_to_num(got - whole[name]))))
                blocked_s = best_of(lambda fn=fn, a=a: fn(*a), args.repeat, warm_up=True)
                row["steps"][name] = {"whole_s": whole_s[name], "blocked_s": blocked_s,
                                      "max_abs_diff": diff, "bit_identical": bool(np.array_equal(got, whole[name]))}
            if not args.no_forward:
                times = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    logits = m.forward(ids, rows="last")
                    times.append(time.perf_counter() - t)
                reference = logits if reference is None else reference
                row["forward_s"] = min(times)
                row["forward_max_abs_diff"] = float(np.max(np.abs(logits - reference)))
        result["rows"].append(row)
        print(f"  {n} threads done", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    return 0


def report(r: dict) -> str:
    names = list(r["rows"][0]["steps"])
    head = ["threads", "decode (G values/s)", "stream (G values/s)", *[f"{n} (ms, one call: x)" for n in names]]
    if "forward_s" in r["rows"][0]:
        head.append("forward, last row (s)")
    lines = [f"{Path(r['model']).name}; {r['machine']['cpu']}, {r['machine']['cores']} cores", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in r["rows"]:
        cells = [str(row["threads"]), f"{row['decode_g_values_per_s']:.2f}", f"{row['stream_g_values_per_s']:.2f}"]
        for n in names:
            s = row["steps"][n]
            mark = "" if s["bit_identical"] else f", diff {s['max_abs_diff']:.1e}"
            cells.append(f"{1e3 * s['blocked_s']:.2f} ({1e3 * s['whole_s']:.2f}{mark})")
        if "forward_s" in row:
            cells.append(f"{row['forward_s']:.2f} (diff {row['forward_max_abs_diff']:.1e})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
