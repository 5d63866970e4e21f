"""Checkpoint tensor names and shapes for a ``TextConfig``, validated up front and read lazily.

``expected_tensors(cfg)`` is the table of gemma4-text-spec.md section 5. ``Gemma4Weights`` checks a
checkpoint against it once (missing, unexpected and mis-shaped tensors are one error naming the
file, tensor, expected and found shape), then hands out decoded tensors on demand: nothing is
upcast to float64 until a layer asks for it, and embedding tables are only ever read row by row.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import memory
from .config import TEXT_PREFIXES, TextConfig
from .config_fields import read_config_json
from .errors import InputError, NonFiniteError, WeightsError
from .ggml_act import VEC_DOT_TYPE, activation_values, convention_path, min_term_error
from .ggml_blocks import MIN_TYPES
from .gguf_store import GGUFStore
from .ops import clipped_linear
from .safetensors_io import PLAIN_FLOATS, TensorStore, decode_where_stored
from .stores import open_store
from .threads import in_parts, scaled

# multimodal towers of Gemma4ForConditionalGeneration; the text oracle does not read them
MULTIMODAL_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
                       "model.vision_embedder.")  # the last: Gemma 4 Unified's vision embedder
STALE_ON_SHARED = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")
FEW_ROWS = 16  # Gemma4Weights.linear streams the weight for at most this many rows
STREAM_VALUES = 1 << 18  # weight values decoded per block when streaming (2 MiB of float64)


SMALL_VALUES = 1 << 16  # on the device, tensors of at most this many values stay there once decoded
WEIGHT_CACHE_ENV = "REFIMPL_WEIGHT_CACHE"  # the weight cache size when Gemma4 is not given one
SIZE_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
AUTO_CACHE = -1  # weight_cache_bytes("auto"): on a GPU, AUTO_SHARE of its free memory; on the CPU, off
AUTO_SHARE = 0.8  # (the rest for the activations: a 4k-token prompt's attention scores alone are 1 GiB)


def weight_cache_bytes(value: int | str | None) -> int:
    """The decoded-weight cache budget in bytes: an int, a size such as "12GiB" / "512MiB" / "0", "all" (no
    limit) or "auto" (AUTO_CACHE: sized when the model knows its device); None reads REFIMPL_WEIGHT_CACHE, and
    without it is "auto": off on the CPU (streamed), 80% of the free memory on a GPU (where a streamed weight would
    cross from the host at every use: 21 of the 55 s of the real-size E2B set's generation on an H100)."""
    if value is None:
        value = os.environ.get(WEIGHT_CACHE_ENV, "auto")
        source = f"{WEIGHT_CACHE_ENV}={value!r}"
    else:
        source = f"weight_cache={value!r}"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    if isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        if text == "ALL":
            return sys.maxsize
        if text == "AUTO":
            return AUTO_CACHE
        number = text.rstrip("KMGTIB")
        unit = text[len(number):]
        try:
            amount = float(number)
        except ValueError:
            amount = -1.0
        if unit in SIZE_UNITS and amount >= 0 and math.isfinite(amount):
            return int(amount * SIZE_UNITS[unit])
    raise InputError(f"{source}: the weight cache size must be a number of bytes, a size such as '12GiB' or "
                     "'512MiB', '0' (off), 'all' or 'auto'")


def expected_tensors(cfg: TextConfig) -> dict[str, tuple[int, ...]]:
    """Every text-decoder tensor the checkpoint must hold (names without prefix) and its shape."""
    H, V, N = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    P, L = cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
    t: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (V, H), "norm.weight": (H,)}
    if cfg.has_ple:
        t["embed_tokens_per_layer.weight"] = (cfg.vocab_size_per_layer_input, L * P)
        t["per_layer_model_projection.weight"] = (L * P, H)
        t["per_layer_projection_norm.weight"] = (P,)
    for layer in cfg.layers:
        p = f"layers.{layer.index}."
        D, K, I = layer.head_dim, layer.num_kv_heads, layer.ffn_width  # noqa: E741 - I: the intermediate size (spec)
        t[p + "input_layernorm.weight"] = (H,)
        t[p + "self_attn.q_proj.weight"] = (N * D, H)
        t[p + "self_attn.q_norm.weight"] = (D,)
        if layer.owns_kv:
            t[p + "self_attn.k_proj.weight"] = (K * D, H)
            t[p + "self_attn.k_norm.weight"] = (D,)
            if not layer.k_eq_v:
                t[p + "self_attn.v_proj.weight"] = (K * D, H)
        t[p + "self_attn.o_proj.weight"] = (H, N * D)
        t[p + "post_attention_layernorm.weight"] = (H,)
        t[p + "pre_feedforward_layernorm.weight"] = (H,)
        t[p + "mlp.gate_proj.weight"] = (I, H)
        t[p + "mlp.up_proj.weight"] = (I, H)
        t[p + "mlp.down_proj.weight"] = (H, I)
        t[p + "post_feedforward_layernorm.weight"] = (H,)
        if cfg.enable_moe_block:
            E, Im = cfg.num_experts, cfg.moe_intermediate_size
            t[p + "router.proj.weight"] = (E, H)
            t[p + "router.scale"] = (H,)
            t[p + "router.per_expert_scale"] = (E,)
            t[p + "experts.gate_up_proj"] = (E, 2 * Im, H)
            t[p + "experts.down_proj"] = (E, H, Im)
            t[p + "pre_feedforward_layernorm_2.weight"] = (H,)
            t[p + "post_feedforward_layernorm_1.weight"] = (H,)
            t[p + "post_feedforward_layernorm_2.weight"] = (H,)
        if cfg.has_ple:
            t[p + "per_layer_input_gate.weight"] = (P, H)
            t[p + "per_layer_projection.weight"] = (H, P)
            t[p + "post_per_layer_input_norm.weight"] = (H,)
        t[p + "layer_scalar"] = (1,)
    return t


