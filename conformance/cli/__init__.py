"""``conformance``: the conformance gate's command line (check, list, generate, verify, selftest,
scoreboard).

    conformance check --backend NAME|module:attr [--fixtures DIR ...] [--model DIR] [--rehash] [--profile P]
                      [--expectations FILE | --no-shipped-expectations] [-k REGEX]
                      [--json FILE] [--junit-xml FILE] [--summary-md FILE] [--html FILE] [--backend-option KEY=VALUE
                      ...] [-q] [-v]
    conformance list backends|cases|profiles [--fixtures DIR ...] [-k REGEX]
    conformance generate (--model DIR | --preset NAME [--seed N]) [--prompts FILE.jsonl] --out DIR
                         [--name N] [--version V] [--cases auto|text|images|audio|videos|mtp|all] [--drafter DIR]
                         [--image FILE ...]
                         [--audio FILE.wav ...] [--workers N | --cluster ADDRESS]
    conformance verify DIR ... [--model DIR] [--rehash] [--recompute]
    conformance selftest [--fixtures DIR ...] [--mutant REGEX] [-k REGEX] [--json FILE] [--workers N] [-q]
    conformance scoreboard REPORT.json ... [--out FILE.md | --into PAGE.md] [--title T]
    conformance loss --fixtures QUANTISED --reference UNQUANTISED [--backend NAME|module:attr] [-k REGEX]
                     [--json FILE] [--summary-md FILE] [--plot OUT.png] [--max-kl X] [--max-kl-p99 X] [--min-top1 P]
                     [--max-dp-rms X] [--backend-option KEY=VALUE ...] [-q]
    conformance explain --backend NAME|module:attr [-k REGEX] [--fixtures DIR ...] [--from REPORT.json]
                        [--json OUT] [--html OUT.html] [--plot OUT.png] [--profile P] [--backend-option KEY=VALUE ...]
                        [-q] [-v]

Exit codes: 0 all selected cases pass (xfail, skipped and not-claimed allowed); 1 some case is fail,
error or xpass; 2 usage error (bad arguments, bad expectations file, unknown profile, bad regex);
3 fixture integrity error; 4 backend error (cannot be found, loaded or opened); 5 no case run (-k
matched no case, or every selected case is not claimed or skipped). User errors print one
``conformance: error:`` line, never a traceback. See docs/conformance.md.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from typing import Sequence

from refimpl.ggml_act import CONVENTIONS as ACTIVATION_CONVENTIONS
from refimpl.signals import interrupt_name, interrupt_signal, stop_signals

from ..protocol.wire import VERSIONS
from ..report.json_report import SCHEMA_VERSION as REPORT_SCHEMA_VERSION
from ..sets.format import SCHEMA_VERSION as SET_SCHEMA_VERSION
from .check import cmd_check, cmd_list, cmd_scoreboard
from .common import (
    EXIT_PIPE,
    EXIT_USAGE,
    PROG,
    Parser,
    UsageError,
    add_device,
    add_selection,
    concurrency_count,
    err,
    oracle_device,
    positive_seconds,
    silence_stdout,
)
from .explain import cmd_explain
from .generate import add_generate_options, cmd_generate, cmd_verify
from .loss import add_loss_options, cmd_loss
from .selftest import cmd_selftest

__all__ = ["build_parser", "main"]

MODEL_HELP = ("the checkpoint of every external fixture set: a directory anywhere whose files have the size and "
              "sha256 the set records (default: the path the set records); synthetic sets ignore it")
LIST_WHAT = ("backends", "cases", "profiles")
REHASH_HELP = "read every checkpoint file again instead of trusting the digest cache (docs/fixtures.md)"

def _add_check(sub) -> None:
    """The 'check' command's options."""
    c = sub.add_parser("check", help="run the fixture sets' cases on a backend and grade them",
                       description="Run the selected cases of the fixture sets on a backend and grade every "
                                   "returned logits row against the oracle's float64 rows. Exit codes: 0 pass, "
                                   "1 fail/error/xpass, 2 usage, 3 fixture integrity, 4 backend, 5 no case run.")
    c.add_argument("--backend", required=True, metavar="NAME|module:attr",
                   help="a registered backend name (see 'conformance list backends') or module:attr")
    c.add_argument("--fixtures", nargs="+", action="extend", metavar="DIR",
                   help="fixture set directories, or directories holding sets (default: the bundled sets)")
    c.add_argument("--model", metavar="DIR", help=MODEL_HELP)
    c.add_argument("--drafter", metavar="DIR",
                   help="the MTP assistant checkpoint of sets with MTP cases (default: the path the set records, "
                        "relative to the checkpoint; checked by its sha256 like the checkpoint)")
    c.add_argument("--rehash", action="store_true", help=REHASH_HELP)
    c.add_argument("--profile", metavar="P", help="grading profile (default: the backend's default_profile)")
    c.add_argument("--expectations", metavar="FILE", help="expectations file (JSON, or TOML for *.toml); "
                   "default: the file the backend ships for its configuration, if any")
    c.add_argument("--no-shipped-expectations", action="store_true",
                   help="grade without the expectations file the backend ships")
    add_selection(c)
    c.add_argument("--json", metavar="FILE", help="write the JSON report (schema v1); - for standard output")
    c.add_argument("--junit-xml", metavar="FILE", help="write a JUnit XML report; - for standard output")
    c.add_argument("--junit-properties", action="store_true",
                   help="also write each case's record as <properties> of its <testcase> (outside the common JUnit "
                        "schema, which allows properties on a <testsuite> only)")
    c.add_argument("--summary-md", metavar="FILE",
                   help="write a Markdown summary (verdict, tables, the first failing cases with their diagnosis); "
                        "- for standard output. Under GitHub Actions it is also appended to $GITHUB_STEP_SUMMARY")
    c.add_argument("--html", metavar="FILE",
                   help="write a self-contained HTML page of the run (verdict, tables, every failed case with its "
                        "diagnosis, rows, metrics and top-k tokens, the expectations applied); - for standard output")
    c.add_argument("--backend-option", action="append", metavar="KEY=VALUE",
                   help="keyword argument for the backend's class or factory (repeatable)")
    c.add_argument("--isolate", action="store_true",
                   help="run a Python backend in a child process behind the subprocess protocol: a backend that "
                        "exits, crashes or hangs costs one case (an error) and the child is restarted")
    c.add_argument("--case-timeout", type=positive_seconds, metavar="SECONDS",
                   help="a case whose request takes longer is an error (check 'timeout'); a backend in a child "
                        "process (--isolate, subprocess, llama-cpp) is restarted, an in-process one ends the run")
    c.add_argument("--concurrency", type=concurrency_count, metavar="N",
                   help="send each set's requests ahead, N at a time, so that a server batches requests of "
                        "different lengths (sorted by prompt: a prefix cache reuses blocks); backends with prefetch "
                        "only (openai)")
    add_device(c, "the oracle (the rows rebuilt through the head, the embeddings, the MTP rows)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    c.add_argument("-v", "--verbose", action="store_true", help="details of every failing case, not only the first")


def _add_explain(sub) -> None:
    """The 'explain' command's options."""
    ex = sub.add_parser("explain", help="re-run cases with traces and name where the backend first leaves the oracle",
                        description="Re-run the selected cases (by default the failed ones of --from REPORT.json) "
                                    "with traces (capability traces), compare every traced point inside the model "
                                    "with the oracle's, row by row, and report the first point where the backend "
                                    "leaves the profile's noise floor: layer, sub-block, rows, and how the error "
                                    "grows from there. Exit codes: 0 every case within the floor, 1 a case "
                                    "diverges or errs, 2 usage, 3 fixture integrity, 4 backend, 5 no case selected. "
                                    "See docs/conformance.md.")
    ex.add_argument("--backend", required=True, metavar="NAME|module:attr",
                    help="a registered backend name (see 'conformance list backends') or module:attr")
    add_selection(ex)
    ex.add_argument("--fixtures", nargs="+", action="extend", metavar="DIR",
                    help="fixture sets (default: the report's sets with --from, else the bundled sets)")
    ex.add_argument("--from", dest="from_report", metavar="REPORT.json",
                    help="explain the failed cases (fail, error, xfail, xpass) of this 'conformance check --json' "
                         "report")
    ex.add_argument("--model", metavar="DIR", help=MODEL_HELP)
    ex.add_argument("--rehash", action="store_true", help=REHASH_HELP)
    ex.add_argument("--profile", metavar="P", help="the profile whose nmse is the floor (default: the backend's)")
    ex.add_argument("--json", metavar="OUT", help="write every case's comparison as JSON; - for standard output")
    ex.add_argument("--html", metavar="OUT.html",
                    help="write the explanation as a self-contained HTML page with a heat map per case")
    ex.add_argument("--plot", metavar="OUT.png",
                    help="draw the error per point and row as a heat map (needs matplotlib: the plot extra)")
    ex.add_argument("--backend-option", action="append", metavar="KEY=VALUE",
                    help="keyword argument for the backend's class or factory (repeatable)")
    add_device(ex, "the oracle whose traces the backend's are compared with")
    ex.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    ex.add_argument("-v", "--verbose", action="store_true", help="the table of every case, not only diverging ones")


def _add_loss(sub) -> None:
    """The 'loss' command's options."""
    lo = sub.add_parser("loss", help="the quantisation loss on the same rows: a quantised set against the "
                        "unquantised set of the same model, and an engine against both",
                        description="Compare every case of a quantised fixture set with the same case of the "
                                    "unquantised (reference) set of the same model, row by row: KL divergence "
                                    "(mean, p99, max), same top-1 %%, delta_p RMS and max_abs, per case and in total; "
                                    "with --backend, also the engine's rows against both oracles. Information, not a "
                                    "verdict, unless a threshold is given. Exit codes: 0 information, or every "
                                    "threshold kept; 1 a threshold exceeded; 2 usage (sets that do not pair); 3 "
                                    "fixture integrity; 4 backend. See docs/quantised.md.")
    add_loss_options(lo)
    add_selection(lo)


def _add_list(sub) -> None:
    """The 'list' command's options."""
    ls = sub.add_parser("list", help="list backends, cases or profiles")
    ls.add_argument("what", choices=LIST_WHAT, nargs="?")
    ls.add_argument("--fixtures", nargs="+", action="extend", metavar="DIR",
                    help="fixture sets for 'list cases' (default: the bundled sets)")
    add_selection(ls)


def _add_generate(sub) -> None:
    """The 'generate' command's options."""
    g = sub.add_parser("generate", help="generate a fixture set with the oracle (the only writer of goldens)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a checkpoint directory (config.json, safetensors, tokenizer)")
    src.add_argument("--preset", metavar="NAME", help="a refimpl synthetic preset (see 'refimpl synth')")
    g.add_argument("--seed", type=int, default=None, help="weights seed for --preset (default 0)")
    g.add_argument("--prompts", metavar="FILE.jsonl", help="extra bases from your prompts (one JSON object a line)")
    g.add_argument("--cases", choices=("auto", "text", "images", "audio", "videos", "mtp", "all"), default="auto",
                   help="which case matrix: text, images (image prompts: bases I0, I1), audio (audio prompts: bases "
                        "S0, S1), videos (synthetic videos' frames: bases V0, V1), mtp (assisted decoding with the "
                        "drafter: bases M0..M3), or all (text plus what the checkpoint's towers and drafter allow, "
                        "videos aside; auto, the default, is the same)")
    g.add_argument("--drafter", metavar="DIR",
                   help="an MTP assistant checkpoint for --model (gemma4_assistant, gemma4_unified_assistant): adds "
                        "the MTP matrix (docs/fixtures.md); a preset with an assistant brings its own")
    g.add_argument("--image", action="append", metavar="FILE",
                   help="an image for the image bases (repeat for more; PNG/PPM natively, other formats with "
                        "pillow); default: synthetic images")
    g.add_argument("--audio", action="append", metavar="FILE.wav",
                   help="a 16 kHz WAV clip for the audio bases (repeat for more); default: synthetic clips")
    g.add_argument("--vision-mask", choices=("sliding-clamped", "all-unclamped"), default="sliding-clamped",
                   help="how image blocks open the oracle's mask on 'vision' checkpoints: sliding-clamped (default: "
                        "sliding layers only, inside the window; transformers' static path, llama.cpp, vLLM) or "
                        "all-unclamped (every layer, after the window; transformers 5.24's default Gemma 4 Unified "
                        "forward, mlx-vlm); recorded in the manifest")
    g.add_argument("--activations", choices=ACTIVATION_CONVENTIONS, default="none",
                   help="the activation convention of the oracle's products: none (default: the dequantised weights "
                        "times the activations as they are) or ggml's CPU activation quantisation on a kernel path "
                        "(x86: the SIMD kernels, ref: the reference quantisers; /f16-kv: with llama.cpp's fp16 K/V "
                        "cache), for a GGUF --model graded on llama.cpp (docs/quantised.md); recorded in the "
                        "manifest")
    g.add_argument("--store", choices=("hidden", "logits"), default="hidden",
                   help="hidden (default): per row the float64 hidden state and its top-k/log-sum-exp summary, the "
                        "logits rebuilt through the checkpoint's head at check time (12 KB a row for E2B); logits: "
                        "also the full float64 logits, readable without the checkpoint (2 MB a row at the published "
                        "vocabulary; docs/fixtures.md)")
    add_generate_options(g)
    g.add_argument("--out", required=True, metavar="DIR", help="the new set's directory (must not exist)")
    g.add_argument("--name", metavar="N", help="set name (default: the preset or model directory name)")
    g.add_argument("--version", metavar="V", help="set version, semver (default 1.0.0)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, metavar="N",
                       help="local worker processes, one job (base) each at a time (default: the CPU count; with "
                            "--device cuda one per GPU, each seeing only its own; 1 runs everything in this process)")
    where.add_argument("--cluster", metavar="ADDRESS",
                       help="run the jobs on a Dask distributed cluster: its scheduler's address, e.g. "
                            "tcp://host:8786 (needs gemma4-conformance[cluster]; the model and --out's parent must be "
                            "on storage every worker sees at the same path; docs/distributed-generation.md)")
    add_device(g, "the oracle that writes the set")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress output")


def _add_verify(sub) -> None:
    """The 'verify' command's options."""
    v = sub.add_parser("verify", help="check fixture sets' schema and sha256 digests")
    v.add_argument("dirs", nargs="+", metavar="DIR")
    v.add_argument("--model", metavar="DIR", help=MODEL_HELP + "; without it, an external set whose recorded path "
                   "is not there is verified without its checkpoint, and verify says so")
    v.add_argument("--rehash", action="store_true", help=REHASH_HELP)
    v.add_argument("--recompute", action="store_true",
                   help="also recompute every base's logits with the oracle (slow for real checkpoints)")


def _add_selftest(sub) -> None:
    """The 'selftest' command's options."""
    st = sub.add_parser("selftest", help="check that the gate kills a deliberately broken engine per bug class",
                        description="Run the harness on the unmutated numpy-engine (the control, which must pass "
                                    "every case at exact-f64) and on its mutants (one planted bug each), graded "
                                    "at fp32 (the verdict) and at bf16 and q8 (for information), and print which "
                                    "mutants are killed and by which check. Exit codes: 0 every mutant killed at "
                                    "fp32 by a check that matches its bug, 1 a survivor, a non-matching kill, a "
                                    "broken mutant or a failing control, 2 usage, 3 fixture integrity, 4 backend, "
                                    "5 no case selected. "
                                    "See docs/bug-classes.md.")
    st.add_argument("--fixtures", nargs="+", action="extend", metavar="DIR",
                    help="fixture set directories, or directories holding sets (default: the bundled sets)")
    st.add_argument("--mutant", metavar="REGEX", help="only the mutants whose name matches REGEX (re.search), "
                                                     "or whose bug class is REGEX")
    add_selection(st)
    st.add_argument("--json", metavar="FILE", help="write the self-test table as JSON")
    st.add_argument("--workers", type=int, default=1, metavar="N",
                    help="run N mutants at a time, each in a process forked after the control (Linux; default 1)")
    st.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    st.add_argument("-v", "--verbose", action="store_true", help="do not wrap the 'breaks' column")


def _add_scoreboard(sub) -> None:
    """The 'scoreboard' command's options."""
    sb = sub.add_parser("scoreboard", help="a Markdown table of several check reports, one column per run",
                        description="Read JSON reports written by 'conformance check --json' and print a "
                                    "Markdown scoreboard: per run, per entry point and per feature, passed/graded "
                                    "with the worst max_abs and KL, then every case that deviates and why.")
    sb.add_argument("reports", nargs="+", metavar="REPORT.json")
    where = sb.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="FILE.md", help="write to FILE.md instead of standard output")
    where.add_argument("--into", metavar="PAGE.md", help="replace the text between the lines "
                       "'<!-- scoreboard:begin -->' and '<!-- scoreboard:end -->' of PAGE.md")
    sb.add_argument("--title", default="Conformance scoreboard", help="the page title")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="Conformance gate for Gemma 4 inference engines against the exact "
                                       "float64 refimpl oracle. See docs/conformance.md.")
    p.add_argument("--version", action=_Version, nargs=0, help="print the version and the formats it speaks, then exit")
    sub = p.add_subparsers(dest="command", metavar="{check,explain,loss,list,generate,verify,selftest,scoreboard}",
                           parser_class=Parser)
    sub.required = True
    for add in (_add_check, _add_explain, _add_loss, _add_list, _add_generate, _add_verify, _add_selftest,
                _add_scoreboard):  # one parser per command, in the order of the help
        add(sub)
    return p


