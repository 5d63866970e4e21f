"""The synthetic checkpoints' presets (refimpl/synth.py writes them): the published variants in miniature
(``PRESETS``, one bundled fixture set each) and the published shapes at real size (``PUBLISHED``)."""

from __future__ import annotations

from .config import FULL, SLIDING

S, F = SLIDING, FULL
TOKENIZER_VOCAB = 512
SPECIAL_PIECES = [
    "<mask>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>",
    "<|video|>", "<|channel>", "<channel|>", "<|think|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
    "<tool_response|>", "<|tool>", "<tool|>", '<|"|>',
]

COMMON = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=64, num_attention_heads=4, head_dim=16, global_head_dim=32,
    sliding_window=8, final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=4096,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, attention_bias=False,
    rope_parameters={
        S: {"rope_type": "default", "rope_theta": 10_000.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=TOKENIZER_VOCAB, num_kv_shared_layers=0,
    use_double_wide_mlp=False, attention_k_eq_v=False, num_global_key_value_heads=None,
    enable_moe_block=False, num_experts=None, top_k_experts=None, moe_intermediate_size=None,
    use_bidirectional_attention=None, bos_token_id=2, pad_token_id=0,
)

PRESETS: dict[str, dict] = {
    "e2b-mini": dict(
        description="E2B in miniature: PLE, MQA, 4:1 sliding/full, 5 of 10 layers KV-shared, double-wide MLP",
        num_hidden_layers=10, layer_types=[S, S, S, S, F] * 2, num_key_value_heads=1, intermediate_size=128,
        hidden_size_per_layer_input=8, num_kv_shared_layers=5, use_double_wide_mlp=True,
    ),
    "e4b-mini": dict(
        description="E4B in miniature: PLE, GQA, 5:1 sliding/full, 6 of 12 layers KV-shared",
        num_hidden_layers=12, layer_types=[S, S, S, S, S, F] * 2, num_key_value_heads=2, intermediate_size=128,
        hidden_size_per_layer_input=8, num_kv_shared_layers=6,
    ),
    "26b-a4b-mini": dict(
        description="26B-A4B in miniature: MoE (8 experts, top-2) beside a dense branch, K=V full layers, 1 global KV "
                    "head",
        num_hidden_layers=6, layer_types=[S, S, S, S, S, F], num_key_value_heads=2, intermediate_size=96,
        attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True, num_experts=8,
        top_k_experts=2, moe_intermediate_size=32, use_bidirectional_attention="vision",
    ),
    "31b-mini": dict(
        description="31B in miniature: dense, K=V full layers, 1 global KV head",
        num_hidden_layers=6, layer_types=[S, S, S, S, S, F], num_key_value_heads=2, intermediate_size=128,
        attention_k_eq_v=True, num_global_key_value_heads=1, use_bidirectional_attention="vision",
    ),
    "all-features": dict(
        description="every text feature at once: PLE, KV sharing of both types, double-wide MLP, MoE, K=V, GQA",
        num_hidden_layers=8, layer_types=[S, S, S, S, F, S, S, F], num_key_value_heads=2, intermediate_size=96,
        hidden_size_per_layer_input=8, num_kv_shared_layers=3, use_double_wide_mlp=True,
        attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=32,
    ),
    "e2b-256-mini": dict(
        description="E2B in miniature at 256-wide rows, for the K-quants: hidden 256, intermediate 256 (512 on the "
                    "double-wide KV-shared layers), PLE dim 256, 4 heads of 64 (128 on full layers): every matrix "
                    "row is whole 256-element super-blocks, so llama.cpp's K-quant presets make real K-quant tensors",
        hidden_size=256, num_attention_heads=4, head_dim=64, global_head_dim=128, num_hidden_layers=6,
        layer_types=[S, S, S, F, S, F], num_key_value_heads=1, intermediate_size=256,
        hidden_size_per_layer_input=256, num_kv_shared_layers=2, use_double_wide_mlp=True,
    ),
}


# tiny vision towers: the E-series one (clipped linears) and the 26B/31B one (standardize), patch 4, pooling 3
_VISION_COMMON = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=64, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", rope_parameters={"rope_type": "default", "rope_theta": 100.0},
    model_type="gemma4_vision",
)
PRESETS["e2b-vision-mini"] = dict(
    PRESETS["e2b-mini"],
    description="E2B in miniature with a tiny E-series vision tower (clipped linears); image tokens causal",
    vision=dict(_VISION_COMMON, use_clipped_linears=True, standardize=False),
)
PRESETS["31b-vision-mini"] = dict(
    PRESETS["31b-mini"],
    description="31B in miniature with a tiny 26B/31B vision tower (standardize); bidirectional image blocks "
                "on sliding layers",
    vision=dict(_VISION_COMMON, use_clipped_linears=False, standardize=True),
)
PRESETS["e2b-audio-mini"] = dict(
    PRESETS["e2b-mini"],
    description="E2B in miniature with a tiny conformer audio tower (128 mel bins, chunk 4, left context 5, "
                "logit cap 50, clipped linears); audio tokens causal",
    audio=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 8],
               conv_kernel_size=5, attention_chunk_size=4, attention_context_left=5, attention_context_right=0,
               attention_logit_cap=50.0, attention_invalid_logits_value=-1.0e9, output_proj_dims=48,
               use_clipped_linears=True, rms_norm_eps=1e-6, residual_weight=0.5, gradient_clipping=1e10,
               hidden_act="silu", model_type="gemma4_audio"),
)
# Gemma 4 Unified in miniature: the 12B's decoder (K=V full layers with one global KV head, no PLE, no MoE,
# vision blocks) with an encoder-free vision embedder (patch 4, merge 3: 12-pixel model patches, so an
# image of up to 70 soft tokens is at most 84 x 120 pixels) and the raw-waveform audio embedder (640
# samples per soft token). The window (8) is shorter than the larger images' blocks.
PRESETS["12b-mini"] = dict(
    description="Gemma 4 Unified 12B in miniature: K=V full layers with 1 global KV head, 5:1 sliding/full, "
                "encoder-free vision embedder (12-px patches) and raw-waveform audio (640 samples a token)",
    family="gemma4_unified", num_hidden_layers=6, layer_types=[S, S, S, S, S, F], num_key_value_heads=2,
    intermediate_size=128, attention_k_eq_v=True, num_global_key_value_heads=1, use_bidirectional_attention="vision",
    unified_vision=dict(patch_size=4, pooling_kernel_size=3, mm_embed_dim=48, mm_posemb_size=72,
                        output_proj_dims=48, rms_norm_eps=1e-6, model_type="gemma4_unified_vision"),
    unified_audio=dict(audio_embed_dim=640, rms_norm_eps=1e-6, model_type="gemma4_unified_audio"),
)
# MTP pairs: a target preset with an assistant (drafter) written beside it in ``assistant/``. Its layers
# read the target's last KV-owning layer of each type, so their head dims and KV heads are the target's.
_ASSISTANT_COMMON = dict(
    hidden_size=32, num_hidden_layers=4, layer_types=[S, S, S, F], num_attention_heads=4, head_dim=16,
    global_head_dim=32, intermediate_size=64, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
    final_logit_softcapping=None,
)
PRESETS["e2b-assistant-mini"] = dict(
    PRESETS["e2b-mini"],
    description="E2B in miniature with an MTP assistant: 4 q-only layers (3 S, 1 F) over the target's layers "
                "3 and 4, and the centroid-masked head (16 clusters of 32 tokens, top 4)",
    assistant=dict(_ASSISTANT_COMMON, family="gemma4_assistant", num_key_value_heads=1,
                   use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4),
)
PRESETS["e2b-vision-assistant-mini"] = dict(
    PRESETS["e2b-vision-mini"],
    description="E2B in miniature with its vision tower and the E2B assistant: MTP after an image prompt (image "
                "tokens causal, PLE from the pad row)",
    assistant=PRESETS["e2b-assistant-mini"]["assistant"],
)
PRESETS["12b-assistant-mini"] = dict(
    PRESETS["12b-mini"],
    description="Gemma 4 Unified 12B in miniature with its MTP assistant: 4 q-only layers over the target's "
                "layers 4 and 5 (K=V full layer, 1 global KV head), dense tied head",
    assistant=dict(_ASSISTANT_COMMON, family="gemma4_unified_assistant", num_key_value_heads=2,
                   attention_k_eq_v=True, num_global_key_value_heads=1, use_ordered_embeddings=False),
)
# The PLE-fold trap (docs/bug-classes.md): RMSNorm(s y; eps) = RMSNorm(y; eps / s^2), so an engine may fold the
# per-layer context's scale s = H^-1/2 into the norm's eps; keeping eps, or dividing it by s once, changes the
# result only where that context is near eps. Here the embedding rows of a band of ordinary ids are a thousandth of
# the others (as a real vocabulary's never-trained ids can be): their per-layer context's mean square is ~3e-7
# (median), next to eps 1e-6, where every other token's is 0.02 and more (median 0.33). The random bases draw them
# as often as any other id.
PRESETS["e2b-ple-eps-mini"] = dict(
    PRESETS["e2b-mini"],
    description="E2B in miniature (e2b-mini's weights) with the embedding rows of ids 472-511 scaled by 1e-3: "
                "their per-layer inputs' context is near the RMSNorm eps (the PLE-fold trap)",
    quiet_rows=dict(first=472, stop=512, scale=1e-3),
)
PRESETS["mtp-layout-mini"] = dict(
    description="an MTP pair whose target's KV-owning prefix does not end in (sliding, full): layers S F S | S F F "
                "with the last 3 KV-shared, so the drafter's store layers are 2 (sliding) and 1 (full), while "
                "llama.cpp's positional rule (n_layer - 2 for sliding, n_layer - 1 for full) and the literal last "
                "layer point elsewhere; PLE, MQA; a dense drafter",
    num_hidden_layers=6, layer_types=[S, F, S, S, F, F], num_key_value_heads=1, intermediate_size=128,
    hidden_size_per_layer_input=8, num_kv_shared_layers=3,
    assistant=dict(_ASSISTANT_COMMON, family="gemma4_assistant", num_key_value_heads=1, use_ordered_embeddings=False),
)
ASSISTANT_DIR = "assistant"  # where write_checkpoint puts a preset's drafter, inside the target's directory
UNIFIED_ARCHITECTURES = {"causal": ("Gemma4UnifiedForCausalLM", "gemma4_unified_text"),
                         "conditional": ("Gemma4UnifiedForConditionalGeneration", "gemma4_unified")}
