"""The oracle as a conformance backend, and backend discovery (``conformance.registry``).

Every request kind the harness sends (full; last on the three entry points at the last, middle and
first row; output-row prefill with micro-batches, some without an output row; chunked prefill with
pieces longer than the sliding window; "none, then the last in the next call"; three sequences
together; decode after each) must give the rows of the oracle's own full forward over the same
tokens, on every preset, within 1e-12 (logits are up to 30 in size). Registry errors are checked
message for message.
"""

from __future__ import annotations

import sys
import textwrap
from importlib.metadata import EntryPoint

import numpy as np
import pytest
from helpers import max_abs, open_per_preset, tup

from conformance import registry
from conformance.backends.refimpl_backend import RefimplBackend, RefimplFloat32Backend
from conformance.protocol import Backend, BackendError, Capabilities, Piece, Request, required_capabilities
from refimpl.mtp import CONVENTIONS
from refimpl.synth import PRESETS

TOL = 1e-12
N = 40  # base length, as the fixture sets use
W = 8  # sliding window of every preset
PRESET_NAMES = list(PRESETS)


# ----------------------------------------------------------------------------------------------
# fixtures: one opened backend per preset, a few bases with their full-forward logits


@pytest.fixture(scope="module")
def backends(preset_dirs):
    yield from open_per_preset(RefimplBackend, preset_dirs)


@pytest.fixture(scope="module")
def bases(oracle_bases):
    return oracle_bases


# ----------------------------------------------------------------------------------------------
# the protocol


def test_identity_and_capabilities():
    b = RefimplBackend()
    assert isinstance(b, Backend)
    assert b.name == "refimpl"
    caps = b.capabilities
    assert isinstance(caps, Capabilities)
    claimed = caps.to_dict()
    assert claimed.pop("embedding_convention") == "scaled"
    assert claimed.pop("default_profile") == "exact-f64"
    assert claimed.pop("mtp_conventions") == ",".join(CONVENTIONS)  # the oracle follows every MTP convention
    assert claimed.pop("weight_formats") == "safetensors,mlx-affine,gguf"  # MLX quantised directories, GGUF files
    assert claimed.pop("activation_conventions") == "none"  # option activations: one of ggml's instead
    assert RefimplBackend(activations="ggml-cpu/x86/f16-kv").capabilities.activation_conventions == \
        "ggml-cpu/x86/f16-kv"
    assert claimed.pop("top_logprobs") is False  # whole logits rows
    assert all(v is True for v in claimed.values()), claimed
    f32 = RefimplFloat32Backend()
    assert (f32.name, f32.dtype, f32.capabilities.default_profile) == ("refimpl-float32", "float32", "fp32")
    assert RefimplBackend(dtype="float32").capabilities == f32.capabilities
    assert RefimplBackend(embed_scale="bf16").name == "refimpl-bf16-scale"


def test_bad_options_and_open_errors(tmp_path):
    with pytest.raises(ValueError, match="dtype must be 'float64' or 'float32', got 'float16'"):
        RefimplBackend(dtype="float16")
    with pytest.raises(ValueError, match="embed_scale must be 'exact' or 'bf16', got 'x'"):
        RefimplBackend(embed_scale="x")
    b = RefimplBackend()
    with pytest.raises(RuntimeError, match=r"run\(\) called before open\(\)"):
        b.run(Request("full", tokens=(2, 3)))
    with pytest.raises(BackendError, match=f"refimpl backend cannot open {tmp_path}: "):
        b.open(tmp_path)


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_full(backends, bases, preset):
    ids, ref = bases[preset][0]
    T, d = 21, 4
    r = backends[preset].run(Request("full", tokens=tup(ids[:T]), decode=tup(ids[T:T + d])))
    assert r.logits.dtype == np.float64 and r.logits.shape == (T, ref.shape[1])
    assert max_abs(r.logits, ref[:T]) < TOL
    assert max_abs(r.decode_logits, ref[T:T + d]) < TOL
    assert r.executed["path"] == "full" and r.executed["dtype"] == "float64"
    # no decode asked: none given
    assert backends[preset].run(Request("full", tokens=tup(ids[:5]))).decode_logits is None


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("entry", ["plain", "seq_id", "embeddings"])
def test_last_entries(backends, bases, preset_models, preset, entry):
    model = preset_models[preset]
    ids, ref = bases[preset][1]
    for T, last_pos in [(17, 16), (17, 8), (W + 1, 0), (1, 0)]:  # last, interior, first, a single token
        d = 3
        prompt = ids[:T]
        emb = model.embed(prompt) if entry == "embeddings" else None
        req = Request("last", tokens=tup(prompt), entry=entry, last_pos=last_pos,
                      seq_id=None if entry == "plain" else 5, embeddings=emb, decode=tup(ids[T:T + d]))
        r = backends[preset].run(req)
        assert r.logits.shape == (1, ref.shape[1])
        assert max_abs(r.logits, ref[last_pos:last_pos + 1]) < TOL, (T, last_pos)
        # decode continues after all T tokens, whatever row was asked
        assert max_abs(r.decode_logits, ref[T:T + d]) < TOL, (T, last_pos)
        assert r.executed["state_len_after_prefill"] == T
        assert r.executed["entry"] == entry


