"""Built-in tiny, random-initialised transformers models for the operator census and the tests.

Each entry builds `(model, inputs)` deterministically from a seed: a model small enough that every
built-in model runs generate and a training step in a few seconds on a CPU, and a dict of plain
tensors shaped like what the model's processor/tokenizer would give (so the census sees the same ops
as a real checkpoint would make it hit). No downloads: configs are written here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

VOCAB = 128
# special token ids of the multimodal models, placed at the top of the tiny vocabulary
IMAGE, VIDEO, VSTART, VEND, AUDIO, ASTART, AEND = 120, 121, 122, 123, 124, 125, 126
BATCH, SEQ = 2, 8


@dataclass
class ModelCase:
    """One built model: `inputs` feed both generate and forward; `labels` the training loss."""

    name: str
    model: torch.nn.Module
    inputs: dict
    labels: dict = field(default_factory=dict)
    can_generate: bool = True
    generate_kwargs: dict = field(default_factory=dict)
    max_tokens_arg: str = "max_new_tokens"   # the full Omni model takes thinker_max_new_tokens
    head: str = ""                           # the head it was built with (heads.HEADS), where known
    note: str = ""                           # what the builder could not do (e.g. the head's loss, plain)


@dataclass
class ModelEntry:
    name: str
    description: str
    build: Callable[[int], ModelCase]


def _text_ids(gen: torch.Generator, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(1, 100, (batch, seq), generator=gen)


def _finish(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    gc = getattr(model, "generation_config", None)
    if gc is not None:
        gc.do_sample = False
        gc.pad_token_id = 0
        gc.eos_token_id = None
        gc.bos_token_id = None
        for attr in ("temperature", "top_p", "top_k"):
            if hasattr(gc, attr):
                setattr(gc, attr, None)
    return model


def _causal_lm(name: str, config, seed: int) -> ModelCase:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = _finish(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
    gen = torch.Generator().manual_seed(seed)
    ids = _text_ids(gen)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return ModelCase(name, model, inputs, labels={"labels": ids.clone()})


_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
              bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)


def _llama(seed: int) -> ModelCase:
    from transformers import LlamaConfig
    return _causal_lm("llama", LlamaConfig(**_SMALL), seed)


def _qwen3(seed: int) -> ModelCase:
    from transformers import Qwen3Config
    return _causal_lm("qwen3", Qwen3Config(**_SMALL, head_dim=8), seed)


def _qwen3_moe(seed: int) -> ModelCase:
    from transformers import Qwen3MoeConfig
    cfg = Qwen3MoeConfig(**_SMALL, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                         decoder_sparse_step=1, norm_topk_prob=True)
    return _causal_lm("qwen3_moe", cfg, seed)


def _mistral(seed: int) -> ModelCase:
    from transformers import MistralConfig
    return _causal_lm("mistral", MistralConfig(**_SMALL, head_dim=8, sliding_window=None), seed)


def _mixtral(seed: int) -> ModelCase:
    from transformers import MixtralConfig
    cfg = MixtralConfig(**_SMALL, head_dim=8, num_local_experts=4, num_experts_per_tok=2)
    return _causal_lm("mixtral", cfg, seed)


def _deepseek_v3(seed: int) -> ModelCase:
    from transformers import DeepseekV3Config
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=None,
        eos_token_id=None, tie_word_embeddings=False)
    return _causal_lm("deepseek_v3", cfg, seed)


def _gemma3(seed: int) -> ModelCase:
    from transformers import Gemma3TextConfig
    cfg = Gemma3TextConfig(**_SMALL, head_dim=8, sliding_window=4, query_pre_attn_scalar=8)
    return _causal_lm("gemma3", cfg, seed)


def _bert(seed: int) -> ModelCase:
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    model = _finish(BertForMaskedLM(cfg))
    gen = torch.Generator().manual_seed(seed)
    ids = _text_ids(gen)
    labels = torch.full_like(ids, -100)
    labels[:, 2::3] = ids[:, 2::3]
    masked = ids.clone()
    masked[:, 2::3] = 103 % VOCAB
    inputs = {"input_ids": masked, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    return ModelCase("bert", model, inputs, labels={"labels": labels}, can_generate=False)


def _t5(seed: int) -> ModelCase:
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=False)
    model = _finish(T5ForConditionalGeneration(cfg))
    gen = torch.Generator().manual_seed(seed)
    ids = _text_ids(gen)
    labels = _text_ids(gen, seq=5)
    return ModelCase("t5", model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                     labels={"labels": labels})


# ---- multimodal -----------------------------------------------------------------------------
_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
               spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
               deepstack_visual_indexes=[0, 1])
_IMG_GRID = (1, 4, 4)      # t, h, w in patches: 16 patches -> 4 merged tokens
_VID_GRID = (2, 4, 4)      # two frames of 16 patches -> 2 x 4 tokens


def _pixels(gen: torch.Generator, grids, channels: int = 3, patch: int = 4, tps: int = 2) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, channels * tps * patch * patch, generator=gen)


def _qwen3_vl(seed: int) -> ModelCase:
    """Qwen3-VL with one image and one two-frame video per sample (frames split by timestamp text)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True})
    cfg = Qwen3VLConfig(text_config=text, vision_config=dict(_VISION, out_hidden_size=32), image_token_id=IMAGE,
                        video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    model = _finish(Qwen3VLForConditionalGeneration(cfg))
    gen = torch.Generator().manual_seed(seed)
    m = 4  # merged tokens per image / per frame
    row = ([5, 6, VSTART] + [IMAGE] * m + [VEND, 7, 8, VSTART] + [VIDEO] * m + [VEND, 9, VSTART]
           + [VIDEO] * m + [VEND, 10, 11])
    types = [0 if t not in (IMAGE, VIDEO) else (1 if t == IMAGE else 2) for t in row]
    ids = torch.tensor([row] * BATCH)
    ids[:, 0:2] = torch.randint(1, 100, (BATCH, 2), generator=gen)
    ids[:, -2:] = torch.randint(1, 100, (BATCH, 2), generator=gen)
    inputs = {
        "input_ids": ids, "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": torch.tensor([types] * BATCH),
        "pixel_values": _pixels(gen, [_IMG_GRID] * BATCH), "image_grid_thw": torch.tensor([_IMG_GRID] * BATCH),
        "pixel_values_videos": _pixels(gen, [_VID_GRID] * BATCH),
        "video_grid_thw": torch.tensor([_VID_GRID] * BATCH),
    }
    labels = ids.clone()
    labels[ids >= IMAGE] = -100
    return ModelCase("qwen3_vl", model, inputs, labels={"labels": labels})


def _omni_thinker_config(vocab: int = VOCAB):
    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=256, moe_intermediate_size=16,
                num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True})
    audio = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=32, downsample_hidden_size=8, max_source_positions=64, n_window=50, n_window_infer=100,
                 conv_chunksize=50)
    return dict(text_config=text, vision_config=dict(_VISION, out_hidden_size=32), audio_config=audio,
                audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
                vision_end_token_id=VEND, audio_start_token_id=ASTART, audio_end_token_id=AEND, user_token_id=3)