PRESET_EXTRAS = ("description", "vision", "audio", "family", "unified_vision", "unified_audio", "assistant",
                 "quiet_rows")

# ----------------------------------------------------------------------------------------------
# published shapes (gemma4-text-spec.md section 1): real-size checkpoints for memory and speed work

PUBLISHED_COMMON = dict(
    vocab_size=262_144, head_dim=256, global_head_dim=512, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, attention_bias=False,
    rope_parameters=COMMON["rope_parameters"], vocab_size_per_layer_input=262_144,
    hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False, attention_k_eq_v=False,
    num_global_key_value_heads=None, enable_moe_block=False, num_experts=None, top_k_experts=None,
    moe_intermediate_size=None, use_bidirectional_attention=None, bos_token_id=2, pad_token_id=0,
)
PUBLISHED: dict[str, dict] = {
    "e2b": dict(
        description="the published E2B text shapes: H 1536, 35 layers (4 S : 1 F), MQA, 20 KV-shared layers "
                    "with the double-wide MLP (12288), PLE 256 with its [262144, 8960] table",
        period=5, hidden_size=1536, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
        intermediate_size=6144, use_double_wide_mlp=True, num_kv_shared_layers=20, hidden_size_per_layer_input=256,
        sliding_window=512, max_position_embeddings=131_072,
    ),
    "e4b": dict(
        description="the published E4B text shapes: H 2560, 42 layers (5 S : 1 F), GQA 8/2, 18 KV-shared layers, "
                    "PLE 256 with its [262144, 10752] table",
        period=6, hidden_size=2560, num_hidden_layers=42, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=10240, num_kv_shared_layers=18, hidden_size_per_layer_input=256, sliding_window=512,
        max_position_embeddings=131_072,
    ),
    "26b-a4b": dict(
        description="the published 26B-A4B text shapes: H 2816, 30 layers (5 S : 1 F), MoE 128 experts top-8 "
                    "(704 wide) beside a 2112 dense branch, K=V full layers with 2 KV heads",
        period=6, hidden_size=2816, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=2112, attention_k_eq_v=True, num_global_key_value_heads=2, enable_moe_block=True,
        num_experts=128, top_k_experts=8, moe_intermediate_size=704, sliding_window=1024,
        max_position_embeddings=262_144, use_bidirectional_attention="vision",
    ),
    "31b": dict(
        description="the published 31B text shapes: H 5376, 60 layers (5 S : 1 F), GQA 32/16, K=V full layers "
                    "with 4 KV heads, dense 21504",
        period=6, hidden_size=5376, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16,
        intermediate_size=21504, attention_k_eq_v=True, num_global_key_value_heads=4, sliding_window=1024,
        max_position_embeddings=262_144, use_bidirectional_attention="vision",
    ),
    "12b": dict(
        description="the published Gemma 4 Unified 12B text shapes: H 3840, 48 layers (5 S : 1 F), GQA 16/8, K=V "
                    "full layers with 1 global KV head, dense 15360, window 1024, no PLE, no MoE",
        family="gemma4_unified", period=6, hidden_size=3840, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, intermediate_size=15360, attention_k_eq_v=True, num_global_key_value_heads=1,
        sliding_window=1024, max_position_embeddings=262_144, use_bidirectional_attention="vision",
    ),
}
