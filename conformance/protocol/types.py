"""The Python backend protocol: what the harness asks an engine, and what it must answer.

A backend declares its ``Capabilities`` once, is opened on one checkpoint directory, and answers
each ``Request`` from a fresh state (no cache, no sequence state survives between requests). The
harness never asks for something the backend does not claim: those cases are reported as
"not claimed", never as passed.

A request is one of five kinds (``Request.kind``):

``full``        one forward over ``tokens``; logits for every row ``[T, V]``.
``last``        a last-logits entry point: logits of the single row ``last_pos`` (0-based within
                ``tokens``; may be interior, i.e. < T - 1) as ``[1, V]``. ``entry`` says which one:
                ``plain``, ``seq_id`` (state keyed by ``seq_id``), or ``embeddings`` (``embeddings``
                ``[T, H]`` given instead of token lookups, plus ``seq_id``; ``tokens`` are still
                given because per-layer embeddings need ids).
``prefill``     one sequence fed as consecutive ``pieces`` that continue the same state; each piece
                has its own tokens and its own output rows (indices within the piece, increasing).
                ``ubatch`` (if set) is the micro-batch size the engine must split each piece into,
                as llama.cpp does with ``n_ubatch``; a micro-batch may contain no output row.
                Answer: the rows of all pieces, in order, ``[sum(len(rows)), V]``. A plain
                output-row prefill is one piece; chunked prefill is several pieces with the last
                row of each; "none, then the last in the next call" is two pieces, the first
                with no rows.
``multi``       several sequences prefilled together (``sequences``, with ``seq_ids``); answer the
                last row of each sequence, ``[n, V]``, in the order given.
**Image prompts** (``Request.images`` non-empty; only ``last`` with entry ``embeddings``, ``prefill`` and
``mtp`` (MTP after media, below); needs the ``image_prompts`` capability): ``tokens`` are the processor's ids,
each image a block ``boi + image_token_id x M + eoi``; ``images`` lists ``(first position, M)`` of every block of
image tokens, positions counted over the whole prompt (all pieces). The input embeddings carry the
image: ``embeddings`` (``last``) or every piece's ``Piece.embeddings`` (``prefill``) hold E[id] * sqrt(H)
at text rows and the image's soft tokens, NOT scaled, at image rows (convention ``raw``: all divided
by sqrt(H)). The engine must take the per-layer inputs' token part from the pad row at image
positions (not the image token's own row) and their context part from the given embeddings, and on
checkpoints with ``use_bidirectional_attention == "vision"`` let tokens of one image block see each
other on sliding layers (any later token of the block; earlier ones within the window), full layers
staying causal. A block never straddles two pieces, image requests carry no ``ubatch``, and decode
tokens are text.

**Audio prompts** (``Request.audio`` non-empty; same entry points; needs ``audio_prompts``): each
clip is a block ``boa + audio_token_id x M + eoa``; ``audio`` lists ``(first position, M)`` per block;
the embeddings hold the clip's soft tokens, unscaled, at its rows. The engine takes the per-layer
inputs' token part from the pad row there and keeps audio tokens causal on every layer (an audio
block is never a vision block). ``audio_inputs`` carries each clip's log-mel ``features`` [T, F] and
frame ``mask`` [T], in prompt order: an engine that claims ``audio_tower`` computes the soft tokens
itself from them (the embeddings' audio rows are then only a reference) instead of trusting the
given rows.

``image_inputs`` carries each image's model input in prompt order, what the processor hands the model:
``pixel_values`` [R, C] in [0, 1] and ``positions`` [R, 2] (x = column, y = row). For a checkpoint with a
vision tower these are its patches [N, 3 p^2] (unpadded); for Gemma 4 Unified the padded 48-pixel (in
miniature: p k pixel) patches [max_soft_tokens, 3 (p k)^2] with (-1, -1) at padding rows, as
transformers' ``pixel_values`` / ``image_position_ids``. An engine that claims ``image_tower`` computes
the image soft tokens itself from them (the embeddings' image rows are then only a reference), so its
tower or embedder is graded too.

**Video prompts** (``Request.videos`` non-empty; needs ``video_prompts`` besides ``image_prompts``): a video is
its sampled frames, each frame a vision block ``boi + video_token_id x M + eoi`` after its timestamp's text
("mm:ss ", frames joined by one space), so each frame is an entry of ``images`` (and of ``image_inputs``:
the frame's patches at the video processor's budget, 70 soft tokens by default), and ``videos`` lists, per
video, the index in ``images`` of its first frame and its number of frames. Everything said of image blocks
holds for frames (pad-row per-layer inputs, each frame its own block for the vision mask), with the video
token as the placeholder: an engine that takes only ``image_token_id`` positions for vision gets them wrong.

**Vision-mask rule.** On ``use_bidirectional_attention == "vision"`` checkpoints the set's manifest
(``oracle.vision_mask``) says how image blocks open the mask: ``sliding-clamped`` (the default: sliding
layers only, the past side still bounded by the window, full layers causal; transformers' static-cache
path, llama.cpp, vLLM) or ``all-unclamped`` (every layer, same-block keys visible whatever the window;
transformers 5.24's default ``Gemma4UnifiedModel.forward``, mlx-vlm). An engine is graded against the
rule of the set.

Every kind may carry ``decode``: after the prefill, feed these tokens one at a time through the
state the prefill left (teacher forcing: the harness gives the tokens), and answer the logits after
each step (``decode_logits`` ``[len(decode), V]``; for ``multi``, ``decode`` and ``decode_logits``
are per sequence). This proves the cache the prefill left is right.

**MTP requests** (``kind == "mtp"``; gemma4-unified-and-mtp-spec.md B6-B7): greedy assisted decoding with
the assistant (drafter) checkpoint at ``drafter``. ``tokens`` is the prompt; ``mtp`` (``MtpRequest``) says
how: its ``convention`` (``refimpl.mtp``: which target keys the drafter attends to and its query position,
e.g. ``target-cache/P``), ``num_drafts`` and ``max_new_tokens``, and a ``mode``:

``rounds``    white box, teacher-forced (capability ``mtp``): the engine prefills the prompt, then runs
              exactly the given ``rounds``. Round r gives the pending token ``token`` (at position P, the
              first one the target has not seen), the ``drafts`` to verify (k of them) and how many to
              keep (``accepted``). The engine runs its drafter k steps at the convention's query position,
              reading ``(token, h)`` at step 0 and ``(drafts[j - 1], h_next)`` at step j, where h is the
              target's final-norm hidden state of the last prompt row (round 1) or of row ``accepted`` of
              the previous verification; it verifies ``[token, *drafts]`` on the target (k + 1 rows) and
              removes the rejected positions from the target's cache (keeping ``token`` and the first
              ``accepted`` drafts). Answer: ``logits`` the prompt's last row ``[1, V]``, and
              ``Response.mtp`` with each round's ``draft_logits`` ``[k, V]``, ``verify_logits``
              ``[k + 1, V]``, the target's own ``accepted`` count (leading drafts equal to its argmax),
              ``drafts`` (the drafter's own argmax per step) and the ``output`` (the first token and what
              every round appends: its kept drafts and the target's argmax after them).
``generate``  black box (capability ``mtp_generate``): the engine runs its own greedy assisted loop for
              ``max_new_tokens`` with ``num_drafts`` drafts a round (fewer when the budget ends: k =
              min(num_drafts, budget - 1)) and answers ``logits`` ``[1, V]`` and ``Response.mtp`` with
              ``output`` (which must equal plain greedy decoding), and per round ``drafts`` and
              ``accepted`` (graded against the oracle's rounds under the convention).

A backend declares the conventions it follows (``mtp_conventions``, comma-separated); a case of another
convention is not claimed.

**Batched MTP** (capability ``mtp_batch``): ``sequences`` (with ``seq_ids``) are several prompts and
``mtp_batch`` one ``MtpRequest`` per sequence (the same mode and convention; each its own rounds and budget);
``mtp`` and ``tokens`` are empty. The engine runs them concurrently, each sequence with its own target cache,
drafter state and rounds, as its server would batch them, and answers ``logits`` ``[n, V]`` (each prompt's last
row, in order) and ``Response.mtp_batch``, one ``MtpResponse`` per sequence; each is graded against the
sequence's solo run (spec M15: drafter state leaking between sequences, a fill value per row).

**MTP after media** (capability ``mtp_media`` besides ``image_prompts`` / ``audio_prompts``): an MTP request whose
prompt holds image or audio blocks carries them as a ``last``/``embeddings`` request does (``embeddings`` [T, H],
``images`` / ``audio``, ``image_inputs`` / ``audio_inputs``). The engine prefills the whole prompt in one call
with its soft tokens (and vision blocks); positions count every soft token, so P, the drafter's query position
and the keys handed over are those of the target's cache; the drafter's inputs stay text, and round 1 reads the
state of the prompt's last row. A placeholder id that is generated or drafted reaches the target as the pad id
(as transformers feeds it).

**Hidden states.** A backend that claims ``hidden_states`` gets every request with ``hidden=True`` and
answers, beside the logits, the final-norm hidden state of every row it returns: ``Response.hidden``
``[R, H]`` row for row with ``logits``, and ``decode_hidden`` row for row with ``decode_logits`` (a list
per sequence for ``multi``). The hidden state of a row is the input of the LM head, the output of the
final RMSNorm (what llama.cpp calls ``h_nextn``, what an MTP drafter and an embedding user read); an
engine that prunes rows before the KV-shared layers produces it for the rows it keeps. Graded row by
row like logits (closeness and row identity).

**Traces** (capability ``traces``; ``conformance explain``): a request with ``trace=True`` asks, beside the
logits, for named intermediate tensors of every row it returns: ``Response.trace`` maps a point of the
forward (``conformance.protocol.trace``: ``embed``, ``layers.{i}.attn_out`` ... ``final_norm``) to an array
row for row with ``logits``, ``decode_trace`` row for row with ``decode_logits`` (a list per sequence for
``multi``). A backend returns any subset of the points; the check never asks for traces.

Logits are returned as float arrays (any float dtype; the harness grades in float64).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from refimpl.errors import check_choice

KINDS = ("full", "last", "prefill", "multi", "mtp")
MTP_MODES = ("rounds", "generate")
ENTRIES = ("plain", "seq_id", "embeddings")
EMBEDDING_CONVENTIONS = ("scaled", "raw")
WEIGHT_FORMATS = ("safetensors", "mlx-affine", "gguf")  # checkpoint formats a fixture set is made from


@dataclass(frozen=True)
class Capabilities:
    """What a backend serves. Anything not claimed is reported as "not claimed", never run."""

    full_forward: bool = True
    last_plain: bool = False  # last-logits entry point, no sequence id
    last_seq_id: bool = False  # last-logits with a sequence id
    last_embeddings: bool = False  # last-logits with input embeddings and a sequence id
    embedding_convention: str = "scaled"  # embeddings given as E[ids] * sqrt(H) ("scaled") or E[ids] ("raw")
    interior_rows: bool = False  # last_pos < T - 1 on the last-logits entry points
    output_rows: bool = False  # prefill with an explicit set of output rows (several rows, or none)
    ubatch: bool = False  # honours a micro-batch size within one prefill call
    chunked_prefill: bool = False  # several pieces continuing one state
    multi_sequence: bool = False  # several sequences prefilled together
    decode: bool = False  # single-token decode steps after a prefill
    image_prompts: bool = False  # prompts with image blocks (soft tokens in the embeddings; see the module doc)
    audio_prompts: bool = False  # prompts with audio blocks (soft tokens in the embeddings)
    audio_tower: bool = False  # with audio_prompts: computes audio soft tokens itself from request.audio_inputs
    image_tower: bool = False  # with image_prompts: computes image soft tokens itself from request.image_inputs
    video_prompts: bool = False  # with image_prompts: video frames among the vision blocks (request.videos)
    hidden_states: bool = False  # answers the final-norm hidden state of every returned row (Response.hidden)
    mtp: bool = False  # MTP requests in mode "rounds": teacher-forced draft rounds, drafter and verify logits
    mtp_generate: bool = False  # MTP requests in mode "generate": its own assisted loop, drafts and acceptance
    mtp_conventions: str = ""  # the MTP conventions it follows, comma-separated (refimpl.mtp.CONVENTIONS)
    mtp_media: bool = False  # MTP requests after an image or audio prompt (with image_prompts / audio_prompts)
    mtp_batch: bool = False  # batched MTP requests: several sequences drafting concurrently (Request.mtp_batch)
    top_logprobs: bool = False  # answers every row as its top-k logprobs (Response.logprobs), not logits (a server)
    traces: bool = False  # answers request.trace: named intermediates of every returned row (Response.trace)
    default_profile: str = "fp32"
    # the checkpoint formats it opens, comma-separated (WEIGHT_FORMATS); a set made from a quantised checkpoint of
    # a format not listed is not claimed
    weight_formats: str = "safetensors"
    # the activation conventions its products follow, comma-separated (refimpl.ggml_act.CONVENTIONS): a set made
    # under another one than "none" (ggml's CPU activation quantisation) is claimed only by a backend declaring it
    activation_conventions: str = "none"

    def __post_init__(self):
        check_choice("embedding_convention", self.embedding_convention, EMBEDDING_CONVENTIONS, error=ValueError)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class AudioInput:
    """One audio clip of an audio prompt, as the feature extractor gives it to the audio tower."""

    features: np.ndarray  # [T, F] log-mel features (float64)
    mask: np.ndarray  # [T] bool: valid frames


@dataclass(frozen=True)
class ImageInput:
    """One image of an image prompt, as the processor gives it to the vision tower or embedder."""

    pixel_values: np.ndarray  # [R, C] float64 in [0, 1]: patches, (row, column, channel) each
    positions: np.ndarray  # [R, 2] int64 (x, y) per patch; (-1, -1) on padding rows


@dataclass(frozen=True)
class MtpRound:
    """One teacher-forced round of an MTP request: the pending token, the drafts to verify, how many to keep."""

    token: int
    drafts: tuple[int, ...]
    accepted: int


@dataclass(frozen=True)
class MtpRequest:
    """What an MTP request asks (see the module doc)."""

    mode: str  # one of MTP_MODES
    convention: str  # "<kv>/<position>", refimpl.mtp.CONVENTIONS
    num_drafts: int
    max_new_tokens: int
    rounds: tuple[MtpRound, ...] = ()  # mode "rounds"

    def __post_init__(self):
        if self.mode not in MTP_MODES:
            raise ValueError(f"unknown MTP mode {self.mode!r}")


@dataclass
class MtpResponse:
    """An engine's answer to an MTP request, round by round."""

    output: tuple[int, ...]  # the generated tokens
    accepted: list[int]  # per round: leading drafts equal to the target's argmax
    drafts: list[tuple[int, ...]]  # per round: the drafter's own argmax of each step
    draft_logits: list[np.ndarray] | None = None  # mode "rounds": per round [k, V]
    verify_logits: list[np.ndarray] | None = None  # mode "rounds": per round [k + 1, V]
    verify_hidden: list[np.ndarray] | None = None  # mode "rounds", request.hidden: per round [k + 1, H]


