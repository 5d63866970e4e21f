"""The prompt of ``refimpl logits|generate`` and its media: the ids (``--tokens``, ``--prompt``, ``--chat``),
the images, audio clips and videos read and preprocessed as the checkpoint's processors do, their soft tokens.
``refimpl.cli`` runs the commands."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .audio_features import RESAMPLE_HINT, read_wav
from .chat import encode_conversation, user_turn
from .errors import InputError, TokenizerError
from .frontends import AudioFrontEnd, ImageFrontEnd, audio_front_end, image_front_end
from .gguf_io import is_gguf
from .image import read_image
from .model import Gemma4
from .multimodal import (
    MultimodalTokens,
    audio_spans,
    expand_audio_placeholders,
    expand_image_placeholders,
    image_spans,
    load_multimodal_tokens,
    video_spans,
)
from .tokenizer import Tokenizer
from .video import expand_video_placeholders, load_video_settings, preprocess_video, read_video_frames, video_ids

__all__ = ["ImagePrompt", "audio_soft_tokens", "check_media_args", "has_media", "image_soft_tokens", "media_prompt",
           "parse_ints", "prompt_ids", "video_soft_tokens"]


# ----------------------------------------------------------------------------------------------
# inputs


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise InputError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise InputError(f"{what} is empty")
    return values


def prompt_ids(args, model_dir: Path, images: int = 0, mm: MultimodalTokens | None = None,
                bos: int | None = None, clips: int = 0, videos: int = 0) -> tuple[list[int], Tokenizer | None]:
    """The prompt's ids. With ``images`` > 0 and no image placeholder in the prompt, one placeholder per
    image is put in front of the text: after <bos> (for --tokens, when the ids start with it), or at the
    start of the user turn's content with --chat, as the Gemma 4 chat template places image items.
    Audio clips (``clips`` > 0) follow the same rule with the audio placeholder; when both kinds go in
    front, the images come first, then the clips (the chat template's order of image and audio items). Videos
    (``videos`` > 0) likewise with the video placeholder, after the images ({"type": "video"} items with --chat).
    --chat renders the checkpoint's own chat template when it has one (``refimpl.chat``; media in front
    go as ``{"type": "image"}`` / ``{"type": "audio"}`` items before the text item), else the
    hand-written Gemma 4 format with the placeholders at the start of the user turn's text."""
    tok = Tokenizer.from_dir(model_dir)
    if args.tokens is not None:
        if args.chat:
            raise InputError("--chat applies to --prompt, not to --tokens")
        ids = parse_ints(args.tokens, "--tokens")
        front = []
        if images and mm.image_token_id not in ids:
            front += [mm.image_token_id] * images
        if videos and mm.video_token_id not in ids:
            front += [mm.video_token_id] * videos
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
        (videos, "video", mm.video_token_id, mm.boi_token_id, mm.eoi_token_id),
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
_VIDEO_MARKERS_GIVEN = ("the prompt already holds begin/end-of-image markers ({boi} / {eoi}); write one bare {image} "
                        "where each video goes and refimpl expands it to its frames, each {boi} + {image} x N + {eoi}")
_AUDIO_MARKERS_GIVEN = ("the prompt already holds begin/end-of-audio markers ({boi} / {eoi}); write one bare {image} "
                        "where each clip goes and refimpl expands it to {boi} + {image} x M + {eoi}")


