"""Read a GGUF file: its metadata and its tensors, decoded exactly into float64 (docs/quantised.md).

    f = GGUFFile(path)               the header, metadata and tensor infos, checked against the file
    f.metadata["general.architecture"]
    f.tensors["blk.0.attn_q.weight"]  GGUFTensor(name, ne, ggml_type, offset, nbytes); .shape = reversed(ne)
    f.get(name)                       float64 [*shape] (ggml_blocks.dequantize of the mapped bytes)

The layout (little-endian): magic ``GGUF``, version uint32 (2 or 3), tensor count uint64, KV count uint64,
the KV pairs (key string, value type uint32, value), the tensor infos (name, n_dims uint32, ne uint64 each,
ggml type uint32, offset uint64 from the data section), padding to ``general.alignment`` (32 by default),
the data section. A string is a uint64 length and its bytes.

Nothing is allocated from what the header claims before it is checked against the bytes the file has: a
count or a length larger than what is left of the file is refused, as are a truncated file, tensor data past
its end or overlapping, a misaligned offset, more than four dimensions, and a key or tensor name given twice.
Every refusal is a GGUFError, one line naming the file.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import RefimplError
from .ggml_blocks import QuantError, dequantize, tensor_nbytes, type_name

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NAME = 64  # GGML_MAX_NAME: a tensor name is shorter

# value type id -> (name, struct format) of the fixed-size scalars (GGUF spec, gguf.h)
SCALARS = {0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"), 4: ("uint32", "<I"),
           5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<?"), 10: ("uint64", "<Q"), 11: ("int64", "<q"),
           12: ("float64", "<d")}
STRING, ARRAY = 8, 9


class GGUFError(RefimplError):
    """A GGUF file that cannot be read as one: the message names the file and what is wrong."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is contiguous
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The NumPy shape: ``ne`` reversed (an HF ``[out, in]`` weight is stored with ne = [in, out])."""
        return tuple(reversed(self.ne))

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


class _Cursor:
    """Reads the header from a buffer, refusing to read (or to trust a length) past its end."""

    def __init__(self, buf, where: str):
        self.buf, self.pos, self.where = buf, 0, where

    def left(self) -> int:
        return len(self.buf) - self.pos

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.where}: {what} (at byte {self.pos})")

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.left()} are left")
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"the length of {what}")
        if n > self.left():
            raise self.fail(f"{what} claims {n} bytes, more than the {self.left()} left in the file")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        """One KV value of type ``vtype`` (arrays as lists; nested arrays allowed, to a depth of 4)."""
        if vtype in SCALARS:
            v = self.scalar(SCALARS[vtype][1], what)
            return bool(v) if vtype == 7 else v
        if vtype == STRING:
            return self.string(what)
        if vtype != ARRAY:
            raise self.fail(f"{what} has value type {vtype}, which GGUF does not define")
        if depth >= 4:
            raise self.fail(f"{what} nests arrays more than 4 deep")
        etype, n = self.scalar("<I", f"the element type of {what}"), self.scalar("<Q", f"the length of {what}")
        least = struct.calcsize(SCALARS[etype][1]) if etype in SCALARS else 8 if etype in (STRING, ARRAY) else 1
        if n * least > self.left():
            raise self.fail(f"{what} claims {n} elements, more than the rest of the file holds")
        if etype in SCALARS and etype != 7:
            fmt = SCALARS[etype][1]
            return np.frombuffer(self.take(n * least, what), dtype=np.dtype(fmt[1]).newbyteorder("<")).tolist()
        return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(n)]


def _header(cur: _Cursor) -> tuple[int, int, int]:
    """(version, tensor count, KV count), checked."""
    magic = cur.take(4, "the magic")
    if magic != MAGIC:
        raise GGUFError(f"{cur.where}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    version = cur.scalar("<I", "the version")
    if version & 0xFFFF == 0 and version != 0:
        raise GGUFError(f"{cur.where}: a big-endian GGUF file, which the oracle does not read")
    if version not in VERSIONS:
        raise GGUFError(f"{cur.where}: GGUF version {version}; the oracle reads versions 2 and 3")
    n_tensors, n_kv = cur.scalar("<Q", "the tensor count"), cur.scalar("<Q", "the KV count")
    # every KV pair takes at least 8 + 4 + 1 bytes, every tensor info 8 + 4 + 8 + 4 + 8
    if n_kv * 13 > cur.left() or n_tensors * 32 > cur.left():
        raise cur.fail(f"the header claims {n_tensors} tensors and {n_kv} KV pairs, more than the file can hold")
    return version, n_tensors, n_kv


def _metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"the key of KV pair {i}")
        if key in out:
            raise cur.fail(f"metadata key {key!r} is given twice")
        out[key] = cur.value(cur.scalar("<I", f"the value type of {key!r}"), f"metadata {key!r}")
    return out


def _tensor_infos(cur: _Cursor, n_tensors: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    infos, seen = [], set()
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}")
        if not name or len(name.encode()) >= MAX_NAME:
            raise cur.fail(f"tensor {i}'s name {name[:80]!r} is empty or not shorter than {MAX_NAME} bytes")
        if name in seen:
            raise cur.fail(f"tensor {name!r} is given twice")
        seen.add(name)
        n_dims = cur.scalar("<I", f"the dimension count of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
        ne = tuple(cur.scalar("<Q", f"dimension {d} of {name}") for d in range(n_dims))
        ggml_type, offset = cur.scalar("<I", f"the type of {name}"), cur.scalar("<Q", f"the offset of {name}")
        infos.append((name, ne, ggml_type, offset))
    return infos


def _alignment(metadata: dict[str, Any], where: str) -> int:
    a = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(a, int) or isinstance(a, bool) or a <= 0 or a & (a - 1):
        raise GGUFError(f"{where}: general.alignment must be a power of two, got {a!r}")
    return a


def _place(infos, data_start: int, alignment: int, size: int, where: str) -> dict[str, GGUFTensor]:
    """The tensors, each checked: a known size for its type and shape, aligned, inside the file, no overlap."""
    tensors: dict[str, GGUFTensor] = {}
    for name, ne, ggml_type, offset in infos:
        n = 1
        for d in ne:
            n *= d
        if n == 0 or n > size * 8:  # no element takes fewer than 1/8 byte (the densest type, Q1_0, takes 1.125)
            raise GGUFError(f"{where}: tensor {name!r} has shape ne={list(ne)}, {n} elements, which a file of "
                            f"{size} bytes cannot hold")
        try:
            nbytes = tensor_nbytes(ggml_type, n, f"tensor {name!r}")
        except QuantError as e:
            raise GGUFError(f"{where}: {e}") from None
        if offset % alignment:
            raise GGUFError(f"{where}: tensor {name!r}'s offset {offset} is not a multiple of the alignment "
                            f"{alignment}")
        start = data_start + offset
        if start + nbytes > size:
            raise GGUFError(f"{where}: tensor {name!r} ({type_name(ggml_type)}, ne={list(ne)}, {nbytes} bytes at "
                            f"{start}) runs past the end of the file ({size} bytes)")
        tensors[name] = GGUFTensor(name, ne, ggml_type, start, nbytes)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise GGUFError(f"{where}: the data of tensors {a!r} and {b!r} overlap")
    return tensors


class GGUFFile:
    """A GGUF file, memory-mapped; its tensors decoded on demand (``get``), never all at once."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        where = str(self.path)
        try:
            with open(self.path, "rb") as fh:
                size = self.path.stat().st_size
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as e:
            raise GGUFError(f"{where}: cannot be read ({e.strerror or e})") from None
        cur = _Cursor(self._map, where)
        self.version, n_tensors, n_kv = _header(cur)
        self.metadata = _metadata(cur, n_kv)
        infos = _tensor_infos(cur, n_tensors)
        self.alignment = _alignment(self.metadata, where)
        self.data_start = -(-cur.pos // self.alignment) * self.alignment
        if infos and self.data_start > size:
            raise GGUFError(f"{where}: truncated: the data section would start at {self.data_start}, past the "
                            f"end of the file ({size} bytes)")
        self.tensors = _place(infos, self.data_start, self.alignment, size, where)

    def raw(self, name: str) -> memoryview:
        """The stored bytes of tensor ``name`` (a view of the mapped file)."""
        t = self.tensors[name]
        return memoryview(self._map)[t.offset:t.offset + t.nbytes]

    def get(self, name: str) -> np.ndarray:
        """Tensor ``name`` decoded exactly into float64, in its NumPy shape (``ne`` reversed)."""
        t = self.tensors[name]
        n = int(np.prod(t.ne))
        return dequantize(np.frombuffer(self.raw(name), dtype=np.uint8), t.ggml_type, n, name).reshape(t.shape)


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file to read as GGUF: named ``*.gguf`` or starting with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


_OPEN: dict[tuple[str, int, int], GGUFFile] = {}
KEEP_OPEN = 4  # GGUF files kept parsed (the config and the weights of one model read the same file)


def open_gguf(path: str | Path) -> GGUFFile:
    """``GGUFFile(path)``, parsed once while the file is unchanged (its size and modification time)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise GGUFError(f"{path}: cannot be read ({e.strerror or e})") from None
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _OPEN:
        if len(_OPEN) >= KEEP_OPEN:
            _OPEN.pop(next(iter(_OPEN)))
        _OPEN[key] = GGUFFile(path)
    return _OPEN[key]