@pytest.mark.parametrize("preset", ["e2b-mini", "all-features"])
def test_last_embeddings_are_used(backends, bases, preset_models, preset):
    """The embeddings entry point reads the given embeddings (not E[ids]); ids still pick the PLE rows."""
    model = preset_models[preset]
    ids, _ = bases[preset][2]
    T = 13
    emb = model.embed(ids[:T]) * 1.01
    ref = model.forward(ids[:T], embeddings=emb, rows="all")
    for last_pos in (T - 1, 4):
        r = backends[preset].run(Request("last", tokens=tup(ids[:T]), entry="embeddings", last_pos=last_pos,
                                         seq_id=0, embeddings=emb))
        assert max_abs(r.logits, ref[last_pos:last_pos + 1]) < TOL
        assert max_abs(r.logits, model.forward(ids[:T], rows=[last_pos])) > 1e-3


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("ubatch", [None, 1, 3, 4, 7, 16, 64])
def test_prefill_output_rows_and_ubatches(backends, bases, preset, ubatch):
    ids, ref = bases[preset][0]
    T, d = 29, 2
    rows = (0, 5, 6, 17, 27, 28)  # with ubatch 3, 4 and 7 some micro-batches have no output row
    req = Request("prefill", pieces=(Piece(tup(ids[:T]), rows),), ubatch=ubatch, decode=tup(ids[T:T + d]))
    r = backends[preset].run(req)
    assert max_abs(r.logits, ref[list(rows)]) < TOL
    assert max_abs(r.decode_logits, ref[T:T + d]) < TOL
    size = ubatch or T
    expected = [min(size, T - s) for s in range(0, T, size)]
    assert r.executed["ubatches"] == expected
    outputs = [u["outputs"] for u in r.executed["pieces"][0]["ubatches"]]
    assert outputs == [sum(s <= row < s + size for row in rows) for s in range(0, T, size)]
    if ubatch in (3, 4, 7):
        assert 0 in outputs


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_prefill_no_rows_at_all(backends, bases, preset):
    ids, ref = bases[preset][0]
    r = backends[preset].run(Request("prefill", pieces=(Piece(tup(ids[:12]), ()),), ubatch=5,
                                     decode=tup(ids[12:15])))
    assert r.logits.shape == (0, ref.shape[1])
    assert max_abs(r.decode_logits, ref[12:15]) < TOL


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("ubatch", [None, 5])
def test_chunked_prefill(backends, bases, preset, ubatch):
    ids, ref = bases[preset][1]
    lengths = [11, 13, W + 1, 3]  # pieces longer than the window, then a short one
    pieces, expect, start = [], [], 0
    for n in lengths:
        pieces.append(Piece(tup(ids[start:start + n]), (n - 1,)))
        start += n
        expect.append(start - 1)
    d = 2
    r = backends[preset].run(Request("prefill", pieces=tuple(pieces), ubatch=ubatch,
                                     decode=tup(ids[start:start + d])))
    assert max_abs(r.logits, ref[expect]) < TOL
    assert max_abs(r.decode_logits, ref[start:start + d]) < TOL
    assert r.executed["state_len_after_prefill"] == start


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_chunked_with_several_rows_per_piece(backends, bases, preset):
    ids, ref = bases[preset][2]
    pieces = (Piece(tup(ids[:10]), (0, 4, 9)), Piece(tup(ids[10:30]), (0, 1, 12, 19)))
    r = backends[preset].run(Request("prefill", pieces=pieces, ubatch=6))
    assert max_abs(r.logits, ref[[0, 4, 9, 10, 11, 22, 29]]) < TOL


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_none_then_last(backends, bases, preset):
    ids, ref = bases[preset][2]
    T1, T2, d = 14, 9, 3
    pieces = (Piece(tup(ids[:T1]), ()), Piece(tup(ids[T1:T1 + T2]), (T2 - 1,)))
    r = backends[preset].run(Request("prefill", pieces=pieces, decode=tup(ids[T1 + T2:T1 + T2 + d])))
    assert r.logits.shape == (1, ref.shape[1])
    assert max_abs(r.logits, ref[T1 + T2 - 1:T1 + T2]) < TOL
    assert max_abs(r.decode_logits, ref[T1 + T2:T1 + T2 + d]) < TOL


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_multi_three_sequences(backends, bases, preset):
    (a, ra), (b, rb), (c, rc) = bases[preset]
    lengths, decode_lens = (23, W - 1, 12), (3, 1, 4)
    seqs = tuple(tup(x[:n]) for x, n in zip((a, b, c), lengths, strict=True))
    decode = tuple(tup(x[n:n + k]) for x, n, k in zip((a, b, c), lengths, decode_lens, strict=True))
    r = backends[preset].run(Request("multi", sequences=seqs, seq_ids=(7, 3, 11), decode=decode))
    expect = np.stack([ref[n - 1] for ref, n in zip((ra, rb, rc), lengths, strict=True)])
    assert max_abs(r.logits, expect) < TOL
    assert isinstance(r.decode_logits, list) and len(r.decode_logits) == 3
    for got, ref, n, k in zip(r.decode_logits, (ra, rb, rc), lengths, decode_lens, strict=True):
        assert max_abs(got, ref[n:n + k]) < TOL
    assert r.executed["seq_ids"] == [7, 3, 11]
    assert r.executed["state_len_after_prefill"] == list(lengths)


