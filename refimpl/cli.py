"""``refimpl``: the oracle's command line (synth, inspect, logits, generate; logits and generate take
images with ``--image``, videos as directories of frames with ``--video`` and 16 kHz WAV audio clips with
``--audio``).

Bad input prints one ``error:`` line and exits 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

from .arrays import DEVICES
from .cli_inputs import (
    audio_soft_tokens,
    check_media_args,
    has_media,
    image_soft_tokens,
    media_prompt,
    parse_ints,
    prompt_ids,
    video_soft_tokens,
)
from .context import check_prompt_context
from .errors import InputError, RefimplError
from .generate import greedy_generate, greedy_generate_multimodal
from .image import SUPPORTED_SOFT_TOKENS
from .inspect_cmd import cmd_inspect
from .model import VISION_MASK_RULES, Gemma4, resolve_rows
from .multimodal import multimodal_logits
from .safetensors_io import write_safetensors
from .signals import interrupt_name, interrupt_signal, stop_signals
from .synth import (
    PRESETS,
    PUBLISHED,
    published_config,
    published_parameters,
    write_checkpoint,
    write_published_checkpoint,
)
from .tokenizer import Tokenizer

EXIT_USAGE = 2


def _piece(tok: Tokenizer | None, i: int) -> str:
    """The piece of id ``i`` for the top-k lines; "-" without a tokenizer or for an id beyond it (the published-shape
    synthetic checkpoints ship a small tokenizer under a 262,144-entry vocabulary)."""
    if tok is None or not 0 <= int(i) < tok.vocab_size:
        return "-"
    return json.dumps(tok.piece(i), ensure_ascii=False)


def _check_context(args, model: Gemma4, ids: list[int], new_tokens: int = 0) -> None:
    """Before any forward, unless --allow-beyond-context: ``refimpl.context.check_prompt_context``."""
    if not args.allow_beyond_context:
        check_prompt_context(model.cfg, len(ids), new_tokens, "--max-new-tokens")


# ----------------------------------------------------------------------------------------------
# commands


def cmd_synth(args) -> int:
    if args.preset in PUBLISHED:
        return _synth_published(args)
    if args.layers is not None:
        raise InputError(f"--layers applies to the published-shape presets ({', '.join(PUBLISHED)}), not to "
                         f"{args.preset}")
    dtype = args.dtype or "f32"
    out = write_checkpoint(args.preset, args.seed, args.out, dtype, args.layout, overwrite=args.force)
    media = any(k in PRESETS[args.preset] for k in ("vision", "audio", "unified_vision", "unified_audio"))
    layout = "conditional" if media else args.layout  # image/audio models exist only in that layout
    print(f"wrote {args.preset} (seed {args.seed}, {dtype}, {layout}) to {out}")
    return 0


def _synth_published(args) -> int:
    dtype = args.dtype or "bf16"
    config = published_config(args.preset, 0, args.layers)  # validates --layers before any work
    n = published_parameters(config)
    layers = config["num_hidden_layers"]
    size = n * (2 if dtype == "bf16" else 4)
    print(f"writing {args.preset} shapes, {layers} layers ({config['num_kv_shared_layers']} KV-shared): "
          f"{n / 1e9:.2f} B parameters, {size / 2**30:.1f} GiB of {dtype}", file=sys.stderr)
    tty = sys.stderr.isatty()
    shown = [-1]

    def progress(done: int, total: int) -> None:
        pct = int(100 * done / max(total, 1))
        if pct != shown[0] and (tty or pct % 10 == 0):
            shown[0] = pct
            line = f"  weights {pct:3d}% ({done / 2**30:.1f} / {total / 2**30:.1f} GiB)"
            print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    out = write_published_checkpoint(args.preset, args.seed, args.out, layers=args.layers, dtype=dtype,
                                     layout=args.layout, overwrite=args.force, progress=progress)
    if tty:
        print(file=sys.stderr)
    print(f"wrote {args.preset} shapes ({layers} layers, seed {args.seed}, {dtype}, {args.layout}) to {out}")
    return 0


def _check_out(out: Path, model_dir: Path, force: bool) -> None:
    """--out of logits, checked before any work: never a path inside the model directory (not even with
    --force: the checkpoint's own files would be overwritten), never a directory, and an existing file
    only with --force."""
    if out.resolve().is_relative_to(model_dir.resolve()):
        raise InputError(f"--out {out} is inside the model directory {model_dir}; refimpl never writes into a "
                         "checkpoint, choose a path outside it")
    if out.is_dir():
        raise InputError(f"--out {out} is a directory; pass the path of the .safetensors file to write")
    if out.exists() and not force:
        raise InputError(f"--out {out} already exists; pass --force to overwrite it, or choose another path")
    if not out.parent.is_dir():
        raise InputError(f"--out {out}: the directory {out.parent} does not exist; create it first")


def _write_atomically(out: Path, tensors: dict, dtype: str, metadata: dict) -> None:
    """write_safetensors into a hidden file beside ``out``, renamed to ``out`` when complete: an error or an
    interrupt (a CI job's timeout while gigabytes of all-rows logits are written) leaves no truncated file and
    keeps the one --force was to replace."""
    target = out.resolve()  # through a symbolic link, as a plain write goes
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"  # made as a plain file is: the user's umask
    try:
        write_safetensors(tmp, tensors, dtype, metadata=metadata)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def cmd_logits(args) -> int:
    if args.top_k < 1:
        raise InputError(f"--top-k must be at least 1, got {args.top_k}")
    check_media_args(args)
    model_dir = Path(args.model)
    _check_out(Path(args.out), model_dir, args.force)
    if has_media(args):
        model = Gemma4(model_dir, args.dtype, args.embed_scale, vision_mask=args.vision_mask, device=args.device)
        prompt = media_prompt(args, model_dir, model)
        ids, tok = prompt.ids, prompt.tok
    else:
        ids, tok = prompt_ids(args, model_dir)
        model = Gemma4(model_dir, args.dtype, args.embed_scale, vision_mask=args.vision_mask, device=args.device)
    rows = args.rows if args.rows in ("last", "all") else parse_ints(args.rows, "--rows")
    index = resolve_rows(rows, len(ids))
    _check_context(args, model, ids)
    metadata = {"model": str(model_dir), "dtype": str(model.dtype), "embed_scale": args.embed_scale}
    if has_media(args):
        soft = image_soft_tokens(model_dir, prompt, args.dtype)
        audio = audio_soft_tokens(model_dir, prompt, args.dtype)
        video = video_soft_tokens(prompt)
        logits = multimodal_logits(model, ids, soft, prompt.tokens, rows=rows, audio_soft_tokens=audio,
                                   video_soft_tokens=video)
        if args.image:
            metadata["images"] = json.dumps(prompt.info)
        if args.audio:
            metadata["audio"] = json.dumps(prompt.audio_info)
        if args.video:
            metadata["videos"] = json.dumps(prompt.video_info)
    else:
        logits = model.forward(ids, rows=rows)
    _write_atomically(Path(args.out), {"logits": logits, "rows": index, "tokens": np.asarray(ids)},
                      "F64" if model.dtype == np.float64 else "F32", metadata)
    images = f" ({prompt.summary})" if has_media(args) else ""
    print(f"{len(ids)} tokens{images}, {len(index)} rows of {logits.shape[1]} logits ({model.dtype}) -> {args.out}")
    if has_media(args):
        print("\n".join(prompt.lines()))
    for r, row in zip(index, logits, strict=True):
        top = np.argsort(-row, kind="stable")[: args.top_k]
        shown = ", ".join(f"{int(t)} {_piece(tok, t)} {row[t]:.4f}" for t in top)
        print(f"  row {int(r)}: {shown}")
    return 0


def cmd_generate(args) -> int:
    check_media_args(args)
    model_dir = Path(args.model)
    if has_media(args):
        if args.max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {args.max_new_tokens}")
        model = Gemma4(model_dir, args.dtype, args.embed_scale, vision_mask=args.vision_mask, device=args.device)
        prompt = media_prompt(args, model_dir, model)
        ids, tok = prompt.ids, prompt.tok
        _check_context(args, model, ids, args.max_new_tokens)
        soft = image_soft_tokens(model_dir, prompt, args.dtype)
        audio = audio_soft_tokens(model_dir, prompt, args.dtype)
        video = video_soft_tokens(prompt)
        print("\n".join(prompt.lines()), file=sys.stderr)
    else:
        ids, tok = prompt_ids(args, model_dir)
        model = Gemma4(model_dir, args.dtype, args.embed_scale, vision_mask=args.vision_mask, device=args.device)
        _check_context(args, model, ids, args.max_new_tokens)

    new_tokens: list[int] = []
    shown = ""

    def show(token: int) -> None:
        """Print the continuation as it grows, holding back an incomplete UTF-8 sequence."""
        nonlocal shown
        new_tokens.append(token)
        if tok is None:
            sys.stdout.write(f"{token} ")
        else:
            text = tok.decode(new_tokens)
            if text.endswith("\ufffd"):
                return
            sys.stdout.write(text[len(shown):])
            shown = text
        sys.stdout.flush()

    if has_media(args):
        result = greedy_generate_multimodal(model, ids, soft, prompt.tokens, args.max_new_tokens, on_token=show,
                                            audio_soft_tokens=audio, video_soft_tokens=video)
    else:
        result = greedy_generate(model, ids, args.max_new_tokens, on_token=show)
    if tok is not None:
        sys.stdout.write(tok.decode(new_tokens)[len(shown):])
    print()
    images = f" ({prompt.summary})" if has_media(args) else ""
    print(f"[{len(ids)} prompt tokens{images}, {len(result.tokens)} new: {','.join(map(str, result.tokens))}; "
          f"{'stopped on a stop id' if result.stopped else 'reached --max-new-tokens'}]", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------
# parser


def _add_prompt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, safetensors, tokenizer.model), "
                   "or a Gemma 4 text model's .gguf file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="comma-separated token ids, e.g. 2,17,300 (used as given: no BOS added)")
    src.add_argument("--prompt", help="text, encoded with <bos> prepended")
    p.add_argument("--chat", action="store_true",
                   help="render --prompt as one user turn with the generation prompt, through the checkpoint's chat "
                        "template (chat_template.jinja or tokenizer_config.json; needs jinja2: pip install "
                        "'gemma4-conformance[chat]') or, without one, the hand-written Gemma 4 chat format")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--device", choices=list(DEVICES), default=None,
                   help="where the text decoder runs: cpu (NumPy; the default, or REFIMPL_DEVICE's) or cuda (CuPy on a "
                        "GPU: pip install 'gemma4-conformance[cuda12]' or '[cuda13]'; docs/refimpl.md, 'GPU')")
    p.add_argument("--embed-scale", choices=["exact", "bf16"], default="exact",
                   help="sqrt(hidden_size) exactly (default, as HF float32) or rounded to bfloat16 (HF bf16, JAX)")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image (PNG, PPM/PGM; other formats through Pillow); repeat for more. Each goes where the "
                        "prompt has an <|image|> placeholder, in order; with no placeholder the images go in front "
                        "of the text (after <bos>; with --chat, at the start of the user turn)")
    p.add_argument("--video", action="append", default=[], metavar="DIR",
                   help="a video as a directory of its frames (image files, in file-name order); repeat for more. "
                        "Each goes where the prompt has a <|video|> placeholder, in order (else in front of the text, "
                        "after the images): its sampled frames, each 'mm:ss ' + <|image> + <|video|> x N + <image|>")
    p.add_argument("--fps", type=float, default=None, metavar="F",
                   help="--video's frame rate, for the frames' timestamps (default 24, as transformers' processor "
                        "without metadata)")
    p.add_argument("--num-frames", type=int, default=None, metavar="N",
                   help="frames sampled of each --video (default: the checkpoint's video processor, else 32)")
    p.add_argument("--audio", action="append", default=[], metavar="FILE.wav",
                   help="an audio clip (16 kHz WAV; other rates are refused, not resampled); repeat for more. Each "
                        "goes where the prompt has an <|audio|> placeholder, in order; with no placeholder the clips "
                        "go in front of the text (after the images when --image puts those in front too)")
    p.add_argument("--mmproj", metavar="FILE.gguf", default=None,
                   help="with a GGUF --model: the projector GGUF that holds its vision and audio towers (llama.cpp's "
                        "convert_hf_to_gguf.py --mmproj), for --image, --video and --audio")
    p.add_argument("--max-soft-tokens", type=int, choices=list(SUPPORTED_SOFT_TOKENS), default=None,
                   help="soft-token budget per image (default: the checkpoint's processor config, else 280)")
    p.add_argument("--vision-mask", choices=list(VISION_MASK_RULES), default=VISION_MASK_RULES[0],
                   help="how image blocks open the attention mask on 'vision' checkpoints: sliding-clamped (default: "
                        "sliding layers only, inside the window; transformers' static path, llama.cpp, vLLM) or "
                        "all-unclamped (every layer, after the window; transformers 5.24's default Gemma 4 Unified "
                        "forward, mlx-vlm)")
    p.add_argument("--allow-beyond-context", action="store_true",
                   help="run a prompt longer than the checkpoint's context (max_position_embeddings in config.json), "
                        "which is otherwise refused before any forward")


def version_line() -> str:
    """``refimpl --version``: the installed gemma4-conformance package's version."""
    try:
        version = metadata.version("gemma4-conformance")
    except metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    return f"refimpl {version} (gemma4-conformance)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refimpl", description="Exact NumPy reference for Gemma 4 (text decoder, "
                                     "image and audio prompts).")
    parser.add_argument("--version", action="version", version=version_line(), help="print the version, then exit")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write a synthetic checkpoint directory")
    p.add_argument("--preset", required=True, choices=[*PRESETS, *PUBLISHED],
                   help="a miniature (*-mini, all-features) or the published shapes of a variant (e2b, e4b, "
                        "26b-a4b, 31b: real-size, written streamed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=["f32", "bf16"], default=None,
                   help="storage dtype of the weights (default f32 for miniatures, bf16 for published shapes)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="published shapes only: keep the first N layers of the pattern (KV sharing scaled; "
                        "the last layer full)")
    p.add_argument("--layout", choices=["causal", "conditional"], default="causal",
                   help="Gemma4ForCausalLM (model.*) or Gemma4ForConditionalGeneration (model.language_model.*)")
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("inspect", help="print the derived layer table of a checkpoint")
    p.add_argument("--model", required=True, help="checkpoint directory, or a Gemma 4 text model's .gguf file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("logits", help="write golden logits for some rows of a prompt")
    _add_prompt(p)
    p.add_argument("--rows", default="last", help="last, all, or comma-separated row indices (negative from the end)")
    p.add_argument("--out", required=True, help="output .safetensors: tensors logits [rows, V], rows, tokens")
    p.add_argument("--top-k", type=int, default=5, help="tokens shown per row in the summary")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file (never one inside --model)")
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("generate", help="greedy generation with the KV cache")
    _add_prompt(p)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with stop_signals():  # SIGTERM/SIGHUP (a CI job's timeout) end it as Ctrl-C does: temporary files go
            return args.func(args)
    except RefimplError as e:
        print(f"refimpl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"refimpl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        print(f"refimpl: interrupted by {interrupt_name(e)}", file=sys.stderr)
        return 128 + interrupt_signal(e)


if __name__ == "__main__":
    sys.exit(main())
