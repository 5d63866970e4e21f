"""``conformance generate`` and ``conformance verify``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from refimpl.arrays import gpus
from refimpl.errors import RefimplError
from refimpl.gguf_io import is_gguf

from ..check.runner import interrupt_signal
from ..generate import (
    PartialRunBusy,
    PartialRunMismatch,
    WorkerLost,
    finished_bases,
    generate_set,
    partial_dir,
    publish_path,
    verify_set,
)
from ..report import ProgressBar, is_tty, printable
from ..sets import FixtureError, link_loop
from .common import EXIT_FIXTURE, EXIT_OK, EXIT_WORKER_LOST, UsageError, err, model_dir_arg, refuse_gguf

ALLOW_BEYOND_CONTEXT_HELP = ("generate bases longer than the checkpoint's context (max_position_embeddings in "
                             "config.json), which are otherwise refused before any forward; recorded in the "
                             "manifest (oracle.beyond_context)")


def add_generate_options(g: argparse.ArgumentParser) -> None:
    """The options of ``conformance generate`` defined here (the rest are in ``conformance.cli.build_parser``)."""
    g.add_argument("--allow-beyond-context", action="store_true", help=ALLOW_BEYOND_CONTEXT_HELP)


class _GenerateProgress:
    """Progress for fixtures.generate_set: accepts (message), (done, total) or (done, total, message)."""

    def __init__(self, enabled: bool):
        self.bar = ProgressBar(sys.stderr, tty=is_tty(sys.stderr), enabled=enabled)

    def __call__(self, *args, **kwargs) -> None:
        nums = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        texts = [str(a) for a in args if isinstance(a, str)] + [str(v) for v in kwargs.values() if isinstance(v, str)]
        text = " ".join(texts)
        if len(nums) >= 2:
            done, total = nums[0], nums[1]
            if self.bar.tty:
                self.bar(done, total, text)
            else:
                self.bar.message(f"[{done}/{total}] {text}".rstrip())
        elif text:
            self.bar.message(text)

    def line(self, text: str) -> None:
        """A stage line of ``generate_set(stages=...)``."""
        self.bar.message(text)

    def close(self) -> None:
        self.bar.close()


def _resume_hint(out: str) -> str:
    """' (N finished bases are kept in DIR; ...)' when a failed generate left a partial run, else ''."""

    try:
        path = partial_dir(publish_path(out))
    except ValueError:
        return ""
    try:
        n = len(finished_bases(path))
    except OSError:
        n = 0
    return (f" ({n} finished base{'s' if n != 1 else ''} kept in {path}; run the same command again to resume)"
            if n else "")


def cmd_generate(args) -> int:
    if (args.model is None) == (args.preset is None):
        raise UsageError("give exactly one of --model DIR or --preset NAME")
    if args.model is not None and args.seed is not None:
        raise UsageError("--seed applies to --preset only")
    if args.workers is not None and args.cluster is not None:
        raise UsageError("--workers and --cluster exclude each other: --cluster runs the jobs on the Dask "
                         "cluster's workers")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    if args.prompts is not None and not Path(args.prompts).is_file():
        raise UsageError(f"--prompts: no such file: {args.prompts}")
    refuse_gguf(args.drafter, "--drafter")
    if args.model is not None and not Path(args.model).is_dir() and not (Path(args.model).is_file()
                                                                          and is_gguf(args.model)):
        raise UsageError(f"--model: no such directory: {args.model}")
    if args.drafter is not None and args.model is None:
        raise UsageError("--drafter applies to --model only (a preset with an assistant brings its own)")
    if args.drafter is not None and not Path(args.drafter).is_dir():
        raise UsageError(f"--drafter: no such directory: {args.drafter}")
    for flag, paths in (("--image", args.image), ("--audio", args.audio)):
        for path in paths or ():
            if not Path(path).is_file():
                raise UsageError(f"{flag}: no such file: {path}")
    out_path = Path(args.out)
    if out_path.exists() and not (out_path.is_dir() and not any(out_path.iterdir())):
        raise UsageError(f"--out: {args.out} already exists; a fixture set is never overwritten "
                         "(choose a new directory, e.g. with a new version)")
    progress = _GenerateProgress(enabled=not args.quiet)
    kw: dict[str, Any] = {"model_dir": args.model, "preset": args.preset, "seed": args.seed or 0,
                          "prompts": args.prompts, "name": args.name, "progress": progress,
                          "cases": args.cases, "images": args.image or None, "audio": args.audio or None,
                          "workers": len(gpus()) if args.workers is None and args.cluster is None
                          and args.device == "cuda" else args.workers, "cluster": args.cluster, "store": args.store,
                          "vision_mask": args.vision_mask, "drafter": args.drafter, "stages": progress.line,
                          "allow_beyond_context": getattr(args, "allow_beyond_context", False),
                          "activations": getattr(args, "activations", "none")}
    if args.version is not None:
        kw["version"] = args.version
    try:
        out = generate_set(args.out, **kw)
    except (PartialRunMismatch, PartialRunBusy) as e:
        progress.close()
        raise UsageError(str(e)) from None
    except WorkerLost as e:
        progress.close()
        hint = _resume_hint(args.out)
        err(f"{e.reason}{hint}" if hint else str(e))
        return EXIT_WORKER_LOST
    except FixtureError as e:
        progress.close()
        err(f"{e}{_resume_hint(args.out)}")
        return EXIT_FIXTURE
    except (ValueError, FileExistsError, OSError) as e:
        progress.close()
        raise UsageError(f"{e}{_resume_hint(args.out)}") from None
    except KeyboardInterrupt as e:
        progress.close()
        err(f"interrupted{_resume_hint(args.out)}")
        return 128 + interrupt_signal(e)
    except Exception as e:  # refimpl errors (bad checkpoint, bad prompts) are user errors
        progress.close()
        if isinstance(e, RefimplError):
            raise UsageError(f"{e}{_resume_hint(args.out)}") from None
        raise
    progress.close()
    print(f"wrote fixture set {out}")
    return EXIT_OK


def cmd_verify(args) -> int:
    bad = 0
    model = model_dir_arg(args.model)
    for d in args.dirs:
        notes: list[str] = []
        p = Path(d)
        loop = link_loop(p)
        if loop is not None:
            problems = [loop]
        elif not (p.is_dir() or (p.is_file() and p.name.endswith(".tar"))):
            problems = [f"no such directory: {d}" if not p.exists() else f"not a directory or a .tar of a set: {d}"]
        else:
            problems = list(verify_set(p, recompute=args.recompute, model=model, rehash=args.rehash, notes=notes))
        if problems:
            bad += 1
            print(f"{d}: {len(problems)} problem(s)")
            for prob in problems:
                print(printable(f"  - {prob}"))
        else:
            print(f"{d}: ok")
            for note in notes:  # e.g. that the checkpoint was not checked
                print(printable(f"  note: {note}"))
    return EXIT_FIXTURE if bad else EXIT_OK