def _placeholders_in_front(tok: Tokenizer, text: str, n: int, what: str, token: int, begin: int, end: int) -> int:
    """How many placeholders go in front of the --prompt text for ``n`` images / clips: refuses
    begin/end markers; one per item when the text has none, else none."""
    b, e, placeholder = (tok.piece(i) for i in (begin, end, token))
    if b in text or e in text:
        template = {"image": _MARKERS_GIVEN, "video": _VIDEO_MARKERS_GIVEN}.get(what, _AUDIO_MARKERS_GIVEN)
        raise InputError(template.format(
            boi=b, eoi=e, image=placeholder))
    return 0 if placeholder in text else n


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
    videos: list = field(default_factory=list)  # refimpl.video.Video per video
    video_info: list[dict] = field(default_factory=list)  # per video: dir, frames, kept, fps, size, resized,
    #                                                       per_frame, soft_tokens, rows
    video_front: ImageFrontEnd | None = None

    @property
    def summary(self) -> str:
        parts = []
        for items, noun in ((self.info, "image"), (self.video_info, "video"), (self.audio_info, "audio clip")):
            n = len(items)
            if n:
                parts.append(f"{sum(i['soft_tokens'] for i in items)} soft tokens of {n} {noun}{'s' if n > 1 else ''}")
        return ", ".join(parts)

    def lines(self) -> list[str]:
        return [f"  image {n} {i['file']}: {i['size'][0]}x{i['size'][1]} (HxW) resized to {i['resized'][0]}x"
                f"{i['resized'][1]}, {i['soft_tokens']} soft tokens at rows {i['rows'][0]}-{i['rows'][1]}"
                for n, i in enumerate(self.info)] + [
                f"  video {n} {i['dir']}: {i['kept']} of {i['frames']} frames at {i['fps']:g} fps, {i['size'][0]}x"
                f"{i['size'][1]} (HxW) resized to {i['resized'][0]}x{i['resized'][1]}, {i['per_frame']} soft tokens a "
                f"frame, rows {i['rows'][0]}-{i['rows'][1]}" for n, i in enumerate(self.video_info)] + [
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
    """Begin/end markers in the (token-id) prompt are refused (the videos' are the images')."""

    def names(i: int) -> str:
        return tok.piece(i) if tok is not None else str(i)

    for template, begin, end, token in ((_MARKERS_GIVEN, mm.boi_token_id, mm.eoi_token_id, mm.image_token_id),
                                        (_AUDIO_MARKERS_GIVEN, mm.boa_token_id, mm.eoa_token_id, mm.audio_token_id)):
        if begin in ids or end in ids:
            raise InputError(template.format(boi=names(begin), eoi=names(end), image=names(token)))


def _image_front_end(args, model_dir: Path, model: Gemma4) -> ImageFrontEnd | None:
    """The image front end (None without --image), after the checks that the model has the towers asked
    for: a checkpoint's config.json, or for a GGUF model the projector file --mmproj names."""
    if args.mmproj is None and is_gguf(model_dir):
        raise InputError(f"{model_dir} is a GGUF text model: its vision and audio towers are in a projector GGUF "
                         "(convert_hf_to_gguf.py --mmproj); pass it with --mmproj FILE")
    if args.mmproj is not None and not is_gguf(model_dir):
        raise InputError(f"--mmproj applies to a GGUF --model; the checkpoint directory {model_dir} holds its own "
                         "towers")
    front = _vision_front_end(args, model_dir, model, "--image") if args.image else None
    if args.mmproj is None and args.audio:
        _config_has(model_dir, "audio_config", "audio", "--audio")
    return front


def _vision_front_end(args, model_dir: Path, model: Gemma4, flag: str) -> ImageFrontEnd:
    """A vision front end of its own for ``flag`` (--image, --video: each with its own budget): the checkpoint's
    (its config.json must have the tower) or the projector's (its soft tokens as wide as the model)."""
    if args.mmproj is None:
        _config_has(model_dir, "vision_config", "vision", flag)
        return image_front_end(model_dir, args.dtype)
    front = image_front_end(model_dir, args.dtype, args.mmproj)
    _check_width(front.cfg.text_hidden_size, model, args.mmproj, "vision")
    return front


def _check_width(width: int, model: Gemma4, projector, tower: str) -> None:
    if width != model.cfg.hidden_size:
        raise InputError(f"{projector}: the {tower} projector makes soft tokens {width} wide, but the model's hidden "
                         f"size is {model.cfg.hidden_size}; pass the projector converted from the same checkpoint")


def media_prompt(args, model_dir: Path, model: Gemma4) -> ImagePrompt:
    """Prompt ids expanded for ``args.image`` and ``args.audio`` (placeholder rule of ``prompt_ids``),
    the images read and preprocessed as the checkpoint's processor does, the clips read and turned into
    the model's input (log-mel features, or Unified's raw frames); no tower or embedder is run yet."""
    images, clips, videos = list(args.image), list(args.audio), list(args.video)
    front = _image_front_end(args, model_dir, model)
    mm = load_multimodal_tokens(model_dir, (["image"] if images or videos else []) + (["audio"] if clips else []))
    ids, tok = prompt_ids(args, model_dir, len(images), mm, model.cfg.bos_token_id, len(clips), len(videos))
    _check_markers(ids, tok, mm)
    # placeholder counts, before any image, video or audio work
    counted = expand_image_placeholders(ids, [1] * len(images), mm)
    expand_audio_placeholders(expand_video_placeholders(counted, [[]] * len(videos), mm), [1] * len(clips), mm)
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
    if videos:
        _read_videos(args, model_dir, model, prompt)
    if clips:
        _read_clips(model_dir, clips, prompt, args.dtype, args.mmproj)
        if args.mmproj is not None:
            _check_width(prompt.audio_front.cfg.text_hidden_size, model, args.mmproj, "audio")
    expanded = expand_image_placeholders(ids, [p.num_soft_tokens for p in prompt.processed], mm)
    expanded = expand_video_placeholders(
        expanded, [video_ids(v, mm, lambda text: tok.encode(text, add_bos=False)) for v in prompt.videos], mm)
    prompt.ids = expand_audio_placeholders(expanded, [i["soft_tokens"] for i in prompt.audio_info], mm).tolist()
    for info, (start, length) in zip(prompt.info, image_spans(prompt.ids, mm), strict=True):
        info["rows"] = [start, start + length - 1]
    frames = video_spans(prompt.ids, mm)
    for info in prompt.video_info:  # (the frames of each video in turn)
        mine, frames = frames[:info["kept"]], frames[info["kept"]:]
        info["rows"] = [mine[0][0], mine[-1][0] + mine[-1][1] - 1]
    for info, (start, length) in zip(prompt.audio_info, audio_spans(prompt.ids, mm), strict=True):
        info["rows"] = [start, start + length - 1]
    return prompt


def _read_videos(args, model_dir: Path, model: Gemma4, prompt: ImagePrompt) -> None:
    """Each --video directory: its frames read, sampled, time-stamped and preprocessed at the video budget
    (refimpl.video), with a vision front end of its own (not the images' budget)."""
    if prompt.tok is None:
        raise InputError(f"{model_dir} has no tokenizer.model: --video needs it for the frames' timestamps")
    front = prompt.video_front = _vision_front_end(args, model_dir, model, "--video")  # (Unified: its embedder)
    settings = load_video_settings(model_dir if args.mmproj is None else Path(args.mmproj).parent)
    front.with_budget(settings.max_soft_tokens)
    fps = 24.0 if args.fps is None else args.fps
    for path in args.video:
        frames = read_video_frames(path)
        video = preprocess_video(frames, fps, front.preprocess_frame, settings, args.num_frames)
        prompt.videos.append(video)
        first = video.processed[0]
        prompt.video_info.append({"dir": str(path), "frames": len(frames), "kept": video.frames, "fps": fps,
                                  "size": list(frames[0].shape[:2]), "resized": list(first.pixels.shape[:2]),
                                  "per_frame": video.num_soft_tokens,
                                  "soft_tokens": video.num_soft_tokens * video.frames})
    if args.fps is None:  # (after the frames are read: a bad video is one error line)
        print("warning: --fps not given: the frames are stamped at 24 frames a second, as transformers' video "
              "processor does without the video's metadata", file=sys.stderr)


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


def image_soft_tokens(model_dir: Path, prompt: ImagePrompt, dtype: str) -> list[np.ndarray]:
    return [prompt.image_front.soft_tokens(p) for p in prompt.processed]  # [] without images


def audio_soft_tokens(model_dir: Path, prompt: ImagePrompt, dtype: str) -> list[np.ndarray]:
    if not prompt.audio:
        return []
    soft = [prompt.audio_front.soft_tokens(a) for a in prompt.audio]
    for s, info in zip(soft, prompt.audio_info, strict=True):
        if s.shape[0] != info["soft_tokens"]:  # only past the processor's audio_seq_length cap
            raise InputError(f"audio file {info['file']} gives {s.shape[0]} soft tokens, more than the processor's "
                             f"cap of {info['soft_tokens']}; pass a shorter clip")
    return soft


def video_soft_tokens(prompt: ImagePrompt) -> list[np.ndarray]:
    """The soft tokens of every video frame, one [N, H] a frame, the videos in prompt order ([] without)."""
    return [prompt.video_front.soft_tokens(p) for v in prompt.videos for p in v.processed]


def check_media_args(args) -> None:
    if args.max_soft_tokens is not None and not args.image:
        raise InputError("--max-soft-tokens applies to --image")
    if args.mmproj is not None and not has_media(args):
        raise InputError("--mmproj applies to --image, --video and --audio")
    for flag, value in (("--fps", args.fps), ("--num-frames", args.num_frames)):
        if value is not None and not args.video:
            raise InputError(f"{flag} applies to --video")


def has_media(args) -> bool:
    return bool(args.image or args.audio or args.video)
