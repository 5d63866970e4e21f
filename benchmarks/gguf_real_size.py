"""The oracle on a real-shape quantised GGUF against the same checkpoint in safetensors, side by side.

    python benchmarks/gguf_real_size.py --model ckpt/e2b-4 [--ftype Q4_K_M] [--tokens 128] [--out OUT.json]

From a checkpoint directory (``refimpl synth --preset e2b --layers 4``): an F16 GGUF written with gguf-py under
llama.cpp's converter's keys, names and type rules (tests/gguf_writer.py: the synthetic checkpoints' small
tokenizer does not fit the converter's vocabulary check), then llama.cpp's own quantiser
(``llama_model_quantize``, the llama-cpp-python that ``make llama-cpp`` builds) to ``--ftype``. Then, each in a
fresh child process of a small parent, ``refimpl logits --rows last`` on the same token ids over the
safetensors directory (bf16 for the published shapes), the F16 GGUF and the quantised GGUF: wall time and peak
memory, the tensor types the quantised file holds, and the largest logit difference from the safetensors run
(quantisation loss, not an error). The writing and quantising run in children too: a forked child starts
from its parent's resident set and exec keeps that peak, so a large parent would inflate every run's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the converter-like writer of the tests

SAFETENSORS = "safetensors"  # the checkpoint directory as it is (bf16 for the published shapes)
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q3_K_M": 12}


def quantise(src: Path, dst: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise SystemExit("llama_model_quantize failed")


def run_logits(model: Path, ids: str, out: Path) -> dict:
    """refimpl logits in a child: wall time, peak resident set (MiB), the logits."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "refimpl", "logits", "--model", str(model), "--tokens", ids,
                                 "--rows", "last", "--out", str(out), "--force"], stdout=subprocess.DEVNULL,
                                stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak resident set
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t0
        if proc.returncode:
            err.seek(0)
            raise SystemExit(f"refimpl logits --model {model} failed:\n{err.read().decode()}")
    from refimpl.safetensors_io import TensorStore

    return {"wall_s": round(wall, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024),
            "logits": TensorStore(out).get("logits")[-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--ftype", default="Q4_K_M", choices=sorted(FTYPES))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", type=Path)
    p.add_argument("--write", type=Path, help=argparse.SUPPRESS)  # the child steps
    p.add_argument("--quantise", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    from gguf_writer import T, write_gguf

    from refimpl.gguf_io import GGUFFile

    if args.write:  # in a child: the parent stays small, so that the runs' peaks are their own (a forked child
        write_gguf(args.model, args.write, T.F16)  # starts from its parent's resident set, and exec keeps it)
        return 0
    if args.quantise:
        quantise(args.model, args.quantise, args.ftype)
        return 0
    work = Path(tempfile.mkdtemp(prefix="gguf-real-size-"))
    f16, quant = work / "f16.gguf", work / f"{args.ftype}.gguf"
    me = [sys.executable, __file__, "--ftype", args.ftype]
    t0 = time.monotonic()
    subprocess.run([*me, "--model", str(args.model), "--write", str(f16)], check=True)
    write_s = time.monotonic() - t0
    t0 = time.monotonic()
    subprocess.run([*me, "--model", str(f16), "--quantise", str(quant)], check=True, stderr=subprocess.DEVNULL)
    quant_s = time.monotonic() - t0
    from refimpl.config import load_config

    vocab = min(1000, load_config(args.model).vocab_size)
    ids = ",".join(map(str, np.random.default_rng(0).integers(3, vocab, args.tokens)))
    runs = {name: run_logits(path, ids, work / f"{name}.safetensors")
            for name, path in ((SAFETENSORS, args.model), ("F16 GGUF", f16), (args.ftype + " GGUF", quant))}
    base = runs[SAFETENSORS]["logits"]
    types = Counter(t.type_name for t in GGUFFile(quant).tensors.values())
    result = {"model": str(args.model), "tokens": args.tokens, "ftype": args.ftype, "write_f16_s": round(write_s, 1),
              "quantise_s": round(quant_s, 1), "sizes_mib": {n: round(q.stat().st_size / 2**20) for n, q in
                                                            (("F16 GGUF", f16), (args.ftype + " GGUF", quant))},
              "quantised_types": dict(sorted(types.items())),
              "runs": {n: {"wall_s": r["wall_s"], "peak_rss_mib": r["peak_rss_mib"],
                           "max_abs_vs_safetensors": float(np.max(np.abs(r["logits"] - base)))}
                       for n, r in runs.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
