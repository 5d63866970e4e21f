"""The MTP oracle (``refimpl.mtp`` with the ``transformers/P`` convention) against transformers 5.24's own
assisted generation in float64: every drafter call of whole ``generate(assistant_model=...)`` runs, on the
bundled MTP presets and on target/drafter pairs drawn by hypothesis (KV-shared targets whose layer pattern
does not end in (sliding, full), K=V full layers, GQA, the centroid head with its cluster map).

Per drafter call: the same query position and logits within 1e-12 of the row's largest logit (1e-14 to 2e-14
measured on the presets, about 1e-12 on the smallest drawn shapes); the same drafts and accepted lengths,
and the output of both runs equal to the oracle's plain greedy decoding. (transformers' own plain greedy
``generate`` is not used: on a KV-shared target without per-layer inputs 5.24 slices ``per_layer_inputs``,
which is None, and fails.)
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers import FULL, SLIDING, examples, micro_assistant, micro_checkpoint, micro_config
from hf_mtp_reference import hf_assisted_run, load_pair
from hf_unified_reference import media_kwargs, token_types

from conformance.check import materialise
from conformance.sets.bundled import bundled_set
from conformance.sets.integrity import load_set
from refimpl import Gemma4
from refimpl.assistant import Drafter
from refimpl.generate import greedy_generate
from refimpl.mtp import assisted_greedy
from refimpl.multimodal import MultimodalInputs, load_multimodal_tokens, multimodal_inputs
from refimpl.synth import ASSISTANT_DIR, write_checkpoint

TOL = 1e-12


def compare(model_dir, drafter_dir, prompt, max_new, k):
    """Every drafter call of transformers' run against the oracle's; returns the oracle run."""
    target, drafter = load_pair(model_dir, drafter_dir)
    hf = hf_assisted_run(target, drafter, prompt, max_new, k)
    run = assisted_greedy(Gemma4(model_dir), Drafter(drafter_dir), prompt, max_new, k, "transformers/P")
    ours = [(r.query_position, row) for r in run.rounds for row in r.draft_logits]
    assert len(hf.calls) == len(ours)
    for call, (position, row) in zip(hf.calls, ours, strict=True):
        assert call.position == position
        assert np.abs(call.logits - row).max() <= TOL * max(1.0, np.abs(row).max())
    # the drafts (every step's argmax, as transformers drafted them), the accepted lengths (the rounds'
    # positions follow from them) and the output: plain greedy decoding, by the oracle's own greedy loop
    assert [int(np.argmax(c.logits)) for c in hf.calls] == [d for r in run.rounds for d in r.draft_argmax]
    assert hf.output == run.output == tuple(greedy_generate(Gemma4(model_dir), prompt, max_new).tokens)
    return run


@pytest.mark.parametrize("preset", ["e2b-assistant-mini", "12b-assistant-mini"])
@pytest.mark.parametrize("n", [5, 13])  # shorter than the window (8) and longer
def test_presets_agree_with_transformers(tmp_path, preset, n):
    model = write_checkpoint(preset, 0, tmp_path / "m")
    prompt = [int(t) for t in np.random.default_rng(n).integers(3, 500, n)]
    run = compare(model, model / ASSISTANT_DIR, prompt, 12, 3)
    assert len(run.rounds) >= 3


def _layouts():
    """(layer_types, num_kv_shared_layers) of a target; transformers forces the last layer to be full, so a
    pattern that does not end in (sliding, full) ends in (full, full)."""
    return st.sampled_from([
        ([SLIDING, SLIDING, FULL, SLIDING, FULL], 2),
        ([SLIDING, FULL, SLIDING, SLIDING, FULL, FULL], 3),  # owning S, F, S: store S = 2, F = 1
        ([FULL, SLIDING, SLIDING, FULL], 1),  # owning F, S, S: store S = 2, F = 0
        ([SLIDING, FULL, SLIDING, FULL], 0),
    ])


@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=_layouts(), seed=st.integers(0, 2**16), kv=st.sampled_from([1, 2]), k_eq_v=st.booleans(),
       centroids=st.sampled_from([None, 4, 8]), n=st.integers(2, 12), k=st.integers(1, 4),
       drafter_types=st.sampled_from([(SLIDING, FULL), (FULL, SLIDING, FULL)]))
def test_drawn_pairs_agree_with_transformers(tmp_path_factory, layout, seed, kv, k_eq_v, centroids, n, k,
                                            drafter_types):
    types, shared = layout
    cfg = micro_config(num_hidden_layers=len(types), layer_types=types, num_kv_shared_layers=shared,
                       num_attention_heads=2, num_key_value_heads=kv, sliding_window=4, attention_k_eq_v=k_eq_v,
                       num_global_key_value_heads=1 if k_eq_v else None)
    root = tmp_path_factory.mktemp("pair")
    model = micro_checkpoint(root / "t", cfg, seed)
    drafter = micro_assistant(root / "d", cfg, seed + 1, layer_types=drafter_types, centroids=centroids)
    prompt = [int(t) for t in np.random.default_rng(seed).integers(3, 64, n)]
    compare(model, drafter, prompt, 9, k)


@pytest.mark.parametrize("name", ["e2b-assistant-mini", "12b-assistant-mini", "mtp-layout-mini"])
def test_bundled_generate_cases_are_transformers_own_runs(name, tmp_path):
    """Every ``transformers/P`` generate case of a bundled MTP set: the rounds (drafts, accepted lengths) and the
    output transformers' own ``generate(assistant_model=...)`` produces."""
    fs = load_set(bundled_set(name))
    model_dir = materialise(fs, tmp_path)
    target, drafter = load_pair(model_dir, fs.drafter_dir(model_dir))
    bases = fs.bases()
    cases = [c for c in fs.cases if c.mtp is not None and c.mtp.media is None and c.mtp.mode == "generate"
             and c.mtp.convention == "transformers/P"]  # (after media: test_mtp_after_media_agrees_with_transformers)
    assert len(cases) == 4
    for case in cases:
        m = case.mtp
        hf = hf_assisted_run(target, drafter, [int(t) for t in bases[case.base][:case.length]], m.max_new_tokens,
                             m.num_drafts)
        assert hf.output == m.output, case.id
        assert [int(np.argmax(c.logits)) for c in hf.calls] == [t for r in m.rounds for t in r.drafts], case.id


