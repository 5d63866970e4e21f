"""Traces from the llama.cpp engine (capability ``traces``; conformance/backends/llama_cpp/trace.py).

The engine serves them in-process: the subprocess protocol carries no trace yet, so the ``llama-cpp`` backend
starts its child with ``traces=false``. llama-cpp-python loads one library per process for good, so each
configuration runs ``LlamaCppEngine`` in a fresh Python process of its own (``serve``), whatever this one loaded.

* On the bundled e2b-mini (per-layer inputs) and 26b-a4b-mini (MoE) sets, cases of every kind (full; last plain
  and seq_id at the last and an interior row; prefill with micro-batches of 5, none-then-last and three chunks;
  multi; each with decode but multi) and a multi request with decode whose outputs llama.cpp computes out of batch
  order (the long sequence first on a per-sequence KV cache: ``split_equal``), decoded interleaved and batched,
  traced through the engine and through the oracle (``RefimplBackend``): every point the oracle returns, the
  engine returns too, row for row, and each row's error (``conformance.check.traces.point_errors``) is within the
  ``nmse`` of the profile the configuration is graded at (``fp32``: f32 KV cache and the exact-GELU library;
  ``fp16-kv``: f16 KV cache). MoE routers choose the oracle's experts. Tracing leaves the logits bit for bit, and
  asking for hidden states too changes no point (``final_norm`` is then the hidden rows, bit for bit).
* A perturbed weight is seen where it is: ``compare_traces(...).first_divergence`` names layer 2's ``ffn_out``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("llama_cpp") is None:  # looked up, not imported: importing it loads a library
    pytest.skip("llama-cpp-python is not installed (scripts/build-llama-cpp.sh)", allow_module_level=True)

from helpers import same_run

from conformance.backends.llama_cpp import convert, library
from conformance.backends.refimpl_backend import RefimplBackend
from conformance.check.profiles import PROFILES
from conformance.check.requests import build_request
from conformance.check.session import Checkpoints, Session
from conformance.check.traces import compare_traces, point_errors
from conformance.protocol import BackendError, Request
from conformance.protocol.trace import point_names
from conformance.sets import bundled_set
from conformance.sets.integrity import load_set

try:
    library.resolve_source()
except BackendError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"llama.cpp converter sources missing: {exc}", allow_module_level=True)

HAVE_EXACT = (library.EXACT_GELU_LIB / "libllama.so").is_file()
REPO = Path(__file__).resolve().parents[4]
SETS = ("e2b-mini", "26b-a4b-mini")
CASES = ("full/A/T9", "last/plain/A/T9/pos8", "last/seq_id/B/T9/pos4", "prefill/A/T19/rows-middle/ub5",
         "prefill/C/T20/none-then-last-17+3/ub5", "prefill/B/T20/chunks-3+12+5", "multi/A-T3+B-T8+C-T13")
REORDERED = "multi/C-T13+A-T3/decode"  # the long sequence first: llama.cpp computes the second one's output first
# points the oracle returns and llama.cpp does not: none (each is a tensor of gemma4.cpp's graph; trace.py)
# (engine options, profile, the perturbation factor that profile's floor sees: half of layer 2's down_proj rows
# scaled by 1.01 gives layer 2's ffn_out an error of 2.5e-5 on e2b-mini, by 1.2 one of 8.5e-3)
CONFIGS = [
    pytest.param(({"kv_type": "f32", "lib": "exact-gelu"}, "fp32", 1.01), id="exact-gelu-f32kv",
                 marks=pytest.mark.skipif(not HAVE_EXACT, reason="no exact-GELU library "
                                          "(scripts/build-llama-cpp.sh --exact-gelu)")),
    pytest.param(({"kv_type": "f16"}, "fp16-kv", 1.2), id="stock-f16kv"),
]
# run in a fresh process by ``serve``: each job (engine options, checkpoint directory, requests) in turn
CHILD = """
import pickle, sys
from pathlib import Path
from conformance.backends.llama_cpp.engine import LlamaCppEngine
out = []
for options, model_dir, requests in pickle.loads(Path(sys.argv[1]).read_bytes()):
    engine = LlamaCppEngine(**options)
    engine.open(Path(model_dir))
    out.append([engine.run(r) for r in requests])
    engine.close()
