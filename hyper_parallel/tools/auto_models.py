"""Any transformers model type, built tiny on the spot, with inputs for every modality its forward takes.

`build_model_type("llama")` takes the type's default config (`AutoConfig.for_model`), shrinks it generically
(the config and every sub-config: 2 layers, small widths, heads and KV heads that divide, a small vocabulary,
small images, few experts, no dropout), applies the type's entry of `tiny_overrides.OVERRIDES` where the
generic shrinking breaks one of the config's own checks, builds the model with the type's head (see
`heads.head_of`: every head transformers registers, the base model for a type with none) and makes inputs for
its modalities (`model_inputs`). `load_path_model(DIR)` feeds a local checkpoint the same way, so
`census --model-path` and `census --model-type` see the ops a real processor's inputs make the model hit.
"""
from __future__ import annotations

from typing import Any

import torch

from .heads import HEAD_BY_NAME, all_model_types, head_of, head_mappings
from .model_inputs import TEXT_LOW, VOCAB, fed_modalities, fitting_inputs, make_inputs
from .models import ModelCase, _finish
from .tiny_overrides import apply_override, base_kwargs

HIDDEN, HEADS_N, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 4, 2, 16, 128
LAYERS = 2
PREDICTION = 4  # time steps a tiny forecaster predicts where its config leaves the horizon unset

_LAYER_KEYS = {"num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers", "num_encoder_layers", "depth", "num_blocks", "text_layers", "vision_layers",
               "num_self_attends_per_block"}
_HIDDEN_KEYS = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "word_embed_proj_dim", "projection_dim",
                "out_hidden_size", "output_dim", "hidden_dim", "model_dim", "embedding_size", "proj_dim",
                "vision_output_dim", "text_hidden_size", "mm_hidden_size", "projector_hidden_size",
                "projection_size", "attention_hidden_size", "embedding_dim", "reassemble_hidden_size",
                "pooler_output_size", "codebook_dim", "emb_dim", "d_latents", "hidden_size_global",
                "fpn_hidden_size", "vector_quantization_hidden_dimension", "audio_hidden_size", "condition_dim",
                "mit_hidden_size", "cross_hidden_size"}  # (the width a decoder cross-attends: its encoder's)
_FFN_KEYS = {"intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner",
             "ffn_hidden_size", "mlp_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
             "expert_intermediate_size", "dense_intermediate_size", "projector_intermediate_size",
             "mit_intermediate_size", "expert_ffn_hidden_size", "intermediate_size_mlp"}
_HEAD_KEYS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
              "decoder_attention_heads", "attention_heads", "num_attention_heads_per_layer"}
_KV_KEYS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv",
            "encoder_num_key_value_heads", "decoder_num_key_value_heads"}
_HEAD_DIM_KEYS = {"head_dim", "d_kv", "attention_head_dim", "kv_channels", "qk_head_dim", "v_head_dim",
                  "head_size", "qk_rope_head_dim", "qk_nope_head_dim", "linear_key_head_dim",
                  "linear_value_head_dim", "mamba_head_dim", "d_head", "rotary_dim", "mamba_headdim"}
_EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_total",
                "zero_expert_num"}  # (LongCat-Flash's identity experts, routed beside the others: 256 by default)