@dataclass(frozen=True)
class Piece:
    tokens: tuple[int, ...]
    rows: tuple[int, ...]  # output rows within this piece, increasing
    embeddings: np.ndarray | None = field(default=None, compare=False)  # image prompts: [len(tokens), H]


@dataclass(frozen=True)
class Request:
    kind: str  # one of KINDS
    tokens: tuple[int, ...] = ()  # full, last
    entry: str = "plain"  # last: one of ENTRIES
    last_pos: int = -1  # last: 0-based row within tokens
    seq_id: int | None = None  # last (seq_id, embeddings)
    embeddings: np.ndarray | None = field(default=None, compare=False)  # last/embeddings: [T, H]
    pieces: tuple[Piece, ...] = ()  # prefill
    ubatch: int | None = None  # prefill: micro-batch size
    sequences: tuple[tuple[int, ...], ...] = ()  # multi
    seq_ids: tuple[int, ...] = ()  # multi
    decode: tuple = ()  # tokens after the prefill; for multi a tuple of tuples, one per sequence
    images: tuple[tuple[int, int], ...] = ()  # image prompts: (first position, soft tokens) of each block
    audio: tuple[tuple[int, int], ...] = ()  # audio prompts: (first position, soft tokens) of each block
    audio_inputs: tuple[AudioInput, ...] = field(default=(), compare=False)  # per audio block, in order
    image_inputs: tuple[ImageInput, ...] = field(default=(), compare=False)  # per image block, in order
    videos: tuple[tuple[int, int], ...] = ()  # video prompts: (index in images of its first frame, frames) per video
    hidden: bool = False  # answer Response.hidden / decode_hidden too (set for backends claiming hidden_states)
    trace: bool = False  # answer Response.trace / decode_trace too (conformance explain, backends claiming traces)
    drafter: str | None = None  # mtp: the assistant checkpoint's directory
    mtp: MtpRequest | None = None  # mtp
    mtp_batch: tuple[MtpRequest, ...] = ()  # batched mtp: one per sequence of ``sequences`` (seq_ids theirs)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown request kind {self.kind!r}")
        if self.entry not in ENTRIES:
            raise ValueError(f"unknown entry point {self.entry!r}")