Path(sys.argv[2]).write_bytes(pickle.dumps(out))
"""


def serve(jobs: list[tuple[dict, Path, list[Request]]], tmp: Path) -> list[list]:
    """The responses of each job's requests, through ``LlamaCppEngine`` in one fresh Python process."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "jobs.pkl").write_bytes(pickle.dumps([(o, str(d), r) for o, d, r in jobs]))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp / "jobs.pkl"), str(tmp / "out.pkl")],
                          capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return pickle.loads((tmp / "out.pkl").read_bytes())


def groups(response) -> list[tuple[np.ndarray, dict | None]]:
    """(logits, trace) of the response's row groups: its rows, then each sequence's decode rows."""
    out = [(response.logits, response.trace)]
    if isinstance(response.decode_trace, list) or isinstance(response.decode_logits, list):
        traces = response.decode_trace or [None] * len(response.decode_logits)
        out += list(zip(response.decode_logits, traces, strict=True))
    elif response.decode_logits is not None:
        out.append((response.decode_logits, response.decode_trace))
    return out


def first_divergence(got, ref, floor: float) -> dict | None:
    g, r = groups(got), groups(ref)
    labels = [f"group {k} row {i}" for k, (logits, _) in enumerate(r) for i in range(len(logits))]
    return compare_traces([t for _, t in g], [t for _, t in r], [lg for lg, _ in g], [lg for lg, _ in r],
                          labels, ["row"] * len(labels), floor).first_divergence


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """Per set: (checkpoint directory, {case: (traced request, oracle response)}), the cases CASES and REORDERED."""
    ck = Checkpoints(tmp_path_factory.mktemp("traces"))
    out = {}
    for name in SETS:
        fs = load_set(bundled_set(name))
        backend = RefimplBackend()
        ctx = Session(backend, ck).enter(fs)
        reqs = {c.id.split("/", 1)[1]: dataclasses.replace(build_request(c, ctx.bases, ctx.embed, ctx.media,
                                                                         ctx.drafter), trace=True)
                for c in fs.cases if c.id.split("/", 1)[1] in CASES}
        seqs = reqs["multi/A-T3+B-T8+C-T13"].sequences
        reqs[REORDERED] = Request(kind="multi", sequences=(seqs[2], seqs[0]), seq_ids=(0, 1),
                                  decode=((seqs[1][0], seqs[1][1]), (seqs[1][2],)), trace=True)
        assert len(reqs) == len(CASES) + 1
        out[name] = (Path(ctx.model_dir), {k: (r, backend.run(r)) for k, r in reqs.items()})
        backend.close()
    return out


@pytest.fixture(scope="module", params=CONFIGS)
def served(request, oracle, tmp_path_factory):
    """(options, profile, perturbation factor, {set: {case: engine response}}, {set: {case: untraced response}},
    {set: full/A/T9 asking for hidden states too}); REORDERED also as "<case>/batched" (multi_decode="batched")."""
    base, profile, factor = request.param
    tmp = tmp_path_factory.mktemp("llama")
    options = {**base, "cache_dir": str(tmp_path_factory.getbasetemp() / "gguf")}
    jobs, plain = [], ["full/A/T9", "prefill/B/T20/chunks-3+12+5", REORDERED]
    for name in SETS:
        model_dir, cases = oracle[name]
        reqs = [r for r, _ in cases.values()]
        jobs.append((options, model_dir, reqs + [dataclasses.replace(cases[k][0], trace=False) for k in plain]
                     + [dataclasses.replace(cases["full/A/T9"][0], hidden=True)]))
        jobs.append(({**options, "multi_decode": "batched"}, model_dir, [cases[REORDERED][0]]))
    got = serve(jobs, tmp)
    traced, untraced, hidden = {}, {}, {}
    for k, name in enumerate(SETS):
        responses, batched = got[2 * k], got[2 * k + 1]
        traced[name] = dict(zip(oracle[name][1], responses, strict=False)) | {REORDERED + "/batched": batched[0]}
        untraced[name] = dict(zip(plain, responses[len(oracle[name][1]):-1], strict=True))
        hidden[name] = responses[-1]
    return options, profile, factor, traced, untraced, hidden