def test_multi_without_decode_and_errors(backends, bases):
    b = backends["e2b-mini"]
    (a, ra), (c, rc) = bases["e2b-mini"][0], bases["e2b-mini"][2]
    r = b.run(Request("multi", sequences=(tup(a[:5]), tup(c[:9])), seq_ids=(1, 2)))
    assert r.decode_logits is None
    assert max_abs(r.logits, np.stack([ra[4], rc[8]])) < TOL
    with pytest.raises(ValueError, match=r"seq_ids \[1, 1\] are not distinct"):
        b.run(Request("multi", sequences=(tup(a[:5]), tup(c[:9])), seq_ids=(1, 1)))
    with pytest.raises(ValueError, match="2 sequences but 1 seq_ids"):
        b.run(Request("multi", sequences=(tup(a[:5]), tup(c[:9])), seq_ids=(1,)))


def test_request_errors(backends, bases):
    b = backends["31b-mini"]
    ids = tup(bases["31b-mini"][0][0][:6])
    with pytest.raises(ValueError, match="last_pos 6 is outside the 6 tokens of the call"):
        b.run(Request("last", tokens=ids, last_pos=6))
    with pytest.raises(ValueError, match=r"piece 0 rows \[3, 2\] must be increasing within \[0, 6\)"):
        b.run(Request("prefill", pieces=(Piece(ids, (3, 2)),)))
    with pytest.raises(ValueError, match="piece 1 has no tokens"):
        b.run(Request("prefill", pieces=(Piece(ids, ()), Piece((), ()))))
    with pytest.raises(ValueError, match="entry 'embeddings' without embeddings"):
        b.run(Request("last", tokens=ids, entry="embeddings", last_pos=5, seq_id=0))


def test_fresh_state_per_request(backends, bases):
    """Nothing survives between requests: the same request answers the same after any other."""
    b = backends["e4b-mini"]
    ids, ref = bases["e4b-mini"][0]
    req = Request("last", tokens=tup(ids[:10]), entry="seq_id", last_pos=9, seq_id=1, decode=tup(ids[10:12]))
    first = b.run(req)
    b.run(Request("last", tokens=tup(ids[:30]), entry="seq_id", last_pos=29, seq_id=1))
    b.run(Request("multi", sequences=(tup(ids[:7]),), seq_ids=(1,), decode=((5, 6),)))
    again = b.run(req)
    assert np.array_equal(first.logits, again.logits)
    assert np.array_equal(first.decode_logits, again.decode_logits)
    assert max_abs(again.logits, ref[9:10]) < TOL