def version_line() -> str:
    """``conformance --version``: the package's version and the formats it speaks."""
    try:
        version = metadata.version("gemma4-conformance")
    except metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    return (f"{PROG} {version} (gemma4-conformance; JSON report schema v{REPORT_SCHEMA_VERSION}, subprocess protocol "
            f"v{max(VERSIONS)}, fixture set schema v{SET_SCHEMA_VERSION})")


class _Version(argparse.Action):
    """--version on one line (argparse's own version action wraps it to the terminal's width)."""

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(version_line() + "\n")
        parser.exit(0)


def _list_what(args):
    """``list``'s word, also where ``--fixtures DIR ...`` took it as one more directory (``list --fixtures DIR
    cases``): a subcommand's words are never a fixture directory."""
    if args.what is None and args.fixtures and args.fixtures[-1] in LIST_WHAT:
        args.what = args.fixtures.pop()
    if args.what is None:
        raise UsageError(f"list: say what to list: {', '.join(LIST_WHAT)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help / --version
            return int(e.code or 0) if not isinstance(e.code, str) else EXIT_USAGE
        commands = {"check": lambda: cmd_check(args, argv), "explain": lambda: cmd_explain(args),
                    "loss": lambda: cmd_loss(args, argv),
                    "list": lambda: cmd_list(_list_what(args)),
                    "generate": lambda: cmd_generate(args), "verify": lambda: cmd_verify(args),
                    "selftest": lambda: cmd_selftest(args, argv), "scoreboard": lambda: cmd_scoreboard(args)}
        if args.command not in commands:
            raise UsageError(f"unknown command {args.command!r}")
        with stop_signals(), oracle_device(getattr(args, "device", None)):  # SIGTERM/SIGHUP end it as Ctrl-C does
            return commands[args.command]()
    except UsageError as e:
        err(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        err(f"interrupted by {interrupt_name(e)}")
        return 128 + interrupt_signal(e)
    except BrokenPipeError:  # a reader that quit early: the output is incomplete, never a pass
        silence_stdout()
        return EXIT_PIPE


