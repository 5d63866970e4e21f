"""A Gemma 4 GGUF file's tensors under the oracle's names, decoded on demand (docs/quantised.md).

``GGUFStore(path)`` offers what ``Gemma4Weights`` asks of a safetensors ``TensorStore``: ``infos`` (name ->
shape, stored type), ``read`` (rows [start, stop) decoded), ``rows`` (a gather), ``decode_into`` from a row's
byte offset (the streamed products) and ``nonfinite``. A tensor's rows are whole blocks (GGUF requires
``ne[0]`` to be a multiple of the block size), so any run of rows decodes on its own: the bytes are read
with ``pread`` a block of rows at a time and decoded exactly into float64 (``ggml_blocks.dequantize``); no
float64 copy of the model is made.

Names: ``model.`` + ``gguf_names.oracle_name`` (``lm_head.weight`` for ``output.weight``); the generated
``rope_freqs.weight`` is read by the config (gguf_config.py), not here.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .ggml_blocks import TYPES, block_mins, dequantize
from .gguf_io import GGUFError, GGUFFile, open_gguf
from .gguf_names import GENERATED, UNPREFIXED, GGUFNameError, oracle_name
from .threads import in_parts

PREFIX = "model."
DECODE_VALUES = 1 << 18  # values decoded per step when reading rows


def undecodable_type(described: str, type_name: str) -> str | None:
    """The refusal of a tensor (``described`` as messages name it) stored as a ggml type the oracle does not
    decode; None for one it does."""
    if type_name in GGUFStore.DECODED:
        return None
    return (f"tensor {described} is of ggml type {type_name}, which the oracle does not decode (it decodes "
            f"{', '.join(GGUFStore.DECODED)})")


@dataclass(frozen=True)
class GGUFInfo:
    name: str  # the oracle's full name
    gguf_name: str
    shape: tuple[int, ...]  # NumPy order
    dtype: str  # the ggml type's name: "Q4_0", "F16", ...
    ggml_type: int
    path: Path
    begin: int  # absolute offset of the data in the file
    end: int

    @property
    def row_values(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        return (self.end - self.begin) // (self.shape[0] if self.shape else 1)


class GGUFStore:
    """The text tensors of one GGUF file, by the oracle's full names."""

    DECODED = tuple(t.name for t in TYPES.values())  # the stored types the oracle decodes
    source = "its metadata"  # what the tensors are checked against, for messages

    def __init__(self, path: str | Path):
        self.model_dir = Path(path)
        self.file: GGUFFile = open_gguf(path)
        self.infos: dict[str, GGUFInfo] = {}
        for t in self.file.tensors.values():
            if t.name in GENERATED:
                continue
            try:
                name = oracle_name(t.name)
            except GGUFNameError as e:
                raise GGUFError(f"{path}: {e}") from None
            full = name if name in UNPREFIXED else PREFIX + name
            self.infos[full] = GGUFInfo(full, t.name, t.shape, t.type_name, t.ggml_type, self.model_dir, t.offset,
                                        t.offset + t.nbytes)
        self._fd: int | None = None
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def quantisation(self) -> dict:
        """What a fixture set records of the file's quantisation: the format, the activations' convention (none:
        the oracle multiplies the decoded weights by the activations as they are) and each tensor's ggml type."""
        return {"format": "gguf", "activations": "none",
                "tensors": {t.name: {"type": t.type_name} for t in sorted(self.file.tensors.values(),
                                                                         key=lambda t: t.name)}}

    @property
    def names(self) -> list[str]:
        return list(self.infos)

    def describe(self, name: str) -> str:
        """How messages name a tensor: the GGUF name, and the checkpoint's."""
        return f"'{self.infos[name].gguf_name}' ({name})"

    def undecodable(self, name: str) -> str | None:
        """Why tensor ``name`` cannot be decoded (a ggml type the oracle does not read), or None."""
        return undecodable_type(self.describe(name), self.infos[name].dtype)

    def release(self, name: str) -> None:
        """Nothing is mapped: the bytes are read with pread (kept for the TensorStore interface)."""

    def _bytes(self, info: GGUFInfo, offset: int, n: int) -> np.ndarray:
        """``n`` stored bytes of ``info`` at absolute file offset ``offset``."""
        if self._fd is None:
            with self._lock:
                if self._fd is None:
                    self._fd = os.open(self.model_dir, os.O_RDONLY)
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise GGUFError(f"{self.model_dir}: tensor {info.gguf_name!r}: the file ended while reading it (was it "
                            "truncated after it was opened?)")
        return np.frombuffer(data, dtype=np.uint8)

    @staticmethod
    def row_offset(info: GGUFInfo, row: int) -> int:
        """Absolute file offset of row ``row`` (along the first axis) of a tensor's stored blocks."""
        return info.begin + row * info.row_bytes

    def decode(self, raw: np.ndarray, info: GGUFInfo, n: int) -> np.ndarray:
        """``n`` values of tensor ``info`` from their stored bytes ``raw`` (whole blocks) -> float64 [n]: ggml's
        dequantisation of its type (a subclass may decode otherwise: the self-test's quantisation mutants)."""
        return dequantize(raw, info.ggml_type, n, f"tensor {info.gguf_name!r}")

    def decode_into(self, info: GGUFInfo, offset: int, dst: np.ndarray) -> None:
        """Fill ``dst`` (1-D, whole rows) with the values stored from absolute offset ``offset``, decoded."""
        rows = dst.size // info.row_values
        dst[:] = self.decode(self._bytes(info, offset, rows * info.row_bytes), info, dst.size)

    def block_mins(self, name: str, start: int, stop: int) -> np.ndarray:
        """The f16 minimum of every block of rows [start, stop) of a Q4_1 / Q5_1 tensor -> float64 [rows, blocks]
        (the weights' ``product`` under ggml's activation convention adds their min term)."""
        info = self.infos[name]
        raw = self._bytes(info, self.row_offset(info, start), (stop - start) * info.row_bytes)
        return block_mins(raw, info.ggml_type, (stop - start) * info.row_values,
                          f"tensor {info.gguf_name!r}").reshape(stop - start, -1)

    def read(self, name: str, start: int = 0, stop: int | None = None, dtype: np.dtype = np.float64,
             out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of a tensor (all by default), decoded to ``dtype`` (into ``out`` when given)."""
        info = self.infos[name]
        first_axis = info.shape[0]
        stop = first_axis if stop is None else stop
        if not 0 <= start <= stop <= first_axis:
            raise IndexError(f"rows [{start}, {stop}) of tensor '{name}' with shape {list(info.shape)}")
        shape = (stop - start, *info.shape[1:])
        if out is None:
            out = np.empty(shape, dtype=dtype)
        elif out.shape != shape or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous {np.dtype(dtype)} array of shape {list(shape)}")
        flat = out.reshape(-1)
        if len(info.shape) == 1:  # a vector (the norms' weights): its blocks need not end at an element
            flat[:] = self.decode(self._bytes(info, info.begin, info.end - info.begin), info, first_axis)[start:stop]
            return out
        step = max(1, DECODE_VALUES // info.row_values)  # rows decoded at a time

        def work(first: int, last: int) -> None:  # rows [first, last) of the result
            for a in range(first, last, step):
                b = min(a + step, last)
                self.decode_into(info, self.row_offset(info, start + a),
                                 flat[a * info.row_values:b * info.row_values])

        in_parts(stop - start, work, unit=step)
        return out

    def get(self, name: str, dtype: np.dtype = np.float64) -> np.ndarray:
        """A whole tensor decoded to ``dtype``."""
        return self.read(name, dtype=dtype)

    def rows(self, name: str, index, dtype: np.dtype = np.float64) -> np.ndarray:
        """``tensor[index]`` along the first axis (an int, a slice or an array of ints), decoded row by row."""
        info = self.infos[name]
        if len(info.shape) == 1:
            return self.read(name, dtype=dtype)[index]
        if isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(info.shape[0])
            return self.read(name, start, max(start, stop), dtype)
        picked = np.arange(info.shape[0])[index]
        flat = np.atleast_1d(picked).reshape(-1)
        out = np.empty((flat.size, info.row_values), dtype=dtype)
        for k, row in enumerate(flat):
            self.decode_into(info, self.row_offset(info, int(row)), out[k])
        return out.reshape(np.shape(picked) + info.shape[1:])

    def nonfinite(self, name: str, index=None) -> int:
        """How many decoded values of a tensor (of its rows ``index``, when given) are NaN or infinite."""
        info = self.infos[name]
        if index is not None:
            return int(np.count_nonzero(~np.isfinite(self.rows(name, index))))
        count, step = 0, max(1, DECODE_VALUES // info.row_values)
        for a in range(0, info.shape[0], step):
            block = self.read(name, a, min(a + step, info.shape[0]))
            count += int(np.count_nonzero(~np.isfinite(block)))
        return count
