"""The rounding bounds of conformance.sets.bounds (docs/profiles.md, "Rounding bounds"): they hold for the
oracle's own chunked-vs-full differences on the miniatures with a wide margin, three real inconsistencies
(a one-position shift, one wrong KV cache entry, a dropped final softcap) exceed them by orders of
magnitude, they grow with depth and length as derived, and the rounding-scaled profiles (exact-f64, fp32)
take their thresholds from them at real size while every miniature keeps the calibrated ones.

No test compares floats of two different calls or blockings for equality: every comparison is against
a bound or a ratio of bounds.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
from helpers import e2b_config

from conformance.check.policy import case_profile
from conformance.check.profiles import PROFILES, rounding_threshold, scaled, with_overrides
from conformance.check.session import Checkpoints
from conformance.generate.bases import consistency_plan, rounding_probe, text_consistency
from conformance.generate.matrix import random_base_length
from conformance.generate.recompute import RECOMPUTE_BOUND, recompute_bound
from conformance.generate.run import CONSISTENCY_BOUND
from conformance.sets import bounds, bundled_set, load_set
from conformance.sets.bounds import (
    FLOAT32_UNIT,
    REFERENCE_LENGTH,
    SAFETY,
    UNIT_ROUNDOFF,
    consistency_bound,
    decoder_units,
    first_order,
    layer_units,
    length_factor,
    logit_bound,
    logit_scale,
    tensor_bound,
)
from refimpl.config import parse_config
from refimpl.model import KVCache
from refimpl.synth import published_config

TEXT_PRESETS = ["e2b-mini", "e4b-mini", "31b-mini", "26b-a4b-mini", "all-features"]

# measured with benchmarks/bounds.py on the published E2B shapes (refimpl synth --preset e2b; docs/profiles.md)
E2B_WORST_ROUNDING = 1.72e-9  # chunked vs full forward, 1,032 tokens, 35 layers (the worst base of a set)
E2B_WEAKEST_BUG = 3.5e-7  # one wrong cache entry in layer 0, the last three decode rows
E2B_FLOAT32_WORST = 1.48  # the oracle in float32 against float64, 1,032 tokens (the worst of three bases)


def base_ids(model, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng([seed, 0])
    return [2] + [int(t) for t in rng.integers(5, model.cfg.vocab_size, n - 1)]


def run(model, ids, pieces, cache, at):
    rows = []
    for size in pieces:
        rows.append(model.forward(ids[at:at + size], rows="all", cache=cache))
        at += size
    return np.concatenate(rows), at


def bug_differences(model, ids, full) -> dict[str, float]:
    """Max |logits - full forward| over the affected rows of each real inconsistency, all made on the last
    three decode steps of the consistency check's plan (before them the cache is right)."""
    plan = consistency_plan(len(ids), model.cfg.sliding_window)
    head, tail = plan[:-3], plan[-3:]
    assert tail == [1, 1, 1]
    cache = KVCache()
    _, at = run(model, ids, head, cache, 0)
    ref = full[at:]
    out = {}
    shifted = copy.deepcopy(cache)
    shifted.length += 1  # every later token one position late (RoPE, masks)
    out["position shift"] = float(np.max(np.abs(run(model, ids, tail, shifted, at)[0] - ref)))
    cfg = model.cfg
    owners = [layer.index for layer in cfg.layers if layer.owns_kv]
    for name, i in (("cache entry, first sliding layer", next(i for i in owners if cfg.layers[i].is_sliding)),
                    ("cache entry, last full layer", max(i for i in owners if not cfg.layers[i].is_sliding))):
        wrong = copy.deepcopy(cache)
        kv = wrong.layers[i]
        j = max(1, len(kv.pos) // 2)
        kv.k[j], kv.v[j] = kv.k[j - 1], kv.v[j - 1]  # one slot holds its predecessor's key and value
        out[name] = float(np.max(np.abs(run(model, ids, tail, wrong, at)[0] - ref)))
    nocap = copy.copy(model)
    nocap.cfg = dataclasses.replace(cfg, final_logit_softcapping=None)
    out["dropped softcap"] = float(np.max(np.abs(nocap.forward(ids, rows="all") - full)))
    return out


@pytest.mark.parametrize("preset", TEXT_PRESETS)
def test_the_bound_holds_for_the_oracle_with_a_wide_margin(preset_models, preset):
    """Chunked prefill and single-token decode through the KV cache against the full forward, as
    ``conformance generate`` checks it, on a base of the set's random length: at least 100x under the bound
    (measured 4e-4..2.3e-3 of it; the bundled sets' worst base, of e2b-vision-mini, 2.5e-12 against 2.9e-10)."""
    model = preset_models[preset]
    n = random_base_length(model.cfg)
    for seed in (0, 1):
        ids = base_ids(model, n, seed)
        full = model.forward(ids, rows="all")
        seen = text_consistency(model, ids, full)
        bound = consistency_bound(model.cfg, n, full)
        assert bound < CONSISTENCY_BOUND  # every miniature keeps the floor it was calibrated with
        assert seen <= bound / 100, (preset, seed, seen, bound)
        # the checkpoint's measured amplification of a one-ulp input perturbation is of the same order
        # (measured 0.47x..1.9x of the difference), so 10 x it bounds the difference too
        probe = rounding_probe(model, ids, full)
        assert 0 < probe and seen <= bounds.PROBE_FACTOR * probe / 2, (preset, seed, seen, probe)


@pytest.mark.parametrize("preset", ["e2b-mini", "31b-mini", "all-features"])
def test_real_inconsistencies_exceed_the_bound_by_orders_of_magnitude(preset_models, preset):
    """A one-position shift, one wrong KV cache entry (in the first sliding and in the last KV-owning full
    layer) and a dropped final softcap move the logits by at least 1e6 x the bound on the miniatures
    (measured 0.18..56 against bounds of 1.4e-10..3.1e-10)."""
    model = preset_models[preset]
    n = random_base_length(model.cfg)
    ids = base_ids(model, n)
    full = model.forward(ids, rows="all")
    bound = consistency_bound(model.cfg, n, full)
    found = bug_differences(model, ids, full)
    assert set(found) == {"position shift", "cache entry, first sliding layer", "cache entry, last full layer",
                          "dropped softcap"}
    for name, diff in found.items():
        assert diff >= 1e6 * bound, (preset, name, diff, bound)


def test_the_bound_grows_with_depth_width_and_length_as_derived():
    cuts = [e2b_config(k) for k in (5, 10, 20, 35)]
    units = [decoder_units(c, 128) for c in cuts]
    assert units == sorted(units) and len(set(units)) == 4
    full = cuts[-1]
    # linear in depth: every layer adds its own path (the KV-shared layers' double-wide MLP adds more)
    per_layer = layer_units(full, 128)
    assert decoder_units(full, 128) == sum(per_layer) + (full.hidden_size + full.hidden_size_per_layer_input + 4) \
        + 2 * full.hidden_size + 4
    shared = [u for layer, u in zip(full.layers, per_layer, strict=True) if not layer.owns_kv and layer.is_sliding]
    owning = [u for layer, u in zip(full.layers, per_layer, strict=True) if layer.owns_kv and layer.is_sliding]
    assert min(shared) - max(owning) == full.intermediate_size  # 2 x 6144 wide: the down projection's length
    # length: below the window every layer sees one more key (softmax sum and weighted sum: 2 u each);
    # beyond it only the full layers do
    W, L = full.sliding_window, full.num_hidden_layers
    n_full = sum(not layer.is_sliding for layer in full.layers)
    assert decoder_units(full, 101) - decoder_units(full, 100) == 2 * L
    assert decoder_units(full, W + 10) - decoder_units(full, W + 9) == 2 * n_full
    # width: the same depth and length at E4B's width costs more
    assert decoder_units(parse_config(published_config("e4b", 7, 35)), 128) > decoder_units(full, 128)
    # the logit scale and the unit roundoff enter linearly; a scale below 1 counts as 1
    b1 = logit_bound(full, 1032, 1.0)
    assert logit_bound(full, 1032, 30.0) == pytest.approx(30 * b1, rel=1e-12)
    assert logit_bound(full, 1032, 0.25) == b1
    assert b1 == pytest.approx(2 * SAFETY * UNIT_ROUNDOFF * decoder_units(full, 1032) * math.sqrt(1032 / 128),
                               rel=1e-12)
    # the worst of n rows: sqrt(n / 128) beyond 128 rows, 1 up to it
    assert REFERENCE_LENGTH == 128
    assert length_factor(1) == length_factor(128) == 1.0
    assert length_factor(512) == pytest.approx(2.0, rel=1e-12)
    assert logit_bound(full, 100, 1.0) == pytest.approx(2 * SAFETY * UNIT_ROUNDOFF * decoder_units(full, 100),
                                                        rel=1e-12)
    assert first_order(full, 1032, 30.0, FLOAT32_UNIT) == pytest.approx(2.0**29 * first_order(full, 1032, 30.0),
                                                                       rel=1e-12)
    with pytest.raises(ValueError, match="positive integer"):
        decoder_units(full, 0)
    with pytest.raises(ValueError, match="logit scale"):
        logit_bound(full, 10, float("nan"))


def test_the_bound_at_e2b_sits_between_the_measured_rounding_and_the_weakest_bug():
    """On the published E2B shapes at full depth (1,032 tokens, logits saturated at the softcap 30) the bound
    is more than 30x the worst measured chunked-vs-full difference, and more than 3x under the smallest
    difference a measured real bug made (docs/profiles.md)."""
    bound = logit_bound(e2b_config(), 1032, 30.0)
    assert bound >= 30 * E2B_WORST_ROUNDING
    assert bound <= E2B_WEAKEST_BUG / 3
    assert bound > 10 * CONSISTENCY_BOUND  # the fixed bound of the miniatures would refuse the oracle there


def test_logit_scale_and_tensor_bound():
    a = np.array([[1.0, -29.5, np.inf], [np.nan, 3.0, -np.inf]])
    assert logit_scale(a) == 29.5
    assert logit_scale(np.zeros((3, 4))) == 1.0
    assert logit_scale(np.full((2, 2), np.nan)) == 1.0
    big = np.zeros((40_000, 512))  # read in blocks of rows
    big[39_999, 7] = -12.0
    assert logit_scale(big) == 12.0
    assert tensor_bound(1000, 5.0) == pytest.approx(2 * SAFETY * UNIT_ROUNDOFF * 1000 * 5.0, rel=1e-12)
    assert tensor_bound(1000, 5.0, rows=512) == pytest.approx(2 * tensor_bound(1000, 5.0), rel=1e-12)
    assert recompute_bound(1000, np.array([5.0])) == RECOMPUTE_BOUND  # the floor, on miniature sizes
    assert recompute_bound(1e8, np.array([5.0])) == tensor_bound(1e8, 5.0)
    assert recompute_bound(1e8, np.ones((512, 3))) == tensor_bound(1e8, 1.0, rows=512)


def test_tower_units_grow_with_the_tower():
    from refimpl.vision import VisionConfig

    v = VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=100.0, patch_size=4,
                     pooling_kernel_size=3, position_embedding_size=64, use_clipped_linears=False,
                     standardize=False, text_hidden_size=64)
    small = bounds.vision_units(v, 100)
    assert bounds.vision_units(v, 200) == small + 2 * 100 * v.num_hidden_layers
    assert bounds.vision_units(dataclasses.replace(v, num_hidden_layers=4), 100) > small
    assert bounds.feature_units(1024) > bounds.feature_units(512)


