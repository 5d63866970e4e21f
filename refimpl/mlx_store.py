"""An MLX quantised checkpoint directory's tensors under the oracle's names, decoded on demand (docs/quantised.md).

``MlxStore(model_dir)`` offers what ``Gemma4Weights`` asks of a safetensors ``TensorStore``: ``infos`` (name ->
shape, stored type), ``read`` (rows [start, stop) decoded), ``rows`` (a gather), ``decode_into`` (the streamed
products) and ``nonfinite``. A quantised module ``<path>`` (``<path>.weight`` packed uint32, ``.scales``,
``.biases``; refimpl/mlx_quant.py) is one tensor ``<path>.weight`` of its logical shape, each row decoded from
its own packed row, scales and biases; every other tensor is the safetensors store's. The quantisation of each
module is config.json's ``quantization`` block (its per-module entry, else the defaults).

Names: mlx-lm's ``gemma4_text`` writes the checkpoint's own (``model.layers.0...``); its ``gemma4`` wrapper
writes ``language_model.model.X`` for the checkpoint's ``model.language_model.X``, and so does mlx-vlm, which
also drops the ``model.`` of the towers and their embedders (``vision_tower.X`` for ``model.vision_tower.X``).
mlx-vlm's sanitize leaves the audio tower's convolutions in MLX's channels-last layout (``[out, kH, kW, in]``
for the subsampling Conv2d's ``[out, in, kH, kW]``, ``[out, kW, in]`` for the depthwise Conv1d's
``[out, in, kW]``); a tensor under mlx-vlm's name is read back in the checkpoint's layout (a transpose,
exact). The first axis is the same in both layouts, so rows are rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .config_fields import read_config_json
from .errors import WeightsError
from .mlx_quant import QuantSpec, check_shapes, dequantize, parse_quantization
from .safetensors_io import TensorStore
from .threads import in_parts

SWITCH = "experts.switch_glu."  # where mlx-lm keeps the MoE experts
DECODE_VALUES = 1 << 18  # values decoded per step when reading rows
WRAPPED = ("language_model.model.", "model.language_model.")  # mlx's gemma4 wrapper, and the checkpoint's
TOWERS = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.", "vision_embedder.")  # mlx-vlm's names
# mlx-vlm's channels-last convolutions: (a name's part, its rank) -> the axes that give the checkpoint's layout
CHANNELS_LAST = {("subsample_conv_projection.", 4): (0, 3, 1, 2), ("depthwise_conv1d.", 3): (0, 2, 1)}


def oracle_name(mlx_name: str) -> str:
    """The checkpoint's name of a tensor as mlx-lm or mlx-vlm saves it."""
    mine, theirs = WRAPPED
    if mlx_name.startswith(mine):
        return theirs + mlx_name[len(mine):]
    return "model." + mlx_name if mlx_name.startswith(TOWERS) else mlx_name


def checkpoint_axes(mlx_name: str, ndim: int) -> tuple[int, ...] | None:
    """The transpose that takes a tensor mlx-vlm saved in MLX's layout back to the checkpoint's, or None."""
    if not mlx_name.startswith(TOWERS) or not mlx_name.endswith(".weight"):
        return None
    return next((axes for (part, rank), axes in CHANNELS_LAST.items() if part in mlx_name and ndim == rank), None)


def is_mlx_quantised(store: TensorStore, config: dict) -> bool:
    """Whether a safetensors checkpoint is MLX-quantised: config.json has a quantization block, or a tensor
    has the scales of a packed weight."""
    return "quantization" in config or "quantization_config" in config or any(
        n.endswith(".scales") and n[:-len(".scales")] + ".weight" in store for n in store.names)


@dataclass(frozen=True)
class MlxInfo:
    name: str  # the oracle's full name
    mlx_name: str  # the stored name (<path>.weight for a quantised module)
    shape: tuple[int, ...]  # the logical shape
    dtype: str  # the stored type: "affine q4 g64", or the safetensors dtype of a plain tensor
    path: Path
    spec: QuantSpec | None = None  # None: a plain tensor
    parts: tuple[MlxInfo, ...] = ()  # a tensor mlx-lm splits (the experts' gate_up_proj): its parts, along axis 1
    axes: tuple[int, ...] | None = None  # a tensor stored in MLX's layout: the transpose back to the checkpoint's

    @property
    def module(self) -> str:
        return self.mlx_name[:-len(".weight")]

    @property
    def row_values(self) -> int:
        return int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1


