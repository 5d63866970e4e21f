"""A GGUF file's own tokenizer (``tokenizer.ggml.*``), for a GGUF with no tokenizer.model beside it
(docs/quantised.md, "The tokenizer").

llama.cpp's converter writes Gemma 4's vocabulary from tokenizer.json: the pieces (spaces as ``▁``, bytes as
``<0xNN>``), their types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte) and the BPE
merges in rank order; every score is -1000, so the merges alone say how text is cut. ``GGUFVocab`` encodes as
the BPE of tokenizer.json does: spaces become ``▁``, the special pieces (user-defined, and control pieces other
than pad, eos, bos and unk) are cut out of the text whole, the rest is split into characters and the adjacent
pair of lowest merge rank is merged until none is left; a symbol that is no piece becomes its UTF-8 bytes.
Decoding joins the pieces, bytes as bytes, ``▁`` as a space, pad, eos, bos as nothing and unk as " ⁇ ", as
SentencePiece decodes them.

It answers the SentencePieceProcessor calls ``Tokenizer`` and its users make (``EncodeAsIds``, ``DecodeIds``,
``IdToPiece``, ``PieceToId``, ``IsControl`` ...), so a ``Tokenizer`` holds either.
"""

from __future__ import annotations

import heapq
import re

from .gguf_io import GGUFError, GGUFFile

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # ▁
UNKNOWN_TEXT = " \u2047 "  # how SentencePiece decodes the unknown piece
_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _list(f: GGUFFile, key: str, kind: type, n: int | None) -> list:
    value = f.metadata.get(key)
    if not isinstance(value, list) or (n is not None and len(value) != n) \
            or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        size = "" if n is None else f" of {n} entries (one per token)"
        raise GGUFError(f"{f.path}: metadata key {key!r} must be a list{size} of {kind.__name__}s")
    return value


