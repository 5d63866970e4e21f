"""A small, strict safetensors reader and writer (pread and memory maps, NumPy).

Format: 8-byte little-endian header length N, a JSON header of N bytes mapping tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the header),
then the raw little-endian data. Tensors are read lazily: ``TensorStore.raw`` returns a view of the
memory map and nothing is copied until a caller decodes it. BF16 is decoded exactly (a bfloat16 is
the top half of a float32), since NumPy has no bfloat16 type.

Memory: ``read`` (and ``get``, and ``rows`` with a slice) reads a tensor's bytes with pread a block at
a time into small buffers and decodes them straight into the result, so the file is never mapped in:
streaming a 10 GB bf16 checkpoint layer by layer keeps only the decoded working set resident (the file
stays in the page cache). A gather of rows (``rows`` with an index list: embedding rows) reads the
memory map and hands its pages back to the kernel afterwards (``madvise(MADV_DONTNEED)``).

``safetensors_stream.write_safetensors_streamed`` writes tensors from chunk generators, so a checkpoint
larger than memory can be written.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import WeightsError
from .threads import in_parts, scaled

# safetensors dtype -> (storage dtype, bytes per element)
STORAGE = {
    "U8": np.dtype("u1"),
    "U32": np.dtype("<u4"),  # MLX's packed quantised weights (refimpl/mlx_store.py)
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
}
PLAIN_FLOATS = ("BF16", "F16", "F32", "F64")  # stored types ``decode_where_stored`` decodes
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Exact decode: the 16 stored bits are the high half of a float32."""
    return np.left_shift(bits, 16, dtype=np.uint32).view(np.float32)


def decode_where_stored(stored, dtype: str, out: np.dtype = np.float64):
    """Decode stored values of a plain float type (PLAIN_FLOATS) with the array's own methods, so the work runs
    where the array lives (a CuPy array: on the GPU, after only the stored bytes crossed): BF16 shifted into
    the high half of a float32, exactly as ``bf16_to_f32``; F16, F32 and F64 converted (exact)."""
    if dtype == "BF16":
        return (stored.astype(np.uint32) << 16).view(np.float32).astype(out)
    return stored.astype(out)


BF16_BLOCK = 1 << 16  # values rounded per step of f32_to_bf16 (its uint32 buffer stays in a core's cache)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), returned as raw uint16 bits, x's shape.

    In uint32 arithmetic, (u + 0x7FFF + bit 16 of u) >> 16, BF16_BLOCK values at a time in place (a third of the
    time of whole-array temporaries on a 16M-value chunk): the addition can wrap only for NaN bit patterns, which
    are replaced (the sign kept, a quiet NaN forced)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).reshape(-1)
    out = np.empty(u.size, np.uint16)
    buffer = np.empty(min(u.size, BF16_BLOCK), np.uint32)
    for start in range(0, u.size, BF16_BLOCK):
        block = u[start:start + BF16_BLOCK]
        step = buffer[:block.size]
        np.right_shift(block, 16, out=step)
        step &= 1
        step += 0x7FFF
        step += block
        step >>= 16
        out[start:start + block.size] = step
    nan = np.isnan(u.view(np.float32))
    if nan.any():
        out[nan] = (u[nan] >> 16) | 0x0040
    return out.reshape(np.shape(x))


DECODE_BLOCK = 1 << 18  # values per step when reading and decoding (cache-resident buffers of 0.5-1 MiB)


def decode_block(src: np.ndarray, dtype: str, dst: np.ndarray, scratch: np.ndarray) -> None:
    """dst[:] = the stored values src decoded (1-D, same length). BF16 goes through ``scratch``, a
    uint32 buffer at least as long: the 16 bits are widened and shifted into the high half of a float32
    in one pass (exact), then converted to dst's type. (Widening first and shifting in place is 15% faster
    in a core's cache, but moves 26 bytes per value where this moves 18: on 16 cores, whose blocks outgrow
    the cache, this decodes 10 to 20% faster; on 2 cores a forward takes the same time either way.)"""
    if dtype == "BF16":
        bits = scratch[:src.size]
        np.left_shift(src, 16, out=bits, dtype=np.uint32)
        np.copyto(dst, bits.view(np.float32))
    else:
        np.copyto(dst, src)


