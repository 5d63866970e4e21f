"""The Gemma 4 Unified oracle against transformers 5.24 ``Gemma4UnifiedForConditionalGeneration`` in float64
(its float32 spots patched to float64 by ``hf_unified_reference.py``): text, image, audio and mixed prompts,
both vision-mask rules against the transformers path that applies each, the embedders alone, chunked
prefill and cached decode, on the ``12b-mini`` preset and on configs drawn by hypothesis.

Rule A ("all-unclamped") is what transformers' default forward does; rule B ("sliding-clamped", the
oracle's default) is what its static-cache mask builder does. Measured worst cases are in the bounds'
comments; 5e-12 is the issue's bound for every comparison.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
from helpers import examples, write_unified_checkpoint
from hf_unified_reference import (
    hf_audio_features,
    hf_image_features,
    hf_logits,
    hf_logits_incremental,
    load_hf_unified,
    recompute_float64_buffers,
    unified_float64_exact,
)

from refimpl.frontends import audio_front_end, image_front_end
from refimpl.model import VISION_MASK_RULES, Gemma4, KVCache
from refimpl.multimodal import (
    MULTIMODAL_PIECES,
    expand_audio_placeholders,
    expand_image_placeholders,
    load_multimodal_tokens,
    multimodal_inputs,
)
from refimpl.synth import piece_id, write_checkpoint

pytestmark = pytest.mark.hf

# Measured worst cases: 7.3e-13 on the 12b-mini mixed prompt below (logits ~30, 6 layers, blocks of 63 and
# 64 soft tokens), 1.6e-12 over 60 drawn configs (rule B, 78 tokens); embedders 3.6e-15.
EXACT_BOUND = 5e-12
FEATURE_BOUND = 1e-13
RULES_DIFFER = 1e-3  # the two rules must be told apart by the prompts that hold a block


@pytest.fixture(scope="module")
def unified(tmp_path_factory):
    torch.set_num_threads(1)
    d = write_checkpoint("12b-mini", 0, tmp_path_factory.mktemp("u") / "12b-mini")
    return d, load_hf_unified(d)


def media_prompt(model_dir, images, waveforms, text=(3, 4, 3, 5), seed=0):
    """(prompt ids, image inputs, clip frames, image soft tokens, clip soft tokens): bos, text, the
    images, text, the clips, text; each block expanded as the processor expands it."""
    img_f, aud_f = image_front_end(model_dir), audio_front_end(model_dir)
    mm = load_multimodal_tokens(model_dir)
    processed = [img_f.preprocess(x) for x in images]
    clips = [aud_f.features(w, 16_000) for w in waveforms]
    rng = np.random.default_rng(seed)
    vocab = json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]
    pool = np.setdiff1d(np.arange(20, vocab), [mm.image_token_id, mm.audio_token_id, mm.boi_token_id,
                                               mm.eoi_token_id, mm.boa_token_id, mm.eoa_token_id, mm.video_token_id])
    ids = [2] + rng.choice(pool, text[0]).tolist()
    for _ in processed:
        ids += [mm.image_token_id] + rng.choice(pool, text[1]).tolist()
    for _ in clips:
        ids += [mm.audio_token_id] + rng.choice(pool, text[2]).tolist()
    ids += rng.choice(pool, text[3]).tolist()
    ids = expand_image_placeholders(ids, [p.num_soft_tokens for p in processed], mm)
    ids = expand_audio_placeholders(ids, [int(c.mask.sum()) for c in clips], mm).tolist()
    soft = [img_f.soft_tokens(p) for p in processed]
    asoft = [aud_f.soft_tokens(c) for c in clips]
    return ids, [(p.pixel_values, p.positions) for p in processed], [c.features for c in clips], soft, asoft, mm


def oracle(model_dir, ids, soft, asoft, mm, rule, cuts=None):
    m = Gemma4(model_dir, vision_mask=rule)
    x = multimodal_inputs(m, ids, soft, mm, audio_soft_tokens=asoft)
    if cuts is None:
        return m.forward(x.ids, embeddings=x.embeddings, vision_blocks=x.vision_blocks)
    cache, rows, bounds = KVCache(), [], [0, *cuts, len(ids)]
    for a, b in itertools.pairwise(bounds):
        rows.append(m.forward(x.ids[a:b], cache=cache, embeddings=x.embeddings[a:b],
                              vision_blocks=x.vision_blocks[a:b]))
    return np.concatenate(rows)


def image(seed, h, w):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def wave(seed, n):
    return np.random.default_rng(seed).uniform(-0.9, 0.9, n)


# ----------------------------------------------------------------------------------------------
# 12b-mini


def test_text_prompt_both_rules(unified):
    d, hf = unified
    ids = [2] + np.random.default_rng(1).integers(20, 512, 29).tolist()  # > 3 W: windows and cache width
    for rule in VISION_MASK_RULES:
        diff = np.abs(Gemma4(d, vision_mask=rule).forward(ids) - hf_logits(hf, ids, rule=rule)).max()
        assert diff < EXACT_BOUND, f"{rule}: {diff:.3g}"


def test_embedders_equal_transformers(unified):
    d, hf = unified
    img_f, aud_f = image_front_end(d), audio_front_end(d)
    for k, (h, w) in enumerate([(50, 70), (36, 36), (24, 60)]):  # wide, square, a 2 x 5 grid at 12 px
        p = img_f.preprocess(image(k, h, w))
        diff = np.abs(img_f.soft_tokens(p) - hf_image_features(hf, p.pixel_values, p.positions)).max()
        assert diff < FEATURE_BOUND, f"image {h}x{w}: {diff:.3g}"
    clip = aud_f.features(wave(0, 640 * 3 + 17), 16_000)  # the last frame zero-padded
    assert clip.features.shape == (4, 640) and not clip.features[3, 17:].any()
    diff = np.abs(aud_f.soft_tokens(clip) - hf_audio_features(hf, clip.features)).max()
    assert diff < FEATURE_BOUND, f"audio: {diff:.3g}"


@pytest.mark.parametrize("media", ["image", "audio", "two images + audio"])
def test_media_prompts_each_rule_against_its_transformers_path(unified, media):
    d, hf = unified
    images = {"image": [image(3, 50, 70)], "audio": [], "two images + audio": [image(3, 50, 70), image(4, 24, 60)]}
    waves = {"image": [], "audio": [wave(1, 640 * 5 + 17)], "two images + audio": [wave(1, 640 * 5 + 17)]}
    ids, imgs, clips, soft, asoft, mm = media_prompt(d, images[media], waves[media])
    ours = {rule: oracle(d, ids, soft, asoft, mm, rule) for rule in VISION_MASK_RULES}
    for rule in VISION_MASK_RULES:
        diff = np.abs(ours[rule] - hf_logits(hf, ids, images=imgs, clips=clips, rule=rule)).max()
        assert diff < EXACT_BOUND, f"{media}, {rule}: {diff:.3g}"
    gap = np.abs(ours["all-unclamped"] - ours["sliding-clamped"]).max()
    if images[media]:
        assert gap > RULES_DIFFER, f"{media}: the rules agree ({gap:.3g}); the prompt does not tell them apart"
    else:
        assert gap == 0.0  # audio is never a vision block: both rules are the causal mask


def test_video_prompt_each_rule_against_its_transformers_path(unified):
    """A 2-frame video (frames of 84 x 120: 70 soft tokens at 12-px model patches, no resize) through the Unified
    embedder, each frame its own block (issue 58): both rules against transformers' pixel_values_videos path."""
    from refimpl.video import VideoSettings, preprocess_video, video_ids

    d, hf = unified
    front, mm = image_front_end(d).with_budget(70), load_multimodal_tokens(d)
    video = preprocess_video([image(k, 84, 120) for k in range(4)], 1.0, front.preprocess_frame, VideoSettings(70, 2))
    assert video.frames == 2 and video.num_soft_tokens == 70 and video.timestamps == ["00:00", "00:02"]
    ids = [2, 30, 31] + video_ids(video, mm, lambda t: [40 + (ord(c) % 50) for c in t]).tolist() + [32, 33, 34]
    frames = [front.soft_tokens(p) for p in video.processed]
    pixels = (np.stack([p.pixel_values for p in video.processed]), np.stack([p.positions for p in video.processed]))
    ours = {}
    for rule in VISION_MASK_RULES:
        m = Gemma4(d, vision_mask=rule)
        x = multimodal_inputs(m, ids, [], mm, video_soft_tokens=frames)
        ours[rule] = m.forward(x.ids, embeddings=x.embeddings, vision_blocks=x.vision_blocks)
        diff = np.abs(ours[rule] - hf_logits(hf, ids, videos=[pixels], rule=rule)).max()
        print(f"\nvideo, {rule}: max |refimpl - transformers| = {diff:.2e}")
        assert diff < EXACT_BOUND, f"video, {rule}: {diff:.3g}"
    assert np.abs(ours["all-unclamped"] - ours["sliding-clamped"]).max() > RULES_DIFFER