def _vision_target(model_dir):
    """E2B-vision as transformers' Gemma4ForConditionalGeneration in float64 with its vision tower, and the context
    that patches the tower's float32 spots (tests/hf_towers.py)."""
    import functools

    import hf_reference
    import torch
    import transformers
    import transformers.models.gemma4.modeling_gemma4 as mg
    from hf_reference import recompute_float64_buffers
    from hf_towers import recompute_vision_inv_freq, vision_float64_exact

    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float64,
                                                                     attn_implementation="eager", use_safetensors=True)
    hf.eval()
    recompute_vision_inv_freq(torch, mg, hf)
    recompute_float64_buffers(hf)
    return hf, functools.partial(vision_float64_exact, torch, mg, hf_reference)


@pytest.mark.parametrize("name, base", [("12b-assistant-mini", "M4"), ("12b-assistant-mini", "M5"),
                                        ("e2b-vision-assistant-mini", "M4")])
def test_mtp_after_media_agrees_with_transformers(name, base, tmp_path):
    """MTP after an image (audio) prompt: transformers' own ``generate(assistant_model=...)`` fed the stored pixel
    values (raw frames) with mm_token_type_ids, against the oracle's assisted run (``transformers/P``) from the
    stored soft tokens, every drafter call: the same query position (counting the soft tokens), logits within
    1e-12 of the row's largest (measured: 5.6e-13 image, 1.2e-13 audio on the Unified pair, 1.0e-12 image on E2B,
    rows up to 27; 27 drafter calls each), the same drafts, the output plain greedy decoding. A
    drafted image token reaches transformers' target as the pad id (the oracle's rule after media; without it
    the second round is up to 28 off). transformers' generate opens a Unified image block on every layer (rule
    A), so the oracle runs under ``all-unclamped`` there."""
    fs = load_set(bundled_set(name))
    model_dir = materialise(fs, tmp_path)
    unified = name.startswith("12b")
    vision = None if unified else _vision_target(model_dir)
    target, drafter = load_pair(model_dir, fs.drafter_dir(model_dir), target=None if unified else vision[0])
    (case,) = [c for c in fs.cases if c.id == f"{name}/mtp/generate/{base}/transformers/P"]
    m, n = case.mtp, case.length
    ids = [int(t) for t in fs.bases()[base][:n]]
    images, clips = fs.image_inputs(m.media), fs.audio_inputs(m.media)
    if unified:
        kw = media_kwargs([(i["pixel_values"], i["positions"]) for i in images],
                          [c["features"][np.asarray(c["mask"]).astype(bool)] for c in clips])
    else:  # the vision tower's patches padded to max_soft_tokens k^2, as its processor pads them
        rows = max(i["pixel_values"].shape[0] for i in images)
        pv = np.zeros((len(images), rows, images[0]["pixel_values"].shape[1]))
        pos = np.full((len(images), rows, 2), -1, dtype=np.int64)
        for j, i in enumerate(images):
            pv[j, :len(i["pixel_values"])], pos[j, :len(i["positions"])] = i["pixel_values"], i["positions"]
        import torch
        kw = {"pixel_values": torch.from_numpy(pv), "image_position_ids": torch.from_numpy(pos)}
    kw["mm_token_type_ids"] = token_types(ids, target.config)
    hf = hf_assisted_run(target, drafter, ids, m.max_new_tokens, m.num_drafts,
                         **({} if unified else {"exact": vision[1]}), **kw)
    oracle = Gemma4(model_dir, vision_mask="all-unclamped" if unified else "sliding-clamped")
    full = multimodal_inputs(oracle, fs.bases()[m.media], [i["soft_tokens"] for i in images],
                             load_multimodal_tokens(model_dir, ["image"] if images else ["audio"]),
                             audio_soft_tokens=[c["soft_tokens"] for c in clips])
    inputs = MultimodalInputs(full.ids[:n], full.embeddings[:n],
                              None if full.vision_blocks is None else full.vision_blocks[:n], full.placeholders)
    run = assisted_greedy(oracle, Drafter(fs.drafter_dir(model_dir)), ids, m.max_new_tokens, m.num_drafts,
                          "transformers/P", inputs=inputs)
    ours = [(r.query_position, row) for r in run.rounds for row in r.draft_logits]
    assert len(hf.calls) == len(ours) and ours[0][0] == n  # round 1 queries at P = the prompt's length
    for call, (position, row) in zip(hf.calls, ours, strict=True):
        assert call.position == position
        assert np.abs(call.logits - row).max() <= TOL * max(1.0, np.abs(row).max())
    assert [int(np.argmax(c.logits)) for c in hf.calls] == [d for r in run.rounds for d in r.draft_argmax]
    assert hf.output == run.output == m.output
