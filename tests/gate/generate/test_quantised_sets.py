"""Fixture sets made from an MLX quantised checkpoint (issue 48): the manifest records the quantisation, verify
checks the files' digests, check relocates the checkpoint with --model, the oracle passes its own set exactly and
mlx-lm, on the same quantised weights, passes it at fp32 (its own float32 rounding is all that is left)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.cli import main
from conformance.sets.manifest import quantisation_problems
from refimpl.synth import write_checkpoint

pytest.importorskip("mlx.core", reason="mlx is not installed (the 'mlx' extra)")
from mlx_convert import quantise, quantise_vlm


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, Path]:
    """(an MLX mixed_3_6 checkpoint of e2b-mini, the text set generated from it)."""
    root = tmp_path_factory.mktemp("qset")
    ckpt = quantise(write_checkpoint("e2b-mini", 0, root / "src"), root / "mixed", 3, 32, "mixed_3_6")
    assert main(["generate", "--model", str(ckpt), "--out", str(root / "set"), "--name", "e2b-mixed", "--cases",
                 "text", "-q"]) == 0
    return ckpt, root / "set"


def test_the_manifest_records_the_quantisation(mixed):
    """Every module config.json quantises, with its own entry's width and group (mixed_3_6 lists them all); the
    activations' convention none; the files by digest as for any external checkpoint."""
    ckpt, set_dir = mixed
    model = json.loads((set_dir / "manifest.json").read_text())["model"]
    block = json.loads((ckpt / "config.json").read_text())["quantization"]
    listed = {k: {"type": "affine", "bits": v["bits"], "group_size": v["group_size"]} for k, v in block.items()
              if isinstance(v, dict)}
    q = model["quantisation"]
    assert (q["format"], q["activations"]) == ("mlx-affine", "none")
    assert q["tensors"] == listed and {v["bits"] for v in listed.values()} == {3, 6}
    assert set(model["sha256"]) >= {"config.json", "model.safetensors"} and model["kind"] == "external"
    assert quantisation_problems(q, "s") == []
    assert quantisation_problems({**q, "format": "q4"}, "s") == ["s: model.quantisation.format must be one of "
                                                                 "mlx-affine, gguf, got 'q4'"]
    assert quantisation_problems("q4", "s") == ["s: model.quantisation must be an object, got str"]
    assert quantisation_problems({**q, "activations": "q8"}, "s") == [
        "s: model.quantisation.activations must be one of none, ggml-cpu/x86, ggml-cpu/ref, ggml-cpu/arm, "
        "ggml-cpu/x86/f16-kv, ggml-cpu/ref/f16-kv, ggml-cpu/arm/f16-kv, ggml-cpu/x86/gelu-table, "
        "ggml-cpu/ref/gelu-table, ggml-cpu/arm/gelu-table, ggml-cpu/x86/f16-kv/gelu-table, "
        "ggml-cpu/ref/f16-kv/gelu-table, ggml-cpu/arm/f16-kv/gelu-table, got 'q8'"]


def test_verify_check_and_relocation(mixed, tmp_path, capsys):
    ckpt, set_dir = mixed
    assert main(["verify", str(set_dir), "--recompute"]) == 0
    moved = shutil.copytree(ckpt, tmp_path / "elsewhere")
    assert main(["check", "--backend", "refimpl", "--fixtures", str(set_dir), "--model", str(moved), "-q",
                 "--profile", "exact-f64"]) == 0
    capsys.readouterr()
    data = moved / "model.safetensors"
    blob = bytearray(data.read_bytes())
    blob[-1] ^= 1
    data.write_bytes(bytes(blob))
    assert main(["check", "--backend", "refimpl", "--fixtures", str(set_dir), "--model", str(moved), "-q"]) == 3
    assert "model.safetensors in the checkpoint directory" in capsys.readouterr().err


def test_mlx_lm_on_its_own_quantised_weights_passes_at_fp32(mixed, tmp_path, capsys):
    """mlx-lm loads the same directory (its QuantizedLinear, no requantisation) and passes every case at fp32, a
    thousand times tighter in max_abs and KL than q4 and q8."""
    pytest.importorskip("mlx_lm")
    _, set_dir = mixed
    out = tmp_path / "r.json"
    assert main(["check", "--backend", "mlx-lm", "--fixtures", str(set_dir), "--profile", "fp32", "-q",
                 "--json", str(out)]) == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert {c["status"] for c in report["cases"]} == {"pass"} and len(report["cases"]) == 52