def test_exact_f64_and_fp32_scale_at_real_size_and_keep_their_floors_on_miniatures():
    exact, fp32 = PROFILES["exact-f64"], PROFILES["fp32"]
    assert exact.scaling == "float64" and fp32.scaling == "float32"
    assert all(PROFILES[n].scaling == "fixed" for n in ("fp16-kv", "bf16", "q8", "q4"))
    for p in (exact, fp32):
        # every bundled miniature sits below the floor: the profile is returned as it is
        assert scaled(p, parse_config(_mini_config()), 48, 30.0) is p
    e2b = e2b_config()
    s = scaled(exact, e2b, 1032, 30.0)
    assert s.max_abs == pytest.approx(logit_bound(e2b, 1032, 30.0), rel=1e-12)
    r = s.max_abs / exact.max_abs
    assert r > 10
    for k in ("max_rel", "delta_p", "tie_margin"):
        assert getattr(s, k) == pytest.approx(getattr(exact, k) * r, rel=1e-12), k
    for k in ("nmse", "kl_max", "kl_mean"):
        assert getattr(s, k) == pytest.approx(getattr(exact, k) * r * r, rel=1e-12), k
    assert 1 - s.cosine_min == pytest.approx((1 - exact.cosine_min) * r * r, rel=1e-6)
    assert s.tie_margin > 2 * s.max_abs
    assert (s.identity_ratio, s.topk, s.rel_floor, s.name, s.scaling) == \
        (exact.identity_ratio, exact.topk, exact.rel_floor, exact.name, exact.scaling)
    assert s.sources[:-1] == exact.sources and "35 layers" in s.sources[-1] and "1032 tokens" in s.sources[-1]
    # still far below float32 effects at that size: a correct float32 engine is off by 0.09..0.9 there
    assert s.max_abs < 1e-6
    # fp32 follows float32 rounding: at E2B it admits the oracle run in float32 (measured max_abs 0.89..1.48,
    # NMSE up to 9.3e-4, KL up to 3.6e-3 on 1,032-token bases; benchmarks/bounds.py --float32), which fails
    # the fixed thresholds
    f = scaled(fp32, e2b, 1032, 30.0)
    assert f.max_abs == pytest.approx(rounding_threshold(fp32, e2b, 1032, 30.0), rel=1e-12)
    assert E2B_FLOAT32_WORST > fp32.max_abs
    assert f.max_abs > 3 * E2B_FLOAT32_WORST and f.nmse > 10 * 9.3e-4 and f.kl_max > 10 * 3.6e-3
    assert f.max_abs < 30 / 5  # still well inside the logit range: a dropped softcap (max_abs 99 there) fails
    # fixed profiles stay fixed
    assert scaled(PROFILES["bf16"], e2b, 1032, 30.0) is PROFILES["bf16"]
    assert rounding_threshold(PROFILES["q8"], e2b, 1032, 30.0) is None
    # an expectations override applies to the scaled profile and wins
    o = with_overrides(s, {"max_abs": 1e-3})
    assert o.max_abs == 1e-3 and o.nmse == s.nmse
    with pytest.raises(ValueError, match="unknown tolerance 'scaling'"):
        with_overrides(exact, {"scaling": 1.0})


