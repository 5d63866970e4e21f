"""The tensors of a checkpoint, whatever holds them: ``open_store(path)`` is a GGUF file's (``GGUFStore``), an MLX
quantised directory's (``MlxStore``: packed weights with scales and biases) or a safetensors directory's or
file's (``TensorStore``). Each serves the same interface to ``Gemma4Weights`` and the drafter."""

from __future__ import annotations

from pathlib import Path

from .config_fields import read_config_json
from .gguf_io import is_gguf
from .gguf_store import GGUFStore
from .mlx_store import MlxStore, is_mlx_quantised
from .safetensors_io import TensorStore


def open_store(path: str | Path) -> GGUFStore | MlxStore | TensorStore:
    """The tensors of the checkpoint at ``path``."""
    if is_gguf(path):
        return GGUFStore(path)
    store = TensorStore(path)
    config = {}
    if Path(path).is_dir() and (Path(path) / "config.json").is_file():
        raw = read_config_json(path)[1]
        config = raw if isinstance(raw, dict) else {}
    return MlxStore(path, store, config) if is_mlx_quantised(store, config) else store
