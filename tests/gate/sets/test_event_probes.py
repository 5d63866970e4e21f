"""One-unit events under a ggml-cpu activation convention (issue 49): a set generated under such a convention
records, per base, its event probe (the logits' change when the inputs move by EVENT_ULPS float32 ulps, under
the convention), and the ggml-cpu profile is held at least to EVENT_FACTOR x that probe, its other thresholds in
proportion; the float64 and float32 scalings ignore it. Whether the
probe predicts llama.cpp itself is tests/oracle/quantised/test_event_probe_llama.py (llama.cpp built)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.check.policy import case_profile
from conformance.check.profiles import PROFILES, rounding_threshold, scaled
from conformance.check.session import Checkpoints
from conformance.generate.bases import event_probe, rounding_probe
from conformance.generate.progress import job_stages
from conformance.generate.run import generate_set
from conformance.sets import bounds, bundled_set, load_set
from conformance.sets.case import row_groups
from refimpl import Gemma4
from refimpl.config import parse_config
from refimpl.synth import published_config

GGUF = bundled_set("e2b-mini-q4-0") / "checkpoint" / "model.gguf"  # llama.cpp's own Q4_0 of e2b-mini
CONVENTION = "ggml-cpu/x86/gelu-table"


def test_an_event_probe_raises_the_ggml_cpu_thresholds_in_proportion():
    """E2B's shapes cut to 4 layers, 1,032 tokens, logits of 30: without a probe ggml-cpu keeps its floor (its
    float32 rounding bound is below it); an event probe of 3.3 raises max_abs to 2 x 3.3 and the squared
    thresholds by the square of the ratio; a probe under half the floor changes nothing; exact-f64 and fp32
    take no event probe."""
    cfg = parse_config(published_config("e2b", 7, 4))
    ggml = PROFILES["ggml-cpu"]
    assert ggml.scaling == "events"
    assert rounding_threshold(ggml, cfg, 1032, 30.0) < ggml.max_abs
    assert scaled(ggml, cfg, 1032, 30.0) is ggml
    assert scaled(ggml, cfg, 1032, 30.0, events=0.4 * ggml.max_abs / bounds.EVENT_FACTOR) is ggml
    raised = scaled(ggml, cfg, 1032, 30.0, events=3.3)
    r = bounds.EVENT_FACTOR * 3.3 / ggml.max_abs
    assert raised.max_abs == pytest.approx(bounds.EVENT_FACTOR * 3.3)
    assert raised.kl_mean == pytest.approx(ggml.kl_mean * r * r) and raised.nmse == pytest.approx(ggml.nmse * r * r)
    assert raised.identity_ratio == ggml.identity_ratio and "event probe 3.3" in raised.sources[-1]
    for name in ("exact-f64", "fp32"):
        p = PROFILES[name]
        assert rounding_threshold(p, cfg, 1032, 30.0, events=1e3) == rounding_threshold(p, cfg, 1032, 30.0)
    assert bounds.recorded_probes({"provenance": {"cross_checks": [{"event_probes": {"A": 0.5, "B": -1}},
                                                                   {"rounding_probes": {"A": 9.0}}]}},
                                  "event_probes") == {"A": 0.5}
    assert bounds.has_events("ggml-cpu/arm/f16-kv") and not bounds.has_events("none")


def test_the_event_probe_is_a_float32_move_and_the_rounding_probe_a_float64_one():
    """Without a convention (no quantiser to absorb a move) the forward answers linearly: the event probe is the
    rounding probe times about EVENT_ULPS x 2^29 = EVENT_ULPS u32 / u64 (within the float64 noise of the
    smaller one). Under the
    convention on e2b-mini's Q4_0 the quantisers absorb a float64 move (every path to the logits goes through an
    8-bit code or an fp16 rounding) and, at its 64-wide rows, a float32 move too on most prompts: events are
    rare there (the e2b-mini set test below), frequent at the published widths."""
    ids = [int(i) for i in np.random.default_rng(3).integers(3, 500, 24)]
    plain = Gemma4(GGUF)
    full = plain.forward(ids, rows="all")
    small, large = rounding_probe(plain, ids, full), event_probe(plain, ids, full)
    ratio = bounds.EVENT_ULPS * 2.0 ** 29
    assert ratio / 30 < large / small < ratio * 30
    model = Gemma4(GGUF, activations=CONVENTION)
    full = model.forward(ids, rows="all")
    assert rounding_probe(model, ids, full) <= 1e-6 * max(event_probe(model, ids, full), 1e-9)


@pytest.fixture(scope="module")
def ggml_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("events") / "set"
    return generate_set(out, model_dir=str(GGUF), cases="text", workers=1, activations=CONVENTION)


def test_a_set_made_under_a_ggml_cpu_convention_records_an_event_probe_per_base(ggml_set, tmp_path):
    """Every base's event probe is in the oracle's consistency entry and the job stages name it; each case is
    graded at the larger of ggml-cpu's floor and EVENT_FACTOR x the largest probe of the bases it reads (on
    e2b-mini's Q4_0 the probes reach about 2: a code one unit off moves a logit of these ill-conditioned
    miniatures that far, as llama.cpp's worst rows do); a probe written larger raises the bars of the cases that
    read that base, and only theirs."""
    manifest = json.loads((ggml_set / "manifest.json").read_text())
    [entry] = [e for e in manifest["provenance"]["cross_checks"] if "event_probes" in e]
    probes = entry["event_probes"]
    assert sorted(probes) == list("ABCG") and all(0 <= v < 5.0 for v in probes.values())
    assert f"by {bounds.EVENT_ULPS} float32 ulps" in entry["detail"]
    assert job_stages({"kind": "text", "activations": CONVENTION})[-1] == "event probe"
    assert "event probe" not in job_stages({"kind": "text", "activations": "none"})
    fs = load_set(ggml_set)
    ctx = Checkpoints(tmp_path / "work").context(fs, "events")
    ggml = PROFILES["ggml-cpu"]

    def expected(case, probes):
        read = {r.base for _, rows in row_groups(case) for r in rows}
        return max(ggml.max_abs, bounds.EVENT_FACTOR * max(probes[b] for b in read))

    for c in fs.cases:
        assert case_profile(ggml, ctx, c).max_abs == pytest.approx(expected(c, probes)), c.id
    entry["event_probes"]["A"] = 3.0
    fs.manifest["provenance"]["cross_checks"] = manifest["provenance"]["cross_checks"]
    for c in fs.cases:
        assert case_profile(ggml, ctx, c).max_abs == pytest.approx(expected(c, {**probes, "A": 3.0})), c.id


def test_a_set_without_a_ggml_cpu_convention_records_none(tmp_path):
    """The oracle's own sets (convention none) run no event probe."""
    out = generate_set(tmp_path / "plain", preset="e2b-mini", cases="text", workers=1)
    checks = json.loads((out / "manifest.json").read_text())["provenance"]["cross_checks"]
    assert not any("event_probes" in e for e in checks)