class GGUFVocab:
    """The tokenizer of a GGUF file's ``tokenizer.ggml.*`` keys, with SentencePieceProcessor's method names."""

    def __init__(self, f: GGUFFile):
        model = f.metadata.get("tokenizer.ggml.model")
        if model not in ("gemma4", "llama", "gemma"):
            raise GGUFError(f"{f.path}: tokenizer.ggml.model is {model!r}; the oracle reads Gemma 4's BPE "
                            "vocabulary ('gemma4'); pass token ids with --tokens, or put the model's tokenizer.model "
                            "beside the file")
        self.pieces: list[str] = _list(f, "tokenizer.ggml.tokens", str, None)
        self.types: list[int] = _list(f, "tokenizer.ggml.token_type", int, len(self.pieces))
        merges = _list(f, "tokenizer.ggml.merges", str, None)
        self.rank: dict[tuple[str, str], int] = {}
        for r, m in enumerate(merges):
            a, _, b = m.partition(" ")
            if not a or not b:
                raise GGUFError(f"{f.path}: tokenizer.ggml.merges[{r}] is {m!r}, not two pieces separated by a space")
            self.rank.setdefault((a, b), r)
        self.ids = {p: i for i, p in reversed(list(enumerate(self.pieces)))}  # the first of a repeated piece
        self.special = {key: self._special_id(f, key) for key in ("bos", "eos", "unknown", "padding")}
        cut = [p for i, p in enumerate(self.pieces) if self.types[i] == USER_DEFINED
               or (self.types[i] == CONTROL and i not in self.special.values())]
        self.cut = re.compile("|".join(re.escape(p) for p in sorted(cut, key=lambda p: (-len(p), p)))) if cut else None
        self.bytes = {int(m.group(1), 16): i for i, p in enumerate(self.pieces)
                      if self.types[i] == BYTE and (m := _BYTE.fullmatch(p))}

    def _special_id(self, f: GGUFFile, key: str) -> int:
        value = f.metadata.get(f"tokenizer.ggml.{key}_token_id", -1)
        if not isinstance(value, int) or isinstance(value, bool) or not -1 <= value < len(self.pieces):
            raise GGUFError(f"{f.path}: metadata key 'tokenizer.ggml.{key}_token_id' must be a token id below "
                            f"{len(self.pieces)}, got {value!r}")
        return value

    # -- SentencePieceProcessor's calls (its method names) ------------------------------------------

    def GetPieceSize(self) -> int:
        return len(self.pieces)

    def bos_id(self) -> int:
        return self.special["bos"]

    def eos_id(self) -> int:
        return self.special["eos"]

    def unk_id(self) -> int:
        return self.special["unknown"]

    def pad_id(self) -> int:
        return self.special["padding"]

    def IdToPiece(self, i: int) -> str:
        return self.pieces[int(i)]

    def PieceToId(self, piece: str) -> int:
        return self.ids.get(piece, self.unk_id())

    def IsControl(self, i: int) -> bool:
        return self.types[int(i)] == CONTROL

    def IsUnknown(self, i: int) -> bool:
        return self.types[int(i)] == UNKNOWN

    def IsUnused(self, i: int) -> bool:
        return self.types[int(i)] == UNUSED

    def IsByte(self, i: int) -> bool:
        return self.types[int(i)] == BYTE

    def EncodeAsIds(self, text: str) -> list[int]:
        ids: list[int] = []
        at = 0
        for m in self.cut.finditer(text) if self.cut is not None else ():
            ids += self._bpe(text[at:m.start()])
            ids.append(self.ids[m.group()])
            at = m.end()
        return ids + self._bpe(text[at:])

    def DecodeIds(self, ids: list[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            piece, kind = self.pieces[int(i)], self.types[int(i)]
            m = _BYTE.fullmatch(piece) if kind == BYTE else None
            if m is not None:
                pending.append(int(m.group(1), 16))
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            if kind == UNKNOWN:
                out.append(UNKNOWN_TEXT)
            elif not (kind == CONTROL and int(i) in self.special.values()):  # markers are text, as in SentencePiece
                out.append(piece.replace(SPACE, " "))
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    # -- BPE ------------------------------------------------------------------------------------

    def _bpe(self, text: str) -> list[int]:
        """Ids of text without special pieces: characters merged by rank (lowest first, the leftmost of equal
        ranks first), unknown symbols as their bytes. A heap of the adjacent pairs: O(n log n)."""
        if not text:
            return []
        sym = list(text.replace(" ", SPACE))  # sym[k]: the symbol starting at character k ("" once merged away)
        nxt = list(range(1, len(sym) + 1))  # the next live symbol's start (len(sym): none)
        prv = list(range(-1, len(sym) - 1))
        heap = [(r, k, sym[k], sym[k + 1]) for k in range(len(sym) - 1)
                if (r := self.rank.get((sym[k], sym[k + 1]))) is not None]
        heapq.heapify(heap)
        while heap:
            _, k, a, b = heapq.heappop(heap)
            j = nxt[k] if sym[k] == a else -1
            if j >= len(sym) or j < 0 or sym[j] != b:
                continue  # stale: one side was merged since
            sym[k], sym[j] = a + b, ""
            nxt[k] = nxt[j]
            if nxt[k] < len(sym):
                prv[nxt[k]] = k
            for left, right in ((prv[k], k), (k, nxt[k])):
                if left >= 0 and right < len(sym) and (r := self.rank.get((sym[left], sym[right]))) is not None:
                    heapq.heappush(heap, (r, left, sym[left], sym[right]))
        ids: list[int] = []
        for s in sym:
            if not s:
                continue
            if s in self.ids:
                ids.append(self.ids[s])
            else:
                ids += [self.bytes.get(b, self.unk_id()) for b in s.encode("utf-8")]
        return ids


def gguf_vocab(f: GGUFFile) -> GGUFVocab | None:
    """The file's tokenizer, or None when it holds no vocabulary (``tokenizer.ggml.tokens`` absent)."""
    return GGUFVocab(f) if "tokenizer.ggml.tokens" in f.metadata else None
