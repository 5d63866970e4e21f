"""``refimpl``: the oracle's command line (synth, inspect, logits, generate; logits and generate take
images with ``--image`` and 16 kHz WAV audio clips with ``--audio``).

Bad input prints one ``error:`` line and exits 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

from .arrays import DEVICES
from .audio_features import RESAMPLE_HINT, read_wav
from .chat import encode_conversation, user_turn
from .context import check_prompt_context
from .errors import InputError, RefimplError, TokenizerError
from .frontends import AudioFrontEnd, ImageFrontEnd, audio_front_end, image_front_end
from .generate import greedy_generate, greedy_generate_multimodal
from .gguf_io import is_gguf
from .image import SUPPORTED_SOFT_TOKENS, read_image
from .inspect_cmd import cmd_inspect
from .model import VISION_MASK_RULES, Gemma4, resolve_rows
from .multimodal import (
    MultimodalTokens,
    audio_spans,
    expand_audio_placeholders,
    expand_image_placeholders,
    image_spans,
    load_multimodal_tokens,
    multimodal_logits,
)
from .safetensors_io import write_safetensors
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


# ----------------------------------------------------------------------------------------------
# inputs


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise InputError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise InputError(f"{what} is empty")
    return values


def _prompt_ids(args, model_dir: Path, images: int = 0, mm: MultimodalTokens | None = None,
                bos: int | None = None, clips: int = 0) -> tuple[list[int], Tokenizer | None]:
    """The prompt's ids. With ``images`` > 0 and no image placeholder in the prompt, one placeholder per
    image is put in front of the text: after <bos> (for --tokens, when the ids start with it), or at the
    start of the user turn's content with --chat, as the Gemma 4 chat template places image items.
    Audio clips (``clips`` > 0) follow the same rule with the audio placeholder; when both kinds go in
    front, the images come first, then the clips (the chat template's order of image and audio items).
    --chat renders the checkpoint's own chat template when it has one (``refimpl.chat``; media in front
    go as ``{"type": "image"}`` / ``{"type": "audio"}`` items before the text item), else the
    hand-written Gemma 4 format with the placeholders at the start of the user turn's text."""
    tok = Tokenizer.from_dir(model_dir)
    if args.tokens is not None:
        if args.chat:
            raise InputError("--chat applies to --prompt, not to --tokens")
        ids = _parse_ints(args.tokens, "--tokens")
        front = []
        if images and mm.image_token_id not in ids:
            front += [mm.image_token_id] * images
        if clips and mm.audio_token_id not in ids:
            front += [mm.audio_token_id] * clips
        if front:
            at = 1 if ids[0] == bos else 0
            ids = ids[:at] + front + ids[at:]
        return ids, tok
    if tok is None and is_gguf(model_dir):
        raise TokenizerError(f"{model_dir}: the GGUF file holds no vocabulary (tokenizer.ggml.tokens) and no "
                             "tokenizer.model lies beside it; pass token ids with --tokens instead of --prompt")
    if tok is None:
        raise TokenizerError(f"{model_dir} has no tokenizer.model; pass token ids with --tokens instead of --prompt")
    text = args.prompt
    kinds = [] if mm is None else [k for k in (
        (images, "image", mm.image_token_id, mm.boi_token_id, mm.eoi_token_id),
        (clips, "audio", mm.audio_token_id, mm.boa_token_id, mm.eoa_token_id)) if k[0]]
    # per kind: (what, placeholder token, how many placeholders go in front of the text)
    front = [(what, token, _placeholders_in_front(tok, text, n, what, token, begin, end))
             for n, what, token, begin, end in kinds]
    chat = None
    if args.chat:
        chat = encode_conversation(tok, model_dir, user_turn(text, [what for what, _, n in front for _ in range(n)]),
                                   placeholders={what: tok.piece(token) for what, token, _ in front})
        if chat.warning:
            print(f"warning: {chat.warning}", file=sys.stderr)
        ids = chat.ids
    else:
        ids = tok.encode("".join(tok.piece(token) * n for _, token, n in front) + text)
    for what, token, n in front:
        placeholder = tok.piece(token)
        want = text.count(placeholder) + n
        if ids.count(token) != want:
            if chat is not None and chat.template is not None:
                raise TokenizerError(
                    f"{chat.template}: the chat template wrote {ids.count(token)} {what} placeholder(s) "
                    f"{placeholder!r} for {want} {what} item(s); write the placeholders into --prompt, or pass the "
                    "token ids with --tokens"
                )
            raise TokenizerError(
                f"the tokenizer does not encode {placeholder!r} as the single {what} token {token}; "
                "pass the token ids with --tokens instead of --prompt"
            )
    return ids, tok


