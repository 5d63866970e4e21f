"""Make a bundled GGUF quantised set: fixtures/e2b-256-mini-q4km (the default) is the e2b-256-mini preset (seed 0,
the 256-wide miniature, so that llama.cpp's K-quants apply) converted to an f32 GGUF by llama.cpp's own converter
and quantised by its own quantiser to Q4_K_M (``llama_model_quantize``, what ``llama-quantize`` runs; no
importance matrix); fixtures/e2b-mini-q4-0 is e2b-mini (seed 0) at Q4_0 under the stock library's f32-cache
convention (``--preset e2b-mini --ftype Q4_0 --activations ggml-cpu/x86/gelu-table``). Each is
its text set generated from that file under ggml's CPU activation convention, and the GGUF shipped inside the set
(``checkpoint/model.gguf``, recorded as a path relative to the set): the quantised bytes depend on the llama.cpp
version and on floating-point code paths of its quantiser, so they are shipped, not regenerated.

    .venv/bin/python scripts/bundle-gguf-set.py [--preset P] [--ftype T] [--activations CONV] [--out DIR]

CONV defaults to ggml-cpu/x86/f16-kv/gelu-table: what stock llama.cpp computes on an x86 CPU with its default f16
KV cache (docs/quantised.md). Needs llama-cpp-python built from source (``make llama-cpp``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from llama_quantize import quantize  # noqa: E402 - after sys.path

from conformance.backends.llama_cpp import convert, library  # noqa: E402
from conformance.generate import generate_set  # noqa: E402
from conformance.sets.format import write_json  # noqa: E402
from refimpl.synth import write_checkpoint  # noqa: E402

COMMAND = "python scripts/bundle-gguf-set.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="e2b-256-mini")
    ap.add_argument("--ftype", default="Q4_K_M")
    ap.add_argument("--activations", default="ggml-cpu/x86/f16-kv/gelu-table")
    ap.add_argument("--out", help="default: fixtures/<preset>-<ftype, lower case, q4km for Q4_K_M>")
    args = ap.parse_args()
    tag = {"Q4_K_M": "q4km"}.get(args.ftype, args.ftype.lower().replace("_", "-"))
    out = Path(args.out or ROOT / "fixtures" / f"{args.preset}-{tag}")
    given = [f"--{k} {getattr(args, k)}" for k in ("preset", "ftype", "activations")
             if getattr(args, k) != ap.get_default(k)]
    with tempfile.TemporaryDirectory() as tmp:
        src = write_checkpoint(args.preset, 0, Path(tmp) / args.preset)
        f32, _ = convert.convert_to_gguf(src, library.resolve_source(), "f32", Path(tmp) / "cache")
        gguf = quantize(f32, Path(tmp) / "model.gguf", args.ftype)
        shutil.rmtree(out, ignore_errors=True)
        generate_set(out, model_dir=gguf, name=out.name, cases="text", store="logits", activations=args.activations,
                     command=" ".join([COMMAND, *given]))
        (out / "checkpoint").mkdir()
        shutil.copyfile(gguf, out / "checkpoint" / gguf.name)
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
        manifest["model"]["path"] = f"checkpoint/{gguf.name}"  # inside the set (FixtureSet.model_record)
        write_json(out / "manifest.json", manifest)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
