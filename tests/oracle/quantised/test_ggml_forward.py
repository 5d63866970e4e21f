"""The oracle's forward under ggml's CPU activation convention (``Gemma4(gguf, activations="ggml-cpu/x86")``,
issue 49) against llama.cpp itself on the same GGUF file: with the exact-GELU library and an f32 KV cache (the
two other sources of difference removed), llama.cpp's logits on a Q8_0 file are the emulated forward's to float32
accumulation, where the forward with the activations as they are is off by the activation quantisation. The
convention's bad uses are one line each."""

from __future__ import annotations

from pathlib import Path

import llama_rows
import numpy as np
import pytest
import strict_device
from llama_rows import llama_source

from conformance.backends.llama_cpp import convert, library
from refimpl import Gemma4
from refimpl.errors import InputError
from refimpl.synth import write_checkpoint

SOURCE = llama_source()

HAVE_EXACT = (library.EXACT_GELU_LIB / "libllama.so").is_file()
IDS = tuple(int(i) for i in np.random.default_rng(0).integers(3, 500, 40))


def llama_logits(options: dict, model, tmp_path: Path, ids: tuple[int, ...] = IDS) -> np.ndarray:
    """llama.cpp's logits for every row of ``ids`` (IDS by default) on ``model`` (tests/llama_rows.py)."""
    return llama_rows.llama_logits(options, model, tmp_path, ids)


def median_row_error(model: Gemma4, theirs: np.ndarray) -> float:
    """The median over the rows of IDS of the largest |logit difference| between ``model``'s forward and
    ``theirs``, in units of the forward's largest |logit|."""
    ours = model.forward(list(IDS), rows="all")
    return float(np.median(np.max(np.abs(ours - theirs), axis=1))) / float(np.max(np.abs(ours)))