_MARKERS_GIVEN = ("the prompt already holds begin/end-of-image markers ({boi} / {eoi}); write one bare {image} "
                  "where each image goes and refimpl expands it to {boi} + {image} x M + {eoi}")
_AUDIO_MARKERS_GIVEN = ("the prompt already holds begin/end-of-audio markers ({boi} / {eoi}); write one bare {image} "
                        "where each clip goes and refimpl expands it to {boi} + {image} x M + {eoi}")


def _placeholders_in_front(tok: Tokenizer, text: str, n: int, what: str, token: int, begin: int, end: int) -> int:
    """How many placeholders go in front of the --prompt text for ``n`` images / clips: refuses
    begin/end markers; one per item when the text has none, else none."""
    b, e, placeholder = (tok.piece(i) for i in (begin, end, token))
    if b in text or e in text:
        raise InputError((_MARKERS_GIVEN if what == "image" else _AUDIO_MARKERS_GIVEN).format(
            boi=b, eoi=e, image=placeholder))
    return 0 if placeholder in text else n


def _piece(tok: Tokenizer | None, i: int) -> str:
    """The piece of id ``i`` for the top-k lines; "-" without a tokenizer or for an id beyond it (the published-shape
    synthetic checkpoints ship a small tokenizer under a 262,144-entry vocabulary)."""
    if tok is None or not 0 <= int(i) < tok.vocab_size:
        return "-"
    return json.dumps(tok.piece(i), ensure_ascii=False)


@dataclass
class ImagePrompt:
    """A prompt with its images and audio clips: ``ids`` expanded (``boi + image_token x M_i + eoi`` per
    image, ``boa + audio_token x A_j + eoa`` per clip)."""

    ids: list[int]
    tok: Tokenizer | None
    tokens: MultimodalTokens
    processed: list = field(default_factory=list)  # refimpl.image.ProcessedImage per image
    info: list[dict] = field(default_factory=list)  # per image: file, size, resized, soft_tokens, rows
    audio: list = field(default_factory=list)  # refimpl.audio_features.AudioFeatures per clip
    audio_info: list[dict] = field(default_factory=list)  # per clip: file, duration_s, frames, valid_frames,
    #                                                       frame_kind, soft_tokens, rows
    image_front: ImageFrontEnd | None = None
    audio_front: AudioFrontEnd | None = None

    @property
    def summary(self) -> str:
        parts = []
        for items, noun in ((self.info, "image"), (self.audio_info, "audio clip")):
            n = len(items)
            if n:
                parts.append(f"{sum(i['soft_tokens'] for i in items)} soft tokens of {n} {noun}{'s' if n > 1 else ''}")
        return ", ".join(parts)

    def lines(self) -> list[str]:
        return [f"  image {n} {i['file']}: {i['size'][0]}x{i['size'][1]} (HxW) resized to {i['resized'][0]}x"
                f"{i['resized'][1]}, {i['soft_tokens']} soft tokens at rows {i['rows'][0]}-{i['rows'][1]}"
                for n, i in enumerate(self.info)] + [
                f"  audio {n} {i['file']}: {i['duration_s']:.3f} s, {i['frames']} {i['frame_kind']} frames "
                f"({i['valid_frames']} valid), {i['soft_tokens']} soft tokens at rows {i['rows'][0]}-{i['rows'][1]}"
                for n, i in enumerate(self.audio_info)]


