"""A small, strict safetensors reader and writer on top of NumPy memory maps.

Format: 8-byte little-endian header length N, a JSON header of N bytes mapping tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the header),
then the raw little-endian data. Tensors are read lazily: ``TensorStore.raw`` returns a view of the
memory map and nothing is copied until a caller decodes it. BF16 is decoded exactly (a bfloat16 is
the top half of a float32), since NumPy has no bfloat16 type.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import WeightsError

# safetensors dtype -> (storage dtype, bytes per element)
STORAGE = {
    "U8": np.dtype("u1"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Exact decode: the 16 stored bits are the high half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), returned as raw uint16 bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = np.where(nan, (u >> 16) | 0x0040, rounded)  # keep the sign, force a quiet NaN
    return rounded.astype(np.uint16)


def decode(raw: np.ndarray, dtype: str, out: np.dtype = np.float64) -> np.ndarray:
    """Decode raw stored values (a memmap view or a copy) to ``out``."""
    if dtype == "BF16":
        return bf16_to_f32(raw).astype(out, copy=False)
    return raw.astype(out)


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

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        index = model_dir / INDEX_FILE
        single = model_dir / SINGLE_FILE
        self.infos: dict[str, TensorInfo] = {}
        self._maps: dict[Path, np.memmap] = {}
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

    def _map(self, path: Path) -> np.memmap:
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path]

    def raw(self, name: str) -> np.ndarray:
        """The stored values as a read-only view of the memory map (no copy)."""
        info = self.infos[name]
        buf = self._map(info.path)[info.begin:info.end]
        return buf.view(STORAGE[info.dtype]).reshape(info.shape)

    def get(self, name: str, dtype: np.dtype = np.float64) -> np.ndarray:
        """Decode a whole tensor to ``dtype`` (a new array)."""
        return decode(self.raw(name), self.infos[name].dtype, dtype)

    def rows(self, name: str, index, dtype: np.dtype = np.float64) -> np.ndarray:
        """Decode only ``tensor[index]`` along the first axis (rows gathered from the memory map)."""
        return decode(self.raw(name)[index], self.infos[name].dtype, dtype)


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "F32",
                      metadata: dict[str, str] | None = None) -> None:
    """Write tensors in name order, deterministically. Float tensors are stored as ``dtype`` (F64, F32,
    F16 or BF16, rounded to nearest even); uint8 tensors (images) as U8, other integer tensors as I64."""
    if dtype not in ("F64", "F32", "F16", "BF16"):
        raise ValueError(f"unsupported dtype {dtype!r}")
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        x = np.asarray(tensors[name])
        kind = ("U8" if x.dtype == np.uint8 else "I64") if np.issubdtype(x.dtype, np.integer) else dtype
        if kind == "BF16":
            data = f32_to_bf16(x.astype(np.float32)).astype("<u2").tobytes()
        else:
            data = x.astype(STORAGE[kind]).tobytes()
        header[name] = {"dtype": kind, "shape": list(x.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for data in blobs:
            f.write(data)