def test_no_token_types_is_causal(unified):
    """transformers without mm_token_type_ids builds plain causal masks: the oracle without blocks."""
    d, hf = unified
    ids, imgs, clips, soft, asoft, mm = media_prompt(d, [image(5, 36, 48)], [])
    m = Gemma4(d)
    x = multimodal_inputs(m, ids, soft, mm)
    ours = m.forward(x.ids, embeddings=x.embeddings)
    diff = np.abs(ours - hf_logits(hf, ids, images=imgs, types=False)).max()
    assert diff < EXACT_BOUND, f"{diff:.3g}"


def test_chunked_prefill_and_decode(unified):
    """Pieces cut around (never inside) the blocks, then four one-token decode steps, through
    transformers' DynamicCache (rule A) and the oracle's cache under the same rule."""
    d, hf = unified
    ids, imgs, clips, soft, asoft, mm = media_prompt(d, [image(6, 50, 70)], [wave(2, 640 * 3 + 5)],
                                                     text=(3, 4, 3, 9))
    first, last = ids.index(mm.boi_token_id), len(ids) - 1 - ids[::-1].index(mm.eoa_token_id)
    cuts = [first, last + 1, last + 4, *range(len(ids) - 4, len(ids))]
    theirs = hf_logits_incremental(hf, ids, cuts, images=imgs, clips=clips)
    ours = oracle(d, ids, soft, asoft, mm, "all-unclamped", cuts=cuts)
    diff = np.abs(ours - theirs).max()
    assert diff < EXACT_BOUND, f"{diff:.3g}"
    whole = oracle(d, ids, soft, asoft, mm, "all-unclamped")
    assert np.abs(ours - whole).max() < EXACT_BOUND