_TOPK_KEYS = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k_experts", "moe_k", "router_topk"}
_VOCAB_KEYS = {"vocab_size", "text_vocab_size"}
# a detector's object queries (and denoising queries): no more than the anchors a tiny image gives
_QUERY_KEYS = {"num_queries": 8, "num_denoising": 4}
# the chunk of a state-space scan (Mamba-2 pads the sequence to it and builds chunk x chunk matrices) and the
# window of sliding-window attention (Longformer pads the sequence to it): at their defaults (256, 512) the tiny
# model spends nearly all of its time on padding
_CHUNK_KEYS = {"chunk_size", "mamba_chunk_size"}
_WINDOW_KEYS = {"attention_window"}
CHUNK, WINDOW = 16, 8
# low-rank projections (DeepSeek's MLA) and the side attentions of sparse / linear-attention layers (DSA's
# indexer, linear attention): widths of their own, not derived from hidden_size, thousands wide by default
_RANK_KEYS = {"q_lora_rank", "kv_lora_rank"}
_SIDE_HEAD_KEYS = {"index_n_heads", "linear_num_heads"}
_SIDE_HEAD_DIM_KEYS = {"index_head_dim", "linear_head_dim"}
RANK = 32
# sizes that multiply the whole model's cost and follow from no other key: a Perceiver's latent array (256 x 1280 by
# default: 10 GB resident for one tiny type), an audio codec's base channel count (VibeVoice doubles 32 over six
# stages to 2048 channels and a 4x wider feed-forward: 6 GB), a byte model's hash vocabulary (500,002 rows)
# a hierarchical backbone's width per stage (SAM 2's Hiera: 96 doubling to 768) and the neck that reads them, in
# another sub-config: both scaled by the same rule (narrowest stage = HIDDEN, its hidden_size), so they still agree
_STAGE_WIDTH_KEYS = {"embed_dim_per_stage", "backbone_channel_list"}
_COST_KEYS = {"num_latents": 16, "num_filters": 8, "encoder_hash_byte_group_vocab": VOCAB,
              "num_windows": 4}  # windowed ViT attention (LW-DETR): a square count of windows in the patch grid
_POS_KEYS = {"max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx",
             "max_source_positions", "max_target_positions", "seq_length"}


# ---- the config, shrunk -------------------------------------------------------------------------
def _small(value: Any, target: int) -> Any:
    return min(value, target) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else value


