"""The Gemma 4 Unified oracle against the independent loop implementation (``tests/naive_gemma4.py``): the
processor's patches, both embedders and the decoder with image and audio soft tokens under both mask
rules, on ``12b-mini`` and on configs drawn by hypothesis. Nothing here needs torch.

The naive side reads the weights with the ``safetensors`` package (not refimpl's reader), cuts patches
pixel by pixel, normalises with ``math.fsum`` and decides every mask entry with an explicit predicate.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import write_unified_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from naive_gemma4 import naive_audio_embedder, naive_forward, naive_unified_patches, naive_vision_embedder
from safetensors.numpy import load_file

from refimpl.frontends import audio_front_end, image_front_end
from refimpl.model import VISION_MASK_RULES, Gemma4
from refimpl.multimodal import (
    MULTIMODAL_PIECES,
    expand_audio_placeholders,
    expand_image_placeholders,
    load_multimodal_tokens,
    multimodal_inputs,
)
from refimpl.synth import piece_id, write_checkpoint
from refimpl.unified import UnifiedAudioConfig, audio_frames

# float64 rounding of ~30-sized logits through 6 layers, summed differently (loops vs BLAS): measured
# 6.5e-13 on the 12b-mini prompt below; embedders below 1e-14; patches are exact.
BOUND = 1e-10


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    d = write_checkpoint("12b-mini", 0, tmp_path_factory.mktemp("u") / "12b-mini")
    return d, load_file(str(d / "model.safetensors"))


def naive_text(weights):
    return {k[len("model.language_model."):]: v for k, v in weights.items() if k.startswith("model.language_model.")}


def image(seed, h, w):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def prompt_with(model_dir, weights, images, waves, seed=0):
    cfg = json.loads((model_dir / "config.json").read_text())
    mm = load_multimodal_tokens(model_dir)
    img_f, aud_f = image_front_end(model_dir), audio_front_end(model_dir)
    processed = [img_f.preprocess(x) for x in images]
    A = cfg["audio_config"]["audio_embed_dim"]
    rng = np.random.default_rng(seed)
    ids = [2, 30, 31]
    for _ in processed:
        ids += [mm.image_token_id, 40 + int(rng.integers(0, 20))]
    for _ in waves:
        ids += [mm.audio_token_id, 60]
    ids += rng.integers(20, 60, 4).tolist()
    ids = expand_image_placeholders(ids, [p.num_soft_tokens for p in processed], mm)
    ids = expand_audio_placeholders(ids, [-(-len(w) // A) for w in waves], mm).tolist()
    # naive soft tokens, from the naive patches of the resized pixels and the raw waveform
    M = img_f.settings.patch_size * img_f.settings.pooling_kernel_size
    naive_soft = [naive_vision_embedder(weights, *naive_unified_patches(p.pixels, M, img_f.settings.max_soft_tokens))
                  for p in processed]
    naive_audio = [naive_audio_embedder(weights, w, A) for w in waves]
    soft = [img_f.soft_tokens(p) for p in processed]
    asoft = [aud_f.soft_tokens(aud_f.features(w, 16_000)) for w in waves]
    return ids, mm, soft, asoft, naive_soft, naive_audio, processed


def compare(model_dir, weights, ids, mm, soft, asoft, naive_soft, naive_audio):
    cfg = json.loads((model_dir / "config.json").read_text())["text_config"]
    worst = 0.0
    for rule in VISION_MASK_RULES:
        m = Gemma4(model_dir, vision_mask=rule)
        x = multimodal_inputs(m, ids, soft, mm, audio_soft_tokens=asoft)
        ours = m.forward(x.ids, embeddings=x.embeddings, vision_blocks=x.vision_blocks)
        # the naive merge: text rows scaled, soft tokens as they are, pad id at placeholders (not used: no PLE)
        rows = [np.asarray(weights["model.language_model.embed_tokens.weight"][t], dtype=np.float64)
                * np.sqrt(cfg["hidden_size"]) for t in ids]
        img_rows = iter(np.concatenate(naive_soft)) if naive_soft else iter(())
        aud_rows = iter(np.concatenate(naive_audio)) if naive_audio else iter(())
        blocks, b, prev = [], -1, False
        for i, t in enumerate(ids):
            if t == mm.image_token_id:
                rows[i] = next(img_rows)
                b += 0 if prev else 1
            elif t == mm.audio_token_id:
                rows[i] = next(aud_rows)
            blocks.append(b if t == mm.image_token_id else -1)
            prev = t == mm.image_token_id
        theirs = naive_forward(cfg, naive_text(weights), ids, inputs=np.array(rows), blocks=blocks, rule=rule)
        worst = max(worst, float(np.abs(ours - theirs).max()))
    return worst


def test_patches_and_embedders_match_the_loops(mini):
    d, weights = mini
    img_f = image_front_end(d)
    for k, (h, w) in enumerate([(50, 70), (24, 60), (60, 24)]):
        p = img_f.preprocess(image(k, h, w))
        pv, pos = naive_unified_patches(p.pixels, 12, 70)
        assert np.array_equal(p.pixel_values, pv) and np.array_equal(p.positions, pos)
        diff = np.abs(img_f.soft_tokens(p) - naive_vision_embedder(weights, pv, pos)).max()
        assert diff < 1e-13, f"{h}x{w}: {diff:.3g}"
    wave = np.random.default_rng(3).uniform(-1, 1, 640 * 4 + 17)
    aud_f = audio_front_end(d)
    diff = np.abs(aud_f.soft_tokens(aud_f.features(wave, 16_000)) - naive_audio_embedder(weights, wave, 640)).max()
    assert diff < 1e-13, f"audio: {diff:.3g}"


def test_decoder_with_images_and_audio_matches_the_loops(mini):
    d, weights = mini
    wave = np.random.default_rng(4).uniform(-1, 1, 640 * 3 + 17)
    args = prompt_with(d, weights, [image(7, 24, 60), image(8, 36, 36)], [wave])
    worst = compare(d, weights, *args[:-1])
    assert worst < BOUND, f"{worst:.3g}"


def test_audio_frames_are_zero_padded_float32():
    cfg = UnifiedAudioConfig(640, 1e-6, 64)
    x = np.random.default_rng(0).uniform(-1, 1, 640 * 2 + 17)
    f = audio_frames(x, cfg)
    assert f.shape == (3, 640)
    assert np.array_equal(f.reshape(-1)[:x.size], x.astype(np.float32).astype(np.float64))
    assert not f[2, 17:].any()


@st.composite
def configs(draw):
    L = draw(st.integers(2, 4))
    types = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]), min_size=L, max_size=L))
    types[-1] = "full_attention"
    N = draw(st.sampled_from([2, 4]))
    p, k = draw(st.sampled_from([(2, 2), (3, 1), (2, 3)]))
    return dict(layers=L, types=types, N=N, kv=draw(st.sampled_from([k for k in (1, 2) if N % k == 0])),
                k_eq_v=draw(st.booleans()), window=draw(st.integers(2, 5)), p=p, k=k,
                A=draw(st.sampled_from([6, 10])), E=draw(st.sampled_from([6, 8])))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(c=configs(), seed=st.integers(0, 1000), n_images=st.integers(0, 2), n_clips=st.integers(0, 1))
def test_drawn_configs_match_the_loops(tmp_path_factory, c, seed, n_images, n_clips):
    text = dict(
        model_type="gemma4_unified_text", vocab_size=64, hidden_size=16, intermediate_size=20,
        num_hidden_layers=c["layers"], layer_types=c["types"], num_attention_heads=c["N"], num_key_value_heads=c["kv"],
        num_global_key_value_heads=1, head_dim=4, global_head_dim=8, attention_k_eq_v=c["k_eq_v"],
        sliding_window=c["window"], final_logit_softcapping=30.0, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, use_bidirectional_attention="vision", bos_token_id=2, pad_token_id=0,
        eos_token_id=[1], hidden_size_per_layer_input=8, num_kv_shared_layers=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1_000_000.0}})
    config = {"architectures": ["Gemma4UnifiedForConditionalGeneration"], "model_type": "gemma4_unified",
              "text_config": text, "tie_word_embeddings": True,
              "vision_config": dict(patch_size=c["p"], pooling_kernel_size=c["k"], mm_embed_dim=c["E"],
                                    mm_posemb_size=80, output_proj_dims=c["E"], rms_norm_eps=1e-6),
              "audio_config": dict(audio_embed_dim=c["A"], rms_norm_eps=1e-6),
              **{key: piece_id(piece) for key, piece in MULTIMODAL_PIECES.items()}}
    d = write_unified_checkpoint(tmp_path_factory.mktemp("naive") / "ckpt", config, seed)
    weights = load_file(str(d / "model.safetensors"))
    waves = [np.random.default_rng(seed).uniform(-1, 1, c["A"] * 2 + 1)] * n_clips
    imgs = [image(seed + j, 8 + 3 * j, 10) for j in range(n_images)]
    args = prompt_with(d, weights, imgs, waves, seed)
    worst = compare(d, weights, *args[:-1])
    assert worst < BOUND, f"{worst:.3g}"
