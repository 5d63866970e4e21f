"""The tensors of one tower of a projector GGUF (llama.cpp's ``convert_hf_to_gguf.py --mmproj``), served under
the checkpoint's names and shapes with the converter's transforms undone (docs/quantised.md, "Projector files").

One mmproj file holds a model's vision and audio towers side by side: ``v.*`` and ``mm.*`` for vision,
``a.*`` and ``mm.a.*`` for audio. A ``TowerMap`` says which names a tower owns, their checkpoint names, and how
a tensor goes back to the checkpoint's layout; ``MmprojStore`` applies it (the calls a ``TowerWeights`` makes:
``infos``, ``names``, ``get``, ``rows``, ``nonfinite``, ``undecodable``, ``describe``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .gguf_config import config_decimal
from .gguf_io import GGUFError, GGUFFile
from .gguf_store import undecodable_type

CLIP_LEAVES = ("input_min", "input_max", "output_min", "output_max")


def identity(name: str, x: np.ndarray) -> np.ndarray:
    return x


@dataclass(frozen=True)
class TowerMap:
    """How one tower's tensors of a projector file map back to the checkpoint's."""

    owns: Callable[[str], bool]  # a GGUF name -> whether this tower reads it
    hf_name: Callable[[str], str]  # a GGUF name -> the checkpoint's (GGUFError for one it does not know)
    shape: Callable[[str, tuple[int, ...]], tuple[int, ...]]  # (checkpoint name, GGUF shape) -> checkpoint shape
    undo: Callable[[str, np.ndarray], np.ndarray] = identity  # (checkpoint name, decoded) -> checkpoint layout


def scalar_clip_bounds(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The converter stores a clipped linear's scalar bounds as [1]; the checkpoint as scalars."""
    return () if name.endswith(CLIP_LEAVES) and shape == (1,) else shape


@dataclass(frozen=True)
class MmprojInfo:
    name: str  # the checkpoint's name
    gguf_name: str
    shape: tuple[int, ...]  # the checkpoint's shape
    dtype: str
    path: Path


class MmprojStore:
    """One tower's tensors of a projector GGUF under the checkpoint's names and shapes, each decoded whole
    when asked."""

    source = "its metadata"  # what the tensors are checked against, for messages

    def __init__(self, f: GGUFFile, tower: TowerMap):
        self.file, self.model_dir, self.tower = f, f.path, tower
        self.infos: dict[str, MmprojInfo] = {}
        for t in f.tensors.values():
            if not tower.owns(t.name):
                continue
            try:
                name = tower.hf_name(t.name)
            except GGUFError as e:
                raise GGUFError(f"{f.path}: {e}") from None
            self.infos[name] = MmprojInfo(name, t.name, tower.shape(name, t.shape), t.type_name, f.path)

    def describe(self, name: str) -> str:
        return f"'{self.infos[name].gguf_name}' ({name})"

    def undecodable(self, name: str) -> str | None:
        return undecodable_type(self.describe(name), self.infos[name].dtype)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    @property
    def names(self) -> list[str]:
        return list(self.infos)

    def get(self, name: str, dtype: np.dtype = np.float64) -> np.ndarray:
        info = self.infos[name]
        x = self.tower.undo(name, self.file.get(info.gguf_name))
        return x.reshape(info.shape).astype(dtype)  # a copy, C-ordered (ascontiguousarray would make a scalar 1-D)

    def rows(self, name: str, index, dtype: np.dtype = np.float64) -> np.ndarray:
        return self.get(name, dtype)[index]

    def nonfinite(self, name: str, index=None) -> int:
        x = self.get(name) if index is None else self.rows(name, index)
        return int(np.count_nonzero(~np.isfinite(x)))


class ProjectorKeys:
    """The ``clip.<tower>.*`` keys and the tensor shapes of one tower of a projector file, each checked in one
    line that names the file."""

    def __init__(self, f: GGUFFile, tower: str):
        self.f, self.meta, self.tower, self.where = f, f.metadata, tower, str(f.path)

    def integer(self, name: str) -> int:
        value = self.meta.get(f"clip.{self.tower}.{name}")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise GGUFError(f"{self.where}: metadata key 'clip.{self.tower}.{name}' must be a positive integer, "
                            f"got {value!r}")
        return value

    def decimal(self, name: str) -> float:
        value = self.meta.get(f"clip.{self.tower}.{name}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise GGUFError(f"{self.where}: metadata key 'clip.{self.tower}.{name}' must be a positive number, "
                            f"got {value!r}")
        return config_decimal(float(value))

    def shape(self, gguf_name: str) -> tuple[int, ...]:
        if gguf_name not in self.f.tensors:
            raise GGUFError(f"{self.where}: no tensor {gguf_name!r}; a Gemma 4 {self.tower} projector holds it")
        return self.f.tensors[gguf_name].shape