class MlxStore:
    """The tensors of an MLX quantised checkpoint directory, by the oracle's full names."""

    DECODED = TensorStore.DECODED + ("affine",)
    source = "config.json"

    def __init__(self, model_dir: str | Path, inner: TensorStore | None = None, config: dict | None = None):
        self.model_dir = Path(model_dir)
        self.inner = inner if inner is not None else TensorStore(model_dir)
        where = f"{self.model_dir / 'config.json'}"
        if config is None:
            _, config = read_config_json(self.model_dir)
        block = config.get("quantization", config.get("quantization_config"))
        if block is None:
            raise WeightsError(f"{where}: the checkpoint holds MLX-quantised tensors (packed weights with scales) but "
                               "config.json has no 'quantization' block saying how they were quantised")
        default, per_module = parse_quantization(block, where)
        self.infos: dict[str, MlxInfo] = {}
        modules = {n[:-len(".scales")] for n in self.inner.names if n.endswith(".scales")}
        for path, spec in per_module.items():
            if spec is not None and path not in modules:
                raise WeightsError(f"{where}: quantization[{path!r}] names no quantised tensor of the checkpoint "
                                   f"(no '{path}.weight' with '{path}.scales')")
        for name in self.inner.names:
            stem = name.rsplit(".", 1)[0]
            if stem in modules and name != stem + ".weight":
                if name not in (stem + ".scales", stem + ".biases"):
                    raise WeightsError(f"{where}: '{name}' sits beside a quantised module's weight and scales, and "
                                       "the oracle does not read it (a tensor-wide nvfp4 scale is not read yet)")
                continue  # the scales and biases of a quantised module: read with its weight
            info = self.inner.infos[name]
            if stem in modules:
                spec = per_module.get(stem, default)
                if spec is None:
                    raise WeightsError(f"{where}: quantization[{stem!r}] is false (not quantised), but the checkpoint "
                                       f"stores '{stem}' packed with scales")
                scale_type = self.inner.infos[stem + ".scales"].dtype
                if (scale_type == "U8") != (spec.mode != "affine"):
                    raise WeightsError(f"{info.path}: {stem}: {spec.mode} scales stored as {scale_type} (expected "
                                       f"{'U8' if spec.mode != 'affine' else 'a float type'})")
                shape = check_shapes(f"{info.path}: {stem}", spec, info.shape,
                                     self.inner.infos[stem + ".scales"].shape,
                                     self.inner.infos[stem + ".biases"].shape if stem + ".biases" in self.inner
                                     else None)
                self.infos[oracle_name(name)] = MlxInfo(oracle_name(name), name, shape, spec.label, info.path, spec)
            else:
                axes = checkpoint_axes(name, len(info.shape))
                shape = info.shape if axes is None else tuple(info.shape[a] for a in axes)
                self.infos[oracle_name(name)] = MlxInfo(oracle_name(name), name, shape, info.dtype, info.path,
                                                        axes=axes)
        self._join_experts()

    def _join_experts(self) -> None:
        """mlx-lm's sanitize splits each MoE layer's ``experts.gate_up_proj`` [E, 2 I, H] in halves along axis 1
        (``experts.switch_glu.gate_proj`` then ``up_proj``) and renames ``experts.down_proj``
        (``experts.switch_glu.down_proj``): the checkpoint's tensors again, each part decoded as stored."""
        for gate in [n for n in self.infos if n.endswith(SWITCH + "gate_proj.weight")]:
            stem = gate[:-len(SWITCH + "gate_proj.weight")]
            up, down = stem + SWITCH + "up_proj.weight", stem + SWITCH + "down_proj.weight"
            parts = (self.infos.pop(gate), self.infos.pop(up))
            shape = (parts[0].shape[0], parts[0].shape[1] + parts[1].shape[1], *parts[0].shape[2:])
            dtypes = " + ".join(dict.fromkeys(p.dtype for p in parts))
            self.infos[stem + "experts.gate_up_proj"] = MlxInfo(stem + "experts.gate_up_proj", parts[0].mlx_name,
                                                                shape, dtypes, parts[0].path, parts[0].spec, parts)
            if down in self.infos:
                self.infos[stem + "experts.down_proj"] = replace(self.infos.pop(down), name=stem + "experts.down_proj")

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def quantisation(self) -> dict:
        """What a fixture set records of the checkpoint's quantisation: the format, the activations' convention
        (none: MLX's affine matmul does not quantise them) and, per stored module, its type, width and group."""
        leaves = [p for info in self.infos.values() for p in info.parts or (info,) if p.spec is not None]
        return {"format": "mlx-affine", "activations": "none",
                "tensors": {p.module: {"type": p.spec.mode, "bits": p.spec.bits, "group_size": p.spec.group_size}
                            for p in sorted(leaves, key=lambda p: p.module)}}

    @property
    def names(self) -> list[str]:
        return list(self.infos)

    def describe(self, name: str) -> str:
        info = self.infos[name]
        return f"'{name}'" if info.mlx_name == name else f"'{info.mlx_name}' ({name})"

    def undecodable(self, name: str) -> str | None:
        info = self.infos[name]
        for part in info.parts or (info,):
            if part.spec is None and (problem := self.inner.undecodable(part.mlx_name)) is not None:
                return problem
        return None

    def release(self, name: str) -> None:
        for info in self.infos[name].parts or (self.infos[name],):
            self._release(info)

    def _release(self, info: MlxInfo) -> None:
        parts = (".weight", ".scales", ".biases") if info.spec is not None and info.spec.mode == "affine" else (
            (".weight", ".scales") if info.spec is not None else ("",))
        for part in parts:
            self.inner.release(info.module + part if part else info.mlx_name)

    @staticmethod
    def row_offset(info: MlxInfo, row: int) -> int:
        """Where row ``row`` starts, for ``decode_into``: its index (along the first axis)."""
        return row

    def _decoded(self, info: MlxInfo, index: slice | np.ndarray) -> np.ndarray:
        """Rows ``index`` (first axis: a slice, or an array of rows) of a quantised module, or of a joined
        tensor's parts, float64."""
        if info.parts:
            return np.concatenate([self._decoded(p, index) if p.spec is not None
                                   else self.inner.rows(p.mlx_name, index) for p in info.parts], axis=1)
        words = self.inner.raw(info.mlx_name)[index]
        scales = self.inner.rows(info.module + ".scales", index)
        biases = self.inner.rows(info.module + ".biases", index) if info.spec.mode == "affine" else None
        return self.decode(words, scales, biases, info.spec)

    def decode(self, words: np.ndarray, scales: np.ndarray, biases: np.ndarray | None, spec) -> np.ndarray:
        """Rows of a quantised module from their packed words, scales and biases -> float64 (MLX's
        dequantisation of ``spec``; a subclass may decode otherwise: the self-test's quantisation mutants)."""
        return dequantize(words, scales, biases, spec)

    def decode_into(self, info: MlxInfo, row: int, dst: np.ndarray) -> None:
        """Fill ``dst`` (1-D, whole rows) with the rows from ``row`` on, decoded."""
        if info.axes is not None:
            dst[:] = self.read(info.name, row, row + dst.size // info.row_values).reshape(-1)
            return
        if info.spec is None:
            inner = self.inner.infos[info.mlx_name]
            self.inner.decode_into(inner, self.inner.row_offset(inner, row), dst)
            return
        dst[:] = self._decoded(info, slice(row, row + dst.size // info.row_values)).reshape(-1)

    def read(self, name: str, start: int = 0, stop: int | None = None, dtype: np.dtype = np.float64,
             out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of a tensor (all by default), decoded to ``dtype`` (into ``out`` when given)."""
        info = self.infos[name]
        if info.axes is not None:  # a few small convolutions: read as stored, then transposed
            rows = self.inner.read(info.mlx_name, start, stop, dtype).transpose(info.axes)
            if out is None:
                return np.ascontiguousarray(rows)
            out[...] = rows
            return out
        if info.spec is None and not info.parts:
            return self.inner.read(info.mlx_name, start, stop, dtype, out)
        stop = info.shape[0] if stop is None else stop
        if not 0 <= start <= stop <= info.shape[0]:
            raise IndexError(f"rows [{start}, {stop}) of tensor '{name}' with shape {list(info.shape)}")
        shape = (stop - start, *info.shape[1:])
        if out is None:
            out = np.empty(shape, dtype=dtype)
        elif out.shape != shape or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous {np.dtype(dtype)} array of shape {list(shape)}")
        step = max(1, DECODE_VALUES // info.row_values)

        def work(first: int, last: int) -> None:  # rows [first, last) of the result
            for a in range(first, last, step):
                b = min(a + step, last)
                out[a:b] = self._decoded(info, slice(start + a, start + b))

        in_parts(stop - start, work, unit=step)
        return out

    def get(self, name: str, dtype: np.dtype = np.float64) -> np.ndarray:
        return self.read(name, dtype=dtype)

    def rows(self, name: str, index, dtype: np.dtype = np.float64) -> np.ndarray:
        """``tensor[index]`` along the first axis (an int, a slice or an array of ints), decoded."""
        info = self.infos[name]
        if info.axes is not None:  # a few small convolutions: the whole tensor, then the rows
            return self.read(name, dtype=dtype)[index]
        if info.spec is None and not info.parts:
            return self.inner.rows(info.mlx_name, index, dtype)
        picked = np.arange(info.shape[0])[index]
        out = self._decoded(info, np.atleast_1d(picked).reshape(-1)).astype(dtype, copy=False)
        return out.reshape(np.shape(picked) + info.shape[1:])

    def nonfinite(self, name: str, index=None) -> int:
        """How many decoded values of a tensor (of its rows ``index``, when given) are NaN or infinite."""
        info = self.infos[name]
        if info.spec is None and not info.parts:
            return self.inner.nonfinite(info.mlx_name, index)
        if index is not None:
            return int(np.count_nonzero(~np.isfinite(self.rows(name, index))))
        count, step = 0, max(1, DECODE_VALUES // info.row_values)
        for a in range(0, info.shape[0], step):
            count += int(np.count_nonzero(~np.isfinite(self.read(name, a, min(a + step, info.shape[0])))))
        return count
