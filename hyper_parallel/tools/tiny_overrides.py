"""Per-type settings where the generic shrinking of `auto_models.shrink_config_dict` breaks a config's own
check or leaves a model that cannot run (the census reports name the type and this table's reason).

Each entry sets config keys on the shrunk config dict (a dotted key reaches into a sub-config:
"text_config.layer_types"), before the config class is built; `base` gives the default config's own
keyword arguments where the type's default config fails its own checks. Entries are data: plain values, no code.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Override:
    why: str
    config: dict = field(default_factory=dict)
    # keyword arguments of the default config itself, where the type's default fails its own checks
    base: dict = field(default_factory=dict)


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

# the image placeholder id is unset by default (generate then has no image tokens to put the queries on)
for _t in ("blip-2", "instructblip", "instructblipvideo"):
    OVERRIDES[_t] = Override("the image placeholder token is unset by default: one of the tiny vocabulary's",
                             {"image_token_index": 50000})
for _t in ("minicpm_ocr", "minicpmv4_6", "minicpmv4_7"):
    OVERRIDES[_t] = Override("the image placeholder token is unset by default: one of the tiny vocabulary's",
                             {"image_token_id": 50000})

# SAM's vision neck outputs the prompt encoder / mask decoder width, their shared positional embedding has half of
# it per coordinate, and the prompt encoder states the image embedding's side (image_size / patch_size)
_SAM = {"vision_config.output_channels": 64, "vision_config.num_pos_feats": 32, "vision_config.global_attn_indexes": [1],
        "prompt_encoder_config.image_embedding_size": 8, "mask_decoder_config.iou_head_hidden_dim": 64}
for _t in ("sam", "sam_hq"):
    OVERRIDES[_t] = Override("the vision neck's width, the positional features and the image embedding's side "
                             "follow the tiny prompt encoder and image (SAM-HQ's decoder also reads the ViT's "
                             "own width)", dict(_SAM, **({"mask_decoder_config.vit_dim": 64} if _t == "sam_hq" else {})))
# text recognisers pool their feature map's height by 3 after a stride of 16: images 48 pixels high
for _t in ("pp_ocrv5_server_rec", "pp_ocrv6_small_rec", "pp_ocrv6_tiny_rec"):
    OVERRIDES[_t] = Override("a text line's image: 48 pixels high (the feature map is pooled by 3 after a stride of "
                             "16), 64 wide", {"image_size": [48, 64]})
OVERRIDES["pp_ocrv5_mobile_rec"] = Override("a text line's image: 96 pixels high (the feature map is pooled by 3 "
                                            "after a stride of 32), 64 wide", {"image_size": [96, 64]})

# config invariants the generic shrinking cannot know (sums, per-stage lists, layer counts that add up)
OVERRIDES.update({
    "reformer": Override("the axial position embeddings' widths sum to hidden_size and their shape multiplies to "
                         "the (chunked) sequence length: 2 x 4 for the 8 tokens, chunks of 4",
                         {"axial_pos_shape": [2, 4], "axial_pos_embds_dim": [32, 32], "local_attn_chunk_length": 4,
                          "lsh_attn_chunk_length": 4, "max_position_embeddings": 8}),
    "dory": Override("input, recurrent and output layers add up to num_hidden_layers (16 + 40 + 16 by default)",
                     {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "sliding_attention",
                                                               "full_attention"],
                      "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1}),
    "dots3_note_text": Override("the sliding-window head is the no-rope and rope parts together",
                                {"head_dim": 32}),
    "dots3_note": Override("the sliding-window head is the no-rope and rope parts together",
                           {"text_config.head_dim": 32, "vision_config.adapter_in_dim": 64,
                            "vision_config.adapter_out_dim": 64, "audio_config.adapter_input_size": 64,
                            "audio_config.adapter_out_dim": 64}),
    "efficientloftr": Override("hidden_size is the last stage's width (256 by default); stages of the tiny width; a "
                               "64-pixel image (training matches in fine windows a 32-pixel one has too few of)",
                               {"out_features": [16, 16, 32, 64], "stage_num_blocks": [1, 1, 1, 1],
                                "num_attention_heads": 8, "num_key_value_heads": 8,
                                # (derived in the config's __post_init__, but the default's values, saved in its
                                # dict, would be set back over them)
                                "stage_in_channels": [1, 16, 16, 32], "stage_block_stride": [[2], [1], [2], [2]],
                                "stage_block_out_channels": [[16], [16], [32], [64]],
                                "stage_block_in_channels": [[1], [16], [16], [32]], "fine_fusion_dims": [64, 32, 16],
                                # (training picks matches in a fine window that a 32-pixel image has too few of)
                                "image_size": 64}),
    "moonshine_streaming": Override("the decoder reads num_key_value_heads, which its config class does not "
                                    "declare (a checkpoint's config sets it)", {"num_key_value_heads": 4}),
    "gemma4_assistant": Override("the default config fails its own check: the assistant's text model takes no "
                                 "per-layer inputs (Gemma 4's default has them)",
                                 base={"text_config": {"hidden_size_per_layer_input": 0,
                                                       "vocab_size_per_layer_input": 0}}),
    "t5gemma2_encoder": Override("the text model reads dropout_rate, which the full T5Gemma 2 config hands down "
                                 "(the encoder's own config does not)", {"text_config.dropout_rate": 0.0}),
    "qwen3_omni_moe": Override("the talker's MoE block reads a shared expert width its config class does not declare",
                               {"talker_config.text_config.shared_expert_intermediate_size": 128,
                                "talker_config.spatial_merge_size": 2}),
    "blt": Override("the per-layer config view counts num_hidden_layers, which the top config does not declare "
                    "(its sub-models do)", {"num_hidden_layers": 2}),
    "apertus1p5": Override("the image and audio codebooks occupy consecutive id ranges inside the vocabulary: "
                           "tiny codebooks above the 256 text ids",
                           {"text_config.vocab_size": 384, "vision_config.codebook_size": 64,
                            "audio_config.codebook_size": 64, "image_token_offset": 256, "audio_token_offset": 320,
                            # (and a VQ image tokenizer and audio decoder of tiny widths: 256 to 1024 channels,
                            # 4 blocks a stage, by default: 4.5 GB and 40 s for the census of one tiny type)
                            "vision_config.base_channels": 32, "vision_config.num_res_blocks": 1,
                            "audio_config.decoder_hidden_size": 64, "audio_config.decoder_intermediate_size": 128,
                            "audio_config.decoder_num_layers": 2}),
    "deepseek_ocr2": Override("the decoder's dense / sparse layer kinds are unset by default",
                              {"text_config.mlp_layer_types": ["dense", "sparse"]}),
    "diffusion_gemma": Override("experts unset by default", {"text_config.num_experts": 4,
                                                             "text_config.top_k_experts": 2,
                                                             "text_config.moe_intermediate_size": 128}),
    "granite4_vision": Override("the vision layers injected into the decoder (deepstack) are unset by default; "
                                "the spatial ones name layers of the full decoder",
                                {"deepstack_layer_map": [[0, 0], [1, 1]], "spatial_target_layers": [1],
                                 "downsample_rate": "2/4"}),
    "nemotron3_5_asr": Override("the default language prompt is a slot of the prompt one-hot, not a token id: it "
                                "stays below num_prompts", {"default_prompt_id": 0}),
    "pp_formulanet": Override("the vision encoder projects to the text decoder's width, which it states itself",
                              {"vision_config.decoder_hidden_size": 64}),
    "align": Override("the image embedding is the EfficientNet's pooled width (its channel lists stay), which the "
                      "text projection must match", {"projection_dim": 640, "text_config.projection_dim": 640}),
    "superglue": Override("the keypoint detector's descriptors are the matcher's hidden width; 2 of the 18 "
                          "self / cross attention layers", {"keypoint_detector_config.descriptor_decoder_dim": 64,
                                                            "gnn_layers_types": ["self", "cross"]}),
    "levit": Override("patch_size is the total stride of the 4-convolution stem (16): the attention biases follow "
                      "image_size / patch_size", {"patch_size": 16, "image_size": 64}),
    "xmod": Override("the language adapter to use is unset by default (a checkpoint names one)",
                     {"default_language": "en_XX"}),
    "llama4": Override("the vision adapter reads the pixel-shuffled patches (4 x the vision width at ratio 0.5) "
                       "and projects to widths of its own (4096 by default)",
                       {"vision_config.intermediate_size": 256, "vision_config.projector_input_dim": 64,
                        "vision_config.projector_output_dim": 64}),
    "step3p7": Override("the sliding-window layers' window and heads are unset / of the full model by default",
                        {"text_config.sliding_window": 4, "text_config.num_sliding_attention_heads": 4,
                         "text_config.share_expert_dim": 128}),
    "hrm_text": Override("num_hidden_layers counts the stack's layers over all its cycles "
                         "(layers per stack x H_cycles x (L_cycles + 1)); two layers a stack (a pipeline cuts a stack's "
                         "layer list), one cycle of each",
                         {"num_layers_per_stack": 2, "H_cycles": 1, "L_cycles": 1, "L_bp_cycles": [1],
                          "num_hidden_layers": 4}),
    "autoformer": Override("the decoder starts from the last label_length steps of the context (10 by default): "
                           "no more than the tiny context has", {"label_length": 2}),
    "timesfm2_5": Override("a context of 16384 steps by default: a few patches", {"context_length": 128}),
    "depth_pro": Override("the fusion reads the patch encoder's hidden states by layer index (11 and 5 of 24), one "
                          "per intermediate feature width", {"intermediate_hook_ids": [1, 0]}),
    "neucodec": Override("the quantizer's width is the acoustic and semantic features concatenated (2 x 64 here; "
                         "2048 by default)", {"quantization_dim": 128}),
    "muse_spark_audio": Override("the waveform is cut into tokens of prod(patch_sizes) samples (1920 by default): "
                                 "patches the tiny 3200-sample waveform divides into; stages of tiny widths (256 to 2048)",
                                 {"patch_sizes": [4, 4, 2, 2], "hidden_sizes": [32, 32, 64, 64],
                                  "depths": [1, 1, 1, 1]}),
    "clap": Override("the audio Swin's last stage (the patch embedding's width doubled per stage) is the "
                     "audio hidden size", {"audio_config.patch_embeds_hidden_size": 32}),
    "seggpt": Override("image_size is the input and its prompt stacked (896 x 448 by default): two 32-pixel "
                       "images", {"image_size": [64, 32]}),
    "pp_doclayout_v2": Override("each label's score threshold and reading priority are unset by default (a "
                                "checkpoint lists them)", {"class_thresholds": [0.5, 0.5], "class_order": [0, 1],
                                 # (the reading-order model's LayoutLMv3 layout embeddings fill its hidden size)
                                 "reading_order_config.coordinate_size": 12, "reading_order_config.shape_size": 8}),
    "gemma4_audio": Override("the projection after the 2 stride-2 convolutions reads subsampling_conv_channels[0] "
                             "as the mel bin count (128 in both by default): the tiny features' 16 bins",
                             {"subsampling_conv_channels": [16, 32]}),
    "gemma3n_text": Override("the KV-sharing layers (the last 15 by default) follow layers of every kind",
                             {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "intermediate_size": 128,
                              "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
                              "layer_types": ["sliding_attention", "full_attention"] * 2}),
})


def base_kwargs(model_type: str) -> dict:
    """The keyword arguments the type's default config is built with (the entry's `base`; {} if none)."""
    entry = OVERRIDES.get(model_type)
    return dict(entry.base) if entry is not None else {}


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


__all__ = ["Override", "OVERRIDES", "apply_override", "base_kwargs"]