def test_mlx_lm_on_mxfp4_weights_embeds_in_bfloat16(tmp_path, monkeypatch, capsys):
    """A finding, shown both ways: mlx's QuantizedEmbedding calls mx.dequantize without a dtype, which for the
    floating-point modes (uint8 scales, no biases) returns bfloat16, so mlx-lm in float32 on mxfp4 weights looks
    its token embeddings up in bfloat16 and the model runs on from there; the set of its own weights fails at
    fp32. With the lookup dequantised to float32 (the one change) every case passes at fp32."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx.nn as nn

    ckpt = quantise(write_checkpoint("e2b-mini", 0, tmp_path / "src"), tmp_path / "mxfp4", 4, 32, mode="mxfp4")
    assert main(["generate", "--model", str(ckpt), "--out", str(tmp_path / "set"), "--name", "e2b-mxfp4",
                 "--cases", "text", "-q"]) == 0
    argv = ["check", "--backend", "mlx-lm", "--fixtures", str(tmp_path / "set"), "--profile", "fp32", "-q", "--json"]
    assert main([*argv, str(tmp_path / "as-is.json")]) == 1
    as_is = json.loads((tmp_path / "as-is.json").read_text())["cases"]
    assert max(c["summary"]["max_abs"] for c in as_is if c["summary"]) > 0.1

    def lookup(self, x):  # QuantizedEmbedding.__call__ with the dequantised rows in float32
        biases = self.get("biases")
        return mx.dequantize(self["weight"][x], scales=self["scales"][x], biases=None if biases is None else
                             biases[x], group_size=self.group_size, bits=self.bits, mode=self.mode, dtype=mx.float32)

    monkeypatch.setattr(nn.QuantizedEmbedding, "__call__", lookup)
    assert main([*argv, str(tmp_path / "f32.json")]) == 0, capsys.readouterr()
    fixed = json.loads((tmp_path / "f32.json").read_text())["cases"]
    assert max(c["summary"]["max_abs"] for c in fixed) < 1e-3


def test_mlx_vlm_on_its_own_quantised_weights_passes_at_fp32(tmp_path, capsys):
    """mlx-vlm loads an ``mlx_vlm.convert -q`` directory of an audio-text checkpoint as it is and passes its set's
    audio and text cases at fp32, its own audio tower computing the audio rows (from the clips, through the
    convolutions the oracle read back from MLX's layout) within float32 rounding of the set's rows."""
    pytest.importorskip("mlx_vlm")
    ckpt = quantise_vlm(write_checkpoint("e2b-audio-mini", 0, tmp_path / "src"), tmp_path / "q8", 8, 64)
    assert main(["generate", "--model", str(ckpt), "--out", str(tmp_path / "set"), "--name", "e2b-audio-q8",
                 "--cases", "audio", "-q"]) == 0
    out = tmp_path / "r.json"
    assert main(["check", "--backend", "mlx-vlm", "--fixtures", str(tmp_path / "set"), "--profile", "fp32", "-q",
                 "--json", str(out)]) == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert {c["status"] for c in report["cases"]} == {"pass"}
    audio = [c["executed"]["audio_rows_max_abs"] for c in report["cases"] if "audio_rows_max_abs" in c["executed"]]
    assert audio and max(audio) < 1e-4


def test_mlx_vlm_quantising_at_open(capsys):
    """Option quantize quantises an unquantised checkpoint at open as mlx_vlm.convert -q does (the unquantised
    oracle's set then fails at fp32: the weights really changed) and is refused, one line, when malformed."""
    pytest.importorskip("mlx_vlm")
    fixtures = str(Path(__file__).resolve().parents[3] / "fixtures" / "e2b-vision-mini")
    assert main(["check", "--backend", "mlx-vlm", "--fixtures", fixtures, "--backend-option", "quantize=8:64",
                 "--profile", "fp32", "-q"]) == 1
    capsys.readouterr()
    assert main(["check", "--backend", "mlx-vlm", "--fixtures", fixtures, "--backend-option",
                 "quantize=mixed_3_6:32", "-q"]) == 4  # the backend's own error, as for any bad option
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "mixed_3_6 with group size 64" not in err and "group size 64, the only one" \
        in err and err.endswith("got 'mixed_3_6:32'")
    from conformance.backends.mlx_vlm.backend import MlxVlmBackend
    assert [MlxVlmBackend(quantize=q).capabilities.default_profile for q in ("4:32", "8:64", "mixed_3_6:64")] == [
        "q4", "q8", "q4"]
    assert MlxVlmBackend(quantize="8:64").name == "mlx-vlm-float32-q8-g64"


class SafetensorsOnly(RefimplBackend):
    """The oracle, claiming to open safetensors checkpoints only; refuses to be opened."""

    def __init__(self):
        super().__init__()
        self.capabilities = dataclasses.replace(self.capabilities, weight_formats="safetensors")

    def open(self, model_dir):
        raise AssertionError("opened on a set of a format it does not claim")


def test_a_backend_that_does_not_open_the_format_claims_none_of_its_cases(mixed, tmp_path, capsys):
    """weight_formats: the set's cases need weight_formats=mlx-affine; a backend without it is never opened and
    reports every case not claimed (exit 5, no case run); the numpy engine, which reads the format through the
    oracle's loader, passes the set exactly."""
    _, set_dir = mixed
    out = tmp_path / "r.json"
    assert main(["check", "--backend", f"{__name__}:SafetensorsOnly", "--fixtures", str(set_dir), "-q",
                 "--json", str(out)]) == 5
    cases = json.loads(out.read_text())["cases"]
    assert {c["status"] for c in cases} == {"not-claimed"} and all(
        "weight_formats=mlx-affine" in c["message"] for c in cases)
    assert main(["check", "--backend", "numpy-engine", "--fixtures", str(set_dir), "-q", "--profile",
                 "exact-f64"]) == 0
    capsys.readouterr()


# ----------------------------------------------------------------------------------------------
# sets from a GGUF file


@pytest.fixture(scope="module")
def gguf_set(tmp_path_factory) -> tuple[Path, Path]:
    """(a Q8_0 GGUF of e2b-mini written with gguf-py under llama.cpp's names, the text set generated from it)."""
    gguf_writer = pytest.importorskip("gguf_writer")
    root = tmp_path_factory.mktemp("gguf-set")
    path = gguf_writer.write_gguf(write_checkpoint("e2b-mini", 0, root / "src"), root / "e2b-q8.gguf",
                                  gguf_writer.T.Q8_0)
    assert main(["generate", "--model", str(path), "--out", str(root / "set"), "--name", "e2b-q8-gguf", "--cases",
                 "text", "-q"]) == 0
    return path, root / "set"


def test_a_gguf_set_records_the_file_and_its_types(gguf_set, capsys):
    """The manifest records the one file by size and sha256 and each of its tensors' ggml type (the file's own
    names); verify --recompute passes; the oracle and the numpy engine pass the set exactly."""
    from refimpl.gguf_io import open_gguf

    path, set_dir = gguf_set
    model = json.loads((set_dir / "manifest.json").read_text())["model"]
    assert (model["kind"], model["path"], list(model["sha256"])) == ("external", str(path), [path.name])
    assert model["size"] == {path.name: path.stat().st_size}
    q = model["quantisation"]
    assert (q["format"], q["activations"]) == ("gguf", "none")
    stored = {t.name: t.type_name for t in open_gguf(path).tensors.values()}
    assert {k: v["type"] for k, v in q["tensors"].items()} == stored and "Q8_0" in stored.values()
    assert quantisation_problems({**q, "tensors": {"x": {"type": "Q9_9"}}}, "s") == [
        "s: model.quantisation.tensors must map the file's tensor names to their ggml types"]
    assert main(["verify", str(set_dir), "--recompute"]) == 0
    for backend in ("refimpl", "numpy-engine"):
        assert main(["check", "--backend", backend, "--fixtures", str(set_dir), "-q", "--profile", "exact-f64"]) == 0
    capsys.readouterr()


def test_a_gguf_set_takes_its_file_anywhere(gguf_set, tmp_path, capsys):
    """check --model: the file under another name, or a directory holding it under its recorded name; a file of
    other bytes is exit 3 naming it; an engine that does not open GGUF files (mlx-lm) claims none of the cases."""
    path, set_dir = gguf_set
    renamed = shutil.copy(path, tmp_path / "mine.gguf")
    (tmp_path / "dir").mkdir()
    shutil.copy(path, tmp_path / "dir" / path.name)
    for given in (renamed, tmp_path / "dir"):
        assert main(["check", "--backend", "refimpl", "--fixtures", str(set_dir), "--model", str(given), "-q"]) == 0
    with open(renamed, "ab") as f:
        f.write(b"x")
    capsys.readouterr()
    assert main(["check", "--backend", "refimpl", "--fixtures", str(set_dir), "--model", str(renamed), "-q"]) == 3
    assert f"{path.name} in the checkpoint directory {renamed} (--model) differs" in capsys.readouterr().err
    pytest.importorskip("mlx_lm")
    assert main(["check", "--backend", "mlx-lm", "--fixtures", str(set_dir), "-q"]) == 5


def test_a_broken_quantised_checkpoint_inside_a_set_is_a_fixture_error(tmp_path, capsys):
    """The bundled MLX set copied with a quantization block the oracle refuses (bits 7; the recorded digest of
    config.json updated, so that only the quantisation is wrong): check says so in one line, exit 3, before any
    backend opens it."""
    from conformance.sets import bundled_sets
    from conformance.sets.format import sha256_file

    src = next(p for p in bundled_sets() if p.name == "e2b-mini-mlx-q4")
    bad = shutil.copytree(src, tmp_path / "bad")
    cfg_path = bad / "checkpoint" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization"]["bits"] = cfg["quantization_config"]["bits"] = 7
    cfg_path.write_text(json.dumps(cfg))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["model"]["sha256"]["config.json"] = sha256_file(cfg_path)
    manifest["model"]["size"]["config.json"] = cfg_path.stat().st_size
    (bad / "manifest.json").write_text(json.dumps(manifest))
    assert main(["check", "--backend", f"{__name__}:SafetensorsOnly", "--fixtures", str(bad), "-q"]) == 3
    err = capsys.readouterr().err
    assert err == (f"conformance: error: fixture integrity: {bad}: the set's quantised checkpoint cannot be read by "
                   f"the oracle: {cfg_path}: quantization: bits 7 is not one of MLX's affine widths the oracle "
                   "decodes (2, 3, 4, 5, 6, 8)\n"), err