class _Buffers(threading.local):
    """Per-thread buffers of the decoding loops (the stored bytes of one block and the BF16 scratch),
    kept from call to call: a thread decodes every block of a forward through the same two buffers."""

    def get(self, stored: np.dtype, n: int) -> tuple[np.ndarray, np.ndarray]:
        raw = getattr(self, "raw", None)
        if raw is None or raw.nbytes < n * stored.itemsize:
            self.raw = raw = np.empty(max(n, DECODE_BLOCK) * stored.itemsize, dtype=np.uint8)
            self.scratch = np.empty(raw.size // 2 + 1, dtype=np.uint32)
        return raw[:n * stored.itemsize].view(stored), self.scratch


_BUFFERS = _Buffers()


def decode(raw: np.ndarray, dtype: str, out: np.dtype = np.float64) -> np.ndarray:
    """Decode raw stored values (a copy, or a view of the memory map) to ``out``. BF16 goes through
    float32 a block at a time (``decode_block``), so no float32 copy of the whole tensor is made."""
    if dtype != "BF16":
        return raw.astype(out)
    if np.dtype(out) == np.float32 or raw.size <= DECODE_BLOCK:
        return bf16_to_f32(raw).astype(out, copy=False)
    flat = raw.reshape(-1)
    result = np.empty(flat.shape, dtype=out)

    def work(first: int, last: int) -> None:  # values [first, last) of flat, into result
        scratch = _BUFFERS.get(STORAGE[dtype], DECODE_BLOCK)[1]
        for start in range(first, last, DECODE_BLOCK):
            stop = min(start + DECODE_BLOCK, last)
            decode_block(flat[start:stop], dtype, result[start:stop], scratch)

    in_parts(flat.size, work, unit=DECODE_BLOCK, least=2)
    return result.reshape(raw.shape)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # "F32" | "F16" | "BF16" | "F64"
    shape: tuple[int, ...]
    path: Path
    begin: int  # absolute byte offset in the file
    end: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate the header of one safetensors file (without reading the data)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path}: corrupt safetensors header: the file has only {size} bytes")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise WeightsError(
                    f"{path}: corrupt safetensors header: it declares a {n}-byte header but the file has "
                    f"{size} bytes (truncated or not a safetensors file)"
                )
            blob = f.read(n)
    except OSError as e:
        raise WeightsError(f"{path}: cannot be read ({e})") from None
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: corrupt safetensors header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: corrupt safetensors header: expected a JSON object")
    data_start = 8 + n
    data_size = size - data_start
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor '{name}'"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise WeightsError(f"{where}: corrupt header entry (needs dtype, shape and data_offsets): {entry!r}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in STORAGE:
            raise WeightsError(f"{where}: dtype {dtype!r} is not supported (use one of {', '.join(STORAGE)})")
        if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise WeightsError(f"{where}: corrupt shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise WeightsError(f"{where}: corrupt data_offsets {offsets!r}")
        nbytes = math.prod(shape) * STORAGE[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise WeightsError(
                f"{where}: corrupt header: shape {shape} of {dtype} needs {nbytes} bytes but data_offsets "
                f"span {offsets[1] - offsets[0]}"
            )
        if offsets[1] > data_size:
            raise WeightsError(
                f"{where}: file is truncated: the tensor needs bytes [{offsets[0]}, {offsets[1]}) of the data "
                f"section but it holds {data_size} bytes"
            )
        infos[name] = TensorInfo(name, dtype, tuple(shape), path, data_start + offsets[0], data_start + offsets[1])
    # the data section must be covered exactly: no overlaps, no gaps, nothing after the last tensor
    end, previous = data_start, None
    for info in sorted(infos.values(), key=lambda t: (t.begin, t.end)):
        if info.begin < end:
            raise WeightsError(
                f"{path}: tensor '{info.name}': corrupt header: its bytes [{info.begin - data_start}, "
                f"{info.end - data_start}) overlap tensor '{previous}' (data ends at {end - data_start})"
            )
        if info.begin > end:
            raise WeightsError(
                f"{path}: tensor '{info.name}': corrupt header: {info.begin - end} unused bytes before it "
                "(the data section must be contiguous)"
            )
        end, previous = info.end, info.name
    if end != size:
        raise WeightsError(f"{path}: corrupt safetensors file: {size - end} bytes after the last tensor")
    return infos


class TensorStore:
    """All tensors of a checkpoint directory (single file or sharded), or of one safetensors file,
    memory-mapped on demand."""

    DECODED = ("F32", "BF16", "F16", "F64")  # weight storage the oracle decodes exactly
    source = "config.json"  # what the tensors are checked against, for messages

    def describe(self, name: str) -> str:
        """How messages name a tensor."""
        return f"'{name}'"

    def undecodable(self, name: str) -> str | None:
        """Why tensor ``name`` cannot be read as weights (integer storage), or None."""
        info = self.infos[name]
        if info.dtype in self.DECODED:
            return None
        return (f"{info.path.name}: tensor '{name}' is stored as {info.dtype}; the oracle reads float weights "
                f"({', '.join(self.DECODED)}), not quantized ones")

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        index = model_dir / INDEX_FILE
        single = model_dir / SINGLE_FILE
        self.infos: dict[str, TensorInfo] = {}
        self._maps: dict[Path, tuple[mmap.mmap, np.ndarray]] = {}
        self._files: dict[Path, object] = {}
        self._lock = threading.Lock()
        if model_dir.is_file():
            self.infos = read_header(model_dir)
        elif index.is_file():
            self._read_index(index)
        elif single.is_file():
            self.infos = read_header(single)
        else:
            raise WeightsError(
                f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}; a checkpoint directory must hold its weights"
            )

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            raise WeightsError(f"{index}: corrupt index: expected a JSON object with a 'weight_map' object") from None
        headers: dict[str, dict[str, TensorInfo]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                raise WeightsError(
                    f"{index}: corrupt index: weight_map entry '{name}' must name a shard file, got {shard!r}"
                    if not isinstance(shard, str) else
                    f"{index}: corrupt index: weight_map entry '{name}' names '{shard}', which is not a file name "
                    "in the checkpoint directory"
                )
            path = self.model_dir / shard
            if shard not in headers:
                if not path.is_file():
                    raise WeightsError(f"{index}: tensor '{name}' is mapped to shard '{shard}', which does not exist")
                headers[shard] = read_header(path)
            if name not in headers[shard]:
                raise WeightsError(f"{path}: tensor '{name}' is listed in {INDEX_FILE} but not stored in this shard")
            self.infos[name] = headers[shard][name]
        for shard, infos in headers.items():
            unlisted = sorted(set(infos) - set(weight_map))
            if unlisted:
                raise WeightsError(
                    f"{self.model_dir / shard}: tensor '{unlisted[0]}' is stored in this shard but not listed in "
                    f"{INDEX_FILE}; add it to the weight_map"
                )

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    @property
    def names(self) -> list[str]:
        return list(self.infos)

    def _map(self, path: Path) -> tuple[mmap.mmap, np.ndarray]:
        """(the read-only mapping of a file, a uint8 array over it)."""
        if path not in self._maps:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[path] = (m, np.frombuffer(m, dtype=np.uint8))
        return self._maps[path]

    def raw(self, name: str) -> np.ndarray:
        """The stored values as a read-only view of the memory map (no copy)."""
        info = self.infos[name]
        buf = self._map(info.path)[1][info.begin:info.end]
        return buf.view(STORAGE[info.dtype]).reshape(info.shape)

    def release(self, name: str) -> None:
        """Hand the mapped pages of a tensor back to the kernel. Reading them again faults them in from
        the page cache; nothing changes but the resident set."""
        info = self.infos[name]
        begin, end = info.begin, info.end
        begin -= begin % mmap.PAGESIZE
        if end > begin and hasattr(mmap, "MADV_DONTNEED"):
            self._map(info.path)[0].madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def _file(self, path: Path):
        f = self._files.get(path)
        if f is None:
            with self._lock:  # decoding threads may ask for the same file at once
                f = self._files.get(path)
                if f is None:
                    f = self._files[path] = open(path, "rb", buffering=0)
        return f

    def _read_into(self, info: TensorInfo, offset: int, buf: np.ndarray) -> None:
        """Fill ``buf`` (contiguous) with the bytes at absolute file offset ``offset``: pread, which never
        maps the file in; the memory map where there is no pread."""
        view = memoryview(buf).cast("B")
        if not hasattr(os, "preadv"):
            view[:] = self._map(info.path)[1][offset:offset + len(view)].data
            return
        fd = self._file(info.path).fileno()
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise WeightsError(f"{info.path}: tensor '{info.name}': the file ended while reading it "
                                   "(was it truncated after the checkpoint was opened?)")
            done += n

    def read(self, name: str, start: int = 0, stop: int | None = None, dtype: np.dtype = np.float64,
             out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of a tensor (along its first axis; all of it by default), decoded to
        ``dtype``: read from the file a DECODE_BLOCK at a time into small buffers and decoded into the
        result (``out``, a contiguous array of that shape and dtype to reuse, or a new one), on
        ``threads.threads()`` threads for large reads. Nothing is mapped, so nothing but the result stays
        resident and there is nothing to release."""
        info = self.infos[name]
        first_axis = info.shape[0] if info.shape else 1
        stop = first_axis if stop is None else stop
        if not 0 <= start <= stop <= first_axis:
            raise IndexError(f"rows [{start}, {stop}) of tensor '{name}' with shape {list(info.shape)}")
        shape = (stop - start, *info.shape[1:]) if info.shape else ()
        if out is None:
            out = np.empty(shape, dtype=dtype)
        elif out.shape != shape or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous {np.dtype(dtype)} array of shape {list(shape)}")
        flat = out.reshape(-1)
        stored = STORAGE[info.dtype]
        base = self.row_offset(info, start)

        def work(first: int, last: int) -> None:  # values [first, last) of the result
            self.decode_into(info, base + first * stored.itemsize, flat[first:last])

        in_parts(flat.size, work, unit=DECODE_BLOCK)
        return out

    @staticmethod
    def row_offset(info: TensorInfo, row: int) -> int:
        """Absolute file offset of row ``row`` (along the first axis) of a tensor's stored values."""
        return info.begin + row * math.prod(info.shape[1:]) * STORAGE[info.dtype].itemsize

    def decode_into(self, info: TensorInfo, offset: int, dst: np.ndarray) -> None:
        """Fill ``dst`` (1-D, contiguous, a float type) with the stored values of ``info`` starting at absolute
        file offset ``offset``, decoded: read ``scaled(DECODE_BLOCK)`` values at a time into this thread's buffers
        (``_Buffers``), decoded from there. The inner loop of ``read`` and of the streamed products."""
        stored = STORAGE[info.dtype]
        block = DECODE_BLOCK if dst.size <= DECODE_BLOCK else scaled(DECODE_BLOCK)
        buf, scratch = _BUFFERS.get(stored, min(block, dst.size))
        for a in range(0, dst.size, block):
            b = min(a + block, dst.size)
            self._read_into(info, offset + a * stored.itemsize, buf[:b - a])
            decode_block(buf[:b - a], info.dtype, dst[a:b], scratch)

    def get(self, name: str, dtype: np.dtype = np.float64) -> np.ndarray:
        """Decode a whole tensor to ``dtype`` (a new array; ``read``)."""
        return self.read(name, dtype=dtype)

    def rows(self, name: str, index, dtype: np.dtype = np.float64) -> np.ndarray:
        """Decode only ``tensor[index]`` along the first axis: a slice is ``read``; other indexes
        (a gather) are taken from the memory map and the pages of the tensor are released."""
        if isinstance(index, slice) and index.step in (None, 1) and self.infos[name].shape:
            start, stop, _ = index.indices(self.infos[name].shape[0])
            return self.read(name, start, max(start, stop), dtype)
        out = decode(self.raw(name)[index], self.infos[name].dtype, dtype)
        self.release(name)
        return out


    def nonfinite(self, name: str, index=None) -> int:
        """How many stored values of a tensor (of its rows ``index`` along the first axis, when given) are
        NaN or infinite, judged on the stored values (a BF16 value is not finite when its 8 exponent bits
        are all set), a block at a time; the tensor's pages are released afterwards."""
        raw = self.raw(name)
        flat = (raw if index is None else raw[index]).reshape(-1)
        count = 0
        for a in range(0, flat.size, DECODE_BLOCK):
            block = flat[a:a + DECODE_BLOCK]
            bad = (block & 0x7F80) == 0x7F80 if self.infos[name].dtype == "BF16" else ~np.isfinite(block)
            count += int(np.count_nonzero(bad))
        self.release(name)
        return count


def encode_tensor(x: np.ndarray, kind: str) -> bytes:
    """The bytes of ``x`` stored as ``kind`` (a safetensors dtype; BF16 rounded to nearest even)."""
    if kind == "BF16":
        return f32_to_bf16(x.astype(np.float32)).astype("<u2").tobytes()
    return np.asarray(x).astype(STORAGE[kind]).tobytes()


def _kind(x: np.ndarray, dtype: str) -> str:
    return ("U8" if x.dtype == np.uint8 else "I64") if np.issubdtype(x.dtype, np.integer) else dtype


def header_blob(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length and the JSON header of tensors (name, safetensors dtype, shape) laid out in order."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, kind, shape in entries:
        nbytes = math.prod(shape) * STORAGE[kind].itemsize
        header[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
    return struct.pack("<Q", len(blob)) + blob


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "F32",
                      metadata: dict[str, str] | None = None) -> None:
    """Write tensors in name order, deterministically. Float tensors are stored as ``dtype`` (F64, F32,
    F16 or BF16, rounded to nearest even); uint8 tensors (images) as U8, other integer tensors as I64."""
    if dtype not in ("F64", "F32", "F16", "BF16"):
        raise ValueError(f"unsupported dtype {dtype!r}")
    arrays = {name: np.asarray(tensors[name]) for name in sorted(tensors)}
    entries = [(name, _kind(x, dtype), tuple(x.shape)) for name, x in arrays.items()]
    with open(path, "wb") as f:
        f.write(header_blob(entries, metadata))
        for name, kind, _ in entries:
            f.write(encode_tensor(arrays[name], kind))