@dataclass
class TopLogprobs:
    """Rows answered as top-k log-probabilities instead of logits (a server's completions endpoint): per row the
    ids of its k most likely tokens and their logprobs, as the server returned them."""

    ids: np.ndarray  # [R, k] int; -1 pads a row that returned fewer than k
    logprobs: np.ndarray  # [R, k] float, each <= 0 (any value at padding)
    # per row, the ids the answer cannot name: a server that keys its logprobs by text (llama-cpp-python) gives one
    # value for tokens that share a text; those ids are neither graded nor counted missing (None: every id named)
    unnamed: list[list[int]] | None = None


@dataclass
class Response:
    logits: np.ndarray  # [R, V] rows as the request defines them
    decode_logits: np.ndarray | list[np.ndarray] | None = None  # [len(decode), V]; a list for multi
    executed: dict[str, Any] = field(default_factory=dict)  # the path the backend says it took
    hidden: np.ndarray | None = None  # [R, H] final-norm hidden states of the logits rows (request.hidden)
    decode_hidden: np.ndarray | list[np.ndarray] | None = None  # [len(decode), H]; a list for multi
    mtp: MtpResponse | None = None  # mtp requests
    mtp_batch: list[MtpResponse] | None = None  # batched mtp requests: one per sequence, in the order given
    # instead of logits / decode_logits (top_logprobs backends): the rows as top-k logprobs (conformance.check.topk)
    logprobs: TopLogprobs | None = None
    decode_logprobs: TopLogprobs | list[TopLogprobs] | None = None  # a list per sequence for multi
    trace: dict[str, np.ndarray] | None = None  # request.trace: point name -> [R, ...] (conformance.protocol.trace)
    decode_trace: dict[str, np.ndarray] | list[dict[str, np.ndarray]] | None = None  # per decode row; a list for multi