def _config_has(model_dir: Path, key: str, kind: str, flag: str) -> None:
    """A clear InputError when config.json has no ``key`` section (no vision / audio part at all);
    ``kind``: "vision" or "audio"."""
    try:
        raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return  # let the front end's loader report it
    if isinstance(raw, dict) and raw.get(key) is None:
        text = "image" if kind == "vision" else "audio"
        raise InputError(f"{model_dir} has no {kind} tower (config.json has no {key}); {flag} needs an {text}-text "
                         "checkpoint (Gemma4ForConditionalGeneration or Gemma4UnifiedForConditionalGeneration with "
                         f"its {kind} weights)")


def _check_markers(ids: list[int], tok: Tokenizer | None, mm: MultimodalTokens) -> None:
    """Begin/end markers in the (token-id) prompt are refused; so are video placeholders."""

    def names(i: int) -> str:
        return tok.piece(i) if tok is not None else str(i)

    for template, begin, end, token in ((_MARKERS_GIVEN, mm.boi_token_id, mm.eoi_token_id, mm.image_token_id),
                                        (_AUDIO_MARKERS_GIVEN, mm.boa_token_id, mm.eoa_token_id, mm.audio_token_id)):
        if begin in ids or end in ids:
            raise InputError(template.format(boi=names(begin), eoi=names(end), image=names(token)))
    if mm.video_token_id in ids:
        raise InputError("video placeholders are not supported yet (images and audio only)")


def _image_front_end(args, model_dir: Path, model: Gemma4) -> ImageFrontEnd | None:
    """The image front end (None without --image), after the checks that the model has the towers asked
    for: a checkpoint's config.json, or for a GGUF model the projector file --mmproj names."""
    images, clips, projector = list(args.image), list(args.audio), args.mmproj
    if projector is None:
        if is_gguf(model_dir):
            raise InputError(f"{model_dir} is a GGUF text model: its vision and audio towers are in a projector GGUF "
                             "(convert_hf_to_gguf.py --mmproj); pass it with --mmproj FILE")
        if images:
            _config_has(model_dir, "vision_config", "vision", "--image")
        if clips:
            _config_has(model_dir, "audio_config", "audio", "--audio")
        return image_front_end(model_dir, args.dtype) if images else None
    if not is_gguf(model_dir):
        raise InputError(f"--mmproj applies to a GGUF --model; the checkpoint directory {model_dir} holds its own "
                         "towers")
    front = image_front_end(model_dir, args.dtype, projector) if images else None
    if front is not None:
        _check_width(front.cfg.text_hidden_size, model, projector, "vision")
    return front


def _check_width(width: int, model: Gemma4, projector, tower: str) -> None:
    if width != model.cfg.hidden_size:
        raise InputError(f"{projector}: the {tower} projector makes soft tokens {width} wide, but the model's hidden "
                         f"size is {model.cfg.hidden_size}; pass the projector converted from the same checkpoint")


