"""The float64 rounding bound (conformance/sets/bounds.py) against what the oracle does, and against bugs.

    python benchmarks/bounds.py (--preset NAME | --model DIR) [--tokens N] [--seed 0] [--bugs]
                                [--trace] [--float32] [--fp16-kv] [--probe] [--no-chunked] [--json OUT.json]
    python benchmarks/bounds.py --depth-sweep [--json OUT.json]

On one sequence (base A of a generated set: ``[bos] + numpy default_rng([seed, 0]).choice(pool, N - 1)``
over the tokenizer's ordinary ids; ``--tokens`` defaults to the set's random base length,
``conformance.generate.matrix.random_base_length``), measures in one run:

- **observed**: max |chunked prefill + single-token decode through the KV cache - full forward| over
  every logit, fed as ``conformance generate`` feeds it (``bases.consistency_plan``), and per row;
- **bound**: ``conformance.sets.bounds.logit_bound`` for the config, N and the logit scale of the rows
  (also the rounding units and the observed / bound ratio);
- with ``--bugs``, the differences three real inconsistencies cause, each against the full forward:
  a one-position shift (the cache's length one too large before the last decode steps: RoPE and the
  masks see every later token one position late), one wrong KV cache entry (before the last decode
  steps, one cached key and value of one layer overwritten by its predecessor's: the first sliding
  layer and the last KV-owning full layer, each reported), a dropped final softcap (the head without
  ``cap * tanh(z / cap)``, on the last rows), and for reference a one-row shift (row i+1 for row i);
  each as the max over its affected rows and the smallest per-row max (what a row-by-row grader sees);
- with ``--trace``, the largest relative difference of the residual stream after every layer
  (chunked against full), to show how the rounding difference grows with depth;
- with ``--float32`` / ``--fp16-kv``, a correct float32 engine (the oracle in float32) and an emulated
  fp16-kv engine (the same with every cached key and value rounded to float16) against float64, with
  every metric the grader uses (``--no-chunked`` skips the chunked comparison);
- with ``--probe``, the rounding probe (``conformance.generate.bases.rounding_probe``: the logits' change
  when the input embeddings move by one unit roundoff) and ``bounds.probe_bound``.

``--depth-sweep`` instead measures observed / first-order (``bounds.first_order``) on random-weight
models of the miniatures' layout, hidden 64 and 256, 5 to 80 layers, 48 and 160 tokens: where depth
makes random weights amplify rounding beyond the bound's model (docs/profiles.md).

Every number comes from this process; ``--json`` writes them with the command and the machine.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import refimpl  # noqa: E402  (before NumPy: OpenBLAS thread settings, docs/refimpl.md)

# isort: split
import numpy as np  # noqa: E402 - after sys.path and refimpl

from conformance.check import metrics  # noqa: E402 - after sys.path and refimpl
from conformance.generate.bases import bos_id, consistency_plan, ordinary_ids, rounding_probe  # noqa: E402 - see above
from conformance.generate.matrix import random_base_length  # noqa: E402 - after sys.path and refimpl
from conformance.sets import bounds  # noqa: E402 - after sys.path and refimpl
from refimpl.model import Gemma4, KVCache, Trace  # noqa: E402 - after sys.path and refimpl
from refimpl.synth import write_checkpoint  # noqa: E402 - after sys.path and refimpl
from refimpl.tokenizer import Tokenizer  # noqa: E402 - after sys.path and refimpl


def base_ids(model_dir: Path, cfg, n: int, seed: int) -> list[int]:
    tok = Tokenizer.from_dir(model_dir)
    pool = ordinary_ids(tok, cfg.vocab_size)
    rng = np.random.default_rng([seed, 0])
    return [bos_id(cfg, tok)] + [int(t) for t in rng.choice(pool, n - 1)]


def row_max(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.max(np.abs(a - b), axis=-1)


def grading_metrics(got: np.ndarray, ref: np.ndarray, block: int = 64) -> dict:
    """The worst of every closeness and distribution metric the grader uses, over the rows (in blocks)."""
    worst = {"max_abs": 0.0, "max_rel": 0.0, "nmse": 0.0, "one_minus_cosine": 0.0, "kl": 0.0, "delta_p": 0.0,
             "ref_at_max_abs": 0.0}
    for a in range(0, ref.shape[0], block):
        g, r = got[a:a + block], ref[a:a + block]
        ma = metrics.max_abs(g, r)
        i = int(np.argmax(ma))
        j = int(np.argmax(np.abs(g[i] - r[i])))
        if ma[i] > worst["max_abs"]:
            worst["ref_at_max_abs"] = float(r[i, j])
        worst["max_abs"] = max(worst["max_abs"], float(ma.max()))
        worst["max_rel"] = max(worst["max_rel"], float(metrics.max_rel(g, r).max()))
        worst["nmse"] = max(worst["nmse"], float(metrics.nmse(g, r).max()))
        worst["one_minus_cosine"] = max(worst["one_minus_cosine"], float((1 - metrics.cosine(g, r)).max()))
        worst["kl"] = max(worst["kl"], float(metrics.kl(r, g).max()))
        worst["delta_p"] = max(worst["delta_p"], float(metrics.delta_p(r, g).max()))
    return worst


def run_pieces(model, ids, pieces, cache, at, trace_rows=None):
    rows = []
    for size in pieces:
        tr = Trace() if trace_rows is not None else None
        rows.append(model.forward(ids[at:at + size], rows="all", cache=cache, trace=tr))
        if tr is not None:
            trace_rows.append(tr)
        at += size
    return rows, at


def f16_kv_forward(model_dir: Path, ids) -> np.ndarray:
    """The oracle in float32 with every cached key and value rounded to float16 (an emulated fp16-kv
    engine, as the calibration of the fp16-kv profile emulates one), logits as float64."""
    import refimpl.model as rm

    plain = rm.LayerKV

    def rounded(k, v, pos, blocks=None):
        return plain(k.astype(np.float16).astype(k.dtype), v.astype(np.float16).astype(v.dtype), pos, blocks)

    rm.LayerKV = rounded
    try:
        return Gemma4(model_dir, dtype="float32").forward(ids, rows="all").astype(np.float64)
    finally:
        rm.LayerKV = plain


def measure(model_dir: Path, n: int, seed: int, bugs: bool, trace: bool, float32: bool = False,
            chunked_check: bool = True, fp16_kv: bool = False, probe: bool = False) -> dict:
    model = Gemma4(model_dir)
    cfg = model.cfg
    ids = base_ids(model_dir, cfg, n, seed)
    out: dict = {"model": str(model_dir), "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                 "vocab": cfg.vocab_size, "tokens": n, "seed": seed}
    t = time.perf_counter()
    full_trace = Trace() if trace else None
    x = model.hidden_states(ids, trace=full_trace)
    full = model.head(x)
    out["seconds_full"] = round(time.perf_counter() - t, 1)
    scale = bounds.logit_scale(full)
    bound = bounds.logit_bound(cfg, n, scale)
    out.update(logit_scale=scale, units=bounds.decoder_units(cfg, n), bound=bound)
    if float32:  # a correct float32 engine: the oracle itself in float32, against float64
        t = time.perf_counter()
        f32 = Gemma4(model_dir, dtype="float32").forward(ids, rows="all").astype(np.float64)
        out["float32"] = {**grading_metrics(f32, full), "seconds": round(time.perf_counter() - t, 1),
                          "over_u32_units_scale": float(np.max(np.abs(f32 - full))) / (2.0**-24 * out["units"] * scale)}
        del f32
    if probe:  # the checkpoint's amplification of a one-ulp input perturbation (one more full forward)
        t = time.perf_counter()
        out["rounding_probe"] = rounding_probe(model, ids, full)
        out["probe_bound"] = bounds.probe_bound(out["rounding_probe"])
        out["seconds_probe"] = round(time.perf_counter() - t, 1)
    if fp16_kv:
        t = time.perf_counter()
        f16 = f16_kv_forward(model_dir, ids)
        out["fp16_kv"] = {**grading_metrics(f16, full), "seconds": round(time.perf_counter() - t, 1)}
        del f16
    if not chunked_check:
        return out

    plan = consistency_plan(n, cfg.sliding_window)
    tail = 0  # the trailing single-token pieces (at most 3): where the bugs are injected
    while tail < min(3, len(plan) - 1) and plan[len(plan) - 1 - tail] == 1:
        tail += 1
    head_pieces, tail_pieces = plan[:len(plan) - tail], plan[len(plan) - tail:]
    t = time.perf_counter()
    cache = KVCache()
    traces: list | None = [] if trace else None
    rows, at = run_pieces(model, ids, head_pieces, cache, 0, traces)
    snapshot = copy.deepcopy(cache)
    tail_rows, _ = run_pieces(model, ids, tail_pieces, cache, at, traces)
    chunked = np.concatenate(rows + tail_rows)
    out["seconds_chunked"] = round(time.perf_counter() - t, 1)
    per_row = row_max(chunked, full)
    out.update(plan=plan,
               observed=float(per_row.max()), observed_over_bound=float(per_row.max()) / bound,
               observed_metrics=grading_metrics(chunked, full),
               observed_rows_p50=float(np.median(per_row)),
               observed_by_position=[float(v) for v in per_row[:: max(1, n // 16)]])
    del chunked, rows

    if trace:
        rel = []
        for i in range(cfg.num_hidden_layers):
            key = f"layers.{i}.residual"
            a = np.concatenate([tr.tensors[key] for tr in traces])
            b = full_trace.tensors[key]
            rel.append(float(np.max(np.abs(a - b)) / np.max(np.abs(b))))
        out["residual_rel_by_layer"] = rel
        out["residual_rel_over_u"] = [r / bounds.UNIT_ROUNDOFF for r in rel]
        del traces, full_trace

    if bugs:
        at_tail = at
        tail_full = full[at_tail:at_tail + sum(tail_pieces)]
        found: dict = {}
        # a one-position shift: the cache's length one too large before the last decode steps
        shifted = copy.deepcopy(snapshot)
        shifted.length += 1
        got, _ = run_pieces(model, ids, tail_pieces, shifted, at_tail)
        found["position_shift"] = row_max(np.concatenate(got), tail_full)
        # one wrong KV cache entry: one cached key/value of one layer overwritten by its predecessor's
        owners = [layer.index for layer in cfg.layers if layer.owns_kv]
        first_sliding = next(i for i in owners if cfg.layers[i].is_sliding)
        last_full = max((i for i in owners if not cfg.layers[i].is_sliding), default=None)
        for name, i in (("cache_entry_first_sliding", first_sliding), ("cache_entry_last_full", last_full)):
            if i is None:
                continue
            wrong = copy.deepcopy(snapshot)
            kv = wrong.layers[i]
            j = len(kv.pos) // 2 if len(kv.pos) > 1 else 0
            j = max(j, 1)
            kv.k[j], kv.v[j] = kv.k[j - 1], kv.v[j - 1]
            got, _ = run_pieces(model, ids, tail_pieces, wrong, at_tail)
            found[name] = row_max(np.concatenate(got), tail_full)
            found[name + "_layer"] = i
        # a dropped final softcap, on the last rows
        last = slice(max(0, n - 8), n)
        nocap = copy.copy(model)
        nocap.cfg = dataclasses.replace(cfg, final_logit_softcapping=None)
        found["softcap_dropped"] = row_max(nocap.head(x[last]), full[last])
        # for reference: a one-row shift (row i + 1 returned for row i)
        found["row_shift"] = row_max(full[1:], full[:-1])
        out["bugs"] = {}
        for k, v in found.items():
            if isinstance(v, np.ndarray):
                out["bugs"][k] = {"max": float(v.max()), "min_row": float(v.min()),
                                  "over_bound": float(v.max()) / bound,
                                  "min_row_over_bound": float(v.min()) / bound}
            else:
                out["bugs"][k] = v
    return out


def depth_sweep() -> list[dict]:
    from refimpl import synth

    S, F = synth.S, synth.F
    rows = []
    for H, inter, heads, hd in ((64, 128, 4, 16), (256, 512, 4, 64)):
        for L in (5, 10, 20, 40, 80):
            name = f"deep-{H}-{L}"
            synth.PRESETS[name] = dict(synth.PRESETS["e2b-mini"], num_hidden_layers=L, num_kv_shared_layers=0,
                                       layer_types=([S, S, S, S, F] * 20)[:L - 1] + [F], hidden_size=H,
                                       intermediate_size=inter, num_attention_heads=heads, head_dim=hd,
                                       global_head_dim=2 * hd)
            for n in (48, 160):
                with tempfile.TemporaryDirectory() as tmp:
                    r = measure(write_checkpoint(name, 0, Path(tmp) / "m"), n, 0, False, False)
                fo = bounds.UNIT_ROUNDOFF * r["units"] * r["logit_scale"]
                rows.append({"hidden": H, "layers": L, "tokens": n, "observed": r["observed"], "bound": r["bound"],
                             "observed_over_first_order": r["observed"] / fo})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--depth-sweep", action="store_true")
    src.add_argument("--preset")
    src.add_argument("--model", type=Path)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bugs", action="store_true")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--float32", action="store_true", help="also the oracle in float32 against float64")
    ap.add_argument("--probe", action="store_true", help="also the rounding probe (one more full forward)")
    ap.add_argument("--fp16-kv", action="store_true", help="also an emulated fp16-kv engine against float64")
    ap.add_argument("--no-chunked", action="store_true", help="skip the chunked-prefill comparison")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.depth_sweep:
        result = {"depth_sweep": depth_sweep()}
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model if args.model is not None else write_checkpoint(args.preset, 0, Path(tmp) / "m")
        from refimpl.config import load_config
        n = args.tokens if args.tokens is not None else random_base_length(load_config(model_dir))
        result = measure(Path(model_dir), n, args.seed, args.bugs, args.trace, args.float32, not args.no_chunked,
                         args.fp16_kv, args.probe)
    result["preset"] = args.preset
    result["command"] = " ".join(["python", "benchmarks/bounds.py", *(argv if argv is not None else sys.argv[1:])])
    result["machine"] = {"platform": platform.platform(), "cpus": len(os.sched_getaffinity(0)),
                         "numpy": np.__version__, "refimpl": refimpl.__version__}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
