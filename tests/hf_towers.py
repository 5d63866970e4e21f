"""transformers' vision and audio towers in exact float64, for the tests that compare the oracle's towers with
them (tests/refimpl/towers/, the fixture and transformers-backend tests): the float64 copies of the spots where
transformers computes in float32 (each pinned by the sha256 of its source in transformers 5.24.0, like
hf_reference.py), the non-persistent buffers recomputed in float64, and the random weights the tower tests use.
Why each spot is patched: tests/refimpl/towers/test_vision_tower.py and test_audio_tower.py, their docstrings."""

from __future__ import annotations

import contextlib
import math

AUDIO_RAW_LOGITS: list[float] = []  # max |logit| before the cap, per attention call of the patched audio forward


def _vision_patches(torch, mg):
    """(owner, attribute, original, float64 replacement, sha256 of the original in transformers 5.24.0)."""
    F64 = torch.float64
    F = torch.nn.functional
    orig_rotary = mg.Gemma4VisionRotaryEmbedding.forward
    orig_pool = mg.Gemma4VisionPooler._avg_pool_by_positions
    orig_pooler = mg.Gemma4VisionPooler.forward

    def rotary_forward_f64(self, x, position_ids):
        # Original: position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        if x.dtype != F64:
            return orig_rotary(self, x, position_ids)
        freqs = position_ids[..., None].to(F64) * self.inv_freq.to(device=x.device, dtype=F64)
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling

        cos = self.recomposition_frequencies(cos)
        sin = self.recomposition_frequencies(sin)
        return cos.to(x.dtype), sin.to(x.dtype)

    def avg_pool_f64(self, hidden_states, pixel_position_ids, length):
        # Original: F.one_hot(...).float() / k_squared; weights.transpose(1, 2) @ hidden_states.float()
        if hidden_states.dtype != F64:
            return orig_pool(self, hidden_states, pixel_position_ids, length)
        input_seq_len = hidden_states.shape[1]
        k = int((input_seq_len // length) ** 0.5)
        k_squared = k**2
        if k_squared * length != input_seq_len:
            raise ValueError(
                f"Cannot pool {hidden_states.shape} to {length}: {k=}^2 times {length=} must be {input_seq_len}."
            )
        clamped_positions = pixel_position_ids.clamp(min=0)
        max_x = clamped_positions[..., 0].max(dim=-1, keepdim=True)[0] + 1
        kernel_idxs = torch.div(clamped_positions, k, rounding_mode="floor")
        kernel_idxs = kernel_idxs[..., 0] + (max_x // k) * kernel_idxs[..., 1]
        weights = F.one_hot(kernel_idxs.long(), length).to(F64) / k_squared
        output = weights.transpose(1, 2) @ hidden_states
        mask = torch.logical_not((weights == 0).all(dim=1))
        return output.to(hidden_states.dtype), mask

    def pooler_forward_f64(self, hidden_states, pixel_position_ids, padding_positions, output_length=None):
        # Original: hidden_states = hidden_states.float() * self.root_hidden_size
        if hidden_states.dtype != F64:
            return orig_pooler(self, hidden_states, pixel_position_ids, padding_positions, output_length)
        if output_length > hidden_states.shape[1]:
            raise ValueError(
                f"Cannot output more soft tokens (requested {output_length}) than there are patches"
                f" ({hidden_states.shape[1]}). Change the value of `num_soft_tokens` when processing."
            )
        hidden_states = hidden_states.masked_fill(padding_positions.unsqueeze(-1), 0.0)
        if hidden_states.shape[1] != output_length:
            hidden_states, padding_positions = self._avg_pool_by_positions(
                hidden_states, pixel_position_ids, output_length
            )
        hidden_states = hidden_states * self.root_hidden_size
        return hidden_states, padding_positions

    return [
        (mg.Gemma4VisionRotaryEmbedding, "forward", orig_rotary, rotary_forward_f64,
         "ea8611d2000fe659053baabf4cbe3f275e1517b7b41d6a80b8b1028e4f306ca8"),
        (mg.Gemma4VisionPooler, "_avg_pool_by_positions", orig_pool, avg_pool_f64,
         "a6c52ab4852ff629691463bb13732e1cf1d1ea6eb9dc6d97814b293dd0a098bc"),
        (mg.Gemma4VisionPooler, "forward", orig_pooler, pooler_forward_f64,
         "ebb31c87df3a3adc0d7fe2a6e78753662b1e466b3d3883647786ca8685fbecfd"),
    ]


def _vision_audited(mg):
    """Read for float32 spots and left alone (see the module docstring); pinned so a change is noticed."""
    return [
        (mg.Gemma4VisionModel.forward, "9f5cdc4ae1af27b6fb12cf3b3564994aaf22fa9668be93ed201dbd127448ff25"),
        (mg.Gemma4VisionPatchEmbedder.forward, "c85821fe0650e3d45a3e3e42f0397eb679cf3c06577b8e9e5fe129abab28fb42"),
    ]



@contextlib.contextmanager

def vision_float64_exact(torch, mg, hf_reference):
    """hf_reference.float64_exact() (RMSNorm, eager softmax) plus the vision rotary and pooler copies."""
    with hf_reference.audited_float64_exact(_vision_patches(torch, mg), _vision_audited(mg),
                                            "tests/test_vision_tower.py"):
        yield


def recompute_vision_inv_freq(torch, mg, model) -> None:
    """Gemma4VisionRotaryEmbedding's inv_freq buffers, same formula, in float64 (checked against the old)."""
    for name, module in model.named_modules():
        if isinstance(module, mg.Gemma4VisionRotaryEmbedding):
            cfg = module.config
            spatial_dim = cfg.head_dim // 2
            base = float(cfg.rope_parameters["rope_theta"])
            new = 1.0 / (base ** (torch.arange(0, spatial_dim, 2, dtype=torch.float64) / spatial_dim))
            for attr in ("inv_freq", "original_inv_freq"):
                old = getattr(module, attr)
                if old.shape != new.shape or not torch.allclose(old.to(torch.float64), new, rtol=1e-6, atol=0):
                    raise RuntimeError(f"{name}.{attr}: float64 recomputation disagrees with transformers")
                setattr(module, attr, new)


def randomise_vision(torch, model, seed: int) -> None:
    """Random vision weights: norms and std_scale around 1, clip bounds finite and biting, the rest N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    named = list(model.named_parameters()) + list(model.named_buffers())
    with torch.no_grad():
        for name, t in named:
            if "inv_freq" in name or not t.is_floating_point():
                continue
            last = name.split(".")[-1]
            if last == "weight" and "norm" in name.split(".")[-2] or last in ("std_scale", "layer_scalar"):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            elif last == "std_bias":
                t.copy_(2.0 * torch.randn(t.shape, generator=g))
            elif last == "position_embedding_table":
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            elif last in ("input_min", "output_min"):
                t.copy_(-(0.6 + 0.6 * torch.rand((), generator=g)))
            elif last in ("input_max", "output_max"):
                t.copy_(0.6 + 0.6 * torch.rand((), generator=g))
            elif name.endswith("embed_scale"):
                continue
            else:
                t.copy_(0.1 * torch.randn(t.shape, generator=g))


def _audio_patches(torch, mg):
    """(owner, attribute, original, float64 replacement, sha256 of the original in transformers 5.24.0)."""
    F64 = torch.float64
    F = torch.nn.functional
    orig_attn = mg.Gemma4AudioAttention.forward

    def audio_attention_forward_f64(self, hidden_states, position_embeddings, attention_mask=None):
        # Original: q/k/v_proj(...).float() and F.softmax(attn_weights, dim=-1, dtype=torch.float32).
        if hidden_states.dtype != F64:
            return orig_attn(self, hidden_states, position_embeddings, attention_mask)
        batch_size, seq_length, _ = hidden_states.shape
        hidden_shape = (batch_size, seq_length, self.num_heads, self.head_dim)

        query_states = self.q_proj(hidden_states).to(F64).view(hidden_shape)
        key_states = self.k_proj(hidden_states).to(F64).view(hidden_shape)
        value_states = self.v_proj(hidden_states).to(F64).view(hidden_shape)

        query_states = query_states * self.q_scale * F.softplus(self.per_dim_scale)
        key_states = key_states * self.k_scale

        query_states = self._convert_to_block(query_states)
        key_states = self._extract_block_context(key_states)
        value_states = self._extract_block_context(value_states)
        num_blocks = query_states.shape[1]

        relative_key_states = self.relative_k_proj(position_embeddings)
        relative_key_states = relative_key_states.view(-1, self.num_heads, self.head_dim)
        relative_key_states = relative_key_states.to(dtype=query_states.dtype)

        queries = query_states.permute(0, 3, 1, 2, 4)
        matrix_ac = queries @ key_states.permute(0, 3, 1, 4, 2)

        queries_flat = queries.reshape(batch_size, self.num_heads, -1, self.head_dim)
        matrix_bd = queries_flat @ relative_key_states.permute(1, 2, 0)
        matrix_bd = matrix_bd.reshape(batch_size, self.num_heads, num_blocks, self.chunk_size, -1)
        matrix_bd = self._rel_shift(matrix_bd)

        attn_weights = matrix_ac + matrix_bd
        AUDIO_RAW_LOGITS.append(attn_weights.detach().abs().max().item())
        attn_weights = attn_weights / self.softcap
        attn_weights = torch.tanh(attn_weights)
        attn_weights = attn_weights * self.softcap

        if attention_mask is not None:
            attn_weights = attn_weights.masked_fill(attention_mask != 0, self.config.attention_invalid_logits_value)

        attn_weights = F.softmax(attn_weights, dim=-1, dtype=F64).to(value_states.dtype)
        attn_output = attn_weights @ value_states.permute(0, 3, 1, 2, 4)
        attn_output = attn_output.permute(0, 2, 3, 1, 4).reshape(batch_size, num_blocks * self.chunk_size, -1)
        attn_output = attn_output[:, :seq_length].contiguous()
        attn_output = self.post(attn_output.to(hidden_states.dtype))

        return attn_output, attn_weights

    return [
        (mg.Gemma4AudioAttention, "forward", orig_attn, audio_attention_forward_f64,
         "2294a6e7b7e7fca7b57e6c19569891b0dd7d243b04d9f80c7e032b8a0ba5aaba"),
    ]


def _audio_audited(mg):
    """Read for float32 spots and left alone (see the module docstring); pinned so a change is noticed."""
    return [
        (mg.Gemma4AudioModel.forward,
         "bad9c8014ef9439d9f261a454b9496d15d970d403d05bca99d454d095cfb141d"),
        (mg.Gemma4AudioModel._convert_4d_mask_to_blocked_5d,
         "e8fecaab4b4615db01e8bcde461e3866592f91fd2c95d2f23288a19105fd6234"),
        (mg.sliding_window_mask_function,
         "85ccb9527d6d2b2e28f265edb13e546431833e47b1e3071896d659adf452a496"),
        (mg.Gemma4AudioRelPositionalEncoding.__init__,
         "6e8503a3923f81dedc457c90313337d3182c96e039958dc14360d16409d312cd"),
        (mg.Gemma4AudioRelPositionalEncoding.forward,
         "9a66b70b8db9fbfd99d55910fe0d29884957baf9f35a70f43cd187d7f44a8e11"),
        (mg.Gemma4AudioAttention.__init__,
         "083bee8b4db55367b4ae255694a3213550438442c25a3a87dce8c52527a54906"),
        (mg.Gemma4AudioAttention._convert_to_block,
         "92b3c69c2e47cadd4fbe25081a3bfa3f0085e5b1e0de373b5d3178655932fb70"),
        (mg.Gemma4AudioAttention._extract_block_context,
         "cae46334a66ec053ff7cd856b5677e6e4c7518d78a94f644b05182791300ef4b"),
        (mg.Gemma4AudioAttention._rel_shift,
         "aecae69ff567aeeb2372610ed213adfeb8006a37b541611f7a1d963974ed514e"),
        (mg.Gemma4AudioSubSampleConvProjectionLayer.forward,
         "19e89d8e6a5159c56f6996699fda49ae633f93bf2fd852b6965d102f1f37bf27"),
        (mg.Gemma4AudioSubSampleConvProjection.forward,
         "db88c9e86a829bb78ccce26b7d228428abc8478edaea91ec0223b93cc244ee6b"),
        (mg.Gemma4AudioFeedForward.forward,
         "bbc8a2fc0282ffeb6be77a2c2672332d59fd4fd0cd0361f05790389f1c80e3e0"),
        (mg.Gemma4AudioCausalConv1d.forward,
         "2153424712184fbcd47827056f50cac56aa489db710bf639ec6afa763e20a9bc"),
        (mg.Gemma4AudioLightConv1d.__init__,
         "166d6e64e113f64656d3734aff5c1e799f35f4ab6ad13ececf5dc3ca47fdd714"),
        (mg.Gemma4AudioLightConv1d.forward,
         "a9f967064fcc16e111b45c510a88af43ef99b0f031f071d2fd38f4db7bcf704c"),
        (mg.Gemma4AudioLayer.forward,
         "1e524db5d2ead758ead1112d3f6b697a9f826f9f44c9f23c292e8510fd37520c"),
        (mg.Gemma4ClippableLinear.forward,
         "9edb64f3c5e32da184b5f77594cc6ab741c18f9a01bca671c5895488b45f87c4"),
        (mg.Gemma4MultimodalEmbedder.forward,
         "20af6ddd8e1c4772517ee1956b4580faafde11e0b1e513bcbb60698dd20eb227"),
        (mg.Gemma4Model.get_audio_features,
         "f20cfcf62d4c7156d2314f1e2b03d3b16e65fd6a8012daf5535c138ce6ec5d36"),
    ]



@contextlib.contextmanager

def audio_float64_exact(torch, mg, hf_reference):
    """hf_reference.float64_exact() (RMSNorm) plus the float64 copy of Gemma4AudioAttention.forward."""
    with hf_reference.audited_float64_exact(_audio_patches(torch, mg), _audio_audited(mg),
                                            "tests/test_audio_tower.py"):
        yield


def recompute_audio_buffers(torch, mg, model) -> None:
    """The non-persistent audio buffers, same formulas, in float64 (each checked against the old value).

    ``from_pretrained(dtype=float64)`` leaves them float64 in dtype but float32-rounded in value
    (inv_timescales is off by up to ~4e-8 relative); softcap is only exact for float32-representable caps.
    """
    for name, module in model.named_modules():
        if isinstance(module, mg.Gemma4AudioRelPositionalEncoding):
            half = module.hidden_size // 2
            inc = math.log(10000.0) / max(half - 1, 1)
            new = torch.exp(torch.arange(half, dtype=torch.float64) * -inc)[None, None]
            old = module.inv_timescales
            if old.shape != new.shape or not torch.allclose(old.to(torch.float64), new, rtol=1e-6, atol=0):
                raise RuntimeError(f"{name}.inv_timescales: float64 recomputation disagrees with transformers")
            module.inv_timescales = new
        if isinstance(module, mg.Gemma4AudioAttention):
            cap = float(module.config.attention_logit_cap)
            if not math.isclose(module.softcap.item(), cap, rel_tol=1e-6):
                raise RuntimeError(f"{name}.softcap: {module.softcap.item()} is not the config's {cap}")
            module.softcap = torch.tensor(cap, dtype=torch.float64)


def randomise_audio(torch, model, seed: int) -> None:
    """Random audio weights: norms around 1, clip bounds finite and biting, q/k large (logits well past
    the cap), the rest N(0, 0.1^2)-ish scaled to their fan-in."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "audio" not in name or not t.is_floating_point() or "inv_timescales" in name or name.endswith("softcap"):
                continue
            parts = name.split(".")
            last = parts[-1]
            if last == "weight" and "norm" in parts[-2]:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            elif last in ("input_min", "output_min"):
                t.copy_(-(0.8 + 0.8 * torch.rand((), generator=g)))
            elif last in ("input_max", "output_max"):
                t.copy_(0.8 + 0.8 * torch.rand((), generator=g))
            elif last == "per_dim_scale":
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            elif parts[-3] in ("q_proj", "k_proj"):
                t.copy_(1.2 * torch.randn(t.shape, generator=g))
            elif "conv.weight" in name and "depthwise" not in name:
                t.copy_(0.4 * torch.randn(t.shape, generator=g))
            else:
                fan_in = t.shape[-1] if t.ndim > 1 else 1
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(fan_in))
        for name, t in model.named_parameters():  # the text/vision side does not matter here
            if "audio" not in name and t.is_floating_point():
                t.copy_(0.1 * torch.randn(t.shape, generator=g))


def randomise_text(torch, model, seed):
    """Text embeddings and PLE table N(0, 1), so logits are several units (the 0.1 of randomise_vision gives ~0.1)."""
    g = torch.Generator().manual_seed(1000 + seed)
    lm = model.model.language_model
    with torch.no_grad():
        lm.embed_tokens.weight.copy_(torch.randn(lm.embed_tokens.weight.shape, generator=g))
        lm.embed_tokens_per_layer.weight.copy_(torch.randn(lm.embed_tokens_per_layer.weight.shape, generator=g))


# the tiny image-text checkpoints of the towers' merge tests (tests/oracle/towers/test_{image,video,audio}_merge.py):
# a 2-layer vision tower, text of hidden 64 with 3 layers (sliding, sliding, full), window 8, PLE width 8, softcap 30
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3,
                   position_embedding_size=64)
TINY_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8,
                 hidden_size_per_layer_input=8, vocab_size_per_layer_input=512, final_logit_softcapping=30.0,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention"])
TINY_TOKEN_IDS = dict(image_token_id=500, boi_token_id=501, eoi_token_id=502, audio_token_id=503, boa_token_id=504,
                      eoa_token_index=505, video_token_id=506)


def tiny_vision_checkpoints(env, tmp_path_factory, prefix: str, seed: int = 0) -> dict:
    """{name: (directory, float64 transformers model)} for "vision" (bidirectional vision blocks) and "causal":
    Gemma4ForConditionalGeneration of TINY_VISION / TINY_TEXT with random weights (seeds ``seed``, ``seed + 1``),
    saved by transformers and loaded back in float64 with its float32 spots made float64."""
    torch, mg, hf_reference = env
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    out = {}
    for k, (name, bidir) in enumerate([("vision", "vision"), ("causal", None)]):
        cfg = Gemma4Config(text_config={**TINY_TEXT, "use_bidirectional_attention": bidir},
                           vision_config=dict(TINY_VISION), audio_config=None, **TINY_TOKEN_IDS)
        model = Gemma4ForConditionalGeneration(cfg)
        randomise_vision(torch, model, seed + k)
        randomise_text(torch, model, seed + k)
        path = tmp_path_factory.mktemp(f"{prefix}_{name}")
        model.save_pretrained(path)
        hf = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                                            use_safetensors=True)
        hf.eval()
        recompute_vision_inv_freq(torch, mg, hf)
        hf_reference.recompute_float64_buffers(hf)
        out[name] = (path, hf)
    return out