def _image_prompt(args, model_dir: Path, model: Gemma4) -> ImagePrompt:
    """Prompt ids expanded for ``args.image`` and ``args.audio`` (placeholder rule of ``_prompt_ids``),
    the images read and preprocessed as the checkpoint's processor does, the clips read and turned into
    the model's input (log-mel features, or Unified's raw frames); no tower or embedder is run yet."""
    images, clips = list(args.image), list(args.audio)
    front = _image_front_end(args, model_dir, model)
    mm = load_multimodal_tokens(model_dir, (["image"] if images else []) + (["audio"] if clips else []))
    ids, tok = _prompt_ids(args, model_dir, len(images), mm, model.cfg.bos_token_id, len(clips))
    _check_markers(ids, tok, mm)
    # placeholder counts, before any image or audio work
    expand_audio_placeholders(expand_image_placeholders(ids, [1] * len(images), mm), [1] * len(clips), mm)
    prompt = ImagePrompt(ids, tok, mm, image_front=front)
    if images:
        if args.max_soft_tokens is not None:
            front.with_budget(args.max_soft_tokens)
        for path in images:
            pixels = read_image(path)
            pre = front.preprocess(pixels)
            prompt.processed.append(pre)
            prompt.info.append({"file": str(path), "size": list(pixels.shape[:2]),
                                "resized": list(pre.pixels.shape[:2]), "soft_tokens": pre.num_soft_tokens})
    if clips:
        _read_clips(model_dir, clips, prompt, args.dtype, args.mmproj)
        if args.mmproj is not None:
            _check_width(prompt.audio_front.cfg.text_hidden_size, model, args.mmproj, "audio")
    expanded = expand_image_placeholders(ids, [p.num_soft_tokens for p in prompt.processed], mm)
    prompt.ids = expand_audio_placeholders(expanded, [i["soft_tokens"] for i in prompt.audio_info], mm).tolist()
    for info, (start, length) in zip(prompt.info, image_spans(prompt.ids, mm), strict=True):
        info["rows"] = [start, start + length - 1]
    for info, (start, length) in zip(prompt.audio_info, audio_spans(prompt.ids, mm), strict=True):
        info["rows"] = [start, start + length - 1]
    return prompt


def _read_clips(model_dir: Path, paths: list, prompt: ImagePrompt, dtype: str, projector: str | None) -> None:
    """Each --audio file: read_wav, the sample-rate check, the checkpoint's audio front end (of the projector
    file, for a GGUF model)."""
    front = prompt.audio_front = audio_front_end(model_dir, dtype, projector)
    for path in paths:
        samples, rate = read_wav(path)
        if rate != front.sampling_rate:
            raise InputError(f"audio file {path} is sampled at {rate} Hz but the checkpoint's feature extractor needs "
                             f"{front.sampling_rate} Hz ({front.sampling_rate / 1000:g} kHz); {RESAMPLE_HINT}")
        feats = front.features(samples, rate)
        count = front.soft_token_count(feats)
        if count == 0:
            raise InputError(f"audio file {path} is too short ({len(samples)} samples): it gives no soft token; "
                             "pass at least 40 ms of audio")
        prompt.audio.append(feats)
        prompt.audio_info.append({"file": str(path), "duration_s": len(samples) / rate,
                                  "frames": int(feats.mask.size), "valid_frames": int(feats.mask.sum()),
                                  "frame_kind": "raw" if front.unified else "mel", "soft_tokens": count})


def _soft_tokens(model_dir: Path, prompt: ImagePrompt, dtype: str) -> list[np.ndarray]:
    return [prompt.image_front.soft_tokens(p) for p in prompt.processed]  # [] without images


def _audio_soft_tokens(model_dir: Path, prompt: ImagePrompt, dtype: str) -> list[np.ndarray]:
    if not prompt.audio:
        return []
    soft = [prompt.audio_front.soft_tokens(a) for a in prompt.audio]
    for s, info in zip(soft, prompt.audio_info, strict=True):
        if s.shape[0] != info["soft_tokens"]:  # only past the processor's audio_seq_length cap
            raise InputError(f"audio file {info['file']} gives {s.shape[0]} soft tokens, more than the processor's "
                             f"cap of {info['soft_tokens']}; pass a shorter clip")
    return soft


def _check_image_args(args) -> None:
    if args.max_soft_tokens is not None and not args.image:
        raise InputError("--max-soft-tokens applies to --image")
    if args.mmproj is not None and not _media(args):
        raise InputError("--mmproj applies to --image and --audio")


def _media(args) -> bool:
    return bool(args.image or args.audio)


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