# ----------------------------------------------------------------------------------------------
# drawn configs


@st.composite
def unified_configs(draw) -> dict:
    L = draw(st.integers(2, 6), label="layers")
    types = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]), min_size=L, max_size=L))
    types[-1] = "full_attention"
    N = draw(st.sampled_from([2, 4]), label="heads")
    kv = draw(st.sampled_from([k for k in (1, 2, 4) if N % k == 0]), label="kv heads")
    global_kv = draw(st.sampled_from([k for k in (1, 2) if N % k == 0]), label="global kv heads")
    p, k = draw(st.sampled_from([(2, 2), (2, 3), (4, 1), (3, 2)]), label="patch, merge")
    text = dict(
        model_type="gemma4_unified_text", vocab_size=64, hidden_size=draw(st.sampled_from([16, 32])),
        intermediate_size=24, num_hidden_layers=L, layer_types=types, num_attention_heads=N,
        num_key_value_heads=kv, num_global_key_value_heads=global_kv, head_dim=draw(st.sampled_from([4, 8])),
        global_head_dim=draw(st.sampled_from([8, 16])), attention_k_eq_v=draw(st.booleans(), label="k_eq_v"),
        sliding_window=draw(st.integers(2, 6), label="window"), final_logit_softcapping=30.0, rms_norm_eps=1e-6,
        max_position_embeddings=4096, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1_000_000.0}},
        num_kv_shared_layers=0, use_bidirectional_attention="vision", bos_token_id=2, pad_token_id=0, eos_token_id=[1],
        # the published config's unused PLE / MoE fields: ignored by both sides
        hidden_size_per_layer_input=draw(st.sampled_from([0, 8])), enable_moe_block=False,
    )
    E = draw(st.sampled_from([8, 12]), label="mm_embed_dim")
    config = {
        "architectures": ["Gemma4UnifiedForConditionalGeneration"], "model_type": "gemma4_unified", "dtype": "float32",
        "text_config": text, "tie_word_embeddings": True, "eos_token_id": [1],
        "vision_config": dict(model_type="gemma4_unified_vision", patch_size=p, pooling_kernel_size=k, mm_embed_dim=E,
                              mm_posemb_size=80, output_proj_dims=E, rms_norm_eps=1e-6),
        "audio_config": dict(model_type="gemma4_unified_audio", audio_embed_dim=draw(st.sampled_from([8, 20])),
                             rms_norm_eps=1e-6),
        **{key: piece_id(piece) for key, piece in MULTIMODAL_PIECES.items()},
    }
    return config


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(config=unified_configs(), seed=st.integers(0, 2**16), n_images=st.integers(0, 2),
       n_clips=st.integers(0, 1), sizes=st.lists(st.tuples(st.integers(4, 40), st.integers(4, 40)), min_size=2,
                                                  max_size=2))