class BackendError(Exception):
    """A backend could not be loaded or opened (the run cannot go on: exit code 4)."""


class CaseTimeout(Exception):
    """A request did not finish within the case timeout (``conformance check --case-timeout``).

    A backend that runs its engine in a child process it can kill and restart (the subprocess and
    llama.cpp backends, and any backend under ``--isolate``) supervises the timeout itself: it has
    ``set_case_timeout(seconds)``, and its ``run`` raises a subclass of this after killing the
    engine, which it restarts for the next request. For any other backend the harness enforces the
    timeout and, since an in-process call cannot be stopped, ends the run there.
    """


@runtime_checkable
class Backend(Protocol):
    """What the harness drives. ``open`` is called once per checkpoint; ``run`` once per request."""

    name: str
    capabilities: Capabilities

    def open(self, model_dir: Path) -> None: ...

    def run(self, request: Request) -> Response: ...

    def close(self) -> None: ...


def claims(capabilities: dict[str, Any], need: str) -> bool:
    """Whether ``capabilities`` (``Capabilities.to_dict()``) claim one entry of ``required_capabilities``: a
    flag, or ``"mtp_conventions=<c>"`` (``c`` among the comma-separated conventions declared)."""
    if "=" in need:
        key, _, value = need.partition("=")
        return value in [c.strip() for c in str(capabilities.get(key, "")).split(",")]
    return bool(capabilities.get(need, False))