def test_every_request_kind_needs_only_claimed_capabilities(backends, bases):
    ids = tup(bases["e2b-mini"][0][0][:12])
    claimed = {k for k, v in backends["e2b-mini"].capabilities.to_dict().items() if v is True}
    requests = [
        Request("full", tokens=ids, decode=(3,)),
        Request("last", tokens=ids, entry="embeddings", last_pos=4, seq_id=0),
        Request("prefill", pieces=(Piece(ids, (1,)), Piece(ids, ())), ubatch=3, decode=(4,)),
        Request("multi", sequences=(ids, ids), seq_ids=(0, 1), decode=((1,), (2,))),
    ]
    for req in requests:
        assert set(required_capabilities(req)) <= claimed


def test_float32_backend(preset_dirs, bases):
    b = RefimplFloat32Backend()
    b.open(preset_dirs["e2b-mini"])
    ids, ref = bases["e2b-mini"][0]
    r = b.run(Request("prefill", pieces=(Piece(tup(ids[:20]), (3, 19)),), ubatch=6, decode=tup(ids[20:22])))
    assert r.logits.dtype == np.float32 and r.executed["dtype"] == "float32"
    err = max(max_abs(r.logits, ref[[3, 19]]), max_abs(r.decode_logits, ref[20:22]))
    assert 0 < err < 1e-3
    b.close()
    assert b.model is None


def test_embed_helper(backends, preset_models, bases):
    ids = bases["e2b-mini"][0][0][:5]
    assert np.array_equal(backends["e2b-mini"].embed(ids), preset_models["e2b-mini"].embed(ids))


# ----------------------------------------------------------------------------------------------
# registry

FAKE_MODULE = "conformance_fake_backends"

FAKE_SOURCE = '''
from conformance.protocol import Capabilities, Response
import numpy as np


class Good:
    def __init__(self, scale=1.0):
        self.name = "good"
        self.capabilities = Capabilities(full_forward=True, last_plain=True, decode=True)
        self.scale = scale

    def open(self, model_dir):
        self.model_dir = model_dir

    def run(self, request):
        return Response(np.zeros((len(request.tokens), 4)) * self.scale)

    def close(self):
        pass


def make_good(**options):
    return Good(**options)


GOOD = Good()


class Raising(Good):
    def __init__(self, **options):
        raise RuntimeError("no GPU found")


class RaisingOnOpen(Good):
    def open(self, model_dir):
        raise OSError("cannot map weights")


class RaisingOnRun(Good):
    def run(self, request):
        raise RuntimeError("kernel launch failed")


class MissingMethod:
    name = "incomplete"
    capabilities = Capabilities()

    def open(self, model_dir):
        pass

    def close(self):
        pass


class BadTypes(Good):
    def __init__(self):
        super().__init__()
        self.name = ""
        self.capabilities = {"full_forward": True}
        self.run = None


NOT_A_BACKEND = 42
'''


@pytest.fixture(scope="module")
def fake_modules(tmp_path_factory):
    root = tmp_path_factory.mktemp("fakebackends")
    (root / f"{FAKE_MODULE}.py").write_text(textwrap.dedent(FAKE_SOURCE))
    (root / "conformance_fake_broken.py").write_text("raise RuntimeError('import-time failure')\n")
    (root / "conformance_fake_needs_dep.py").write_text("import conformance_fake_dependency_xyz\n")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in (FAKE_MODULE, "conformance_fake_broken", "conformance_fake_needs_dep"):
        sys.modules.pop(name, None)


def test_available_backends_lists_refimpl():
    found = registry.available_backends()
    assert found["refimpl"] == "conformance.backends.refimpl_backend:RefimplBackend"


def test_load_registered_name_with_options():
    b = registry.load_backend("refimpl")
    assert isinstance(b, RefimplBackend) and b.dtype == "float64"
    f32 = registry.load_backend("refimpl", dtype="float32")
    assert f32.dtype == "float32" and f32.capabilities.default_profile == "fp32"


