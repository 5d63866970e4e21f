"""Write a checkpoint directory as a Gemma 4 GGUF with gguf-py, as llama.cpp's converter does (the quantised-weights
spec, §3.2-3.4): the ``gemma4.*`` keys from config.json, the tensors under their GGUF names, ``rope_freqs``
generated, the converter's type rules (F32 for vectors, norms, the router and names not ending ``.weight``; the
out type for the rest). For tests: ``kv`` edits a key (None drops it), ``types`` sets a tensor's type, ``drop``
leaves tensors out, ``quantizer`` makes the blocks (tests/libggml.py: libggml's own). llama.cpp's own converter
is compared with the oracle in tests/oracle/quantised/test_gguf_llama_cpp.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import gguf
import gguf.quants as gguf_quants
import numpy as np

from refimpl.config import FULL, SLIDING, load_config
from refimpl.safetensors_io import TensorStore, write_safetensors
from refimpl.weights import expected_tensors

T = gguf.GGMLQuantizationType
A = "gemma4"
# the converter's own Gemma 4 renames (Gemma4Model.filter_tensors / modify_tensors), not in TensorNameMap
CONVERTER = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}


def converter_name(name: str, n_layers: int) -> str:
    """The GGUF name llama.cpp's converter gives the checkpoint tensor ``name`` (without ``model.``)."""
    for hf, gg in CONVERTER.items():
        if name.endswith("." + hf):
            return f"blk.{name.split('.')[1]}.{gg}"
    if name == "lm_head.weight":
        return "output.weight"
    stem, suffix = (name[: -len(".weight")], ".weight") if name.endswith(".weight") else (name, ".weight")
    mapped = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n_layers).get_name("model." + stem)
    assert mapped is not None, name
    return mapped + suffix  # layer_scalar and the experts' stacks get .weight appended


def metadata(model_dir: Path) -> dict[str, Any]:
    """The converter's ``gemma4.*`` and tokenizer id keys for a checkpoint: key -> value (bool, int, float, list)."""
    cfg = load_config(model_dir)
    full = [x for x in cfg.layers if x.layer_type == FULL]
    swa = [x for x in cfg.layers if x.layer_type == SLIDING]
    kv: dict[str, Any] = {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings or 131072,
        "embedding_length": cfg.hidden_size, "feed_forward_length": [x.ffn_width for x in cfg.layers],
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": [x.num_kv_heads for x in cfg.layers],
        "attention.key_length": full[0].head_dim, "attention.value_length": full[0].head_dim,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "attention.sliding_window": cfg.sliding_window,
        "attention.sliding_window_pattern": [x.is_sliding for x in cfg.layers],
        "attention.shared_kv_layers": cfg.num_kv_shared_layers,
        "embedding_length_per_layer_input": cfg.hidden_size_per_layer_input,
        "rope.freq_base": float(full[0].rope.theta), "rope.dimension_count": full[0].head_dim,
    }
    if swa:
        kv |= {"attention.key_length_swa": swa[0].head_dim, "attention.value_length_swa": swa[0].head_dim,
               "rope.freq_base_swa": float(swa[0].rope.theta), "rope.dimension_count_swa": swa[0].head_dim}
    else:
        kv |= {"attention.key_length_swa": full[0].head_dim, "attention.value_length_swa": full[0].head_dim}
    if cfg.final_logit_softcapping is not None:
        kv["final_logit_softcapping"] = float(cfg.final_logit_softcapping)
    if cfg.enable_moe_block:
        kv |= {"expert_count": cfg.num_experts, "expert_used_count": cfg.top_k_experts,
               "expert_feed_forward_length": cfg.moe_intermediate_size}
    out = {f"{A}.{k}": v for k, v in kv.items()}
    out["tokenizer.ggml.bos_token_id"] = cfg.bos_token_id
    out["tokenizer.ggml.eos_token_id"] = cfg.eos_token_ids[0]
    out["tokenizer.ggml.padding_token_id"] = cfg.pad_token_id
    return out


