"""The GGUF container (refimpl/gguf_io.py; issue 45, part 1): files written by gguf-py's GGUFWriter read back
(metadata as gguf-py's GGUFReader reads it, tensors as gguf-py dequantises them, shapes reversed from ``ne``),
and every kind of bad input refused in one line naming the file, before anything is allocated from what the
header claims: files built byte by byte here, from the layout of the quantised-weights spec."""

from __future__ import annotations

import struct

import gguf
import gguf.quants as gguf_quants
import numpy as np
import pytest
from gguf_writer import add_kv

from refimpl.gguf_io import GGUFError, GGUFFile

T = gguf.GGMLQuantizationType


def _written(path, tensors: dict[str, tuple[np.ndarray, T]], **kv) -> None:
    w = gguf.GGUFWriter(str(path), "gemma4")
    for key, value in kv.items():
        add_kv(w, key.replace("__", "."), value)
    for name, (array, qtype) in tensors.items():
        if qtype in (T.F32, T.F16):
            w.add_tensor(name, array.astype(np.float32 if qtype == T.F32 else np.float16))
        else:
            raw = gguf_quants.quantize(array.astype(np.float32), qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_written_by_gguf_py_reads_back(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (rng.standard_normal((8, 64)), T.Q8_0),
               "blk.0.attn_q.weight": (rng.standard_normal((4, 64)), T.Q4_0),
               "blk.0.ffn_up.weight": (rng.standard_normal((3, 96)), T.Q5_1),
               "blk.0.attn_k.weight": (rng.standard_normal((2, 32)), T.Q4_1),
               "blk.0.attn_v.weight": (rng.standard_normal((2, 32)), T.Q5_0),
               "blk.0.attn_norm.weight": (rng.standard_normal(64), T.F32),
               "output_norm.weight": (rng.standard_normal(64), T.F16),
               "blk.0.inp_gate.weight": (rng.standard_normal((5, 64)), T.BF16)}
    path = tmp_path / "m.gguf"
    _written(path, tensors, gemma4__block_count=1, gemma4__attention__layer_norm_rms_epsilon=1e-6,
             gemma4__attention__sliding_window_pattern=[True, False], general__name="tiny",
             tokenizer__ggml__tokens=["<pad>", "<bos>", "a"], gemma4__feed_forward_length=[96, 192])
    f = GGUFFile(path)
    reader = gguf.GGUFReader(str(path))
    assert f.version == 3 and f.alignment == 32 and f.data_start % 32 == 0
    assert f.metadata["general.architecture"] == "gemma4" and f.metadata["general.name"] == "tiny"
    assert f.metadata["gemma4.block_count"] == 1
    assert f.metadata["gemma4.attention.layer_norm_rms_epsilon"] == np.float32(1e-6)
    assert f.metadata["gemma4.attention.sliding_window_pattern"] == [True, False]
    assert f.metadata["tokenizer.ggml.tokens"] == ["<pad>", "<bos>", "a"]
    assert f.metadata["gemma4.feed_forward_length"] == [96, 192]
    assert set(f.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}  # GGUF.*: the header
    assert set(f.tensors) == set(tensors)
    for t in reader.tensors:
        ours = f.tensors[t.name]
        assert ours.ne == tuple(int(x) for x in t.shape) and ours.ggml_type == int(t.tensor_type)
        assert ours.offset == t.data_offset and ours.shape == tensors[t.name][0].shape
        got = f.get(t.name)
        want32 = np.asarray(gguf_quants.dequantize(np.asarray(t.data), t.tensor_type)).reshape(ours.shape)
        assert got.dtype == np.float64 and got.shape == ours.shape
        if t.tensor_type in (T.Q4_1, T.Q5_1):  # gguf-py rounds d·q + m once to float32
            assert np.array_equal(got.astype(np.float32), want32)
        else:
            assert np.array_equal(got, want32.astype(np.float64))


# ----------------------------------------------------------------------------------------------
# files built byte by byte: every field where we choose it


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


ARCH = (("general.architecture", 8, _s("gemma4")),)


def _build(kv=ARCH, tensors=(("t", (32,), 8, 0),), data=None,
           version=3, magic=b"GGUF", n_tensors=None, n_kv=None, alignment=32) -> bytes:
    """A GGUF: kv as (key, value type, encoded value), tensors as (name, ne, ggml type, offset)."""
    out = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                              len(kv) if n_kv is None else n_kv)
    for key, vtype, value in kv:
        out += _s(key) + struct.pack("<I", vtype) + value
    for name, ne, ggml_type, offset in tensors:
        out += _s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", ggml_type, offset)
    out += bytes(-len(out) % alignment)
    return out + (bytes(34) if data is None else data)  # one zero Q8_0 block


