"""Per-type settings where the generic shrinking of `auto_models.shrink_config_dict` breaks a config's own
check or leaves a model that cannot run (the census reports name the type and this table's reason).

Each entry sets config keys on the shrunk config dict (a dotted key reaches into a sub-config:
"text_config.layer_types"), before the config class is built. Entries are data: plain values, no code.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Override:
    why: str
    config: dict = field(default_factory=dict)


OVERRIDES: dict[str, Override] = {
    "jamba": Override("attention every 8th layer from the 4th: none among 2 layers (generate needs one)",
                      {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                       "expert_layer_offset": 1}),
    "bamba": Override("no attention layer by default (attn_layer_indices unset): generate needs one",
                      {"attn_layer_indices": [1]}),
    "granitemoehybrid": Override("every layer linear by default: generate needs an attention layer",
                                 {"layer_types": ["linear_attention", "attention"]}),
    "lfm2_moe": Override("layer_types unset by default", {"layer_types": ["conv", "full_attention"]}),
    "recurrent_gemma": Override("the block pattern starts with two recurrent blocks: none attends in 2 layers",
                                {"block_types": ["recurrent", "attention"]}),
    "zamba": Override("attention every 6th layer from the 4th, its width twice the hidden size",
                      {"attn_layer_period": 2, "attn_layer_offset": 1, "layers_block_type": ["mamba", "hybrid"],
                       "attention_hidden_size": 128, "attention_head_dim": 32, "n_mamba_heads": 2}),
    "zamba2": Override("hybrid layers listed by index past the 2 kept; Mamba head width from the full model",
                       {"layers_block_type": ["mamba", "hybrid"], "hybrid_layer_ids": [1], "mamba_headdim": 16,
                        "n_mamba_heads": 8, "attention_hidden_size": 128, "attention_head_dim": 32,
                        "adapter_rank": 8}),
    "beit": Override("the semantic-segmentation head reads 4 backbone stages; the default config names 1",
                     {"num_hidden_layers": 4, "out_indices": [1, 2, 3, 4], "out_features": None}),
    "data2vec-vision": Override("the semantic-segmentation head reads 4 backbone stages; the default config names 1",
                                {"num_hidden_layers": 4, "out_indices": [1, 2, 3, 4], "out_features": None}),
    "dots1": Override("experts unset by default", {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                                   "n_shared_experts": 1}),
}
# SAM 2's prompt encoder states the image and the backbone's total stride (16) it prompts: the 64-pixel image of
# the tiny Hiera backbone, whose last feature map is 64 / 16 pixels a side (the generic patch of 4 would not match)
_SAM2_PROMPT = {"prompt_encoder_config.image_size": 64, "prompt_encoder_config.patch_size": 16}
for _t in ("sam2", "sam2_video", "edgetam_video"):
    OVERRIDES[_t] = Override("the prompt encoder's image and stride follow the tiny backbone's 64-pixel image",
                             dict(_SAM2_PROMPT))

# the thinker's rotary index reads vision_start_token_id from its own config, which only the talker declares
for _t in ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"):
    OVERRIDES[_t] = Override("the thinker's config lacks the vision start id its rotary index reads (the talker's "
                             "config has it): the talker's default", {"vision_start_token_id": 151652})

# defaults this transformers leaves to a checkpoint (unset, or a key the model reads that its config class lacks)
OVERRIDES.update({
    "dbrx": Override("the attention reads rope_theta (and clips by clip_qkv, unset) from its attention config, "
                     "which does not declare it",
                     {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0}),
    "qwen4_exp_text": Override("the indexer's token budget and compression are unset by default",
                               {"indexer_budget": 16, "indexer_compress_ratio": 4, "indexer_n_heads": 2,
                                "indexer_kv_heads": 1, "indexer_head_dim": 16}),
    "qwen4_exp": Override("the indexer's token budget and compression are unset by default",
                          {"text_config.indexer_budget": 16, "text_config.indexer_compress_ratio": 4,
                           "text_config.indexer_n_heads": 2, "text_config.indexer_kv_heads": 1,
                           "text_config.indexer_head_dim": 16}),
    "bros": Override("the bounding-box embedding widths are derived from hidden_size once; the default's stay",
                     {"dim_bbox_sinusoid_emb_2d": 16, "dim_bbox_sinusoid_emb_1d": 2, "dim_bbox_projection": 16}),
    "layoutlmv3": Override("4 coordinate and 2 shape embeddings are concatenated to the hidden size; the visual "
                           "positions follow input_size (the image side)",
                           {"coordinate_size": 12, "shape_size": 8, "input_size": 32}),
    "lilt": Override("six layout embeddings of hidden_size // 6 are concatenated to the hidden size",
                     {"hidden_size": 96}),
    "mobilevitv2": Override("five stride-2 stages and a 2 x 2 unfolding: the generic 16-pixel image (8 patches of "
                            "2) ends at 1 x 1", {"image_size": 64}),
    "fun_asr_nano": Override("the adaptor's width must be a quarter of the text hidden size",
                             {"adaptor_config.intermediate_size": 16}),
})


def apply_override(model_type: str, d: dict) -> str:
    """Set the type's override keys on the shrunk config dict `d`; returns the entry's reason ("" if none)."""
    entry = OVERRIDES.get(model_type)
    if entry is None:
        return ""
    for key, value in entry.config.items():
        *path, last = key.split(".")
        target = d
        for part in path:
            target = target.setdefault(part, {})
        target[last] = value
    return entry.why


__all__ = ["Override", "OVERRIDES", "apply_override"]