def cmd_logits(args) -> int:
    if args.top_k < 1:
        raise InputError(f"--top-k must be at least 1, got {args.top_k}")
    _check_image_args(args)
    model_dir = Path(args.model)
    _check_out(Path(args.out), model_dir, args.force)
    if _media(args):
        model = Gemma4(model_dir, args.dtype, args.embed_scale, vision_mask=args.vision_mask, device=args.device)
        prompt = _image_prompt(args, model_dir, model)
        ids, tok = prompt.ids, prompt.tok
    else:
        ids, tok = _prompt_ids(args, model_dir)
        model = Gemma4(model_dir, args.dtype, args.embed_scale, vision_mask=args.vision_mask, device=args.device)
    rows = args.rows if args.rows in ("last", "all") else _parse_ints(args.rows, "--rows")
    index = resolve_rows(rows, len(ids))
    _check_context(args, model, ids)
    metadata = {"model": str(model_dir), "dtype": str(model.dtype), "embed_scale": args.embed_scale}
    if _media(args):
        soft = _soft_tokens(model_dir, prompt, args.dtype)
        audio = _audio_soft_tokens(model_dir, prompt, args.dtype)
        logits = multimodal_logits(model, ids, soft, prompt.tokens, rows=rows, audio_soft_tokens=audio)
        if args.image:
            metadata["images"] = json.dumps(prompt.info)
        if args.audio:
            metadata["audio"] = json.dumps(prompt.audio_info)
    else:
        logits = model.forward(ids, rows=rows)
    write_safetensors(args.out, {"logits": logits, "rows": index, "tokens": np.asarray(ids)},
                      "F64" if model.dtype == np.float64 else "F32", metadata=metadata)
    images = f" ({prompt.summary})" if _media(args) else ""
    print(f"{len(ids)} tokens{images}, {len(index)} rows of {logits.shape[1]} logits ({model.dtype}) -> {args.out}")
    if _media(args):
        print("\n".join(prompt.lines()))
    for r, row in zip(index, logits, strict=True):
        top = np.argsort(-row, kind="stable")[: args.top_k]
        shown = ", ".join(f"{int(t)} {_piece(tok, t)} {row[t]:.4f}" for t in top)
        print(f"  row {int(r)}: {shown}")
    return 0


def cmd_generate(args) -> int:
    _check_image_args(args)
    model_dir = Path(args.model)
    if _media(args):
        if args.max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {args.max_new_tokens}")
        model = Gemma4(model_dir, args.dtype, args.embed_scale, vision_mask=args.vision_mask, device=args.device)
        prompt = _image_prompt(args, model_dir, model)
        ids, tok = prompt.ids, prompt.tok
        _check_context(args, model, ids, args.max_new_tokens)
        soft = _soft_tokens(model_dir, prompt, args.dtype)
        audio = _audio_soft_tokens(model_dir, prompt, args.dtype)
        print("\n".join(prompt.lines()), file=sys.stderr)
    else:
        ids, tok = _prompt_ids(args, model_dir)
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

    if _media(args):
        result = greedy_generate_multimodal(model, ids, soft, prompt.tokens, args.max_new_tokens, on_token=show,
                                            audio_soft_tokens=audio)
    else:
        result = greedy_generate(model, ids, args.max_new_tokens, on_token=show)
    if tok is not None:
        sys.stdout.write(tok.decode(new_tokens)[len(shown):])
    print()
    images = f" ({prompt.summary})" if _media(args) else ""
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
    p.add_argument("--audio", action="append", default=[], metavar="FILE.wav",
                   help="an audio clip (16 kHz WAV; other rates are refused, not resampled); repeat for more. Each "
                        "goes where the prompt has an <|audio|> placeholder, in order; with no placeholder the clips "
                        "go in front of the text (after the images when --image puts those in front too)")
    p.add_argument("--mmproj", metavar="FILE.gguf", default=None,
                   help="with a GGUF --model: the projector GGUF that holds its vision and audio towers (llama.cpp's "
                        "convert_hf_to_gguf.py --mmproj), for --image and --audio")
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
        return args.func(args)
    except RefimplError as e:
        print(f"refimpl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"refimpl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