def test_load_module_attr_class_factory_instance(fake_modules):
    mod = __import__(FAKE_MODULE)
    cls = registry.load_backend(f"{FAKE_MODULE}:Good", scale=2.0)
    assert type(cls).__name__ == "Good" and cls.scale == 2.0
    fac = registry.load_backend(f"{FAKE_MODULE}:make_good", scale=3.0)
    assert type(fac).__name__ == "Good" and fac.scale == 3.0
    assert registry.load_backend(f"{FAKE_MODULE}:GOOD") is mod.GOOD
    f32 = registry.load_backend("conformance.backends.refimpl_backend:RefimplFloat32Backend")
    assert f32.name == "refimpl-float32"


def test_unknown_name():
    known = ", ".join(sorted(registry.available_backends()))
    with pytest.raises(BackendError) as e:
        registry.load_backend("llamacpp")
    assert str(e.value) == (
        f"unknown backend 'llamacpp'; registered backends: {known}. Give a registered name or a Python "
        "object as module:attr (e.g. mypackage.backend:MyBackend)")


def test_unknown_name_when_none_registered(monkeypatch):
    monkeypatch.setattr(registry, "_entry_points", lambda: {})
    with pytest.raises(BackendError) as e:
        registry.load_backend("refimpl")
    assert "registered backends: (none)." in str(e.value)
    assert registry.available_backends() == {}


@pytest.mark.parametrize("spec", ["mod:", ":Attr", "a:b:c"])
def test_malformed_spec(spec):
    with pytest.raises(BackendError) as e:
        registry.load_backend(spec)
    assert str(e.value) == f"backend spec {spec!r} is not of the form module:attr (e.g. mypackage.backend:MyBackend)"


def test_empty_spec():
    with pytest.raises(BackendError) as e:
        registry.load_backend("  ")
    assert str(e.value) == "backend spec must be a registered name or module:attr, got '  '"


def test_module_not_found():
    with pytest.raises(BackendError) as e:
        registry.load_backend("no_such_engine_pkg.backend:Engine")
    assert str(e.value) == ("backend 'no_such_engine_pkg.backend:Engine': no module named 'no_such_engine_pkg'; "
                            "check the module path, or install the package that provides 'no_such_engine_pkg'")


def test_missing_dependency(fake_modules):
    with pytest.raises(BackendError) as e:
        registry.load_backend("conformance_fake_needs_dep:X")
    assert str(e.value) == (
        "backend 'conformance_fake_needs_dep:X': module 'conformance_fake_needs_dep' needs "
        "'conformance_fake_dependency_xyz', which is not installed; install the package that provides "
        "'conformance_fake_dependency_xyz'")


def test_missing_dependency_of_an_extra(fake_modules, monkeypatch):
    monkeypatch.setitem(registry.EXTRA_FOR_MODULE, "conformance_fake_dependency_xyz", "hf")
    sys.modules.pop("conformance_fake_needs_dep", None)
    with pytest.raises(BackendError) as e:
        registry.load_backend("conformance_fake_needs_dep:X")
    assert str(e.value) == (
        "backend 'conformance_fake_needs_dep:X': module 'conformance_fake_needs_dep' needs "
        "'conformance_fake_dependency_xyz', which is not installed; install the 'hf' extra: "
        "pip install 'gemma4-conformance[hf]'")


def test_registered_entry_point_with_extras(fake_modules, monkeypatch):
    eps = {
        "gpu": EntryPoint("gpu", "conformance_fake_needs_dep:X [gpu]", registry.GROUP),
        "fake": EntryPoint("fake", f"{FAKE_MODULE}:make_good", registry.GROUP),
    }
    monkeypatch.setattr(registry, "_entry_points", lambda: eps)
    sys.modules.pop("conformance_fake_needs_dep", None)
    with pytest.raises(BackendError) as e:
        registry.load_backend("gpu")
    assert str(e.value) == (
        "backend 'gpu': module 'conformance_fake_needs_dep' needs 'conformance_fake_dependency_xyz', which is "
        "not installed; install the backend's extras: pip install 'gemma4-conformance[gpu]'")
    assert registry.load_backend("fake", scale=4.0).scale == 4.0
    assert registry.available_backends() == {"fake": f"{FAKE_MODULE}:make_good",
                                              "gpu": "conformance_fake_needs_dep:X [gpu]"}


