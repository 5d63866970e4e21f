"""The event probe against llama.cpp: per row, how far llama.cpp is from the oracle under ggml's CPU convention,
and how far the oracle moves when its inputs move by a few float32 ulps (the move of ``conformance.generate
.bases.rounding_probe`` at that unit, ``moved_embeddings``; the event probe is 8 ulps), on the same prompts.

    python benchmarks/event_probe_vs_llama.py --model FILE.gguf [--kv-type f16] [--tokens 64] [--prompts 1]
        [--ulps 1,8] [--moves 2] [--out OUT.json]
    python benchmarks/event_probe_vs_llama.py --wide LAYERS --work DIR [...]

``--model``: a GGUF file (e.g. the Q4_K_M of ``benchmarks/gguf_real_size_gate.py``); ``--wide LAYERS``: a model
with E2B's row widths (hidden 1,536, 8 heads of 256, MLP 6,144, PLE 256) and LAYERS layers, the miniatures'
512-piece vocabulary, written under ``--work`` and converted by llama.cpp's own converter to Q8_0. llama.cpp runs
the stock library (its fp16 GELU table) with ``--kv-type``; the oracle the matching convention
(ggml-cpu/x86[/f16-kv]/gelu-table). Prints, per prompt, the median / p90 / worst row of each; writes every row
to ``--out``. Needs ``make llama-cpp``. docs/quantised.md, "One-unit events".
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import pickle, sys
from pathlib import Path
from conformance.backends.llama_cpp.engine import LlamaCppEngine
options, model, requests = pickle.loads(Path(sys.argv[1]).read_bytes())
engine = LlamaCppEngine(**options)
engine.open(Path(model))
Path(sys.argv[2]).write_bytes(pickle.dumps([engine.run(r).logits for r in requests]))
"""


def wide_model(layers: int, work: Path) -> Path:
    """A Q8_0 GGUF (llama.cpp's converter) of a ``layers``-layer model with E2B's row widths."""
    from conformance.backends.llama_cpp import convert, library
    from refimpl.presets import FULL, PRESETS, SLIDING
    from refimpl.synth import write_checkpoint

    PRESETS["wide-bench"] = dict(description="E2B's row widths", num_hidden_layers=layers,
                                 layer_types=[SLIDING] * (layers - 1) + [FULL], num_key_value_heads=1,
                                 hidden_size=1536, num_attention_heads=8, head_dim=256, global_head_dim=512,
                                 intermediate_size=6144, hidden_size_per_layer_input=256, sliding_window=512)
    src = write_checkpoint("wide-bench", 0, work / "wide", overwrite=True)
    return convert.convert_to_gguf(src, library.resolve_source(), "q8_0", work / "cache")[0]


def llama_rows(path: Path, ids: list[int], kv: str, work: Path) -> np.ndarray:
    from conformance.protocol import Request

    (work / "job.pkl").write_bytes(pickle.dumps(({"kv_type": kv, "lib": "stock"}, str(path),
                                                  [Request(kind="full", tokens=tuple(ids))])))
    subprocess.run([sys.executable, "-c", CHILD, str(work / "job.pkl"), str(work / "out.pkl")], check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return pickle.loads((work / "out.pkl").read_bytes())[0].astype(np.float64)


def spread(rows: np.ndarray) -> str:
    return f"{np.median(rows):.3g} / {np.quantile(rows, 0.9):.3g} / {rows.max():.3g}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path)
    p.add_argument("--wide", type=int, metavar="LAYERS")
    p.add_argument("--work", type=Path)
    p.add_argument("--kv-type", default="f16", choices=("f16", "f32"))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--ulps", default="1,8")
    p.add_argument("--moves", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if (args.model is None) == (args.wide is None):
        p.error("give one of --model FILE.gguf and --wide LAYERS")
    from conformance.generate.bases import moved_embeddings
    from refimpl import Gemma4

    work = args.work or Path(tempfile.mkdtemp(prefix="event-probe-"))
    work.mkdir(parents=True, exist_ok=True)
    path = args.model or wide_model(args.wide, work)
    conv = "ggml-cpu/x86" + ("/f16-kv" if args.kv_type == "f16" else "") + "/gelu-table"
    model = Gemma4(path, activations=conv)
    result: dict = {"model": str(path), "convention": conv, "tokens": args.tokens, "prompts": []}
    for prompt in range(args.prompts):
        ids = [int(i) for i in np.random.default_rng(prompt).integers(3, 500, args.tokens)]
        ours = model.forward(ids, rows="all")
        theirs = np.max(np.abs(llama_rows(path, ids, args.kv_type, work) - ours), axis=1)
        entry = {"seed": prompt, "logit_scale": float(np.max(np.abs(ours))), "llama": theirs.tolist()}
        print(f"prompt {prompt}: llama.cpp median / p90 / worst row {spread(theirs)}", flush=True)
        for ulps in (float(u) for u in args.ulps.split(",")):
            for move in range(args.moves):
                moved = moved_embeddings(np.asarray(model.embed(np.asarray(ids))), ulps * 2.0 ** -24, move)
                rows = np.max(np.abs(model.forward(ids, rows="all", embeddings=moved) - ours), axis=1)
                entry[f"probe_{ulps:g}ulp_{move}"] = rows.tolist()
                print(f"  move of {ulps:g} ulps ({move}): {spread(rows)}", flush=True)
        result["prompts"].append(entry)
    if args.out:
        args.out.write_text(json.dumps(result) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