@pytest.fixture(scope="module")
def q8(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(e2b-mini, its Q8_0 GGUF by llama.cpp's own converter, the converter cache)."""
    root = tmp_path_factory.mktemp("ggml-forward")
    src = write_checkpoint("e2b-mini", 0, root / "e2b-mini")
    path, _ = convert.convert_to_gguf(src, SOURCE, "q8_0", root / "cache")
    return src, path, root / "cache"


@pytest.mark.skipif(not HAVE_EXACT, reason="no exact-GELU library (scripts/build-llama-cpp.sh --exact-gelu)")
def test_llama_cpp_on_q8_0_is_the_emulated_forward(q8, tmp_path):
    """40 tokens, every row: llama.cpp (a fresh process: one library per process) within 2e-6 of the largest
    logit of the ggml-cpu forward (measured 1.7e-7); the forward with unquantised activations more than 1e-2."""
    src, path, cache = q8
    options = {"kv_type": "f32", "lib": "exact-gelu", "outtype": "q8_0", "cache_dir": str(cache)}
    theirs = llama_logits(options, src, tmp_path)
    emulated = Gemma4(path, activations="ggml-cpu/x86").forward(list(IDS), rows="all")
    plain = Gemma4(path).forward(list(IDS), rows="all")
    scale = float(np.max(np.abs(emulated)))
    assert float(np.max(np.abs(emulated - theirs))) <= 2e-6 * scale
    assert float(np.max(np.abs(plain - theirs))) >= 1e-2 * scale


def test_the_convention_changes_only_what_it_names(q8):
    """Each product of the ggml-cpu forward is the exact weight times the emulated activations: a projection
    through the weights' ``linear`` equals the product computed here from the decoded weight and
    ``activation_values``; under "none" it is the plain product."""
    from refimpl.ggml_act import activation_values

    _, path, _ = q8
    x = np.random.default_rng(1).normal(0, 1, (3, 64))
    for conv in ("none", "ggml-cpu/x86", "ggml-cpu/ref"):
        w = Gemma4(path, activations=conv).weights
        name = "layers.0.mlp.gate_proj.weight"
        W = w[name]
        want = x @ W.T if conv == "none" else activation_values(x, "Q8_0", conv.split("/")[1]) @ W.T
        assert np.allclose(w.linear(x, name), want, rtol=1e-13, atol=1e-13)


def test_bad_uses_are_one_line(q8):
    src, path, _ = q8
    with pytest.raises(InputError, match=r"^unknown activation convention 'ggml-gpu' \(known: none, ggml-cpu/x86, "
                                         r"ggml-cpu/ref, ggml-cpu/arm, ggml-cpu/x86/f16-kv, ggml-cpu/ref/f16-kv, "
                                         r"ggml-cpu/arm/f16-kv, ggml-cpu/x86/gelu-table, ggml-cpu/ref/gelu-table, "
                                         r"ggml-cpu/arm/gelu-table, ggml-cpu/x86/f16-kv/gelu-table, "
                                         r"ggml-cpu/ref/f16-kv/gelu-table, ggml-cpu/arm/f16-kv/gelu-table\)$"):
        Gemma4(path, activations="ggml-gpu")
    with pytest.raises(InputError, match=r": activations ggml-cpu/x86: ggml's activation convention applies to GGUF "
                                         r"checkpoints only$"):
        Gemma4(src, activations="ggml-cpu/x86")


def test_what_is_not_emulated_yet_is_refused(tmp_path):
    """A Q4_1 per-layer model projection (multiplied outside the weights' product, where the Q8_1 min term is
    added; llama.cpp's quantiser leaves it F32): one line, naming it. A Q4_1 projection is accepted."""
    gguf_writer = pytest.importorskip("gguf_writer")
    src = write_checkpoint("e2b-mini", 0, tmp_path / "e2b")
    q41 = gguf_writer.write_gguf(src, tmp_path / "q41.gguf", gguf_writer.T.Q8_0,
                                 types={"per_layer_model_proj.weight": gguf_writer.T.Q4_1,
                                        "blk.0.ffn_up.weight": gguf_writer.T.Q4_1})
    with pytest.raises(InputError, match=r": activations ggml-cpu/x86: 'per_layer_model_proj.weight' .*is Q4_1, whose "
                                         r"products ggml computes with the Q8_1 min term, not emulated yet for this "
                                         r"tensor \(MoE experts, the per-layer model projection\)$"):
        Gemma4(q41, activations="ggml-cpu/x86")
    ok = gguf_writer.write_gguf(src, tmp_path / "ok.gguf", gguf_writer.T.Q8_0,
                                types={"blk.0.ffn_up.weight": gguf_writer.T.Q4_1})
    assert Gemma4(ok, activations="ggml-cpu/x86").forward([5, 6, 7], rows="last").shape == (1, 512)


@pytest.mark.parametrize(("ftype", "every_row"), [("Q4_1", False), ("Q5_1", True)])
def test_q4_1_and_q5_1_with_the_q8_1_min_term(tmp_path, monkeypatch, ftype, every_row):
    """e2b-mini quantised to Q4_1 / Q5_1 by llama.cpp's own quantiser (70 projections of that type), 12 tokens, the
    stock library with an f32 cache: ggml multiplies a block's minimum by Q8_1's fp16 s, and the forward under
    ``ggml-cpu/x86/gelu-table`` (which adds that term's difference from the exact one) is llama.cpp's within 2e-6
    of the largest logit, on every row for Q5_1 (measured 1.8e-7), on the median row for Q4_1 (1.4e-7; its
    worst row 3.5e-2, an activation code one unit off); without the min term's difference the median row is
    off by more than 1e-2 (measured 4.6e-2)."""
    import llama_quantize

    ids = IDS[:12]
    src = write_checkpoint("e2b-mini", 0, tmp_path / "e2b")
    f32, _ = convert.convert_to_gguf(src, SOURCE, "f32", tmp_path / "cache")
    path = llama_quantize.quantize(f32, tmp_path / f"e2b-{ftype}.gguf", ftype)
    theirs = llama_logits({"kv_type": "f32", "lib": "stock"}, path, tmp_path, ids)
    ours = Gemma4(path, activations="ggml-cpu/x86/gelu-table").forward(list(ids), rows="all")
    rows = np.max(np.abs(ours - theirs), axis=1) / float(np.max(np.abs(ours)))
    assert (np.max(rows) if every_row else np.median(rows)) <= 2e-6
    monkeypatch.setattr("refimpl.weights.min_term_error", lambda x, path: np.zeros((len(x), x.shape[-1] // 32)))
    without = Gemma4(path, activations="ggml-cpu/x86/gelu-table").forward(list(ids), rows="all")
    assert np.median(np.max(np.abs(without - theirs), axis=1)) >= 1e-2 * float(np.max(np.abs(ours)))



def test_a_set_made_under_the_convention(q8, tmp_path, capsys, monkeypatch):
    """generate --activations records the convention (model.quantisation.activations); verify --recompute
    rebuilds the rows under it; its cases need activation_conventions=ggml-cpu/x86: the oracle backend declaring
    none reports them not claimed, the one built under it passes them exactly, under the other path (a convention
    of its own) none is claimed either. The convention is refused for a checkpoint that is not a GGUF file."""
    import json

    from conformance.cli import main
    from conformance.sets.manifest import quantisation_problems

    src, path, _ = q8
    out = tmp_path / "set"
    assert main(["generate", "--model", str(path), "--out", str(out), "--name", "e2b-q8-x86", "--cases", "text",
                 "-q", "--activations", "ggml-cpu/x86"]) == 0
    q = json.loads((out / "manifest.json").read_text())["model"]["quantisation"]
    assert (q["format"], q["activations"]) == ("gguf", "ggml-cpu/x86")
    assert quantisation_problems({**q, "format": "mlx-affine", "tensors": {}}, "s") == [
        "s: model.quantisation.activations ggml-cpu/x86 applies to a gguf checkpoint only"]
    assert main(["verify", str(out), "--recompute"]) == 0
    report = tmp_path / "r.json"
    assert main(["check", "--backend", "refimpl", "--fixtures", str(out), "-q", "--json", str(report)]) == 5
    cases = json.loads(report.read_text())["cases"]
    assert {c["status"] for c in cases} == {"not-claimed"} and all(
        "activation_conventions=ggml-cpu/x86" in c["message"] for c in cases)
    assert main(["check", "--backend", "refimpl", "--backend-option", "activations=ggml-cpu/x86", "--fixtures",
                 str(out), "-q", "--profile", "exact-f64"]) == 0
    assert main(["check", "--backend", "refimpl", "--backend-option", "activations=ggml-cpu/ref", "--fixtures",
                 str(out), "-q"]) == 5
    # the convention emulates CPU kernels: under --device cuda (CuPy stood in for) its oracle stays on the host
    strict_device.install(monkeypatch)
    assert main(["check", "--backend", "refimpl", "--backend-option", "activations=ggml-cpu/x86", "--fixtures",
                 str(out), "-q", "--profile", "exact-f64", "--device", "cuda"]) == 0
    monkeypatch.setenv("REFIMPL_DEVICE", "cuda")
    assert Gemma4(path, activations="ggml-cpu/x86").device == "cpu" and Gemma4(path).device == "cuda"
    capsys.readouterr()
    assert main(["generate", "--model", str(src), "--out", str(tmp_path / "no"), "--activations", "ggml-cpu/x86",
                 "-q"]) == 2
    assert capsys.readouterr().err.strip() == ("conformance: error: activations ggml-cpu/x86 (ggml's CPU activation "
                                               "quantisation) applies to a GGUF file given as the model only")
    assert not (tmp_path / "no").exists()


@pytest.mark.skipif(not HAVE_EXACT, reason="no exact-GELU library (scripts/build-llama-cpp.sh --exact-gelu)")
def test_llama_cpp_on_its_own_gguf_passes_at_ggml_cpu(q8, tmp_path):
    """llama.cpp (exact GELU, f32 KV) handed the set's own Q8_0 file passes every text case it claims at the
    profile ggml-cpu against the oracle under the convention; the same file's set without the convention (the
    dequantised weights times unquantised activations) fails most of them at that profile."""
    import json

    from conformance.cli import main

    _, path, _ = q8
    argv = ["check", "--backend", "llama-cpp", "--backend-option", "lib=exact-gelu", "--backend-option",
            "kv_type=f32", "--profile", "ggml-cpu", "-q"]
    statuses = {}
    for conv in ("ggml-cpu/x86", "none"):
        out = tmp_path / conv.replace("/", "-")
        assert main(["generate", "--model", str(path), "--out", str(out), "--name", "e2b-q8", "--cases", "text",
                     "-q", "--activations", conv, "--store", "logits"]) == 0
        main([*argv, "--fixtures", str(out), "--json", str(tmp_path / f"{out.name}.json")])
        cases = json.loads((tmp_path / f"{out.name}.json").read_text())["cases"]
        statuses[conv] = [c["status"] for c in cases]
    assert statuses["ggml-cpu/x86"].count("pass") == 44 and set(statuses["ggml-cpu/x86"]) == {"pass", "not-claimed"}
    assert statuses["none"].count("fail") >= 22


@pytest.mark.skipif(not HAVE_EXACT, reason="no exact-GELU library (scripts/build-llama-cpp.sh --exact-gelu)")
def test_llama_cpp_with_an_f16_cache_is_the_f16_kv_convention(q8, tmp_path):
    """llama.cpp with its default fp16 K/V cache on the Q8_0 file, 40 tokens: the forward under
    ggml-cpu/x86/f16-kv (K and V stored in fp16, queries and probabilities rounded to fp16 for their products)
    is its forward to float32 accumulation on the median row (a row with a code or fp16 rounding one unit off
    aside), where the f32-cache convention is off on the median row by the cache's rounding; the backend
    with an f16 cache declares that convention and passes the set made under it at ggml-cpu."""
    import json

    from conformance.cli import main

    src, path, cache = q8
    options = {"kv_type": "f16", "lib": "exact-gelu", "outtype": "q8_0", "cache_dir": str(cache)}
    theirs = llama_logits(options, src, tmp_path)
    row_err = {conv: median_row_error(Gemma4(path, activations=conv), theirs)
               for conv in ("ggml-cpu/x86/f16-kv", "ggml-cpu/x86")}
    assert row_err["ggml-cpu/x86/f16-kv"] <= 2e-6 and row_err["ggml-cpu/x86"] >= 1e-2
    out = tmp_path / "set"
    assert main(["generate", "--model", str(path), "--out", str(out), "--name", "e2b-q8-f16kv", "--cases", "text",
                 "-q", "--activations", "ggml-cpu/x86/f16-kv", "--store", "logits"]) == 0
    main(["check", "--backend", "llama-cpp", "--backend-option", "lib=exact-gelu", "--fixtures", str(out),
          "--profile", "ggml-cpu", "-q", "--json", str(tmp_path / "r.json")])
    statuses = [c["status"] for c in json.loads((tmp_path / "r.json").read_text())["cases"]]
    assert statuses.count("pass") == 44 and set(statuses) == {"pass", "not-claimed"}


@pytest.mark.skipif(not HAVE_EXACT, reason="no exact-GELU library (scripts/build-llama-cpp.sh --exact-gelu)")
def test_the_moe_experts_follow_the_convention(tmp_path):
    """26b-a4b-mini (MoE) converted by llama.cpp and quantised to Q8_0 by its own quantiser, 40 tokens: ggml's
    mul_mat_id converts each routed expert's activations as mul_mat does, and the forward under the convention
    (the router's F32 products left as they are) is llama.cpp's to float32 accumulation on every row (measured
    4.8e-6; without the convention 5.0)."""
    import llama_quantize

    src = write_checkpoint("26b-a4b-mini", 0, tmp_path / "moe")
    f32, _ = convert.convert_to_gguf(src, SOURCE, "f32", tmp_path / "cache")
    path = llama_quantize.quantize(f32, tmp_path / "moe-q8_0.gguf", "Q8_0")
    options = {"kv_type": "f32", "lib": "exact-gelu"}
    theirs = llama_logits(options, path, tmp_path)
    emulated = Gemma4(path, activations="ggml-cpu/x86").forward(list(IDS), rows="all")
    plain = Gemma4(path).forward(list(IDS), rows="all")
    scale = float(np.max(np.abs(emulated)))
    assert float(np.max(np.abs(emulated - theirs))) <= 2e-6 * scale
    assert float(np.max(np.abs(plain - theirs))) >= 1e-2 * scale



def test_the_stock_library_is_the_gelu_table_convention(q8, tmp_path):
    """The stock library (GGML_GELU_FP16: the GELU of every MLP, expert and per-layer gate looked up in a
    table of fp16 values) on the Q8_0 file, f32 KV, 40 tokens: the forward under ggml-cpu/x86/gelu-table is
    its forward to float32 accumulation on the median row, the exact-GELU convention is not; the backend with
    the stock library declares that convention and passes the set made under it at ggml-cpu."""
    import json

    from conformance.cli import main

    src, path, cache = q8
    options = {"kv_type": "f32", "lib": "stock", "outtype": "q8_0", "cache_dir": str(cache)}
    theirs = llama_logits(options, src, tmp_path)
    row_err = {conv: median_row_error(Gemma4(path, activations=conv), theirs)
               for conv in ("ggml-cpu/x86/gelu-table", "ggml-cpu/x86")}
    assert row_err["ggml-cpu/x86/gelu-table"] <= 2e-6 and row_err["ggml-cpu/x86"] >= 1e-2
    out = tmp_path / "set"
    assert main(["generate", "--model", str(path), "--out", str(out), "--name", "e2b-q8-stock", "--cases", "text",
                 "-q", "--activations", "ggml-cpu/x86/gelu-table", "--store", "logits"]) == 0
    main(["check", "--backend", "llama-cpp", "--backend-option", "kv_type=f32", "--fixtures", str(out),
          "-q", "--json", str(tmp_path / "r.json")])  # no --profile: the set's convention chooses ggml-cpu
    report = json.loads((tmp_path / "r.json").read_text())
    statuses = [c["status"] for c in report["cases"]]
    assert statuses.count("pass") == 44 and set(statuses) == {"pass", "not-claimed"}
    assert report["profile"]["name"] == "fp16-kv" and report["fixture_sets"][0]["profile"] == "ggml-cpu"


def test_llama_cpp_passes_the_bundled_q4_k_m_set(tmp_path):
    """The bundled set e2b-256-mini-q4km (scripts/bundle-gguf-set.py: llama.cpp's own Q4_K_M file, made under
    ggml-cpu/x86/f16-kv/gelu-table): stock llama.cpp with its default f16 K/V cache, 40 tokens on the set's own
    file, is the oracle's forward under the set's convention to float32 accumulation on the median row (a row with
    a code or fp16 rounding one unit off aside; the forward with float64 activations is off by more than 1e-2 of
    the largest logit), and `conformance check` with no --profile passes every case it claims, graded at the
    set's profile ggml-cpu."""
    import json

    from conformance.cli import main
    from conformance.sets import bundled_set, load_set

    fs = load_set(bundled_set("e2b-256-mini-q4km"))
    path = Path(fs.model_record["path"])
    options = {"kv_type": "f16", "lib": "stock"}
    theirs = llama_logits(options, path, tmp_path)
    row_err = {conv: median_row_error(Gemma4(path, activations=conv), theirs) for conv in (fs.activations, "none")}
    assert row_err[fs.activations] <= 2e-6 and row_err["none"] >= 1e-2, row_err
    assert main(["check", "--backend", "llama-cpp", "--fixtures", str(fs.path), "-q",
                 "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    statuses = [c["status"] for c in report["cases"]]
    assert statuses.count("pass") == 44 and set(statuses) == {"pass", "not-claimed"}
    assert report["fixture_sets"][0]["profile"] == "ggml-cpu"