def test_every_oracle_point_within_the_profile(served, oracle):
    options, profile, _, traced, untraced, hidden = served
    floor = PROFILES[profile].nmse
    worst: dict[str, float] = {}
    for name in SETS:
        model_dir, cases = oracle[name]
        cfg = convert.read_text_config(model_dir)
        for case, got in traced[name].items():
            ref = cases[case.removesuffix("/batched")][1]
            assert got.executed["trace"].startswith("cb_eval") and len(groups(got)) == len(groups(ref)), case
            for (logits, g), (_, r) in zip(groups(got), groups(ref), strict=True):
                assert set(g) == set(r), (f"{name}/{case}", sorted(set(g) ^ set(r)))
                for point, want in r.items():
                    assert g[point].shape == want.shape and g[point].shape[0] == logits.shape[0], (case, point)
                    errors = point_errors(point, g[point], want)
                    if point.endswith("router.experts"):
                        assert not errors.any(), f"{name}/{case}: {point} chose other experts"
                        continue
                    kind = point.rsplit(".", 1)[-1] if point.startswith("layers.") else point
                    worst[kind] = max(worst.get(kind, 0.0), float(errors.max()))
        # every point of the vocabulary this checkpoint has: per-layer inputs on e2b-mini, routers on 26b-a4b-mini
        want = {p for p in point_names(cfg["num_hidden_layers"])
                if not (p.endswith("ple_add") and not cfg.get("hidden_size_per_layer_input"))
                and not (p.endswith("router.experts") and not cfg.get("enable_moe_block"))}
        assert set(traced[name]["full/A/T9"].trace) == want, name
        for case, plain in untraced[name].items():  # the trace changes nothing, and is only there when asked
            assert plain.trace is None and plain.decode_trace is None and "trace" not in plain.executed
            for (a, _), (b, _) in zip(groups(plain), groups(traced[name][case]), strict=True):
                same_run(a, b)
        # with hidden states too (llama_set_embeddings_nextn): the same trace, and its final_norm is the hidden state
        both, alone = hidden[name], traced[name]["full/A/T9"]
        np.testing.assert_array_equal(both.hidden, both.trace["final_norm"])
        assert both.trace.keys() == alone.trace.keys()
        for point, value in alone.trace.items():
            same_run(both.trace[point], value, point)
    print(f"\n{profile} ({options}): worst point_errors per point kind: "
          + ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items())))
    assert set(worst) == {"embed", "attn_out", "ffn_out", "ple_add", "residual", "final_norm"}
    assert max(worst.values()) < floor, sorted(worst.items(), key=lambda kv: -kv[1])


def test_a_perturbed_layer_is_where_the_trace_diverges(served, oracle, tmp_path):
    """Layer 2's MLP with its down projection changed: all of it scaled by 1.01 is invisible (the RMSNorm after it,
    post_feedforward_layernorm, and on MoE layers post_feedforward_layernorm_1, is blind to its input's scale); half
    of its output rows scaled turns the MLP's output, and the trace diverges at layers.2.ffn_out."""
    from safetensors.numpy import load_file, save_file

    options, profile, factor = served[:3]
    floor = PROFILES[profile].nmse
    jobs = []
    for name in SETS:
        model_dir = oracle[name][0]
        weights = load_file(model_dir / "model.safetensors")
        down = weights["model.layers.2.mlp.down_proj.weight"]
        half = down.copy()
        half[: len(down) // 2] *= factor
        for label, value in (("all", down * 1.01), ("half", half)):
            copy = tmp_path / f"{name}-{label}"
            shutil.copytree(model_dir, copy)
            save_file({**weights, "model.layers.2.mlp.down_proj.weight": value}, copy / "model.safetensors")
            jobs.append((options, copy, [oracle[name][1][c][0] for c in ("full/A/T9", "last/plain/A/T9/pos8")]))
    got = iter(serve(jobs, tmp_path / "engine"))
    for name in SETS:
        refs = [oracle[name][1][c][1] for c in ("full/A/T9", "last/plain/A/T9/pos8")]
        for label, responses in (("all", next(got)), ("half", next(got))):
            for response, ref in zip(responses, refs, strict=True):
                first = first_divergence(response, ref, floor)
                if label == "all":
                    assert first is None, (name, label, first)
                else:
                    assert first is not None and first["point"] == "layers.2.ffn_out", (name, label, first)