def _refused(tmp_path, raw: bytes, match: str) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw)
    with pytest.raises(GGUFError) as e:
        GGUFFile(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    assert match in msg, msg
    return msg


def test_the_hand_built_file_reads(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(_build())
    f = GGUFFile(path)
    assert f.tensors["t"].shape == (32,) and not f.get("t").any()


@pytest.mark.parametrize("raw, match", [
    (b"", "truncated: the magic needs 4 bytes, 0 are left"),
    (b"GGML" + bytes(20), "not a GGUF file (it starts with b'GGML', not b'GGUF')"),
    (_build(version=1), "GGUF version 1; the oracle reads versions 2 and 3"),
    (_build(version=3 << 24), "a big-endian GGUF file"),
    (_build(n_tensors=2**60), "the header claims 1152921504606846976 tensors"),
    (_build(n_kv=2**40), "KV pairs, more than the file can hold"),
    (_build(kv=(("general.architecture", 8, struct.pack("<Q", 2**50)),)), "claims 1125899906842624 bytes"),
    (_build(kv=(("k", 13, b""),)), "metadata 'k' has value type 13, which GGUF does not define"),
    (_build(kv=(("k", 9, struct.pack("<IQ", 4, 2**61)),)), "metadata 'k' claims 2305843009213693952 elements"),
    (_build(kv=(("k", 4, struct.pack("<I", 1)), ("k", 4, struct.pack("<I", 2)))), "metadata key 'k' is given twice"),
    (_build(kv=(("general.alignment", 4, struct.pack("<I", 24)),)), "general.alignment must be a power of two"),
    (_build(tensors=(("t", (32,), 8, 0), ("t", (32,), 8, 64))), "tensor 't' is given twice"),
    (_build(tensors=(("t", (1, 1, 1, 1, 32), 8, 0),)), "tensor 't' has 5 dimensions; GGUF allows 1 to 4"),
    (_build(tensors=(("t", (2**40, 2**20), 8, 0),)), "which a file of"),
    (_build(tensors=(("t", (0,), 8, 0),)), "0 elements"),
    (_build(tensors=(("t", (40,), 8, 0),)), "40 elements are not a whole number of Q8_0 blocks of 32"),
    (_build(tensors=(("t", (32,), 8, 16),)), "offset 16 is not a multiple of the alignment 32"),
    (_build(tensors=(("t", (32,), 8, 4096),)), "runs past the end of the file"),
    (_build(tensors=(("t", (64,), 8, 0),)), "runs past the end of the file"),
    (_build(tensors=(("a", (64,), 8, 0), ("b", (32,), 8, 32)), data=bytes(68)), "tensors 'a' and 'b' overlap"),
    (_build(tensors=(("t", (256,), 99, 0),)), "ggml type type 99, whose block size the oracle does not know"),
    (_build(tensors=(("x" * 64, (32,), 8, 0),)), "not shorter than 64 bytes"),
    (_build(kv=(("k", 8, _s(b"\xff\xfe")),)), "metadata 'k' is not UTF-8"),
])
def test_bad_files_are_refused_in_one_line(tmp_path, raw, match):
    _refused(tmp_path, raw, match)


def test_every_truncation_is_refused(tmp_path):
    """Cut anywhere before the end of the last tensor's data: one line, never a traceback or a partial read."""
    raw = _build(kv=(("general.architecture", 8, _s("gemma4")), ("a", 9, struct.pack("<IQ", 4, 3) + bytes(12))),
                 tensors=(("t", (32,), 8, 0), ("u", (4, 8), 0, 64)), data=bytes(64 + 128))
    for cut in range(len(raw)):
        msg = _refused(tmp_path, raw[:cut], "")
        assert "truncated" in msg or "past the end" in msg or "more than" in msg or "not a GGUF" in msg, (cut, msg)


def test_an_unknown_type_reads_and_is_refused_when_decoded(tmp_path):
    """An IQ4_XS tensor keeps the file readable (its size is known); decoding it is refused, naming it."""
    path = tmp_path / "k.gguf"
    path.write_bytes(_build(tensors=(("blk.0.attn_q.weight", (256,), 23, 0),), data=bytes(136)))
    f = GGUFFile(path)
    assert f.tensors["blk.0.attn_q.weight"].type_name == "IQ4_XS"
    with pytest.raises(Exception, match=r"^blk\.0\.attn_q\.weight is of ggml type IQ4_XS, which the oracle does "
                                        r"not decode"):
        f.get("blk.0.attn_q.weight")