_AUDIO_FRAMES = 20   # -> 3 audio tokens after the three stride-2 convolutions


def _omni_inputs(gen: torch.Generator) -> dict:
    m, a = 4, 3
    row = [1, 3, 5, ASTART] + [AUDIO] * a + [AEND, 6, VSTART] + [IMAGE] * m + [VEND, 7, 8]
    ids = torch.tensor([row] * BATCH)
    ids[:, 2] = torch.randint(10, 100, (BATCH,), generator=gen)
    ids[:, -2:] = torch.randint(10, 100, (BATCH, 2), generator=gen)
    return {
        "input_ids": ids, "attention_mask": torch.ones_like(ids),
        "input_features": torch.randn(BATCH, 16, _AUDIO_FRAMES, generator=gen),
        "feature_attention_mask": torch.ones(BATCH, _AUDIO_FRAMES, dtype=torch.long),
        "pixel_values": _pixels(gen, [_IMG_GRID] * BATCH), "image_grid_thw": torch.tensor([_IMG_GRID] * BATCH),
    }


def _qwen3_omni_thinker(seed: int) -> ModelCase:
    """The Omni thinker (text + image + audio in, text out)."""
    from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration
    torch.manual_seed(seed)
    model = _finish(Qwen3OmniMoeThinkerForConditionalGeneration(Qwen3OmniMoeThinkerConfig(**_omni_thinker_config())))
    inputs = _omni_inputs(torch.Generator().manual_seed(seed))
    labels = inputs["input_ids"].clone()
    labels[labels >= IMAGE] = -100
    return ModelCase("qwen3_omni_thinker", model, inputs, labels={"labels": labels})