def test_import_time_failure(fake_modules):
    with pytest.raises(BackendError) as e:
        registry.load_backend("conformance_fake_broken:X")
    assert str(e.value) == ("backend 'conformance_fake_broken:X': importing module 'conformance_fake_broken' "
                            "failed: RuntimeError: import-time failure")


def test_attr_missing(fake_modules):
    with pytest.raises(BackendError) as e:
        registry.load_backend(f"{FAKE_MODULE}:Nope")
    assert str(e.value) == f"backend '{FAKE_MODULE}:Nope': module '{FAKE_MODULE}' has no attribute 'Nope'"


def test_raising_backend(fake_modules, tmp_path):
    with pytest.raises(BackendError) as e:
        registry.load_backend(f"{FAKE_MODULE}:Raising")
    assert str(e.value) == f"backend '{FAKE_MODULE}:Raising': the class raised RuntimeError: no GPU found"
    b = registry.load_backend(f"{FAKE_MODULE}:RaisingOnOpen")
    with pytest.raises(BackendError) as e:
        registry.open_backend(b, tmp_path)
    assert str(e.value) == f"backend 'good' could not open {tmp_path}: OSError: cannot map weights"


def test_factory_bad_options(fake_modules):
    with pytest.raises(BackendError) as e:
        registry.load_backend(f"{FAKE_MODULE}:make_good", colour="red")
    assert str(e.value).startswith(f"backend '{FAKE_MODULE}:make_good': the factory raised TypeError: ")


def test_instance_takes_no_options(fake_modules):
    with pytest.raises(BackendError) as e:
        registry.load_backend(f"{FAKE_MODULE}:GOOD", dtype="float32")
    assert str(e.value) == (f"backend '{FAKE_MODULE}:GOOD' is an instance, not a class or factory; it takes "
                            "no options (got dtype)")


def test_missing_method_backend(fake_modules):
    with pytest.raises(BackendError) as e:
        registry.load_backend(f"{FAKE_MODULE}:MissingMethod")
    assert str(e.value) == (f"backend '{FAKE_MODULE}:MissingMethod' does not satisfy the backend protocol "
                            "(conformance.protocol.Backend): missing run")


def test_not_a_backend(fake_modules):
    with pytest.raises(BackendError) as e:
        registry.load_backend(f"{FAKE_MODULE}:NOT_A_BACKEND")
    assert str(e.value) == (f"backend '{FAKE_MODULE}:NOT_A_BACKEND' does not satisfy the backend protocol "
                            "(conformance.protocol.Backend): missing name, capabilities, open, run, close")


def test_wrong_member_types(fake_modules):
    with pytest.raises(BackendError) as e:
        registry.load_backend(f"{FAKE_MODULE}:BadTypes")
    assert str(e.value) == (
        f"backend '{FAKE_MODULE}:BadTypes' does not satisfy the backend protocol (conformance.protocol.Backend): "
        "name must be a non-empty str, got ''; capabilities must be a conformance.protocol.Capabilities, got dict; "
        "run is not callable")


def test_check_backend_without_spec():
    class Nameless:
        pass

    with pytest.raises(BackendError) as e:
        registry.check_backend(Nameless())
    assert str(e.value) == ("backend object Nameless does not satisfy the backend protocol "
                            "(conformance.protocol.Backend): missing name, capabilities, open, run, close")


def test_open_backend_passes_backend_errors_through(tmp_path):
    b = registry.load_backend("refimpl")
    with pytest.raises(BackendError) as e:
        registry.open_backend(b, tmp_path)
    assert str(e.value).startswith(f"refimpl backend cannot open {tmp_path}: ")


# ----------------------------------------------------------------------------------------------
# the example backend of docs/backend-protocol.md runs as written


def _doc_example() -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[4] / "docs" / "backend-protocol.md").read_text()
    start = text.index("```python\n# my_engine_conformance.py")
    return text[start + len("```python\n"):text.index("```", start + 3)]