def _mini_config() -> dict:
    from refimpl.synth import preset_config

    return preset_config("e4b-mini", 5)  # the largest path sum of the bundled miniatures


def test_the_check_session_scales_per_case_from_the_sets_model_and_bases(tmp_path):
    """policy.case_profile: on a bundled set every case keeps the calibrated exact-f64 (its derived bound is
    below the floor); given the published E2B config in its place, a case is graded with the thresholds of
    its base's length and logit scale."""
    fs = load_set(bundled_set("e2b-mini"))
    ctx = Checkpoints(tmp_path).context(fs, "scaled")
    exact = PROFILES["exact-f64"]
    assert all(case_profile(exact, ctx, c) is exact for c in fs.cases)
    assert case_profile(PROFILES["fp32"], ctx, fs.cases[0]) is PROFILES["fp32"]
    ctx.__dict__["text_config"] = e2b_config()  # what a set of the published shapes would read
    case = next(c for c in fs.cases if c.base == "A")
    got = case_profile(exact, ctx, case)
    n = len(fs.bases()["A"])
    assert got.max_abs == pytest.approx(logit_bound(e2b_config(), n, logit_scale(fs.base_logits()["A"])), rel=1e-12)
    assert case_profile(PROFILES["q4"], ctx, case) is PROFILES["q4"]


