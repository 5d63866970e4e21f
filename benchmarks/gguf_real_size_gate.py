"""The gate on a real-shape quantised GGUF: llama.cpp's own file, a set generated from it under ggml's activation
convention, llama.cpp checked on that set; wall time and peak memory of each step.

    python benchmarks/gguf_real_size_gate.py --model ckpt/e2b-4 [--ftype Q4_K_M] [--kv-type f16]
        [--match REGEX] [--work DIR [--reuse]] [--out OUT.json]

From a checkpoint directory (``refimpl synth --preset e2b --layers 4``: the published E2B shapes, cut): its
512-piece synthetic tokenizer padded with UNUSED pieces to the config's vocabulary size (the converter needs one
piece per row of the embedding; the weights are linked, not copied); llama.cpp's own converter to an F16 GGUF
(``conformance.backends.llama_cpp.convert.convert_to_gguf``); its own quantiser to ``--ftype``
(``llama_model_quantize``, no importance matrix); ``conformance generate --model FILE.gguf --cases text
--activations CONV`` (CONV: the stock library's convention with ``--kv-type``, ggml-cpu/x86[/f16-kv]/gelu-table);
then ``conformance check --backend llama-cpp`` on that set (``--match REGEX`` when given: at real size every
case on a 1,032-token base makes the check rebuild and hold that base's logits, 2 GiB each). Each step runs in a
fresh child of a small wrapper that reports the peak resident set of everything it ran (RUSAGE_CHILDREN: the
largest process of the step, the engine's own child included); each step's record is kept in
``WORK/steps.json``, and ``--reuse`` skips the steps recorded there (to check another subset of the same set).
Needs llama-cpp-python built from source (``make llama-cpp``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# run argv, then print the wall time and the peak resident set (KiB) of every process it ran, as one JSON line
WRAPPER = ("import json, resource, subprocess, sys, time; t0 = time.monotonic(); "
           "rc = subprocess.run(sys.argv[1:]).returncode; "
           "print(json.dumps({'rc': rc, 'wall_s': time.monotonic() - t0, "
           "'peak_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")
CONVERT = ("import sys; from pathlib import Path; from conformance.backends.llama_cpp import convert, library; "
           "path, _ = convert.convert_to_gguf(Path(sys.argv[1]), library.resolve_source(), 'f16', Path(sys.argv[2])); "
           "Path(sys.argv[3]).write_text(str(path))")
QUANTISE = ("import sys; sys.path.insert(0, sys.argv[4]); from pathlib import Path; "
            "from llama_quantize import quantize; quantize(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])")


def padded_checkpoint(model: Path, out: Path) -> Path:
    """``model`` under ``out`` with its tokenizer.model padded to the config's vocab_size by UNUSED pieces
    ``<unused_pad_N>`` (the other files linked)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from refimpl.config import load_config

    out.mkdir(parents=True, exist_ok=True)
    for p in model.iterdir():
        if p.name != "tokenizer.model" and not (out / p.name).exists():
            (out / p.name).symlink_to(p.resolve())
    proto = pb.ModelProto()
    proto.ParseFromString((model / "tokenizer.model").read_bytes())
    for i in range(len(proto.pieces), load_config(model).vocab_size):
        proto.pieces.add(piece=f"<unused_pad_{i}>", score=0.0, type=pb.ModelProto.SentencePiece.UNUSED)
    (out / "tokenizer.model").write_bytes(proto.SerializeToString())
    return out


def step(name: str, argv: list[str], ok: tuple[int, ...] = (0,)) -> dict:
    """``argv`` run under the wrapper: {"wall_s", "peak_mib", "exit"}; SystemExit when it exits other than
    ``ok``."""
    import subprocess

    print(f"[gguf-real-size-gate] {name}: {' '.join(argv)}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *argv], stdout=subprocess.PIPE, text=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if got["rc"] not in ok:
        raise SystemExit(f"{name} failed (exit {got['rc']})")
    return {"wall_s": round(got["wall_s"], 1), "peak_mib": round(got["peak_kib"] / 1024), "exit": got["rc"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--ftype", default="Q4_K_M")
    p.add_argument("--kv-type", default="f16", choices=("f16", "f32"))
    p.add_argument("--match", help="check only the cases whose id matches this regular expression (check --match)")
    p.add_argument("--work", type=Path, help="where the files go (default: a new temporary directory)")
    p.add_argument("--reuse", action="store_true", help="skip the steps WORK/steps.json records as done")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="gguf-real-size-gate-"))
    work.mkdir(parents=True, exist_ok=True)
    conv = "ggml-cpu/x86" + ("/f16-kv" if args.kv_type == "f16" else "") + "/gelu-table"
    quant, fixtures, report = work / f"{args.ftype}.gguf", work / "set", work / "check.json"
    record = work / "steps.json"
    steps = json.loads(record.read_text()) if args.reuse and record.is_file() else {}

    def once(name: str, argv: list[str], ok: tuple[int, ...] = (0,)) -> None:
        if name not in steps:
            steps[name] = step(name, argv, ok)
            record.write_text(json.dumps(steps, indent=1) + "\n")

    ckpt = padded_checkpoint(args.model, work / "checkpoint")
    once("convert F16", [sys.executable, "-c", CONVERT, str(ckpt), str(work / "cache"), str(work / "f16.path")])
    f16 = Path((work / "f16.path").read_text())
    once("quantise", [sys.executable, "-c", QUANTISE, str(f16), str(quant), args.ftype, str(ROOT / "tests")])
    if "generate" not in steps:
        shutil.rmtree(fixtures, ignore_errors=True)
    once("generate", [sys.executable, "-m", "conformance.cli", "generate", "--model", str(quant), "--out",
                      str(fixtures), "--name", "real-size-gguf", "--cases", "text", "--activations", conv])
    check = [sys.executable, "-m", "conformance.cli", "check", "--backend", "llama-cpp", "--backend-option",
             f"kv_type={args.kv_type}", "--fixtures", str(fixtures), "-q", "--json", str(report)]
    steps.pop("check", None)  # the check runs every time (another subset, another engine build)
    # check exits 1 when a case fails: that is a result, not a broken step
    once("check", check + (["--match", args.match] if args.match else []), ok=(0, 1))
    cases = json.loads(report.read_text())["cases"]
    graded = [c["summary"] for c in cases if c.get("summary")]
    from refimpl.gguf_io import GGUFFile

    result = {"model": str(args.model), "ftype": args.ftype, "kv_type": args.kv_type, "activations": conv,
              "match": args.match, "sizes_mib": {"F16 GGUF": round(f16.stat().st_size / 2**20),
                                                   f"{args.ftype} GGUF": round(quant.stat().st_size / 2**20),
                                                   "set": round(sum(f.stat().st_size for f in fixtures.iterdir())
                                                                / 2**20, 1)},
              "quantised_types": dict(sorted(Counter(t.type_name for t in GGUFFile(quant).tensors.values()).items())),
              "steps": steps, "statuses": dict(Counter(c["status"] for c in cases)),
              "worst": {k: max((g[k] for g in graded if g.get(k) is not None), default=None)
                        for k in ("max_abs", "kl_max", "kl_mean", "nmse_max")},
              "profile": json.loads(report.read_text())["fixture_sets"][0].get("profile")}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