def rope_freqs(model_dir: Path) -> np.ndarray:
    """The converter's rope_freqs.weight: the full layers' rotated pairs 1.0, the others 1e30."""
    full = next(x for x in load_config(model_dir).layers if x.layer_type == FULL)
    n = int(full.head_dim * full.rope.partial_rotary_factor / 2)
    return np.array([1.0] * n + [1e30] * (full.head_dim // 2 - n), dtype=np.float32)


def converter_type(gguf_name: str, ndim: int, outtype: T) -> T:
    """ModelBase.prepare_tensors' rule: F32 for vectors, norms, the router and names not ending .weight."""
    if ndim <= 1 or gguf_name.endswith("_norm.weight") or "ffn_gate_inp" in gguf_name \
            or not gguf_name.endswith(".weight"):
        return T.F32
    return outtype


def add_kv(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    """One metadata key, typed from its Python value (bool, uint32, float32, string, array)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


def encode(values: np.ndarray, qtype: T, quantizer=None) -> tuple[np.ndarray, T | None]:
    """(the array to hand GGUFWriter.add_tensor, its raw_dtype) for float values stored as ``qtype``; a row that
    is not whole blocks of ``qtype`` falls back to F16, as the converter does. ``quantizer(values, qtype)``:
    the blocks' bytes (default: gguf-py's quantiser)."""
    if values.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = T.F16
    if qtype == T.F32:
        return values.astype(np.float32), None
    if qtype == T.F16:
        return values.astype(np.float16), None
    if quantizer is not None and qtype not in (T.BF16,):
        return quantizer(values.astype(np.float32), qtype), qtype
    try:
        return gguf_quants.quantize(values.astype(np.float32), qtype), qtype
    except NotImplementedError:  # gguf-py quantises no K-quant: zero blocks of the right size stand in
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((*values.shape[:-1], values.shape[-1] // block * nbytes), dtype=np.uint8), qtype


def write_gguf(model_dir: Path, out: Path, outtype: T = T.F32, kv: dict[str, Any] | None = None,
               types: dict[str, T] | None = None, drop: tuple[str, ...] = (), arch: str = A,
               quantizer=None) -> Path:
    """``model_dir`` written as the GGUF ``out`` (see the module docstring); returns ``out``."""
    model_dir, out = Path(model_dir), Path(out)
    cfg = load_config(model_dir)
    store = TensorStore(model_dir)
    prefix = next(p for p in ("model.language_model.", "model.") if p + "embed_tokens.weight" in store)
    w = gguf.GGUFWriter(str(out), arch)
    for key, value in (metadata(model_dir) | (kv or {})).items():
        if value is not None:
            add_kv(w, key, value)
    names = [(prefix + n, n) for n in expected_tensors(cfg)]
    if not cfg.tie_word_embeddings:
        names.append(("lm_head.weight", "lm_head.weight"))
    if "rope_freqs.weight" not in drop:
        w.add_tensor("rope_freqs.weight", rope_freqs(model_dir))
    for full, name in names:  # encoded one at a time: the writer holds the stored bytes only
        g = converter_name(name, cfg.num_hidden_layers)
        if g not in drop:
            values = store.get(full)
            array, raw = encode(values, (types or {}).get(g, converter_type(g, values.ndim, outtype)), quantizer)
            w.add_tensor(g, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def decoded_checkpoint(model_dir: Path, path: Path, out: Path, decode: Callable[[Any], np.ndarray]) -> Path:
    """``model_dir``'s config with the values ``decode(gguf-py's ReaderTensor)`` gives for each tensor of the GGUF
    ``path``, under the checkpoint's names (named forward, as the converter does): a checkpoint directory ``out``
    of what an independent decoder reads from the same blocks."""
    cfg = load_config(model_dir)
    store = TensorStore(model_dir)
    prefix = next(p for p in ("model.language_model.", "model.") if p + "embed_tokens.weight" in store)
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    tensors = {}
    for name in expected_tensors(cfg):
        values = decode(reader[converter_name(name, cfg.num_hidden_layers)])
        tensors[prefix + name] = np.asarray(values).reshape(store.infos[prefix + name].shape).astype(np.float64)
    out.mkdir()
    shutil.copy(model_dir / "config.json", out / "config.json")
    write_safetensors(out / "model.safetensors", tensors, "F32")
    return out
