"""Self-check of tests/hf_reference.py on a tiny random checkpoint written by transformers.

hf_reference runs HF transformers' Gemma 4 with its float32 steps switched to
float64. Here that is checked against tests/naive_gemma4.py (an independent,
all-float64 implementation written from the spec): they must agree to ~1e-14,
while stock transformers (float32 RMSNorm / softmax / RoPE inside a float64
model) must be visibly worse, which proves the patches are in effect.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_reference as H  # noqa: E402  (needs torch + transformers)
from naive_gemma4 import naive_forward  # noqa: E402 - after the importorskip of torch

pytestmark = pytest.mark.hf

S, F = "sliding_attention", "full_attention"
# Every Gemma 4 text feature at once: PLE, KV sharing (both layer types),
# k_eq_v with one global KV head, double-wide MLP, MoE, final soft-cap.
CONFIG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
    sliding_window=4, hidden_size_per_layer_input=4, vocab_size_per_layer_input=128,
    num_kv_shared_layers=2, final_logit_softcapping=30.0, layer_types=[S, S, S, F, S, F],
    enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
    attention_k_eq_v=True, num_global_key_value_heads=1, use_double_wide_mlp=True,
)
IDS = [2, 17, 100, 45, 99, 127, 3, 8, 50, 1, 77, 123, 40, 5, 64, 31]  # longer than sliding_window


def _randomise(model, seed: int) -> None:
    """Random weights; norm weights, scales and the layer_scalar buffers around 1, not at 1."""
    g = torch.Generator().manual_seed(seed)
    tensors = list(model.named_parameters())
    tensors += [(n, b) for n, b in model.named_buffers() if n.endswith("layer_scalar")]
    with torch.no_grad():
        for name, t in tensors:
            parts = name.split(".")
            if name.endswith(("norm.weight", "layernorm.weight", ".scale", "per_expert_scale", "layer_scalar")) \
                    or "norm" in parts[-2]:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.1 * torch.randn(t.shape, generator=g))


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny models: OpenMP threads only add overhead, and on a busy 2-core box
    their spin-waiting made these forwards 50-100x slower (seconds, not ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(model_dir, naive weights) of a float32 Gemma4ForCausalLM checkpoint."""
    from safetensors.numpy import load_file

    cfg = transformers.Gemma4TextConfig(**CONFIG)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    _randomise(model, seed=0)
    model_dir = tmp_path_factory.mktemp("gemma4_tiny")
    model.save_pretrained(model_dir)
    weights = {k.removeprefix("model."): v.astype(np.float64)
               for k, v in load_file(model_dir / "model.safetensors").items()}
    return model_dir, weights


@pytest.fixture(scope="module")
def model(checkpoint):
    return H.load_hf_causal_lm(checkpoint[0])


@pytest.fixture(scope="module")
def naive_logits(checkpoint):
    return naive_forward(CONFIG, checkpoint[1], IDS)


def test_exact_matches_naive_and_stock_does_not(model, naive_logits):
    exact = H.hf_logits(model, IDS, exact=True)
    stock = H.hf_logits(model, IDS, exact=False)
    assert exact.shape == naive_logits.shape == (len(IDS), CONFIG["vocab_size"])
    assert exact.dtype == np.float64
    assert np.abs(exact - naive_logits).max() < 1e-11
    assert np.abs(stock - naive_logits).max() > 1e-9  # the float32 spots are real and patched


def test_incremental_matches_full(model, naive_logits):
    inc = H.hf_logits_incremental(model, IDS, [5, 1, 1, 7, 2], exact=True)
    assert np.abs(inc - naive_logits).max() < 1e-11


def test_trace_and_patches_restored(model):
    trace = H.hf_trace(model, IDS)
    assert sorted(trace) == list(range(CONFIG["num_hidden_layers"]))
    for idx in trace.values():
        assert idx.shape == (len(IDS), CONFIG["top_k_experts"])
        assert ((0 <= idx) & (idx < CONFIG["num_experts"])).all()
    for owner, attr, original, _, _ in H._PATCHES:
        assert getattr(owner, attr) is original


def test_multimodal_checkpoint_layout(tmp_path, checkpoint, naive_logits):
    """A Gemma4ForConditionalGeneration directory loads as the same text model."""
    text_cfg = transformers.Gemma4TextConfig(**CONFIG)
    cfg = transformers.Gemma4Config(text_config=text_cfg.to_dict(), vision_config=None, audio_config=None)
    mm = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    causal = transformers.Gemma4ForCausalLM.from_pretrained(checkpoint[0], use_safetensors=True)
    missing, unexpected = mm.model.language_model.load_state_dict(causal.model.state_dict(), strict=False)
    assert not missing and not unexpected
    mm.save_pretrained(tmp_path)
    model = H.load_hf_causal_lm(tmp_path)
    assert np.abs(H.hf_logits(model, IDS) - naive_logits).max() < 1e-11
