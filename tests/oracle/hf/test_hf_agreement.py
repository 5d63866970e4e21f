"""Agreement with Hugging Face transformers ``Gemma4ForCausalLM`` (eager attention), on every preset.

transformers in float64 still computes RMSNorm, the attention softmax, the router softmax and the RoPE
angles in float32; ``tests/hf_reference.py`` replaces exactly those spots with float64 (precision only,
the formulas are transformers' own). With them replaced the two implementations must agree to
float64 rounding; without, only to the float32 level, which bounds what a float32 engine can reach.

Prompts are longer than the presets' sliding window (8), so sliding masks, the window rule and
KV sharing across the window are all exercised.
"""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_reference import hf_logits, hf_logits_incremental, hf_trace, load_hf_causal_lm

from refimpl.model import Gemma4, KVCache, Trace
from refimpl.synth import PRESETS, write_checkpoint
from refimpl.tokenizer import Tokenizer

pytestmark = pytest.mark.hf

# float64 rounding of ~30-sized logits through up to 12 layers. Measured worst case over the presets and
# prompts below: 7.3e-13 full forward (e2b-mini, 2W+5), 4.1e-13 chunked (e2b-mini). A looser bound
# would hide real bugs.
EXACT_BOUND = 2e-12
# transformers as shipped (float32 norms, softmaxes, RoPE angles) vs the float64 oracle. Measured worst
# case 1.7e-4 (e2b-mini, 2W+5), best 5.5e-6 (31b-mini): the floor a float32 engine can reach.
SHIPPED_BOUND = 5e-4


def prompts(model_dir):
    """A chat prompt from the checkpoint's tokenizer, and 2W+5 and 5W random ids (W = 8)."""
    tok = Tokenizer.from_dir(model_dir)
    chat = tok.encode_chat([{"role": "user", "content": "Why does the sliding window need a cache?"}])
    rng = np.random.default_rng(11)
    return {"chat": chat, "2W+5": [2] + rng.integers(0, 512, 20).tolist(),
            "5W": [2] + rng.integers(0, 512, 39).tolist()}


@pytest.fixture(scope="module")
def hf_models(preset_dirs):
    return {preset: load_hf_causal_lm(path) for preset, path in preset_dirs.items()}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_oracle_equals_transformers_in_float64(preset, preset_dirs, preset_models, hf_models):
    for name, ids in prompts(preset_dirs[preset]).items():
        assert len(ids) > 8
        ours = preset_models[preset].forward(ids)
        theirs = hf_logits(hf_models[preset], ids)
        diff = np.abs(ours - theirs).max()
        assert diff < EXACT_BOUND, f"{preset} {name}: max |oracle - transformers| = {diff:.3g}"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_transformers_as_shipped_is_float32_close(preset, preset_dirs, preset_models, hf_models):
    ids = prompts(preset_dirs[preset])["2W+5"]
    ours = preset_models[preset].forward(ids)
    shipped = hf_logits(hf_models[preset], ids, exact=False)
    diff = np.abs(ours - shipped).max()
    assert diff < SHIPPED_BOUND
    assert diff > 100 * EXACT_BOUND  # the float32 spots are real: the exact comparison is not vacuous


@pytest.mark.parametrize("preset", ["26b-a4b-mini", "all-features"])
def test_moe_expert_choices_are_identical(preset, preset_dirs, preset_models, hf_models):
    ids = prompts(preset_dirs[preset])["5W"]
    trace = Trace()
    preset_models[preset].forward(ids, trace=trace)
    theirs = hf_trace(hf_models[preset], ids)
    assert sorted(theirs) == list(range(len(preset_models[preset].cfg.layers)))
    for layer, experts in theirs.items():
        ours = trace.tensors[f"layers.{layer}.router.experts"]
        assert np.array_equal(np.sort(ours, axis=1), np.sort(experts, axis=1)), f"layer {layer}"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_chunked_prefill_and_decode_match_transformers_cache(preset, preset_dirs, preset_models, hf_models):
    ids = prompts(preset_dirs[preset])["5W"]
    plan = [11, 1, 1, 17, 10]  # a piece longer than the window, single-token decode steps
    cache, rows = KVCache(), []
    start = 0
    for n in plan:
        rows.append(preset_models[preset].forward(ids[start:start + n], cache=cache))
        start += n
    ours = np.concatenate(rows)
    theirs = hf_logits_incremental(hf_models[preset], ids, plan)
    assert np.abs(ours - theirs).max() < EXACT_BOUND


def test_bf16_checkpoint_and_conditional_layout(tmp_path):
    """BF16 storage is decoded exactly by both; the published Gemma4ForConditionalGeneration layout
    (text_config, model.language_model.*) loads to the same numbers."""
    ids = [2, 5, 300, 17, 45, 99, 3, 8, 250, 1, 77, 123, 400, 6, 7, 200, 201, 202, 64]
    for layout in ("causal", "conditional"):
        path = write_checkpoint("e2b-mini", 3, tmp_path / layout, dtype="bf16", layout=layout)
        ours = Gemma4(path).forward(ids)
        theirs = hf_logits(load_hf_causal_lm(path), ids)
        assert np.abs(ours - theirs).max() < EXACT_BOUND, layout
