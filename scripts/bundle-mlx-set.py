"""Make the bundled MLX quantised set, fixtures/e2b-mini-mlx-q4: the e2b-mini preset (seed 0) quantised by mlx-lm's
own quantize_model at 4 bits, group size 32 (tests/mlx_convert.py: as mlx_lm.convert -q), its text set generated
from that directory, and the checkpoint shipped inside the set (``checkpoint/``, recorded as a path relative to the
set): the quantised bytes depend on the mlx version, so they are shipped, not regenerated.

    .venv/bin/python scripts/bundle-mlx-set.py [--out fixtures/e2b-mini-mlx-q4]
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

from mlx_convert import quantise  # noqa: E402 - after sys.path

from conformance.generate import generate_set  # noqa: E402
from conformance.sets.format import write_json  # noqa: E402
from refimpl.synth import write_checkpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "fixtures" / "e2b-mini-mlx-q4"))
    out = Path(ap.parse_args().out)
    with tempfile.TemporaryDirectory() as tmp:
        src = write_checkpoint("e2b-mini", 0, Path(tmp) / "e2b-mini")
        ckpt = quantise(src, Path(tmp) / "checkpoint", 4, 32)
        shutil.rmtree(out, ignore_errors=True)
        generate_set(out, model_dir=ckpt, name=out.name, cases="text", store="logits",
                     command="python scripts/bundle-mlx-set.py")
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
        shutil.copytree(ckpt, out / "checkpoint")
        extra = sorted(set(p.name for p in (out / "checkpoint").iterdir()) - set(manifest["model"]["sha256"]))
        for name in extra:  # only the files the set records travel with it
            (out / "checkpoint" / name).unlink()
        manifest["model"]["path"] = "checkpoint"  # inside the set (FixtureSet.model_record)
        write_json(out / "manifest.json", manifest)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