def test_docs_example_backend(tmp_path, monkeypatch, preset_dirs, bases):
    (tmp_path / "my_engine_conformance.py").write_text(_doc_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    b = registry.load_backend("my_engine_conformance:MyEngineBackend")
    claimed = {k for k, v in b.capabilities.to_dict().items() if v is True}
    assert claimed == {"full_forward", "last_plain", "decode"}
    registry.open_backend(b, preset_dirs["all-features"])
    ids, ref = bases["all-features"][0]
    full = Request("full", tokens=tup(ids[:11]), decode=tup(ids[11:14]))
    last = Request("last", tokens=tup(ids[:9]), last_pos=8, decode=tup(ids[9:12]))
    interior = Request("last", tokens=tup(ids[:9]), last_pos=4)
    assert set(required_capabilities(full)) <= claimed and set(required_capabilities(last)) <= claimed
    assert "interior_rows" not in claimed and "interior_rows" in required_capabilities(interior)
    r = b.run(full)
    assert max_abs(r.logits, ref[:11]) < 1e-3 and max_abs(r.decode_logits, ref[11:14]) < 1e-3
    r = b.run(last)
    assert max_abs(r.logits, ref[8:9]) < 1e-3 and max_abs(r.decode_logits, ref[9:12]) < 1e-3
    b.close()
    sys.modules.pop("my_engine_conformance", None)


# ----------------------------------------------------------------------------------------------
# the pytest plugin (run in a subprocess from an empty directory, as a user would)


def _pytest(tmp_path, *args, env_path: str | None = None):
    import os
    import subprocess

    env = dict(os.environ)
    if env_path is not None:
        env["PYTHONPATH"] = env_path + os.pathsep + env.get("PYTHONPATH", "")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this project's configuration
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", "pytest.ini",
                           "--rootdir", str(tmp_path), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def _bundled(name: str) -> str:
    from conformance.sets import bundled_sets

    paths = {p.name: p for p in map(__import__("pathlib").Path, bundled_sets())}
    if name not in paths:
        pytest.skip(f"bundled set {name} not installed")
    return str(paths[name])


def test_plugin_is_inert_without_the_option(tmp_path):
    rc, out = _pytest(tmp_path, "--co", "-q")
    assert rc == 5 and "conformance" not in out  # 5: no tests collected


def test_plugin_runs_cases_on_refimpl(tmp_path):
    rc, out = _pytest(tmp_path, "--conformance-backend", "refimpl", "--conformance-fixtures", _bundled("e2b-mini"),
                      "-q", "-k", "last/embeddings or ub5 or multi")
    assert rc == 0, out
    assert "conformance (refimpl, exact-f64): " in out and " pass" in out and "failed" not in out


def test_plugin_reports_fail_xfail_xpass_skip_and_not_claimed(tmp_path):
    s = _bundled("e2b-mini")
    (tmp_path / "exp.json").write_text(
        '{"entries": [{"match": "^e2b-mini/full/A/", "action": "known-failure", "reason": "float32"},'
        ' {"match": "^e2b-mini/full/B/", "action": "skip", "reason": "not today"}]}')
    rc, out = _pytest(tmp_path, "--conformance-backend", "refimpl", "--conformance-backend-option", "dtype=float32",
                      "--conformance-profile", "exact-f64", "--conformance-expectations", "exp.json",
                      "--conformance-fixtures", s, "-q", "-rsx", "-k", "full or last/plain/A/T9/pos8")
    assert rc == 1, out
    assert "XFAIL" in out and "known failure (expectations entry 0: float32); fail: row 0: max_abs" in out
    assert "skipped: skipped by expectations entry 1: not today" in out
    assert "e2b-mini/last/plain/A/T9/pos8: fail [max_abs]: row 8: max_abs" in out
    assert 'executed: {"decode_steps": 3, "dtype": "float32"' in out
    # a known failure that passes fails the run
    (tmp_path / "stale.json").write_text(
        '{"entries": [{"match": "^e2b-mini/full/A/", "action": "known-failure", "reason": "old"}]}')
    rc, out = _pytest(tmp_path, "--conformance-backend", "refimpl", "--conformance-expectations", "stale.json",
                      "--conformance-fixtures", s, "-q", "-k", "full/A/")
    assert rc == 1 and "xpass: passed, but expectations entry 0 declares a known failure (old)" in out, out
    # the docs' example backend: what it does not claim is skipped as not claimed
    (tmp_path / "my_engine_conformance.py").write_text(_doc_example())
    rc, out = _pytest(tmp_path, "--conformance-backend", "my_engine_conformance:MyEngineBackend",
                      "--conformance-fixtures", s, "-q", "-rs", "-k", "full or last/plain/A/T9 or multi",
                      env_path=str(tmp_path))
    assert rc == 0, out
    assert "not-claimed: needs interior_rows (not claimed by the backend)" in out
    assert "not-claimed: needs multi_sequence (not claimed by the backend)" in out


def test_plugin_usage_errors(tmp_path):
    rc, out = _pytest(tmp_path, "--conformance-backend", "nope")
    assert rc == 4 and "ERROR: --conformance-backend: unknown backend 'nope'; registered backends: " in out, out
    rc, out = _pytest(tmp_path, "--conformance-backend", "refimpl", "--conformance-profile", "zz")
    assert rc == 4 and "ERROR: --conformance-profile: unknown profile 'zz'; choose one of " in out, out
    rc, out = _pytest(tmp_path, "--conformance-backend", "refimpl", "--conformance-fixtures", str(tmp_path / "x"))
    assert rc == 4 and f"ERROR: --conformance-fixtures: no such directory: {tmp_path / 'x'}" in out, out
    rc, out = _pytest(tmp_path, "--conformance-backend", "refimpl", "--conformance-backend-option", "=1")
    assert rc == 4 and "--conformance-backend-option must be KEY=VALUE with KEY a Python identifier" in out, out
    (tmp_path / "bad.json").write_text("{")
    rc, out = _pytest(tmp_path, "--conformance-backend", "refimpl", "--conformance-expectations", "bad.json")
    assert rc == 4 and "ERROR: --conformance-expectations: " in out and "not valid JSON" in out, out
    # a broken fixture set is a collection error of that set
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text("{}")
    rc, out = _pytest(tmp_path, "--conformance-backend", "refimpl", "--conformance-fixtures", str(tmp_path / "broken"))
    # (its collector is the set's manifest: the node ids of its cases are "broken/manifest.json::<case id>")
    assert rc == 2 and "ERROR collecting broken/manifest.json" in out and "FixtureError" in out, out


def test_plugin_backend_that_raises(tmp_path):
    s = _bundled("e2b-mini")
    (tmp_path / f"{FAKE_MODULE}.py").write_text(textwrap.dedent(FAKE_SOURCE))
    rc, out = _pytest(tmp_path, "--conformance-backend", f"{FAKE_MODULE}:RaisingOnOpen", "--conformance-fixtures", s,
                      "-q", "-k", "full", env_path=str(tmp_path))
    assert rc == 1 and "2 failed" in out, out
    assert "e2b-mini/full/A/T9: backend error: backend 'good' could not open " in out
    assert "OSError: cannot map weights" in out
    rc, out = _pytest(tmp_path, "--conformance-backend", f"{FAKE_MODULE}:RaisingOnRun", "--conformance-fixtures", s,
                      "-q", "-k", "full/A", env_path=str(tmp_path))
    assert rc == 1 and "e2b-mini/full/A/T9: error: RuntimeError: kernel launch failed" in out, out
    assert 'raise RuntimeError("kernel launch failed")' in out  # the backend's traceback is shown
    rc, out = _pytest(tmp_path, "--conformance-backend", f"{FAKE_MODULE}:MissingMethod", env_path=str(tmp_path))
    assert rc == 4 and "does not satisfy the backend protocol (conformance.protocol.Backend): missing run" in out


def test_plugin_uses_the_expectations_a_backend_ships(tmp_path):
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[4])
    (tmp_path / "shipped.json").write_text(
        '{"entries": [{"match": "/full/", "action": "known-failure", "reason": "NaN in row 0"}]}')
    args = ["--conformance-backend", "tests.gate.cli.test_conformance_cli:ShippedExpectationsBackend",
            "--conformance-backend-option", f"expectations_file={tmp_path / 'shipped.json'}",
            "--conformance-profile", "exact-f64", "--conformance-fixtures", _bundled("e2b-mini"), "-q", "-rx",
            "-k", "full"]
    rc, out = _pytest(tmp_path, *args, env_path=root)
    assert rc == 0 and "2 xfailed" in out and "NaN in row 0" in out, out
    rc, out = _pytest(tmp_path, *args, "--conformance-no-shipped-expectations", env_path=root)
    assert rc == 1 and "2 failed" in out, out