def test_drawn_configs_match_transformers(tmp_path_factory, config, seed, n_images, n_clips, sizes):
    torch.set_num_threads(1)
    d = write_unified_checkpoint(tmp_path_factory.mktemp("drawn") / "ckpt", config, seed)
    hf = load_hf_unified(d)
    A = config["audio_config"]["audio_embed_dim"]
    images = [image(seed + j, *sizes[j]) for j in range(n_images)]
    ids, imgs, clips, soft, asoft, mm = media_prompt(d, images, [wave(seed, A * 3 + 1)] * n_clips, seed=seed)
    for rule in VISION_MASK_RULES:
        ours = oracle(d, ids, soft, asoft, mm, rule)
        theirs = hf_logits(hf, ids, images=imgs, clips=clips, rule=rule)
        diff = np.abs(ours - theirs).max()
        assert diff < EXACT_BOUND, f"{rule}: {diff:.3g}"


# ----------------------------------------------------------------------------------------------
# checkpoints written by transformers itself (save_pretrained: the per_layer_config serialisation, no
# global_head_dim; published tensor names), the module-name variant, and Gemma4UnifiedForCausalLM


def _saved_by_transformers(tmp_path, seed=0):
    from transformers import (
        Gemma4UnifiedAudioConfig,
        Gemma4UnifiedConfig,
        Gemma4UnifiedForConditionalGeneration,
        Gemma4UnifiedTextConfig,
        Gemma4UnifiedVisionConfig,
    )
    text = Gemma4UnifiedTextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=4, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        final_logit_softcapping=30.0, max_position_embeddings=512)
    config = Gemma4UnifiedConfig(
        text_config=text, audio_config=Gemma4UnifiedAudioConfig(audio_embed_dim=20),
        vision_config=Gemma4UnifiedVisionConfig(patch_size=4, pooling_kernel_size=2, mm_embed_dim=48, mm_posemb_size=16,
                                                output_proj_dims=48),
        boi_token_id=290, eoi_token_id=291, image_token_id=292, video_token_id=293, boa_token_id=294,
        eoa_token_index=295, audio_token_id=296)
    torch.manual_seed(seed)
    model = Gemma4UnifiedForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    out = tmp_path / "saved"
    model.save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"image_processor": {
        "patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70}}))
    return out


def test_checkpoints_written_by_transformers(tmp_path):
    """Both tensor namings and both architectures, as transformers 5.24 writes and reads them."""
    from safetensors.numpy import load_file, save_file
    from transformers import Gemma4UnifiedForCausalLM
    torch.set_num_threads(1)
    d = _saved_by_transformers(tmp_path)
    text = json.loads((d / "config.json").read_text())["text_config"]
    assert "per_layer_config" in text and "global_head_dim" not in text  # the serialisation transformers writes
    hf = load_hf_unified(d)
    ids, imgs, clips, soft, asoft, mm = media_prompt(d, [image(9, 40, 24)], [wave(3, 20 * 6 + 7)])
    ours = oracle(d, ids, soft, asoft, mm, "sliding-clamped")
    assert np.abs(ours - hf_logits(hf, ids, images=imgs, clips=clips, rule="sliding-clamped")).max() < EXACT_BOUND

    # the same weights under transformers' module names (model.embed_vision.*, ...multimodal_embedder...)
    mod = tmp_path / "modules"
    mod.mkdir()
    for f in ("config.json", "processor_config.json"):
        (mod / f).write_bytes((d / f).read_bytes())
    renamed = {k.replace("model.vision_embedder.", "model.embed_vision.").replace(
        "model.embed_vision.embedding_projection", "model.embed_vision.multimodal_embedder.embedding_projection"): v
        for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file(renamed, str(mod / "model.safetensors"), metadata={"format": "pt"})
    ids2, _, _, soft2, asoft2, _ = media_prompt(mod, [image(9, 40, 24)], [wave(3, 20 * 6 + 7)])
    assert ids2 == ids
    assert np.abs(oracle(mod, ids2, soft2, asoft2, mm, "sliding-clamped") - ours).max() < 1e-12  # same weights

    # Gemma4UnifiedForCausalLM: flat config, tensors under model.
    causal = tmp_path / "causal"
    lm = Gemma4UnifiedForCausalLM.from_pretrained(str(d), config=hf.config.text_config,
                                                  key_mapping={"^model.language_model.": "model."})
    lm.save_pretrained(causal)
    text_ids = [2] + np.random.default_rng(4).integers(3, 290, 19).tolist()
    lm = recompute_float64_buffers(lm.double().eval())
    with torch.no_grad(), unified_float64_exact():
        theirs = lm(torch.tensor([text_ids])).logits[0].numpy()
    assert json.loads((causal / "config.json").read_text())["architectures"] == ["Gemma4UnifiedForCausalLM"]
    diff = np.abs(Gemma4(causal).forward(text_ids) - theirs).max()
    assert diff < EXACT_BOUND, f"{diff:.3g}"