def _shrink_rope(rope: dict, head_dim_old: int | None, head_dim_new: int) -> dict:
    rope = dict(rope)
    sec = rope.get("mrope_section")
    if isinstance(sec, list) and sec and all(isinstance(s, int) for s in sec):
        half = head_dim_new // 2
        scaled = [max(1, s * half // max(sum(sec), 1)) for s in sec]
        # the rest to the section no other equals (ERNIE-VL's [22, 22, 20] pairs its height and width sections)
        unique = [i for i, s in enumerate(sec) if sec.count(s) == 1]
        scaled[unique[0] if len(unique) == 1 else 0] += half - sum(scaled)
        rope["mrope_section"] = scaled
    for key in ("original_max_position_embeddings",):
        if isinstance(rope.get(key), int):
            rope[key] = min(rope[key], 256)
    for key in ("short_factor", "long_factor"):
        if isinstance(rope.get(key), list):
            rope[key] = rope[key][: head_dim_new // 2] + [1.0] * max(0, head_dim_new // 2 - len(rope[key]))
    return rope


def shrink_config_dict(d: dict, depth: int = 0) -> dict:
    """The config dict with every size made tiny; nested sub-config dicts are shrunk the same way."""
    d = dict(d)
    old_layers = next((d[k] for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers")
                       if isinstance(d.get(k), int)), None)
    heads_old = next((d[k] for k in _HEAD_KEYS if isinstance(d.get(k), int)), None)
    head_dim_old = d.get("head_dim") if isinstance(d.get("head_dim"), int) else None
    mla_old = sum(d[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim") if isinstance(d.get(k), int))
    hidden_old = {k: d[k] for k in _HIDDEN_KEYS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)}
    images_old = {k: v.get("image_size") for k, v in d.items() if isinstance(v, dict)}
    for key, value in list(d.items()):
        if isinstance(value, dict) and value.get("model_type") == "timm_backbone":
            d[key] = _resnet_for(value)
        elif isinstance(value, dict) and key != "rope_parameters" and key != "rope_scaling" and (
                "model_type" in value or any(k in value for k in _HIDDEN_KEYS | _LAYER_KEYS)):
            d[key] = shrink_config_dict(value, depth + 1)
        elif isinstance(value, bool) or value is None:
            continue
        elif key in _LAYER_KEYS:
            d[key] = _small(value, LAYERS)
        elif key in _HIDDEN_KEYS and not (key == "hidden_dim" and isinstance(d.get("out_channels"), list)):
            d[key] = _small(value, HIDDEN)  # (an EfficientNet's hidden_dim follows its channel lists)
        elif key in _FFN_KEYS and isinstance(value, list):  # one per layer (Gemma 3n)
            d[key] = [_small(v, INTERMEDIATE) for v in value]
        elif key in _FFN_KEYS:
            d[key] = _small(value, INTERMEDIATE)
        elif key in _HEAD_KEYS and isinstance(value, list):  # one per stage (Swin): powers of two divide widths
            d[key] = [min(HEADS_N, 1 << (v.bit_length() - 1)) if isinstance(v, int) and v > 0 else v for v in value]
        elif key in _HEAD_KEYS:
            d[key] = _small(value, HEADS_N)
        elif key == "depths" and isinstance(value, list):  # blocks per stage
            d[key] = [_small(v, LAYERS) for v in value]
        elif key in _STAGE_WIDTH_KEYS and isinstance(value, list) and value and all(
                isinstance(v, int) and v > 0 for v in value):  # widths per stage: scaled so the narrowest is HIDDEN
            d[key] = [max(1, v * HIDDEN // min(value)) for v in value] if min(value) > HIDDEN else value
        elif key in _COST_KEYS:
            d[key] = _small(value, _COST_KEYS[key])
        elif key in _QUERY_KEYS:
            d[key] = _small(value, _QUERY_KEYS[key])
        elif key in _HEAD_DIM_KEYS:
            d[key] = _small(value, HEAD_DIM)
        elif key in _EXPERT_KEYS:
            d[key] = _small(value, 4)
        elif key in _TOPK_KEYS:
            d[key] = _small(value, 2)
        elif key in _VOCAB_KEYS or key.endswith("vocab_size") or key.startswith("vocab_size_"):
            d[key] = _small(value, VOCAB)
        elif key in _POS_KEYS:
            d[key] = _small(value, 512)
        elif key in _RANK_KEYS:
            d[key] = _small(value, RANK)
        elif key in _SIDE_HEAD_KEYS:
            d[key] = _small(value, HEADS_N)
        elif key in _SIDE_HEAD_DIM_KEYS:  # wider than HEAD_DIM: the indexer's rotary part is HEAD_DIM of it
            d[key] = _small(value, 2 * HEAD_DIM)
        elif key in _CHUNK_KEYS:
            d[key] = _small(value, CHUNK)
        elif key in _WINDOW_KEYS:  # Longformer's is one even window or one per layer
            d[key] = [_small(v, WINDOW) for v in value] if isinstance(value, list) else _small(value, WINDOW)
        elif "dropout" in key or key in ("drop_path_rate", "layerdrop", "encoder_layerdrop", "decoder_layerdrop",
                                         "router_jitter_noise", "attention_probs_dropout_prob",
                                         "hidden_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
            if isinstance(value, float):
                d[key] = 0.0
    _fill_unset(d, heads_old)
    _fit_groups(d, hidden_old)
    _fit_feature_sizes(d, images_old)
    kv_key = next((k for k in _KV_KEYS if isinstance(d.get(k), int)), None)
    if kv_key is not None and heads_old:
        kv_old = d[kv_key]
        d[kv_key] = 1 if kv_old == 1 else (HEADS_N if kv_old >= heads_old else KV_HEADS)
    for key in ("n_group", "topk_group", "num_expert_group"):
        if isinstance(d.get(key), int):
            d[key] = min(d[key], 2 if key == "n_group" or key == "num_expert_group" else 1)
    for key in ("first_k_dense_replace",):
        if isinstance(d.get(key), int):
            d[key] = min(d[key], 1)
    # vision sizes: an 8 x 8 patch grid of 4-pixel patches (even sizes for a merge of 2); images of at most
    # 64 pixels a side for a convolutional model (no patches)
    if isinstance(d.get("patch_size"), int):
        patch_old = d["patch_size"]
        d["patch_size"] = min(d["patch_size"], 4)
        window = d.get("window_size")
        if isinstance(window, int) and "spatial_merge_size" in d and patch_old > 1 and window % patch_old == 0 \
                and window >= 2 * patch_old:
            # a window in pixels of whole patches, merged (Qwen2.5-VL's 112 = 8 x 14): as many new patches, up to 4
            d["window_size"] = d["patch_size"] * min(window // patch_old, 4)
        elif isinstance(window, int):  # attention windows in patches (Swin) within the 8 x 8 patch grid
            d["window_size"] = min(window, 4)
        for key in ("image_size", "img_size"):
            if isinstance(d.get(key), int) or _is_pair(d.get(key)):
                d[key] = d["patch_size"] * 8 if isinstance(d[key], int) else [d["patch_size"] * 8] * 2
    else:
        for key in ("image_size", "img_size"):
            if isinstance(d.get(key), int) and not isinstance(d.get(key), bool):
                d[key] = min(d[key], 64)
            elif _is_pair(d.get(key)):
                d[key] = [min(v, 64) for v in d[key]]
    # a state-space mixer's heads fill its expanded width: heads * head_dim == expand * hidden_size
    for heads, dim, expand in (("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_d_head", "mamba_expand")):
        width = d.get(expand, 0) * d.get("hidden_size", 0) if isinstance(d.get(expand), int) else 0
        if heads.startswith("mamba") and isinstance(d.get("mamba_d_ssm"), int):  # Falcon-H1 sets the width itself
            width = d["mamba_d_ssm"]
        if width and isinstance(d.get(heads), int) and isinstance(d.get(dim), int) and width % d[dim] == 0:
            d[heads] = width // d[dim]
    # randomness a training step would draw differently in the plain and the DTensor run: off
    for key in ("mask_time_prob", "mask_feature_prob"):
        if isinstance(d.get(key), float):
            d[key] = 0.0
    # backbones transformers builds itself, not timm's (not installed, and not what the census is about)
    for key in ("use_timm_backbone", "use_pretrained_backbone"):
        if d.get(key) is True:
            d[key] = False
    # a speech encoder takes 2 * max_source_positions mel frames: 64 of them
    if isinstance(d.get("num_mel_bins"), int) and isinstance(d.get("max_source_positions"), int):
        d["max_source_positions"] = min(d["max_source_positions"], 32)
    # lists with one entry per layer: cut to the new layer count, keeping one layer of each kind where they
    # differ (a hybrid model's linear and full attention layers); dicts keyed by layer index: the kept layers
    per_layer: dict = {}  # the per-layer lists before the cut (a backbone that keeps more stages takes more)
    if old_layers and old_layers > LAYERS:
        layers = _hybrid_layers(d, old_layers)
        for key in _LAYER_KEYS:
            if d.get(key) == LAYERS and layers > LAYERS:
                d[key] = layers
        for key, value in list(d.items()):
            if isinstance(value, list) and len(value) == old_layers:
                kinds = _kinds(value)
                per_layer[key] = value
                d[key] = (kinds + [kinds[0]] * layers)[:layers] if len(kinds) > 1 else value[:layers]
    for key, value in list(d.items()):  # (keyed by layer index: not a projector's sizes keyed by patch count)
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value) and old_layers and \
                all(int(k) < old_layers for k in value):
            d[key] = {k: shrink_config_dict(v, depth + 1) if isinstance(v, dict) else v
                      for k, v in value.items() if int(k) < LAYERS}
    _fit_stages(d, old_layers, per_layer)
    _fit_hidden_state_indices(d, old_layers)
    for key in ("deepstack_visual_indexes", "vision_feature_layers", "fullatt_block_indexes"):
        if isinstance(d.get(key), list):
            d[key] = [i for i in d[key] if isinstance(i, int) and -LAYERS <= i < LAYERS] or [LAYERS - 1]
    if isinstance(d.get("vision_feature_layer"), int) and not -LAYERS <= d["vision_feature_layer"] < LAYERS:
        d["vision_feature_layer"] = -1
    elif isinstance(d.get("vision_feature_layer"), list) and d["vision_feature_layer"] and all(
            isinstance(i, int) for i in d["vision_feature_layer"]):  # several layers (Molmo2's [24, 18]): the last
        kept = [i for i in d["vision_feature_layer"] if -LAYERS <= i < LAYERS]
        d["vision_feature_layer"] = kept or list(range(LAYERS - 1, -1, -1))[:len(d["vision_feature_layer"])]
    head_dim_new = d.get("head_dim") if isinstance(d.get("head_dim"), int) else (
        HIDDEN // HEADS_N if heads_old else HEAD_DIM)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(d.get(key), dict):
            d[key] = _shrink_rope(d[key], head_dim_old, _rotary_dim(d, d[key], head_dim_new))
    # image tokens pooled from the vision tower's patch grid (Gemma 3): a square that divides the tiny grid's side
    vision = d.get("vision_config")
    if isinstance(d.get("mm_tokens_per_image"), int) and isinstance(vision, dict) and \
            isinstance(vision.get("image_size"), int) and isinstance(vision.get("patch_size"), int):
        side = vision["image_size"] // vision["patch_size"]
        per_side = int(d["mm_tokens_per_image"] ** 0.5)
        if side and (per_side > side or side % max(per_side, 1)):
            d["mm_tokens_per_image"] = (side // 2) ** 2 if side >= 2 else 1
    # a query head of a no-rope and a rope part (DeepSeek's MLA): its width is their sum
    if all(isinstance(d.get(k), int) for k in ("qk_nope_head_dim", "qk_rope_head_dim")):
        mla = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
        if isinstance(d.get("qk_head_dim"), int):
            d["qk_head_dim"] = mla
        if head_dim_old and head_dim_old == mla_old:  # (a head_dim stated as that sum: Mistral 4's)
            d["head_dim"] = mla
    # layers sharing the key-value cache of earlier ones (Gemma 3n, a Gemma 4 assistant): all of them stay all
    if old_layers and d.get("num_kv_shared_layers") == old_layers:
        d["num_kv_shared_layers"] = next((d[k] for k in _LAYER_KEYS if isinstance(d.get(k), int)), LAYERS)
    if "sliding_window" in d and isinstance(d["sliding_window"], int):
        d["sliding_window"] = min(d["sliding_window"], 4)
    if "tie_word_embeddings" in d and depth == 0:
        d["tie_word_embeddings"] = False
    return d


def _fit_groups(d: dict, hidden_old: dict) -> None:
    """A convolution grouped over the whole hidden width (Mimi's depthwise upsampling: upsample_groups ==
    hidden_size): its groups follow the width it was equal to, so the channels still divide."""
    for key, value in list(d.items()):
        if not (key.endswith("groups") and isinstance(value, int) and not isinstance(value, bool)):
            continue
        for hk, old in hidden_old.items():
            if value == old and isinstance(d.get(hk), int) and d[hk] != old:
                d[key] = d[hk]
                break


def _side(size) -> int | None:
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    return size[0] if _is_pair(size) else None


def _fit_feature_sizes(d: dict, images_old: dict) -> None:
    """A neck that states its backbone's feature-map sizes (SAM 2's backbone_feature_sizes, [[256, 256], ...]
    for a 1024-pixel image): scaled with the backbone's image, so the maps it reshapes to still fit."""
    sizes = d.get("backbone_feature_sizes")
    if not (isinstance(sizes, list) and sizes and all(_is_pair(p) for p in sizes)):
        return
    for key, old in images_old.items():
        new = _side(d[key].get("image_size")) if isinstance(d.get(key), dict) else None
        if _side(old) and new and new < _side(old):
            ratio = _side(old) / new
            d["backbone_feature_sizes"] = [[max(1, int(v / ratio)) for v in p] for p in sizes]
            return


def _kinds(value: list) -> list:
    """The distinct entries of a per-layer list of kinds (strings or numbers), in order; [] for other lists."""
    if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return []
    return list(dict.fromkeys(value))


def _hybrid_layers(d: dict, old_layers: int) -> int:
    """Layers to keep: LAYERS, or one per kind of a hybrid model's per-layer kinds (linear / full / sliding
    attention, convolution...) up to 4, so that every kind is built and run."""
    most = max([len(_kinds(v)) for v in d.values() if isinstance(v, list) and len(v) == old_layers] or [0])
    return max(LAYERS, min(most, 4))


def _fill_unset(d: dict, heads: int | None) -> None:
    """Sizes this transformers leaves unset (None) in a default config that its model code reads as numbers
    (a checkpoint's config always sets them): filled with the tiny sizes. Only these: elsewhere None often
    means "off" (DeepSeek's q_lora_rank)."""
    if heads:
        if "head_dim" in d and d["head_dim"] is None:
            d["head_dim"] = HIDDEN // HEADS_N
        for key in _KV_KEYS:
            if key in d and d[key] is None:
                d[key] = heads
    if "vocab_size" in d and d["vocab_size"] is None:
        d["vocab_size"] = VOCAB
    if "prediction_length" in d and d["prediction_length"] is None:  # a forecaster's horizon (no default)
        d["prediction_length"] = PREDICTION
    if any(isinstance(d.get(k), int) for k in _EXPERT_KEYS):
        for key, size in (("num_experts_per_tok", 2), ("moe_intermediate_size", INTERMEDIATE)):
            if key in d and d[key] is None:
                d[key] = size


def _resnet_for(timm: dict) -> dict:
    """A tiny transformers ResNet in place of a timm backbone (timm is not installed, and the census is about
    transformers' own modules), with the timm config's output stages."""
    stages = [i for i in timm.get("out_indices") or [1, 2, 3, 4] if 1 <= i <= 4]
    return {"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1],
            "layer_type": "basic", "out_indices": stages, "out_features": [f"stage{i}" for i in stages]}


def _is_pair(value) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value)


def _fit_stages(d: dict, old_layers: int | None, per_layer: dict | None = None) -> None:
    """A backbone's outputs (`out_features` / `out_indices`) name stages. Where the stages are the layers
    (a ViT backbone: stage_names = stem + one per layer), the shrunk model keeps as many layers as outputs
    (at least LAYERS) and outputs its last ones; where they are not (a ConvNeXt's stages), they stay."""
    names = d.get("stage_names")
    feats, idx = d.get("out_features"), d.get("out_indices")
    if not isinstance(names, list) or not (isinstance(feats, list) or isinstance(idx, list)):
        return
    old = [i % len(names) for i in idx] if isinstance(idx, list) else [names.index(f) for f in feats if f in names]
    if old_layers and len(names) == old_layers + 1 and old:
        layers = max(LAYERS, len(old))
        for key in _LAYER_KEYS:
            if d.get(key) == min(old_layers, LAYERS):
                d[key] = layers
        for key, value in (per_layer or {}).items():  # one entry per stage (a Swin's depths and heads)
            if isinstance(d.get(key), list) and len(d[key]) < layers and not any(isinstance(v, str) for v in value):
                d[key] = value[:layers]
        old = list(range(layers - len(old) + 1, layers + 1))
        d["out_features"] = ["stem" if i == 0 else f"stage{i}" for i in old]
    else:  # the stages stay: their own names (PVTv2's have no stem: out_indices [3] is "stage4")
        d["out_features"] = [names[i] for i in old]
    d["out_indices"] = old
    d.pop("stage_names")


def _fit_hidden_state_indices(d: dict, old_layers: int | None) -> None:
    """A neck reading the encoder's hidden states by index (DPT's backbone_out_indices): as many layers as it
    reads (at least LAYERS), and their last hidden states."""
    idx = d.get("backbone_out_indices")
    if not (old_layers and isinstance(idx, list) and idx and all(isinstance(i, int) for i in idx)):
        return
    layers = max(LAYERS, len(idx))
    for key in _LAYER_KEYS:
        if d.get(key) == min(old_layers, LAYERS):
            d[key] = layers
    d["backbone_out_indices"] = list(range(layers - len(idx), layers))


def _text_vocab(d: dict) -> int:
    """The tiny vocabulary special ids are moved into: VOCAB, or the model's own text vocabulary where that is
    smaller (a protein or phoneme model's few dozen tokens)."""
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    own = text.get("vocab_size", d.get("vocab_size"))
    return own if isinstance(own, int) and 16 <= own < VOCAB else VOCAB


def _remap_special_ids(d: dict, vocab: int, taken: dict) -> dict:
    """Special token ids (pad, bos, image, video, audio...) moved into the tiny vocabulary, above the text ids."""
    d = dict(d)
    for key, value in list(d.items()):
        if isinstance(value, dict) and key not in ("rope_parameters", "rope_scaling", "id2label", "label2id"):
            d[key] = _remap_special_ids(value, vocab, taken)
        elif isinstance(key, str) and key.endswith(("_token_id", "_token_index", "_id")) and \
                isinstance(value, int) and not isinstance(value, bool) and "layer" not in key:
            if value < TEXT_LOW:   # 0, 1, 2 stay: the random text ids start above them
                continue
            own = d.get("vocab_size")
            if isinstance(own, int) and value < own < 16:  # inside a few-token vocabulary of its own (a reading-
                continue  # order model's start / pad / end / pred), fed no random text

            if value not in taken:
                taken[value] = vocab - 1 - len(taken)
            d[key] = taken[value]
    return d


def _modeling_source(config_cls) -> str:
    """The source of the modeling module beside a config class's module (empty if there is none)."""
    import importlib.util
    module = config_cls.__module__
    if ".configuration_" not in module:
        return ""
    try:
        spec = importlib.util.find_spec(module.replace(".configuration_", ".modeling_"))
    except ImportError:
        return ""
    if spec is None or not spec.origin:
        return ""
    with open(spec.origin) as f:
        return f.read()


def _default_mrope(d: dict, config_cls) -> None:
    """Multimodal rotary code with a built-in section default (e.g. [16, 24, 24], for head_dim 128) gets one
    that fits the tiny head_dim."""
    import re
    source = _modeling_source(config_cls)
    if "mrope_section" not in source:
        return
    found = re.search(r"mrope_section\W+\[(\d+),\s*(\d+),\s*(\d+)\]", source)
    default = [int(v) for v in found.groups()] if found else [16, 24, 24]
    subs = [d] + [v for v in d.values() if isinstance(v, dict) and "model_type" in v]
    for sub in subs:
        rope = sub.get("rope_parameters")
        kinds = _kinds(sub["layer_types"]) if isinstance(sub.get("layer_types"), list) else []
        if rope == {} and kinds and all(isinstance(k, str) for k in kinds) and any(k in sub for k in _HEAD_KEYS):
            # no rope by default, read per layer type (Cohere Compass): one per kind, with a section that fits
            head_dim = sub.get("head_dim") if isinstance(sub.get("head_dim"), int) else HIDDEN // HEADS_N
            one = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": default}
            sub["rope_parameters"] = {k: _shrink_rope(one, None, _rotary_dim(sub, one, head_dim)) for k in kinds}
        elif isinstance(rope, dict) and rope and "mrope_section" not in rope and any(k in sub for k in _HEAD_KEYS) \
                and not any(isinstance(v, dict) for v in rope.values()):  # (not empty, not one per layer type)
            head_dim = sub.get("head_dim") if isinstance(sub.get("head_dim"), int) else HIDDEN // HEADS_N
            rope = dict(rope, mrope_section=default)
            sub["rope_parameters"] = _shrink_rope(rope, None, _rotary_dim(sub, rope, head_dim))


def _rotary_dim(d: dict, rope: dict, head_dim: int) -> int:
    """The rotated part of a head: head_dim times the partial rotary factor (of the rope dict or the config)."""
    factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    return int(head_dim * factor) if isinstance(factor, float) and 0 < factor < 1 else head_dim


def tiny_config(model_type: str):
    """The type's default config, shrunk (see `shrink_config_dict`), with the type's entry of
    `tiny_overrides.OVERRIDES` applied and special ids inside the vocabulary."""
    from transformers import AutoConfig
    base = AutoConfig.for_model(model_type, **base_kwargs(model_type))
    d = shrink_config_dict(base.to_dict())
    apply_override(model_type, d)
    d = _remap_special_ids(d, _text_vocab(d), {})
    _default_mrope(d, type(base))
    for k in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(k, None)
    d.pop("model_type", None)
    cfg = type(base)(**d)
    cfg.pad_token_id = getattr(cfg, "pad_token_id", None) if getattr(cfg, "pad_token_id", None) is not None else 0
    if hasattr(cfg, "num_labels"):
        cfg.num_labels = 2
    if getattr(cfg, "is_encoder_decoder", False) and getattr(cfg, "decoder_start_token_id", None) is None:
        cfg.decoder_start_token_id = cfg.pad_token_id  # labels are shifted right from it in training
    return cfg

def _model_class(cls_name: str):
    import transformers
    return getattr(transformers, cls_name)


def build_model_type(model_type: str, seed: int = 0, head: str | None = None) -> ModelCase:
    """A tiny random model of `model_type` (with `head`, default the type's own: see `heads.head_of`), its
    inputs and labels; the same seed gives the same ones."""
    head, cls_name = head_of(model_type, head)
    cls = _model_class(cls_name)
    cfg = _config_for(cls, tiny_config(model_type))
    torch.manual_seed(seed)
    try:
        model = cls._from_config(cfg, attn_implementation="sdpa")
    except (ValueError, ImportError):
        torch.manual_seed(seed)
        model = cls._from_config(cfg, attn_implementation="eager")
    return _case(model_type, _ready(model), head, seed)


def _config_for(cls, cfg):
    """The config the class takes: the type's own, or the sub-config of the class's config class where the
    head is built on one part of a composite model (MusicGen's causal LM on its decoder config)."""
    wanted = getattr(cls, "config_class", None)
    if not isinstance(wanted, type) or isinstance(cfg, wanted):
        return cfg
    for name in (getattr(cfg, "sub_configs", None) or {}):
        sub = getattr(cfg, name, None)
        if isinstance(sub, wanted):
            return sub
    return cfg


def _case(name: str, model, head: str, seed: int) -> ModelCase:
    inputs, labels, note = fitting_inputs(model, model.config, head, seed)
    can_generate = HEAD_BY_NAME[head].generates and _can_generate(model)
    return ModelCase(name, model, inputs, labels=labels, can_generate=can_generate, head=head, note=note)


def _ready(model):
    """Greedy, no eos, and a decoder start token for encoder-decoder generation."""
    model = _finish(model)
    gc = getattr(model, "generation_config", None)
    cfg = model.config
    # (MusicGen's decoder pads its codebooks' delay pattern with the start token)
    starts = getattr(cfg, "is_encoder_decoder", False) or hasattr(model, "build_delay_pattern_mask")
    if gc is not None and starts and gc.decoder_start_token_id is None:
        start = getattr(cfg, "decoder_start_token_id", None)
        gc.decoder_start_token_id = start if start is not None else (getattr(cfg, "pad_token_id", None) or 0)
    if gc is not None and hasattr(model, "build_delay_pattern_mask") and gc.num_return_sequences is None:
        gc.num_return_sequences = 1  # (its own generate reads the count as it is, unset meaning one)
    return model


def _can_generate(model) -> bool:
    try:
        return bool(model.can_generate())
    except Exception:
        return False


def load_path_model(path: str, seed: int = 0) -> ModelCase:
    """A local Hugging Face checkpoint (never downloaded), fed every modality its config declares."""
    import os

    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"census --model-path {path!r}: not a folder with a config.json "
                                f"(a local Hugging Face checkpoint; nothing is downloaded)")
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()   # the weight-loading bar would tear the census's own progress lines
    try:
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    except ImportError:  # an older hub without the switch: its bars stay
        pass
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        head, cls_name = head_of(cfg.model_type)
    except KeyError as e:
        raise ValueError(f"census --model-path {path!r}: {e.args[0]}") from None
    torch.manual_seed(seed)
    model = _model_class(cls_name).from_pretrained(path, local_files_only=True, attn_implementation="sdpa")
    return _case(str(path), _ready(model), head, seed)


def _config_classes(config_cls, seen: set) -> list:
    """The config class and every sub-config class below it (text, vision, encoder, decoder...), from the
    classes' declarations: no config is instantiated, since some defaults do not validate (Gemma4Assistant's
    default text config fails its own architecture check). A sub-config declared as `AutoConfig` is resolved
    through its spec's default model type."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if config_cls in seen:
        return []
    seen.add(config_cls)
    out = [config_cls]
    specs = getattr(config_cls, "sub_configs_defaults", None) or {}
    for name, sub in (getattr(config_cls, "sub_configs", None) or {}).items():
        if sub is AutoConfig:
            default_type = getattr(specs.get(name), "model_type", None)
            sub = CONFIG_MAPPING[default_type] if default_type in CONFIG_MAPPING else None
        if isinstance(sub, type):
            out += _config_classes(sub, seen)
    return out


def has_tp_plan(model_type: str) -> bool:
    """Whether the type's config, or one of its sub-configs (text, decoder, encoder...), declares a
    base_model_tp_plan: what transformers gathers into `model.tp_plan`, which `shard(model, "auto")` uses."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return any(bool(getattr(c, "base_model_tp_plan", None))
               for c in _config_classes(CONFIG_MAPPING[model_type], set()))


__all__ = ["all_model_types", "head_of", "tiny_config", "make_inputs", "build_model_type", "load_path_model",
           "has_tp_plan", "shrink_config_dict", "fed_modalities", "head_mappings"]