def required_capabilities(request: Request) -> list[str]:
    """The capability flags a request needs; the harness runs it only if all are claimed (``claims``)."""
    need: list[str] = []
    if request.kind == "full":
        need.append("full_forward")
    elif request.kind == "last":
        need.append({"plain": "last_plain", "seq_id": "last_seq_id", "embeddings": "last_embeddings"}[request.entry])
        if request.last_pos != len(request.tokens) - 1:
            need.append("interior_rows")
    elif request.kind == "prefill":
        last_only = all(piece.rows == (len(piece.tokens) - 1,) for piece in request.pieces)
        if len(request.pieces) == 1 or not last_only:
            need.append("output_rows")  # chunked prefill sampling each piece's last row needs only chunking
        if len(request.pieces) > 1:
            need.append("chunked_prefill")
        if request.ubatch is not None:
            need.append("ubatch")
    elif request.kind == "multi":
        need.append("multi_sequence")
    elif request.kind == "mtp":
        spec = request.mtp_batch[0] if request.mtp_batch else request.mtp
        need.append("mtp" if spec is None or spec.mode == "rounds" else "mtp_generate")
        if spec is not None:
            need.append(f"mtp_conventions={spec.convention}")
        if request.mtp_batch:
            need.append("mtp_batch")
        if request.images or request.audio:
            need.append("mtp_media")
    if request.decode:
        need.append("decode")
    if request.images:
        need.append("image_prompts")
    if request.audio:
        need.append("audio_prompts")
    if request.videos:
        need.append("video_prompts")
    return need
