"""Image prompts end to end (refimpl.multimodal + refimpl.vision + Gemma4.forward) against transformers'
``Gemma4ForConditionalGeneration`` full-sequence logits, float64 with the float32 spots patched.

Two tiny random checkpoints written by transformers 5.24 (vision tower as in tests/oracle/towers/test_vision_tower.py;
text: hidden 64, 3 layers sliding/sliding/full, window 8, PLE width 8 over a 512-row table that holds
the image token's own row, softcap 30): one with ``use_bidirectional_attention="vision"``, one without.
Prompts ``text + boi + 63|65 image tokens + eoi + text (+ second image + text)`` with pixel inputs from
``Gemma4ImageProcessorPil``; transformers gets input_ids, pixel_values (float64), image_position_ids and
mm_token_type_ids. Every row of the logits is compared.

Also shown: each rule matters (a deliberately wrong variant differs by far more than the bound): the
vision block mask on the bidirectional model, no sqrt(H) on soft tokens, the pad row for PLE at image
positions, and the PLE context term from the merged embedding.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_towers import TINY_TEXT, TINY_TOKEN_IDS, TINY_VISION, tiny_vision_checkpoints, vision_float64_exact

from refimpl.errors import InputError
from refimpl.model import Gemma4, KVCache
from refimpl.multimodal import load_multimodal_tokens, multimodal_inputs, multimodal_logits, vision_block_ids
from refimpl.ops import attention_mask, vision_block_mask
from refimpl.vision import load_vision_tower, vision_tower_batch

# float64 rounding through the tower and 3 decoder layers, logits up to 30 (softcap). Measured worst case
# over every row of the 3 cases below: 4.2e-13 (vision, 1 image), 1.0e-12 (vision, 2), 6.9e-13 (causal, 2).
EXACT_BOUND = 5e-12

VISION, TEXT, TOKEN_IDS = TINY_VISION, TINY_TEXT, TINY_TOKEN_IDS
IMAGE_SIZES = [(40, 56), (90, 36)]  # 63 and 65 soft tokens (see tests/oracle/towers/test_vision_tower.py)
IMG, BOI, EOI = TOKEN_IDS["image_token_id"], TOKEN_IDS["boi_token_id"], TOKEN_IDS["eoi_token_id"]


@pytest.fixture(scope="module")
def env(torch_one_thread):
    pytest.importorskip("PIL")  # the image processor
    return torch_one_thread


@pytest.fixture(scope="module")
def processed(env):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    proc = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=3, max_soft_tokens=70)
    rng = np.random.default_rng(11)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in IMAGE_SIZES]
    out = proc(images=images, return_tensors="np")
    counts = [int(n) for n in out["num_soft_tokens_per_image"]]
    assert counts == [63, 65]
    return np.asarray(out["pixel_values"]), np.asarray(out["image_position_ids"]), counts


@pytest.fixture(scope="module")
def checkpoints(env, tmp_path_factory):
    """{name: (dir, float64 HF model)} for "vision" (bidirectional image blocks) and "causal"."""
    return tiny_vision_checkpoints(env, tmp_path_factory, "merge")


def _prompt(counts, seed=0):
    rng = np.random.default_rng(seed)

    def text(n: int) -> list:
        return list(rng.integers(3, 480, n))

    ids = [2] + text(5)
    for n in counts:
        ids += [BOI] + [IMG] * n + [EOI] + text(6)
    return np.array(ids, dtype=np.int64)


def _hf_logits(env, hf, ids, pixel_values, positions, token_types=True):
    torch, mg, hf_reference = env

    mm = torch.from_numpy((ids == IMG).astype(np.int64)[None]) if token_types else None
    with torch.no_grad(), vision_float64_exact(torch, mg, hf_reference):
        out = hf(input_ids=torch.from_numpy(ids[None]), pixel_values=torch.from_numpy(pixel_values.astype(np.float64)),
                 image_position_ids=torch.from_numpy(positions.astype(np.int64)), mm_token_type_ids=mm,
                 use_cache=False)
    return out.logits[0].numpy()


def _ours(path, ids, pixel_values, positions, n_images):
    model = Gemma4(path)
    soft = vision_tower_batch(pixel_values[:n_images], positions[:n_images], *load_vision_tower(path))
    tokens = load_multimodal_tokens(path)
    return model, soft, tokens, multimodal_logits(model, ids, soft, tokens)


CASES = [("vision", 1), ("vision", 2), ("causal", 2)]


@pytest.mark.hf
@pytest.mark.parametrize("name,n_images", CASES)
def test_image_prompt_logits_equal_transformers(name, n_images, checkpoints, processed, env, monkeypatch):
    path, hf = checkpoints[name]
    pixel_values, positions, counts = processed
    ids = _prompt(counts[:n_images], seed=n_images)
    model, soft, tokens, ours = _ours(path, ids, pixel_values, positions, n_images)
    theirs = _hf_logits(env, hf, ids, pixel_values[:n_images], positions[:n_images])
    assert ours.shape == theirs.shape == (len(ids), TEXT["vocab_size"])
    diff = float(np.abs(ours - theirs).max())
    print(f"\n{name}, {n_images} image(s), T={len(ids)}: max |refimpl - transformers| = {diff:.2e} "
          f"(logits up to {np.abs(theirs).max():.1f})")
    assert diff < EXACT_BOUND
    if name == "vision" and n_images == 1:  # spec trap 2: without mm_token_type_ids HF is causal over images
        no_types = _hf_logits(env, hf, ids, pixel_values[:1], positions[:1], token_types=False)
        m = multimodal_inputs(model, ids, soft, tokens)
        causal = model.forward(m.ids, embeddings=m.embeddings)
        assert np.abs(causal - no_types).max() < EXACT_BOUND

    # every rule matters: a deliberately wrong variant is far off
    m = multimodal_inputs(model, ids, soft, tokens)
    img = ids == IMG

    def off(ids_=m.ids, embeddings=m.embeddings, vision_blocks=m.vision_blocks):
        x = model.forward(ids_, embeddings=embeddings, vision_blocks=vision_blocks)
        return float(np.abs(x - theirs).max())

    wrong = {}
    if name == "vision":
        wrong["no block mask"] = off(vision_blocks=None)
        # the earlier HF rule (spec 7.3.1): same-block keys open beyond the sliding window's past side
        import refimpl.model as rm
        with monkeypatch.context() as mp:
            mp.setattr(rm, "vision_block_mask", lambda qp, kp, w, qb, kb: rm.attention_mask(qp, kp, w) | (
                (qb[:, None] == kb[None, :]) & (qb[:, None] >= 0)))
            wrong["block mask not clamped to the window"] = off()
    else:
        assert m.vision_blocks is None
    scaled = m.embeddings.copy()
    scaled[img] *= np.sqrt(TEXT["hidden_size"])
    wrong["soft tokens times sqrt(H)"] = off(embeddings=scaled)
    wrong["PLE row of the image token id"] = off(ids_=ids)
    # PLE context term from the pre-merge embedding (E[pad] sqrt(H) at image rows), as trap 17 describes
    premerge = model.embed(m.ids)
    model.ple = lambda x0, ple_ids: Gemma4.ple(model, premerge, ple_ids)
    try:
        wrong["PLE context from the pre-merge embedding"] = off()
    finally:
        del model.ple
    print("wrong variants:", {k: f"{v:.2e}" for k, v in wrong.items()})
    for k, v in wrong.items():
        assert v > 0.1, k


@pytest.mark.hf
def test_block_mask_only_opens_sliding_layers_within_a_block(checkpoints, processed):
    path, _ = checkpoints["vision"]
    pixel_values, positions, counts = processed
    ids = _prompt(counts, seed=2)
    model = Gemma4(path)
    soft = vision_tower_batch(pixel_values, positions, *load_vision_tower(path))
    m = multimodal_inputs(model, ids, soft, load_multimodal_tokens(path))
    assert sorted(set(m.vision_blocks.tolist())) == [-1, 0, 1]
    # boi/eoi are outside the blocks
    assert (m.vision_blocks[(ids == BOI) | (ids == EOI)] == -1).all()
    # text before the first image does not depend on the images at all
    first = int(np.argmax(ids == BOI))
    full = model.forward(m.ids, embeddings=m.embeddings, vision_blocks=m.vision_blocks)
    other = [s + 1.0 for s in soft]
    m2 = multimodal_inputs(model, ids, other, load_multimodal_tokens(path))
    full2 = model.forward(m2.ids, embeddings=m2.embeddings, vision_blocks=m2.vision_blocks)
    assert np.array_equal(full[:first + 1], full2[:first + 1])
    # through a cache: the image prompt prefilled in one call, then text decoded token by token
    cache = KVCache()
    split = len(ids) - 4
    pieces = [model.forward(m.ids[:split], embeddings=m.embeddings[:split], vision_blocks=m.vision_blocks[:split],
                            cache=cache)]
    for t in range(split, len(ids)):
        pieces.append(model.forward(m.ids[t:t + 1], embeddings=m.embeddings[t:t + 1], cache=cache))
    assert np.abs(np.concatenate(pieces) - full).max() < 1e-12
    # bad inputs
    with pytest.raises(InputError, match=r"lengths \[63, 65\], but the images have \[63\]"):
        multimodal_inputs(model, ids, soft[:1], load_multimodal_tokens(path))
    with pytest.raises(InputError, match=r"must be \[M, 64\]"):
        multimodal_inputs(model, ids, [soft[0][:, :8], soft[1]], load_multimodal_tokens(path))
    # the causal checkpoint refuses block ids
    causal = Gemma4(checkpoints["causal"][0])
    with pytest.raises(InputError, match="causal in every layer"):
        causal.forward(m.ids, embeddings=m.embeddings, vision_blocks=m.vision_blocks)


def test_vision_block_mask_by_hand():
    # W = 3; tokens 0..6, one block at 2..5
    pos = np.arange(7)
    blocks = np.array([-1, -1, 0, 0, 0, 0, -1])
    m = vision_block_mask(pos, pos, 3, blocks, blocks).astype(int)
    expected = np.array([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],  # block token: all later block tokens, W - 1 = 2 back
        [0, 1, 1, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1, 0],  # the block's first token (2) is outside the window's past side
        [0, 0, 0, 0, 1, 1, 1],
    ])
    assert (m == expected).all()
    assert (vision_block_mask(pos, pos, 3, -np.ones(7, int), -np.ones(7, int)) == attention_mask(pos, pos, 3)).all()


def test_vision_block_ids():
    v = np.array([0, 1, 1, 0, 0, 1, 0, 1, 1, 1], dtype=bool)
    assert vision_block_ids(v).tolist() == [-1, 0, 0, -1, -1, 1, -1, 2, 2, 2]
    assert vision_block_ids(np.array([1, 1, 0], dtype=bool)).tolist() == [0, 0, -1]