class Gemma4Weights:
    """The text-decoder tensors of one checkpoint, validated against its config, decoded on demand."""

    def __init__(self, model_dir: str | Path, cfg: TextConfig, dtype: np.dtype = np.float64,
                 weight_cache: int = 0, activations: str = "none", xp=np):
        """``activations``: the activation convention of every product (ggml_act.CONVENTIONS): "none", or
        ggml's CPU rule on a kernel path (a GGUF checkpoint's only), each product's activations converted as
        ggml converts them for that weight's type before it multiplies. ``xp``: the array module the weights
        are used in (numpy; cupy for a model on the GPU: each weight copied there as stored and decoded there, the
        weight cache held there, and the vectors (norm scales, per-layer scalars: ``__getitem__`` of at most
        SMALL_VALUES values) kept there after their first use, a copy a forward saved per use)."""
        self.cfg = cfg
        self.xp = xp
        self.activation_path = convention_path(activations)
        self.activations = activations
        # x, weight type, kernel path -> the values ggml's product multiplies (replaceable: the self-test's
        # quantisation mutants plant another rule here)
        self.activation_rule = activation_values
        self.dtype = np.dtype(dtype)
        # bytes of weights ``product`` may keep between calls (decoded, or on the device as stored: ``keep``)
        self.cache_budget = self._auto_budget() if weight_cache == AUTO_CACHE else weight_cache
        self.cache: dict[tuple[str, int, int], np.ndarray] = {}
        self.cache_bytes = 0
        memory.for_the_oracle()  # the allocator reuses freed arrays (memory.py); once per process
        self.store = open_store(model_dir)
        self.prefix = self._find_prefix()
        self.ignored: list[str] = []
        self._local = threading.local()  # per-thread buffer of ``product``
        self._small: dict[str, Any] = {}  # on the device: the small tensors, decoded there once
        self.resident: dict[str, Any] = {}  # on the device, keep "stored": whole tensors as stored
        self._validate()
        self.keep = self._keep()
        if self.activation_path is not None:
            self._check_activation_types()

    def _auto_budget(self) -> int:
        """weight_cache "auto": AUTO_SHARE of the GPU's free memory now; 0 (streamed) on the CPU."""
        if self.xp is np:
            return 0
        return int(AUTO_SHARE * self.xp.cuda.runtime.memGetInfo()[0])

    def _keep(self) -> str:
        """What the weight cache keeps: "decoded" float64 weights (the CPU; a device whose budget holds every
        matrix decoded), or, on a device whose budget does not but holds them as stored (a safetensors
        checkpoint's BF16/F16/F32: a quarter of the bytes for BF16), "stored": whole tensors copied there once
        and decoded at each use (``_decoded``, ``rows``), the budget counted in stored bytes. With the cache
        off, "decoded" (nothing is kept)."""
        if self.xp is np or self.cache_budget == 0 or not isinstance(self.store, TensorStore):
            return "decoded"
        infos = [self.store.infos[self.prefix + name] for name, shape in expected_tensors(self.cfg).items()
                 if len(shape) in (2, 3) and name != "embed_tokens_per_layer.weight"]
        # (what ``product`` multiplies by, and the MoE experts ``rows`` gathers)
        decoded = sum(math.prod(info.shape) for info in infos) * self.dtype.itemsize
        if decoded <= self.cache_budget or not all(info.dtype in PLAIN_FLOATS for info in infos):
            return "decoded"
        return "stored"

    def _crosses_as_stored(self, full: str) -> bool:
        """On the device, a BF16/F16/F32 tensor of a safetensors checkpoint crosses as stored and is decoded there
        (``_stored_on_device``); other stores decode on the host."""
        return (self.xp is not np and isinstance(self.store, TensorStore)
                and self.store.infos[full].dtype in PLAIN_FLOATS)

    def _stored_on_device(self, full: str, index):
        """The stored values of ``tensor[index]`` (first axis; ``...`` for all) on the device: taken from its
        resident copy under keep "stored" (the whole tensor copied there on first use while the budget lasts),
        else copied there from the memory map."""
        kept = self.resident.get(full)
        if kept is None and self.keep == "stored":
            raw = self.store.raw(full)
            if self.cache_bytes + raw.nbytes <= self.cache_budget:
                kept = self.resident[full] = self.xp.asarray(raw)
                self.cache_bytes += raw.nbytes
                self.store.release(full)
        if kept is not None:
            return kept[self.xp.asarray(index)] if isinstance(index, np.ndarray) else kept[index]
        stored = self.xp.asarray(self.store.raw(full)[index])
        self.store.release(full)
        return stored

    def _check_activation_types(self) -> None:
        """Under the ggml-cpu convention: a GGUF checkpoint, every product's weight type emulated (InputError)."""
        where = f"{self.store.model_dir}: activations {self.activations}"
        if not isinstance(self.store, GGUFStore):
            raise InputError(f"{where}: ggml's activation convention applies to GGUF checkpoints only")
        for full in [self.head_name, *(self.prefix + n for n, shape in expected_tensors(self.cfg).items()
                                       if len(shape) >= 2 and not n.startswith("embed_tokens"))]:
            kind = self.store.infos[full].dtype
            if kind not in VEC_DOT_TYPE:
                raise InputError(f"{where}: {self.store.describe(full)} is {kind}, whose products ggml computes with "
                                 "its activation quantisation, not emulated yet")
            if kind in MIN_TYPES and (".experts." in full or full.endswith("per_layer_model_projection.weight")):
                # the min term is added in ``product``; these two are multiplied elsewhere (model.experts, the
                # per-layer inputs), where it is not (llama.cpp's quantiser leaves the projection F32)
                raise InputError(f"{where}: {self.store.describe(full)} is {kind}, whose products ggml computes with "
                                 "the Q8_1 min term, not emulated yet for this tensor (MoE experts, the per-layer "
                                 "model projection)")

    def activations_for(self, x: np.ndarray, full: str) -> np.ndarray:
        """x [R, in] as the product with the tensor ``full`` sees it: ggml's converted activations, decoded
        (exact in float64), under the ggml-cpu convention; x itself under "none"."""
        if self.activation_path is None:
            return x
        return self.activation_rule(x, self.store.infos[full].dtype, self.activation_path).astype(x.dtype, copy=False)

    def _find_prefix(self) -> str:
        for prefix in TEXT_PREFIXES:
            if prefix + "embed_tokens.weight" in self.store:
                return prefix
        raise WeightsError(
            f"{self.store.model_dir}: missing tensor 'embed_tokens.weight' (looked for "
            + " and ".join(f"'{p}embed_tokens.weight'" for p in TEXT_PREFIXES)
            + "); is this a Gemma 4 checkpoint?"
        )

    def _file(self, full_name: str) -> str:
        return self.store.infos[full_name].path.name

    def _validate(self) -> None:
        expected = expected_tensors(self.cfg)
        problems: list[str] = []
        for name, shape in expected.items():
            full = self.prefix + name
            if full not in self.store:
                problems.append(f"missing tensor '{full}' (expected shape {list(shape)})")
            elif self.store.infos[full].shape != shape:
                found = list(self.store.infos[full].shape)
                problems.append(f"{self._file(full)}: tensor {self.store.describe(full)} has shape {found}, expected "
                                f"{list(shape)}")
            elif (problem := self.store.undecodable(full)) is not None:
                problems.append(problem)
        shared = {layer.index for layer in self.cfg.layers if not layer.owns_kv}
        for full in self.store.names:
            if full.startswith(MULTIMODAL_PREFIXES):
                self.ignored.append(full)
                continue
            if full == "lm_head.weight":
                self._check_head(full, problems)
                continue
            name = full[len(self.prefix):] if full.startswith(self.prefix) else None
            if name in expected:
                continue
            if name is not None and _is_stale_shared(name, shared):
                self.ignored.append(full)  # stale K/V projections left on KV-shared layers
                continue
            problems.append(f"{self._file(full)}: unexpected tensor {self.store.describe(full)} (not part of this "
                            "config's text decoder)")
        if not self.cfg.tie_word_embeddings and "lm_head.weight" not in self.store:
            problems.append(
                f"missing tensor 'lm_head.weight' (expected shape [{self.cfg.vocab_size}, {self.cfg.hidden_size}]; "
                "the config sets tie_word_embeddings to false)"
            )
        if problems:
            shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
            raise WeightsError(
                f"{self.store.model_dir}: the weights do not match {self.store.source}:\n  " + "\n  ".join(shown)
            )

    def _check_head(self, full: str, problems: list[str]) -> None:
        shape = (self.cfg.vocab_size, self.cfg.hidden_size)
        if self.store.infos[full].shape != shape:
            found = list(self.store.infos[full].shape)
            problems.append(f"{self._file(full)}: tensor {self.store.describe(full)} has shape {found}, expected "
                            f"{list(shape)}")
        elif self.cfg.tie_word_embeddings:
            self.ignored.append(full)  # tied: the head is the embedding table

    # ------------------------------------------------------------------------------------------
    # access

    @property
    def storage_dtypes(self) -> dict[str, int]:
        """How many text tensors are stored in each dtype (for inspect)."""
        counts: dict[str, int] = {}
        for name in expected_tensors(self.cfg):
            d = self.store.infos[self.prefix + name].dtype
            counts[d] = counts.get(d, 0) + 1
        return counts

    def __getitem__(self, name: str) -> np.ndarray:
        """A whole tensor, decoded to the compute dtype (a matrix from the weight cache while its budget lasts)."""
        full = self.prefix + name
        shape = self.store.infos[full].shape
        if len(shape) == 2 and (W := self._cached(full, 0, shape[0])) is not None:  # (the PLE model projection)
            return W
        if self.xp is np or math.prod(shape) > SMALL_VALUES:
            return self._decoded(full, 0, None)
        kept = self._small.get(full)
        if kept is None:
            kept = self._small[full] = self._decoded(full, 0, None)
        return kept

    def rows(self, name: str, index) -> np.ndarray:
        """Only ``tensor[index]`` (first axis), gathered from the memory map and decoded. On the device, the rows of
        a BF16/F16/F32 tensor of a safetensors checkpoint cross as stored and are decoded there, as ``_decoded``
        (the embedding and PLE rows of a prompt: a quarter of the bytes, and no decoding on the host). On the
        device the MoE experts (3-D, gathered an expert at a time) are kept by the weight cache as the matrices
        are, decoded whole (any store) or resident as stored: no later forward reads them from the host again."""
        full = self.prefix + name
        shape = self.store.infos[full].shape
        if self.xp is not np and len(shape) == 3 and (W := self._cached(full, 0, shape[0])) is not None:
            return W[self.xp.asarray(index)] if isinstance(index, np.ndarray) else W[index]  # (MoE experts)
        if not self._crosses_as_stored(full):
            return self.xp.asarray(self.store.rows(full, index, self.dtype))
        return decode_where_stored(self._stored_on_device(full, index), self.store.infos[full].dtype, self.dtype)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """x [R, in] @ W[out, in]^T for the named weight W, decoded from the checkpoint as it runs."""
        return self.product(x, self.prefix + name)

    def head_linear(self, y: np.ndarray, start: int, stop: int) -> np.ndarray:
        """y [R, H] @ head[start:stop]^T: logits of vocabulary entries [start, stop) before the softcap."""
        return self.product(y, self.head_name, start, stop)

    def product(self, x: np.ndarray, full: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """x [R, in] @ W[start:stop]^T for the tensor named ``full`` (rows [start, stop) of W, all by default).

        Many rows: W is decoded whole into a buffer reused from call to call (the only float64 copy of
        a weight, sized by the largest one; the decoding split between threads) and multiplied in one
        BLAS call. At most FEW_ROWS rows (decode steps, KV-shared layers pruned to the output rows, the
        head of a last-row prefill): a matrix-vector product is bound by the bytes it reads, so W's rows
        are split between ``threads()`` threads, each decoding STREAM_VALUES at a time into its own block
        and multiplying the block while it is in cache, BLAS on that thread alone (``own_blas``);
        no full float64 copy is made. (``np.dot``: the same BLAS call as ``@``, which keeps the GIL while
        it multiplies and so would run the threads' products one at a time.)"""
        rows, cols = self.store.infos[full].shape
        stop = rows if stop is None else stop
        seen = self.activations_for(x, full)
        W = self._cached(full, start, stop)
        if W is not None:
            return self._with_min_term(seen @ W.T, x, full, start, stop)
        if self.xp is not np:  # on the device: copied there, decoded and multiplied there
            return seen @ self._decoded(full, start, stop).T
        if x.shape[0] > FEW_ROWS:
            W = self.store.read(full, start, stop, self.dtype, out=self._buffer((stop - start, cols)))
            return self._with_min_term(seen @ W.T, x, full, start, stop)
        out = np.empty((seen.shape[0], stop - start), dtype=np.result_type(seen.dtype, self.dtype))
        unit = max(1, STREAM_VALUES // cols)  # rows of a block on a few threads: parts are whole units
        step = unit if stop - start <= unit else max(1, scaled(STREAM_VALUES) // cols)  # rows of a block of a part
        info = self.store.infos[full]

        def work(first: int, last: int) -> None:  # output columns [first, last) of out
            block = self._buffer((step, cols))
            for a in range(first, last, step):
                b = min(a + step, last)
                W = block[:b - a]
                self.store.decode_into(info, self.store.row_offset(info, start + a), W.reshape(-1))
                out[:, a:b] = np.dot(seen, W.T)

        in_parts(stop - start, work, unit=unit, own_blas=True)
        return self._with_min_term(out, x, full, start, stop)

    def _with_min_term(self, y: np.ndarray, x: np.ndarray, full: str, start: int, stop: int) -> np.ndarray:
        """``y`` = x_hat @ W[start:stop]^T, plus, for a Q4_1 / Q5_1 weight under ggml's activation convention, what
        ggml's min term adds beyond the exact one: the activations' ``min_term_error`` [R, blocks] times the weight
        blocks' minima [stop - start, blocks] (ggml_act.py). Every other product is returned as it is."""
        if self.activation_path is None or self.store.infos[full].dtype not in MIN_TYPES:
            return y
        y += min_term_error(x, self.activation_path) @ self.store.block_mins(full, start, stop).T
        return y

    def _cached(self, full: str, start: int, stop: int) -> np.ndarray | None:
        """W[start:stop] decoded, kept in the weight cache while its budget lasts; None once it is spent.

        The cache only fills: a forward visits the weights in the same order every time, so evicting the
        oldest would make every later visit a miss. The first ``cache_budget`` bytes of weights stay."""
        key = (full, start, stop)
        if key in self.cache:
            return self.cache[key]
        if self.keep == "stored":
            return None
        nbytes = (stop - start) * math.prod(self.store.infos[full].shape[1:]) * self.dtype.itemsize
        if self.cache_bytes + nbytes > self.cache_budget:
            return None
        W = self.cache[key] = self._decoded(full, start, stop)
        self.cache_bytes += nbytes
        return W

    def _decoded(self, full: str, start: int, stop: int | None) -> np.ndarray:
        """Rows [start, stop) of the tensor ``full`` decoded to the compute dtype, as an array of ``xp``. On the
        device, a BF16/F16/F32 tensor of a safetensors checkpoint crosses as stored (2 bytes a value for BF16,
        not 8) and is decoded there (``decode_where_stored``, exact); other stores decode on the host."""
        info = self.store.infos[full]
        if not self._crosses_as_stored(full):
            return self.xp.asarray(self.store.read(full, start, stop, self.dtype))
        index = slice(start, stop) if info.shape else ...
        return decode_where_stored(self._stored_on_device(full, index), info.dtype, self.dtype)

    def _buffer(self, shape: tuple[int, int]) -> np.ndarray:
        """A float array of ``shape`` reused by this thread's next call (grown to the largest shape asked)."""
        size = shape[0] * shape[1]
        buf = getattr(self._local, "buffer", None)
        if buf is None or buf.size < size:
            buf = self._local.buffer = None  # free the old one before allocating the new one
            buf = self._local.buffer = np.empty(size, dtype=self.dtype)
        return buf[:size].reshape(shape)

    @property
    def head_name(self) -> str:
        """Full name of the tensor the LM head multiplies by: the tied embedding table or lm_head."""
        if self.cfg.tie_word_embeddings:
            return self.prefix + "embed_tokens.weight"
        return "lm_head.weight"

    def head_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the LM head matrix [V, H], decoded."""
        return self.store.read(self.head_name, start, stop, self.dtype)


def nonfinite_error(store: TensorStore, what: str, suspects, dtype) -> NonFiniteError:
    """The error for ``what`` ("the logits are") not finite: it names the first of ``suspects`` ((full
    tensor name, a row of it or None for all of it)) whose stored values are not finite, or, when they
    all are finite, says that the values overflowed ``dtype``."""
    for full, row in suspects:
        n = store.nonfinite(full, row)
        if n:
            where = "" if row is None else f"row {row} of "
            return NonFiniteError(
                f"{store.model_dir}: {what} not finite: {where}tensor '{full}' ({store.infos[full].path.name}) holds "
                f"{n} NaN/inf value{'' if n == 1 else 's'}; the checkpoint is corrupt (re-download or re-convert it)"
            )
    return NonFiniteError(f"{store.model_dir}: {what} not finite, but the weights read there are: the values "
                          f"overflowed {np.dtype(dtype)}")


def _is_stale_shared(name: str, shared: set[int]) -> bool:
    parts = name.split(".", 2)
    return (len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) in shared
            and parts[2] in STALE_ON_SHARED)


def check_tower_tensors(store, expected: dict[str, tuple[int, ...]], prefixes: tuple[str, ...], what: str,
                        hint=lambda name: "") -> None:
    """One WeightsError listing every missing, mis-shaped, non-float and unexpected tensor of a tower
    (the tensors under ``prefixes``) against ``expected`` (full name -> shape); ``hint(name)`` explains an
    unexpected one. ``what`` names the tower in the message ("vision", "audio")."""
    problems = []
    for name, shape in expected.items():
        info = store.infos.get(name)
        if info is None:
            problems.append(f"missing tensor '{name}' (expected shape {list(shape)})")
        elif info.shape != shape:
            problems.append(f"{info.path.name}: tensor '{name}' has shape {list(info.shape)}, expected {list(shape)}")
        elif (problem := store.undecodable(name)) is not None:
            problems.append(problem)
    problems += [f"unexpected tensor '{name}'{hint(name)}" for name in store.names
                 if name.startswith(prefixes) and name not in expected]
    if problems:
        shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise WeightsError(f"{store.model_dir}: the {what} weights do not match {store.source}:\n  "
                           + "\n  ".join(shown))


CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")  # a clippable linear's scalar buffers
CLIP_HINT = " (clip bounds, but the config sets use_clipped_linears to false)"


def clippable_tensors(name: str, shape: tuple[int, int], clipped: bool) -> dict[str, tuple[int, ...]]:
    """The tensors of the clippable linear ``name``: ``name.linear.weight`` [out, in], then its four scalar
    bounds when the tower uses clipped linears."""
    t: dict[str, tuple[int, ...]] = {name + ".linear.weight": shape}
    if clipped:
        t.update({name + "." + b: () for b in CLIP_BOUNDS})
    return t


class TowerWeights:
    """The tensors of one encoder tower (vision, audio) of a checkpoint, validated against its config at
    construction (``check_tower_tensors``), decoded on demand to ``dtype`` (float64 or float32).

    A tower declares ``what`` ("vision"), ``prefixes`` (the checkpoint names it owns),
    ``parse_config(raw, where)`` (its section of config.json -> its config) and
    ``expected_tensors(cfg)`` (full name -> shape), and may extend ``unexpected_hint(name)``;
    ``load(model_dir, dtype)`` then reads the config and the weights of a checkpoint directory."""

    what = "tower"
    prefixes: tuple[str, ...] = ()
    parse_config: Callable[[Any, str], Any]
    expected_tensors: Callable[[Any], dict[str, tuple[int, ...]]]

    def __init__(self, model_dir: str | Path, cfg, dtype: str | np.dtype = "float64", store=None):
        """``store``: the tensors under the checkpoint's names (default: ``model_dir``'s, ``stores.open_store``:
        safetensors, or an MLX quantised directory's, whose towers mlx-vlm saves under its own names; an mmproj
        GGUF's through gguf_mmproj.MmprojStore)."""
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float64, np.float32):
            raise InputError(f"dtype must be float64 or float32, got {self.dtype}")
        self.cfg = cfg
        memory.for_the_oracle()
        self.store = store if store is not None else open_store(model_dir)
        check_tower_tensors(self.store, self.expected(), self.prefixes, self.what, self.unexpected_hint)

    @classmethod
    def load_config(cls, model_dir: str | Path):
        """The tower's config, read from a checkpoint directory's config.json."""
        path, raw = read_config_json(model_dir)
        return cls.parse_config(raw, str(path))

    @classmethod
    def load(cls, model_dir: str | Path, dtype: str | np.dtype = "float64"):
        """(weights, cfg) of a checkpoint directory's tower."""
        cfg = cls.load_config(model_dir)
        return cls(model_dir, cfg, dtype), cfg

    def expected(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the tower and its projector (full checkpoint names) and its shape."""
        return self.expected_tensors(self.cfg)

    def unexpected_hint(self, name: str) -> str:
        """Why a tensor under ``prefixes`` that the config does not expect may be there ("" if unknown)."""
        return CLIP_HINT if name.endswith(CLIP_BOUNDS) else ""

    def check_finite(self, soft_tokens: np.ndarray) -> np.ndarray:
        """The tower's output, when finite; else NonFiniteError naming the first tower tensor that is not
        (read only then)."""
        if not np.isfinite(soft_tokens).all():
            raise nonfinite_error(self.store, f"the {self.what} tower's soft tokens are",
                                  [(name, None) for name in self.expected()], self.dtype)
        return soft_tokens

    def __getitem__(self, name: str) -> np.ndarray:
        """A whole tensor by its full checkpoint name, decoded to the compute dtype."""
        return self.store.get(name, self.dtype)

    def clip_bounds(self, prefix: str) -> tuple[float, float, float, float] | None:
        """(input_min, input_max, output_min, output_max) of a clippable linear, or None without clipping."""
        if not self.cfg.use_clipped_linears:
            return None
        return tuple(float(self.store.get(prefix + "." + b, np.float64)) for b in CLIP_BOUNDS)  # type: ignore[return-value]

    def clippable(self, x: np.ndarray, prefix: str) -> np.ndarray:
        """The clippable linear ``prefix`` (``.linear.weight`` plus its bounds) applied to x."""
        return clipped_linear(x, self[prefix + ".linear.weight"], self.clip_bounds(prefix))