def test_generation_holds_each_base_to_its_own_bound(tmp_path, monkeypatch):
    """generate_set records each base's bound in the manifest's consistency entry, measures a checkpoint's own
    amplification (the rounding probe) where a base exceeds the model's bound and holds it to 10 x that, and
    refuses the set when a base exceeds both, naming the base and the ratio."""
    import conformance.generate.jobs as jobs
    import conformance.generate.run as run_mod
    from conformance.generate import generate_set
    from conformance.sets import FixtureError

    out = generate_set(tmp_path / "set", preset="31b-mini", cases="text", workers=1)
    [check] = json.loads((out / "manifest.json").read_text())["provenance"]["cross_checks"]
    assert check["bounds"] == {b: CONSISTENCY_BOUND for b in "ABCG"}  # the floor, on a miniature
    assert "rounding_probes" not in check  # within the model's bound: no probe was needed
    # a model bound too small for this checkpoint: the probe explains the difference, the set is published
    monkeypatch.setattr(run_mod, "CONSISTENCY_BOUND", 0.0)
    monkeypatch.setattr(jobs, "consistency_bound", lambda cfg, n, logits: 1e-300)
    out = generate_set(tmp_path / "probed", preset="31b-mini", cases="text", workers=1)
    m = json.loads((out / "manifest.json").read_text())
    [check] = m["provenance"]["cross_checks"]
    probes = check["rounding_probes"]
    assert sorted(probes) == list("ABCG") and all(0 < v < 1e-11 for v in probes.values())
    assert check["bounds"] == {b: pytest.approx(bounds.PROBE_FACTOR * v, rel=1e-12) for b, v in probes.items()}
    assert bounds.recorded_probes(m) == probes
    # the grader scales exact-f64 with a recorded probe (here far below the floor: unchanged)
    fs = load_set(out)
    ctx = Checkpoints(tmp_path / "work").context(fs, "scaled")
    assert case_profile(PROFILES["exact-f64"], ctx, fs.cases[0]) is PROFILES["exact-f64"]
    # neither bound explains it: refused
    monkeypatch.setattr(jobs, "probe_bound", lambda probe: 1e-300)
    with pytest.raises(FixtureError, match=r"on base [ABCG] \(\d+ tokens\), .* x its float64 rounding bound"):
        generate_set(tmp_path / "refused", preset="31b-mini", cases="text", workers=1)
    assert not (tmp_path / "refused").exists()


