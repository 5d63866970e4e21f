"""The checkpoint's SentencePiece tokenizer: encode with BOS, decode, and the Gemma 4 chat format.

Raw text is encoded as ``[<bos>] + pieces`` (gemma4-text-spec.md section 7: prepend id 2 explicitly).
Chat prompts are rendered turn by turn::

    <bos><|turn>system\\n{text}<turn|>\\n        (only if there is a system message)
    <|turn>user\\n{text}<turn|>\\n
    <|turn>model\\n{text}<turn|>\\n               (role "assistant" is rendered as "model")
    <|turn>model\\n                              (the generation prompt)

Special markers are inserted by id and only the text between them goes through SentencePiece, as the
Hugging Face tokenizer does when it splits special tokens out before tokenising. ``encode_rendered`` does
the same for a string that a chat template rendered (``refimpl.chat``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import sentencepiece as spm

from .errors import TokenizerError
from .gguf_io import is_gguf, open_gguf
from .gguf_vocab import GGUFVocab, gguf_vocab

TOKENIZER_FILE = "tokenizer.model"
TURN_START, TURN_END = "<|turn>", "<turn|>"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "model", "model": "model"}
# Gemma 4's markers (gemma4-text-spec.md section 7): added tokens of the Hugging Face tokenizer, split out of
# rendered chat text whatever their type in tokenizer.model
MARKERS = ("<mask>", TURN_START, TURN_END, "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>",
           "<|video|>", "<|channel>", "<channel|>", "<|think|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
           "<tool_response|>", "<|tool>", "<tool|>", '<|"|>')


class Tokenizer:
    def __init__(self, path: str | Path, vocab: GGUFVocab | None = None):
        """The SentencePiece model at ``path``, or ``vocab``: the tokenizer of the GGUF file ``path``."""
        self.path = Path(path)
        if vocab is not None:
            self.sp = vocab
        else:
            self.sp = spm.SentencePieceProcessor()
            try:
                self.sp.Load(str(self.path))
            except (OSError, RuntimeError) as e:
                raise TokenizerError(f"{self.path}: not a SentencePiece model ({e})") from None
        self.bos_id = self.sp.bos_id()
        if self.bos_id < 0:
            raise TokenizerError(f"{self.path}: the tokenizer defines no <bos> piece")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer | None":
        """The directory's tokenizer, or None when it ships none (token ids still work then). For a GGUF file: the
        tokenizer.model beside it, else the file's own vocabulary (``tokenizer.ggml.*``), else None."""
        if is_gguf(model_dir):
            beside = Path(model_dir).parent / TOKENIZER_FILE
            if beside.is_file():
                return cls(beside)
            vocab = gguf_vocab(open_gguf(model_dir))
            return cls(model_dir, vocab) if vocab is not None else None
        path = Path(model_dir) / TOKENIZER_FILE
        return cls(path) if path.is_file() else None

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    def piece_id(self, piece: str) -> int:
        i = self.sp.PieceToId(piece)
        if i == self.sp.unk_id() and piece != self.sp.IdToPiece(i):
            raise TokenizerError(f"{self.path}: the tokenizer has no '{piece}' piece, needed for the chat format")
        return i

    def has_piece(self, piece: str) -> bool:
        i = self.sp.PieceToId(piece)
        return not (i == self.sp.unk_id() and piece != self.sp.IdToPiece(i))

    def encode_rendered(self, text: str, specials: Iterable[str] = ()) -> list[int]:
        """Token ids of text a chat template rendered (no <bos> added: the template writes it). The
        tokenizer's control pieces (<bos>, <eos>, <pad>), Gemma 4's markers and ``specials`` (strings
        that are pieces of the vocabulary) are split out and inserted by id, longest first at each place,
        and only the text between them goes through SentencePiece, as the Hugging Face tokenizer does
        with its added tokens (``add_special_tokens=False``)."""
        pieces = {self.sp.IdToPiece(i) for i in range(self.vocab_size) if self.sp.IsControl(i)}
        pieces |= {p for p in (*MARKERS, *specials) if p and self.has_piece(p)}
        if not pieces:
            return self.encode(text, add_bos=False)
        pattern = re.compile("|".join(re.escape(p) for p in sorted(pieces, key=lambda p: (-len(p), p))))
        ids: list[int] = []
        at = 0
        for m in pattern.finditer(text):
            if m.start() > at:
                ids += self.encode(text[at:m.start()], add_bos=False)
            ids.append(self.sp.PieceToId(m.group()))
            at = m.end()
        if at < len(text):
            ids += self.encode(text[at:], add_bos=False)
        return ids

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(self.sp.EncodeAsIds(text))
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    def piece(self, i: int) -> str:
        if not 0 <= int(i) < self.vocab_size:
            raise TokenizerError(f"{self.path}: token id {int(i)} is outside the tokenizer's {self.vocab_size} pieces")
        return self.sp.IdToPiece(int(i))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation in the Gemma 4 chat format, starting with <bos>."""
        start, end = self.piece_id(TURN_START), self.piece_id(TURN_END)
        ids = [self.bos_id]
        for n, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise TokenizerError(f"chat message {n} must be an object with 'role' and 'content'")
            role = ROLES.get(message["role"])
            if role is None:
                raise TokenizerError(
                    f"chat message {n} has role {message['role']!r}; use one of {', '.join(ROLES)}"
                )
            ids += [start] + self.encode(f"{role}\n{message['content']}", add_bos=False) + [end]
            ids += self.encode("\n", add_bos=False)
        if add_generation_prompt:
            ids += [start] + self.encode("model\n", add_bos=False)
        return ids