def _qwen3_omni(seed: int) -> ModelCase:
    """The full Omni model (thinker + talker + code2wav) generating text only (`return_audio=False`)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration
    torch.manual_seed(seed)
    talker_text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                       num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=16)
    predictor = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=4)
    talker = dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=4, thinker_hidden_size=32,
                  accept_hidden_layer=1, codec_eos_token_id=100, codec_nothink_id=101, codec_think_bos_id=102,
                  codec_think_eos_id=103, codec_pad_id=104, codec_bos_id=105, audio_token_id=AUDIO,
                  image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
                  audio_start_token_id=ASTART, spatial_merge_size=2, speaker_id={"ethan": 106})
    code2wav = dict(codebook_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                    intermediate_size=64, num_hidden_layers=1, num_quantizers=4, upsample_rates=[2, 2],
                    upsampling_ratios=[2], decoder_dim=32, sliding_window=8, max_position_embeddings=64)
    cfg = Qwen3OmniMoeConfig(thinker_config=_omni_thinker_config(), talker_config=talker, code2wav_config=code2wav,
                             enable_audio_output=True, im_start_token_id=2, im_end_token_id=4, tts_pad_token_id=110,
                             tts_bos_token_id=111, tts_eos_token_id=112, system_token_id=113, user_token_id=3,
                             assistant_token_id=114)
    model = _finish(Qwen3OmniMoeForConditionalGeneration(cfg))
    _finish(model.thinker)
    inputs = _omni_inputs(torch.Generator().manual_seed(seed))
    labels = inputs["input_ids"].clone()
    labels[labels >= IMAGE] = -100
    return ModelCase("qwen3_omni", model, inputs, labels={"labels": labels},
                     generate_kwargs={"return_audio": False, "thinker_eos_token_id": None},
                     max_tokens_arg="thinker_max_new_tokens")


MODELS: dict[str, ModelEntry] = {e.name: e for e in [
    ModelEntry("llama", "LlamaForCausalLM", _llama),
    ModelEntry("qwen3", "Qwen3ForCausalLM", _qwen3),
    ModelEntry("qwen3_moe", "Qwen3MoeForCausalLM (4 experts, top-2)", _qwen3_moe),
    ModelEntry("mistral", "MistralForCausalLM", _mistral),
    ModelEntry("mixtral", "MixtralForCausalLM (4 experts, top-2)", _mixtral),
    ModelEntry("deepseek_v3", "DeepseekV3ForCausalLM (MLA, grouped routing, shared expert)", _deepseek_v3),
    ModelEntry("gemma3", "Gemma3ForCausalLM (text, sliding + global layers)", _gemma3),
    ModelEntry("bert", "BertForMaskedLM (forward instead of generate)", _bert),
    ModelEntry("t5", "T5ForConditionalGeneration (seq2seq)", _t5),
    ModelEntry("qwen3_vl", "Qwen3VLForConditionalGeneration (text + image + video)", _qwen3_vl),
    ModelEntry("qwen3_omni_thinker", "Qwen3OmniMoeThinkerForConditionalGeneration (text + image + audio)",
               _qwen3_omni_thinker),
    ModelEntry("qwen3_omni", "Qwen3OmniMoeForConditionalGeneration (full model, text output)", _qwen3_omni),
]}


def model_names() -> list[str]:
    """Names of the built-in models, in census order."""
    return list(MODELS)


def build_model(name: str, seed: int = 0) -> ModelCase:
    """Build a built-in model and its inputs; the same seed gives the same weights and inputs."""
    if name not in MODELS:
        raise KeyError(f"unknown built-in model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name].build(seed)


def load_pretrained(path: str, seed: int = 0) -> ModelCase:
    """A local Hugging Face checkpoint (never downloaded), fed every modality its config declares (text,
    images with their grids, video, audio: the inputs `census --model-type` builds)."""
    from .auto_models import load_path_model
    return load_path_model(path, seed)
