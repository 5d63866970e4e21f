"""Audio prompts end to end (refimpl.multimodal + refimpl.audio + Gemma4.forward) against transformers'
``Gemma4ForConditionalGeneration`` full-sequence logits, float64 with the float32 spots patched.

Two tiny random checkpoints written by transformers 5.24, both with the audio tower of
tests/oracle/towers/test_audio_tower.py (hidden 32, 2 layers, 16 mel bins, chunk 4) and the text decoder of
tests/oracle/towers/test_image_merge.py (hidden 64, 3 layers sliding/sliding/full, window 8, PLE width 8 over a
512-row table that holds the audio token's own row, softcap 30):

* ``causal``: text + audio, ``use_bidirectional_attention`` None;
* ``vision``: ``use_bidirectional_attention="vision"`` plus the vision tower of tests/oracle/towers/test_image_merge.py,
  to show that audio tokens stay causal where image tokens form bidirectional blocks.

Prompts ``text + boa + audio x A + eoa + text`` with one clip, two clips (the second with a masked tail:
41 mel frames, 11 of them masked, 8 soft tokens instead of 11), and image + clip on the bidirectional
checkpoint. transformers gets input_ids, input_features (float64), input_features_mask and
mm_token_type_ids (3 at audio tokens, 1 at image tokens), refimpl ``multimodal_logits`` with the
soft tokens of ``refimpl.audio.audio_tower`` run on the same features clip by clip. Every logits row is
compared.

Also shown: each rule matters (a deliberately wrong variant differs by far more than the bound): audio
soft tokens scaled by sqrt(H), PLE token part from the audio token's own row instead of the pad row, and
(bidirectional checkpoint) the audio run treated as a vision block. And a chunked prefill with the clip
inside one piece, then text decode through ``KVCache``, equals the full forward.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hf_towers import (
    TINY_TEXT,
    TINY_TOKEN_IDS,
    TINY_VISION,
    audio_float64_exact,
    randomise_audio,
    randomise_text,
    randomise_vision,
    recompute_audio_buffers,
    recompute_vision_inv_freq,
    vision_float64_exact,
)

from refimpl.errors import InputError
from refimpl.model import Gemma4, KVCache
from refimpl.multimodal import (
    MultimodalTokens,
    audio_spans,
    check_image_runs,
    expand_audio_placeholders,
    expand_image_placeholders,
    load_multimodal_tokens,
    multimodal_inputs,
    multimodal_logits,
    parse_multimodal_tokens,
    vision_block_ids,
    vision_token_mask,
)

# float64 rounding through the audio tower (~1e-14 on the soft tokens) and 3 decoder layers, logits up to
# 30 (softcap). Measured worst case over every row of the 3 cases below (pytest -s prints them):
# 9.9e-13 (causal, 1 clip), 1.3e-12 (causal, 2 clips), 7.1e-13 (vision, image + clip); ~4x the worst, as
# tests/oracle/towers/test_image_merge.py. Every wrong variant below is off by more than 10.
EXACT_BOUND = 5e-12

AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[16, 8],
             conv_kernel_size=5, attention_chunk_size=4, attention_context_left=5, attention_context_right=0,
             output_proj_dims=24, use_clipped_linears=False, rms_norm_eps=1e-3)
VISION, TEXT, TOKEN_IDS = TINY_VISION, TINY_TEXT, TINY_TOKEN_IDS
IMG, BOI, EOI = 500, 501, 502
AUD, BOA, EOA = 503, 504, 505
N_MELS, T_FRAMES = 16, 41
IMAGE_SIZE = (40, 56)  # 63 soft tokens (tests/oracle/towers/test_vision_tower.py)


@pytest.fixture(scope="module")
def env(torch_one_thread):
    return torch_one_thread


def _randomise(torch, model, seed):
    """Vision weights as tests/oracle/towers/test_vision_tower.py, audio weights as test_audio_tower.py (logits past the
    cap), text 0.1 N(0, 1) with N(0, 1) embedding and PLE tables (logits of several units)."""

    randomise_vision(torch, model, seed)  # every parameter
    keep = {n: t.detach().clone() for n, t in model.named_parameters() if "audio" not in n}
    randomise_audio(torch, model, seed)  # audio, and overwrites the rest with 0.1 N(0, 1)
    with torch.no_grad():
        for n, t in model.named_parameters():
            if n in keep:
                t.copy_(keep[n])
    randomise_text(torch, model, seed)


@pytest.fixture(scope="module")
def checkpoints(env, tmp_path_factory):
    """{name: (dir, float64 HF model)} for "causal" (text + audio) and "vision" (bidirectional, + vision tower)."""
    torch, mg, hf_reference = env
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    out = {}
    for seed, (name, bidir, vision) in enumerate([("causal", None, None), ("vision", "vision", VISION)]):
        cfg = Gemma4Config(text_config={**TEXT, "use_bidirectional_attention": bidir},
                           vision_config=dict(vision) if vision else None, audio_config=dict(AUDIO), **TOKEN_IDS)
        model = Gemma4ForConditionalGeneration(cfg)
        _randomise(torch, model, seed)
        path = tmp_path_factory.mktemp(f"audio_merge_{name}")
        model.save_pretrained(path)
        hf = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                                            use_safetensors=True)
        hf.eval()
        assert hf.config.audio_config._attn_implementation == "eager"
        recompute_audio_buffers(torch, mg, hf)
        if vision:
            recompute_vision_inv_freq(torch, mg, hf)
        hf_reference.recompute_float64_buffers(hf)
        out[name] = (path, hf)
    return out


@pytest.fixture(scope="module")
def features():
    """[2, T, 16] log-mel-like features, masks [2, T]: clip 0 fully valid (11 soft tokens), clip 1 with 11
    masked tail frames (8 soft tokens); masked frames zero, as the feature extractor leaves them."""
    rng = np.random.default_rng(5)
    mask = np.ones((2, T_FRAMES), dtype=bool)
    mask[1, 30:] = False
    x = rng.normal(-2.0, 1.5, (2, T_FRAMES, N_MELS)) * mask[..., None]
    return x, mask


@pytest.fixture(scope="module")
def image(env):
    pytest.importorskip("PIL")
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    proc = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=3, max_soft_tokens=70)
    pixels = np.random.default_rng(12).integers(0, 256, (*IMAGE_SIZE, 3), dtype=np.uint8)
    out = proc(images=[pixels], return_tensors="np")
    assert [int(n) for n in out["num_soft_tokens_per_image"]] == [63]
    return np.asarray(out["pixel_values"]), np.asarray(out["image_position_ids"]), 63


def _text(rng, n):
    return [int(t) for t in rng.integers(3, 480, n)]


def _prompt(items, seed):
    """[2] + text + (boi + image x M + eoi | boa + audio x A + eoa) + text per item ("image", M) / ("audio", A)."""
    rng = np.random.default_rng(seed)
    ids = [2] + _text(rng, 5)
    for kind, n in items:
        ids += ([BOI] + [IMG] * n + [EOI]) if kind == "image" else ([BOA] + [AUD] * n + [EOA])
        ids += _text(rng, 6)
    return np.array(ids, dtype=np.int64)


def _hf_logits(env, hf, ids, x, mask, image=None, token_types=True):
    torch, mg, hf_reference = env

    types = np.where(ids == AUD, 3, np.where(ids == IMG, 1, 0))[None]
    kwargs = dict(input_ids=torch.from_numpy(ids[None]), input_features=torch.from_numpy(x.astype(np.float64)),
                  input_features_mask=torch.from_numpy(mask),
                  mm_token_type_ids=torch.from_numpy(types) if token_types else None, use_cache=False)
    if image is not None:
        kwargs.update(pixel_values=torch.from_numpy(image[0].astype(np.float64)),
                      image_position_ids=torch.from_numpy(image[1].astype(np.int64)))
    with torch.no_grad(), audio_float64_exact(torch, mg, hf_reference), vision_float64_exact(torch, mg, hf_reference):
        out = hf(**kwargs)
    return out.logits[0].numpy()


def _audio_soft(path, x, mask):
    from refimpl.audio import audio_tower, load_audio_tower

    weights, cfg = load_audio_tower(path)
    return [audio_tower(x[b], mask[b], weights, cfg) for b in range(len(x))]


def _image_soft(path, image):
    from refimpl.vision import load_vision_tower, vision_tower_batch

    return vision_tower_batch(image[0], image[1], *load_vision_tower(path))


# (checkpoint, clips used, with an image in front)
CASES = [("causal", [0], False), ("causal", [0, 1], False), ("vision", [1], True)]


@pytest.mark.hf
@pytest.mark.parametrize("name,clips,with_image", CASES)
def test_audio_prompt_logits_equal_transformers(name, clips, with_image, checkpoints, features, env, request):
    path, hf = checkpoints[name]
    x, mask = features[0][clips], features[1][clips]
    audio = _audio_soft(path, x, mask)
    assert [a.shape for a in audio] == [(11 if c == 0 else 8, TEXT["hidden_size"]) for c in clips]
    image = request.getfixturevalue("image") if with_image else None
    items = ([("image", image[2])] if with_image else []) + [("audio", a.shape[0]) for a in audio]
    ids = _prompt(items, seed=len(clips) + 3 * with_image)
    model = Gemma4(path)
    tokens = load_multimodal_tokens(path)
    assert (tokens.boa_token_id, tokens.eoa_token_id) == (BOA, EOA)
    soft = _image_soft(path, image) if with_image else []
    ours = multimodal_logits(model, ids, soft, tokens, audio_soft_tokens=audio)
    theirs = _hf_logits(env, hf, ids, x, mask, image)
    assert ours.shape == theirs.shape == (len(ids), TEXT["vocab_size"])
    diff = float(np.abs(ours - theirs).max())
    print(f"\n{name}, clips {clips}{' + image' if with_image else ''}, T={len(ids)}: "
          f"max |refimpl - transformers| = {diff:.2e} (logits up to {np.abs(theirs).max():.1f})")
    assert diff < EXACT_BOUND

    # every rule matters: a deliberately wrong variant is far off
    m = multimodal_inputs(model, ids, soft, tokens, audio_soft_tokens=audio)
    aud = ids == AUD

    def off(ids_=m.ids, embeddings=m.embeddings, vision_blocks=m.vision_blocks):
        out = model.forward(ids_, embeddings=embeddings, vision_blocks=vision_blocks)
        return float(np.abs(out - theirs).max())

    wrong = {}
    scaled = m.embeddings.copy()
    scaled[aud] *= np.sqrt(TEXT["hidden_size"])
    wrong["audio soft tokens times sqrt(H)"] = off(embeddings=scaled)
    own_row = np.where(aud, ids, m.ids)  # image rows keep the pad id: only the audio rule is changed
    wrong["PLE row of the audio token id"] = off(ids_=own_row)
    if name == "vision":
        assert (m.vision_blocks[aud] == -1).all() and sorted(set(m.vision_blocks.tolist())) == [-1, 0]
        wrong["audio run as a vision block"] = off(vision_blocks=vision_block_ids(vision_token_mask(ids, tokens) | aud))
        # and the image block is real here: without it, far off too
        wrong["no image block"] = off(vision_blocks=None)
        # without mm_token_type_ids transformers is causal over images too (spec trap 2); audio unaffected
        causal = model.forward(m.ids, embeddings=m.embeddings)
        assert np.abs(causal - _hf_logits(env, hf, ids, x, mask, image, token_types=False)).max() < EXACT_BOUND
    else:
        assert m.vision_blocks is None
    print("wrong variants:", {k: f"{v:.2e}" for k, v in wrong.items()})
    for k, v in wrong.items():
        assert v > 0.1, k


@pytest.mark.hf
def test_chunked_prefill_and_decode_equal_the_full_forward(checkpoints, features):
    path, _ = checkpoints["causal"]
    x, mask = features
    audio = _audio_soft(path, x, mask)
    ids = _prompt([("audio", 11), ("audio", 8)], seed=9)
    model = Gemma4(path)
    tokens = load_multimodal_tokens(path)
    full = multimodal_logits(model, ids, [], tokens, audio_soft_tokens=audio)
    (a0, n0), (a1, n1) = audio_spans(ids, tokens)
    assert (n0, n1) == (11, 8)
    # text | clip 0 whole in one piece | text + clip 1 whole | text | token-by-token decode
    cuts = [0, a0 - 2, a0 + n0 + 3, a1 + n1 + 1, len(ids) - 3]
    cache = KVCache()
    pieces = []
    for s, e in itertools.pairwise(cuts):
        clips = [a for a, (start, _) in zip(audio, ((a0, n0), (a1, n1)), strict=True) if s <= start < e]
        if clips:
            pieces.append(multimodal_logits(model, ids[s:e], [], tokens, audio_soft_tokens=clips, cache=cache))
        else:
            pieces.append(model.forward(ids[s:e], cache=cache))
    for t in range(cuts[-1], len(ids)):
        pieces.append(model.forward(ids[t:t + 1], cache=cache))
    diff = float(np.abs(np.concatenate(pieces) - full).max())
    print(f"\nchunked prefill + decode vs full forward: {diff:.2e}")
    assert diff < 1e-12
    # audio is causal, so even a clip split across calls (merged inputs sliced) gives the same logits
    m = multimodal_inputs(model, ids, [], tokens, audio_soft_tokens=audio)
    cache = KVCache()
    split = a0 + 5
    halves = [model.forward(m.ids[:split], embeddings=m.embeddings[:split], cache=cache),
              model.forward(m.ids[split:], embeddings=m.embeddings[split:], cache=cache)]
    assert np.abs(np.concatenate(halves) - full).max() < 1e-12
    # text before the first clip does not depend on the audio at all; the text after it does
    other = multimodal_logits(model, ids, [], tokens, audio_soft_tokens=[a + 1.0 for a in audio])
    assert np.array_equal(other[:a0], full[:a0]) and np.abs(other[a0:] - full[a0:]).max() > 0.1
    # bad inputs through multimodal_inputs
    with pytest.raises(InputError, match=r"audio-token runs have lengths \[11, 8\], but the audio clips have \[11\]"):
        multimodal_inputs(model, ids, [], tokens, audio_soft_tokens=audio[:1])
    with pytest.raises(InputError, match=r"soft tokens of audio clip 1 must be \[M, 64\] \(M >= 1\), got \[8, 24\]"):
        multimodal_inputs(model, ids, [], tokens, audio_soft_tokens=[audio[0], audio[1][:, :24]])
    with pytest.raises(InputError, match=r"holds 19 audio placeholder\(s\) \(503\) but no audio soft tokens"):
        multimodal_logits(model, ids, [], tokens)


# ----------------------------------------------------------------------------------------------
# without transformers


TOKENS = parse_multimodal_tokens(TOKEN_IDS)


def test_token_ids_and_defaults():
    assert (TOKENS.boa_token_id, TOKENS.eoa_token_id, TOKENS.audio_token_id) == (BOA, EOA, AUD)
    shipped = parse_multimodal_tokens({})  # transformers' Gemma4Config defaults
    assert (shipped.boa_token_id, shipped.eoa_token_id, shipped.audio_token_id) == (256000, 258883, 258881)
    assert MultimodalTokens(1, 2, 3, -1, -1).boa_token_id == 256000  # positional construction still works
    from refimpl.errors import ConfigError
    with pytest.raises(ConfigError, match="'eoa_token_index' must be a non-negative integer token id"):
        parse_multimodal_tokens({"eoa_token_index": "x"})


def test_expand_audio_placeholders_and_spans():
    ids = expand_audio_placeholders([2, 7, AUD, 8, AUD, 9], [3, 2], TOKENS)
    assert ids.tolist() == [2, 7, BOA, AUD, AUD, AUD, EOA, 8, BOA, AUD, AUD, EOA, 9]
    assert audio_spans(ids, TOKENS) == [(3, 3), (9, 2)]
    assert audio_spans([2, 3], TOKENS) == []
    both = expand_image_placeholders(expand_audio_placeholders([2, IMG, AUD], [2], TOKENS), [1], TOKENS)
    assert both.tolist() == [2, BOI, IMG, EOI, BOA, AUD, AUD, EOA]
    with pytest.raises(InputError, match=r"^the prompt holds 1 audio placeholder\(s\) \(503, the <\|audio\|> token\) "
                                         r"but 2 audio clip\(s\) were given; put one placeholder where each clip goes"):
        expand_audio_placeholders([2, AUD], [1, 2], TOKENS)
    with pytest.raises(InputError, match="already holds begin/end-of-audio tokens; give one bare audio placeholder "
                                         "per clip"):
        expand_audio_placeholders([2, BOA, AUD], [1], TOKENS)


def test_check_runs():
    ids = np.array([2, BOI, IMG, IMG, EOI, BOA, AUD, AUD, AUD, EOA, BOA, AUD, EOA, 5])
    check_image_runs(ids, TOKENS, [2], [3, 1])
    with pytest.raises(InputError, match=r"holds 4 audio placeholder\(s\) \(503\) but no audio soft tokens were "
                                         r"given; pass audio_soft_tokens"):
        check_image_runs(ids, TOKENS, [2])
    with pytest.raises(InputError, match=r"audio-token runs have lengths \[3, 1\], but the audio clips have \[4\]"):
        check_image_runs(ids, TOKENS, [2], [4])
    with pytest.raises(InputError, match=r"audio-token runs have lengths \[\], but the audio clips have \[2\]"):
        check_image_runs(ids[:5], TOKENS, [2], [2])
    with pytest.raises(InputError, match=r"video-token runs have lengths \[1\], but the video frames given have "
                                         r"\[\] soft tokens; each frame needs its own run"):
        check_image_runs(np.append(ids, 506), TOKENS, [2], [3, 1])
    check_image_runs(np.append(ids, 506), TOKENS, [2], [3, 1], [1])
    # audio never forms a vision block
    assert vision_token_mask(ids, TOKENS).tolist() == [i in (IMG,) for i in ids.tolist()]