def test_a_recorded_probe_raises_the_scaled_thresholds():
    """A checkpoint that amplifies rounding beyond the first-order model (random deep weights: E4B's shapes at
    1,032 tokens) has its probe recorded; exact-f64 then admits 10 x the probe, fp32 10 x the probe x 2^29."""
    e4b = parse_config(published_config("e4b", 7))
    exact, fp32 = PROFILES["exact-f64"], PROFILES["fp32"]
    plain = rounding_threshold(exact, e4b, 1032, 30.0)
    probe = 10 * plain  # a probe this large means the model's bound cannot hold
    assert rounding_threshold(exact, e4b, 1032, 30.0, probe) == pytest.approx(bounds.PROBE_FACTOR * probe)
    assert scaled(exact, e4b, 1032, 30.0, probe).max_abs == pytest.approx(bounds.PROBE_FACTOR * probe)
    assert rounding_threshold(fp32, e4b, 1032, 30.0, probe) == pytest.approx(bounds.PROBE_FACTOR * probe * 2**29)
    # a small probe changes nothing
    assert rounding_threshold(exact, e4b, 1032, 30.0, 1e-20) == plain
    assert "rounding probe" in scaled(exact, e4b, 1032, 30.0, probe).sources[-1]
    with pytest.raises(ValueError, match="rounding probe"):
        bounds.probe_bound(float("inf"))
    assert bounds.recorded_probes({"provenance": {"cross_checks": [{"rounding_probes": {"A": 2e-9, "B": "x"}},
                                                                   {"implementation": "other"}]}}) == {"A": 2e-9}
    assert bounds.recorded_probes({}) == {}
