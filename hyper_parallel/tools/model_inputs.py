"""Inputs for a tiny model of any transformers type: every modality its forward takes, and the labels its
head's loss takes.

`make_inputs(model, cfg, head)` reads the forward's signature and the config: token ids with masks, token
types and boxes; images (pixel values with their grids or sizes, or a video's frames for a video head);
audio (waveforms or spectrogram features, shaped as the config says); point prompts; time series; and the
image / video / audio placeholder tokens a multimodal model expects, counted by running its own feature
extractor once. `head_labels` gives the labels of the head's own loss (tokens, classes, spans, CTC targets,
boxes, pixel classes, a contrastive loss); `fitting_inputs` keeps the richest variant the plain model
accepts, and drops labels whose loss the plain model cannot take (it then trains on a sum of its outputs).
"""
from __future__ import annotations

import inspect
import re

import torch

from .heads import HEAD_BY_NAME
from .models import BATCH

VOCAB = 256
SEQ = 8
TEXT_LOW, TEXT_HIGH = 3, 96      # random text ids; special ids are moved above TEXT_HIGH
WAVE = 3200                      # samples of a waveform (0.2 s at 16 kHz)

# ---- reading the config ---------------------------------------------------------------------------------------
def _forward_params(model) -> set:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _sub(cfg, *names):
    for n in names:
        sub = getattr(cfg, n, None)
        if sub is not None and not isinstance(sub, (int, float, str, bool, list, dict)):
            return sub
    return None


def _sub_configs(cfg) -> list:
    """The config's sub-configs (text, vision, decoder...), in their declared order."""
    return [getattr(cfg, n) for n in (getattr(cfg, "sub_configs", None) or {})
            if getattr(cfg, n, None) is not None and not isinstance(getattr(cfg, n), (int, float, str, bool, list, dict))]


def _first(cfg, names, default=None):
    for n in names:
        v = getattr(cfg, n, None) if cfg is not None else None
        if v is not None:
            return v
    return default


def _token_id(cfg, kind: str):
    names = (f"{kind}_token_id", f"{kind}_token_index", f"{kind}_token")
    found = _first(cfg, names)
    if found is None and _sub(cfg, "vlm_config") is not None:  # a retriever around a VLM (ColPali): the VLM's
        found = _first(_sub(cfg, "vlm_config"), names)
    return found


def _vocab(cfg) -> int:
    text = _sub(cfg, "text_config", "decoder", "language_config", "llm_config", "model_config") or cfg
    return int(_first(text, ("vocab_size",), _first(cfg, ("vocab_size",), VOCAB)))


def _image_count_from_error(err: BaseException) -> int | None:
    m = re.search(r"features[:\s]*(\d+)", str(err))
    return int(m.group(1)) if m else None


def _count_features(features, batch: int) -> int | None:
    """Placeholder tokens per sample from what a model's get_*_features returned."""
    if hasattr(features, "pooler_output") and features.pooler_output is not None:
        features = features.pooler_output
    elif hasattr(features, "last_hidden_state") and not isinstance(features, torch.Tensor):
        features = features.last_hidden_state
    if isinstance(features, (list, tuple)):
        if features and all(isinstance(f, torch.Tensor) for f in features):
            rows = sum(f.shape[0] if f.ndim <= 2 else f.shape[0] * f.shape[1] for f in features)
            return rows // batch
        return None
    if isinstance(features, torch.Tensor):
        if features.ndim >= 3:
            return features.shape[0] * features.shape[1] // batch
        if features.ndim == 2:
            return features.shape[0] // batch
    return None


def _grid_pixels(vcfg, gen, grids) -> torch.Tensor:
    patch = int(_first(vcfg, ("patch_size",), 4))
    tps = int(_first(vcfg, ("temporal_patch_size", "patch_temporal"), 1))
    chans = int(_first(vcfg, ("in_channels", "in_chans", "num_channels"), 3))
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, chans * tps * patch * patch, generator=gen)


def _image_inputs(model, cfg, params: set, gen, batch: int) -> dict:
    """pixel_values (and grids / sizes) for one image per sample, in the layout the model's forward takes."""
    vcfg = _sub(cfg, "vision_config", "vision_tower_config", "visual", "vision_encoder_config") or cfg
    out: dict = {}
    if "image_grid_thw" in params:
        merge = int(_first(vcfg, ("spatial_merge_size", "merge_size"), 2))
        t = 1
        grid = (t, 2 * merge, 2 * merge)
        out["pixel_values"] = _grid_pixels(vcfg, gen, [grid] * batch)
        out["image_grid_thw"] = torch.tensor([grid] * batch)
        return out
    size = _first(vcfg, ("image_size", "img_size"), None)
    if size is None:  # a vision config wrapping its backbone's (SAM 2's Hiera): the backbone's image size
        size = _first(_sub(vcfg, "backbone_config"), ("image_size", "img_size"), 32)
    if isinstance(size, (list, tuple)):
        h, w = int(size[0]), int(size[-1])
    elif isinstance(size, dict):
        h, w = int(size.get("height", 32)), int(size.get("width", 32))
    else:
        h = w = int(size)
    chans = int(_first(vcfg, ("num_channels", "in_channels", "in_chans"), 3))
    position_key = next((k for k in ("pixel_position_ids", "image_position_ids") if k in params), None)
    if position_key is not None:  # patches with their (x, y) grid positions (Gemma 4's vision tower)
        return _positioned_patches(vcfg, gen, batch, chans, h // int(_first(vcfg, ("patch_size",), 4)),
                                   position_key)
    if "target_sizes" in params:  # NaViT-packed patches (MiniCPM-V): every image's patches in one row of
        patch = int(_first(vcfg, ("patch_size",), 4))  # patch-high pixels, with each image's grid in patches
        grid = (h // patch, w // patch)
        return {"pixel_values": torch.randn(1, chans, patch, batch * grid[0] * grid[1] * patch, generator=gen),
                "target_sizes": torch.tensor([grid] * batch, dtype=torch.int32)}
    out["pixel_values"] = torch.randn(batch, chans, h, w, generator=gen)
    if "image_sizes" in params:
        out["image_sizes"] = torch.tensor([[h, w]] * batch)
    return out


def _positioned_patches(vcfg, gen, batch: int, chans: int, side: int, position_key: str) -> dict:
    """pixel_values as (batch, patches, patch * patch * channels) with `position_key` (batch, patches, 2), the
    (x, y) of each patch in its grid: a side of whole pooling windows where the tower pools patches."""
    patch = int(_first(vcfg, ("patch_size",), 4))
    pool = int(_first(vcfg, ("pooling_kernel_size",), 1))
    side = max(pool, side // pool * pool) if pool > 1 else max(side, 1)
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    positions = torch.stack([xs.flatten(), ys.flatten()], -1)
    return {"pixel_values": torch.randn(batch, side * side, patch * patch * chans, generator=gen),
            position_key: positions.unsqueeze(0).expand(batch, -1, -1).contiguous()}


def _feature_count(model, kind: str, inputs: dict, batch: int) -> int | None:
    fn = None
    for owner in (model, getattr(model, "model", None)):
        fn = getattr(owner, f"get_{kind}_features", None) if owner is not None else None
        if fn is not None:
            break
    if fn is None:
        return None
    params = set(inspect.signature(fn).parameters)
    kwargs = {k: v for k, v in inputs.items() if k in params}
    with torch.no_grad():
        try:
            return _count_features(fn(**kwargs), batch)
        except Exception:  # the count then comes from the forward's own mismatch message
            # or from a Q-Former's query tokens, one feature each (InstructBLIP's image features need its
            # Q-Former's prompt, made later; its forward scatters however many there are without a check)
            queries = getattr(model.config, "num_query_tokens", None)
            return queries if isinstance(queries, int) and kind == "image" else None




def _video_frames(model, cfg, params: set, gen, batch: int) -> dict:
    """pixel_values of a video head: (batch, frames, channels, height, width) at the config's frame count."""
    vcfg = _sub(cfg, "vision_config") or cfg
    image = _image_inputs(model, cfg, params, gen, batch)["pixel_values"]
    frames = int(_first(vcfg, ("num_frames", "frames_per_clip"), 4))
    return {"pixel_values": torch.randn(batch, frames, *image.shape[1:], generator=gen)}


def _audio_features(cfg, params: set, gen, batch: int, time_first: bool = False) -> dict:
    """input_features: (batch, mel bins, frames) as Whisper's encoder takes them, or (batch, frames, features)
    where the config counts features per frame (Speech2Text's input_feat_per_channel) or `time_first` says
    so (a conformer's)."""
    acfg = _sub(cfg, "audio_config", "audio_encoder_config", "encoder_config", "encoder") or cfg
    if isinstance(_first(acfg, ("input_feat_per_channel",)), int):
        feats = int(acfg.input_feat_per_channel) * int(_first(acfg, ("input_channels",), 1))
        return {"input_features": torch.randn(batch, 32, feats, generator=gen)}
    mel_keys = ("feature_projection_input_dim", "num_mel_bins", "n_mels", "feature_size", "input_feat_size",
                "num_mels")  # (Wav2Vec2-BERT stacks 2 frames of 80 bins)
    mels = _first(acfg, mel_keys)
    if mels is None and acfg is cfg:  # the bins stated by the sub-model that reads them (CLVP's decoder config)
        mels = next((_first(sub, mel_keys) for sub in _sub_configs(cfg) if _first(sub, mel_keys)), None)
    mels = int(mels or 16)
    frames = min(2 * int(_first(acfg, ("max_source_positions",), 32)), 64)
    shape = (batch, frames, mels) if time_first else (batch, mels, frames)
    image = _first(acfg, ("patch_embed_input_channels",))
    if isinstance(image, int):  # a spectrogram patchified as an image (CLAP's audio Swin): channels, frames, bins
        shape = (batch, image, frames, mels)
    out = {"input_features": torch.randn(*shape, generator=gen)}
    for mask in ("feature_attention_mask", "input_features_mask", "audio_attention_mask"):
        if mask in params:
            out[mask] = torch.ones(batch, frames, dtype=torch.long)
            break
    return out


def _audio_values(cfg, gen, batch: int, channels: int | None = None) -> dict:
    """input_values: a waveform (batch, samples); a codec's (batch, channels, samples), with the config's
    audio_channels or `channels`; or a spectrogram (batch, frames, mel bins) where the config says how many
    frames it takes (the Audio Spectrogram Transformer's max_length)."""
    if isinstance(getattr(cfg, "max_length", None), int) and isinstance(getattr(cfg, "num_mel_bins", None), int):
        return {"input_values": torch.randn(batch, cfg.max_length, cfg.num_mel_bins, generator=gen)}
    channels = getattr(cfg, "audio_channels", None) if channels is None else channels
    if isinstance(channels, int):
        return {"input_values": torch.randn(batch, channels, WAVE, generator=gen)}
    return {"input_values": torch.randn(batch, WAVE, generator=gen)}


def _lagged_series(cfg, params: set, gen, batch: int) -> dict:
    """A forecaster with lagged inputs (Time Series Transformer, Informer, Autoformer): past values over the
    context plus the largest lag, their time features (the config's count, possibly none) and observed mask,
    and the horizon's future values and time features the decoder reads."""
    past = int(cfg.context_length) + max(cfg.lags_sequence)
    horizon = int(cfg.prediction_length)
    size = int(_first(cfg, ("input_size",), 1))
    feats = int(_first(cfg, ("num_time_features",), 0)) + int(_first(cfg, ("num_dynamic_real_features",), 0))
    shape = (batch, past) if size == 1 else (batch, past, size)
    out = {"past_values": torch.randn(*shape, generator=gen),
           "past_time_features": torch.randn(batch, past, feats, generator=gen)}
    if "past_observed_mask" in params:
        out["past_observed_mask"] = torch.ones(*shape)
    if "future_values" in params:
        out["future_values"] = torch.randn(batch, horizon, *shape[2:], generator=gen)
    if "future_time_features" in params:
        out["future_time_features"] = torch.randn(batch, horizon, feats, generator=gen)
    for key, n in (("static_categorical_features", "num_static_categorical_features"),
                   ("static_real_features", "num_static_real_features")):
        count = int(_first(cfg, (n,), 0))
        if key in params and count:
            out[key] = torch.zeros(batch, count, dtype=torch.long) if "categorical" in key else \
                torch.randn(batch, count, generator=gen)
    return out


def _row(text: int, placeholders: list, gen) -> list:
    """Token ids: a little text, then each placeholder run wrapped in its start/end ids, then text."""
    ids = torch.randint(TEXT_LOW, TEXT_HIGH, (text,), generator=gen).tolist()
    row = ids[: text // 2]
    for start, token, n, end in placeholders:
        row += ([start] if start is not None else []) + [token] * n + ([end] if end is not None else [])
    return row + ids[text // 2:]


def _boxes(batch: int, seq: int, gen) -> torch.Tensor:
    """Token bounding boxes (x0, y0, x1, y1) in 0..1000 with x0 <= x1, y0 <= y1 (LayoutLM's bbox)."""
    a = torch.randint(0, 500, (batch, seq, 2), generator=gen)
    return torch.cat([a, a + torch.randint(0, 500, (batch, seq, 2), generator=gen)], -1)


# the input variants tried in order: every modality first, then fewer, until the plain forward accepts one
VARIANTS = (
    {"image", "video", "audio", "image_sizes"},
    {"image", "video", "audio"},
    {"image", "video_frames", "audio"},
    {"image", "audio"},
    {"image"},
    {"audio"},
    set(),
)


# where the config does not say how a modality is laid out, the layouts tried in turn (see fitting_inputs):
# spectrogram frames last or first, a waveform with a channel dim, images grouped per sample (Idefics3's
# (batch, images, channels, height, width))
# the last: no mask over the audio (an encoder that hands its attention_mask to attention as it comes takes the
# processor's 4-D float mask, which the census cannot guess; all-ones masks nothing anyway)
LAYOUTS = ({}, {"audio_time_first": True}, {"wave_channels": 1}, {"images_per_sample": True},
           {"no_audio_mask": True}, {"audio_time_first": True, "wave_channels": 1},  # (a codec reading a mono
           {"patch_images": True})  # waveform and its frames of features, NeuCodec; flattened patches as images
# (channels, patch, patch) for a vision tower that convolves each (Kimi-K2.5's))


def make_inputs(model, cfg, head: str, seed: int = 0, batch: int = BATCH,
                feed: set | None = None, layout: dict | None = None) -> tuple[dict, dict]:
    """(inputs, labels) for `model`: every modality its forward takes and its config declares.

    `feed` limits the modalities ("image", "image_sizes", "video" or "video_frames" (one placeholder run per
    frame, as Qwen3-VL's processor writes them), "audio"); None feeds all. `layout` (one of LAYOUTS) says how
    audio is laid out where the config does not."""
    feed = VARIANTS[0] if feed is None else feed
    layout = layout or {}
    gen = torch.Generator().manual_seed(seed)
    params = _forward_params(model)
    vocab = _vocab(cfg)
    high = min(TEXT_HIGH, vocab)
    inputs: dict = {}
    placeholders: list = []
    image_id, video_id, audio_id = _token_id(cfg, "image"), _token_id(cfg, "video"), _token_id(cfg, "audio")
    start, end = _token_id(cfg, "vision_start"), _token_id(cfg, "vision_end")
    # a composite built without a tower (its sub-config unset: EmbeddingGemma 2 of text only) takes none of its inputs
    if getattr(cfg, "vision_config", False) is None:
        feed = feed - {"image", "video", "video_frames", "image_sizes"}
    if getattr(cfg, "audio_config", False) is None:
        feed = feed - {"audio"}
    if "image" in feed and "flattened_patches" in params:  # Pix2Struct: patches with their row and column
        vcfg = _sub(cfg, "vision_config") or cfg
        width, side = int(_first(vcfg, ("patch_embed_hidden_size",), 48)), 4
        rows, cols = torch.meshgrid(torch.arange(1, side + 1), torch.arange(1, side + 1), indexing="ij")
        where = torch.stack([rows.flatten(), cols.flatten()], -1).float().unsqueeze(0).expand(batch, -1, -1)
        inputs["flattened_patches"] = torch.cat([where, torch.randn(batch, side * side, width, generator=gen)], -1)
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones(batch, side * side, dtype=torch.long)
    if "image" in feed and head == "video-classification" and "pixel_values" in params:
        inputs.update(_video_frames(model, cfg, params, gen, batch))
    elif "image" in feed and "pixel_values" in params:
        image = _image_inputs(model, cfg, params, gen, batch)
        if "image_sizes" not in feed:
            image.pop("image_sizes", None)
        inputs.update(image)
        if image_id is not None:
            n = _feature_count(model, "image", image, batch)
            placeholders.append([start, image_id, n or 1, end])
    if "image" in feed and "pixel_values_videos" in params and "video_grid_thw" not in params and \
            (head == "video-classification" or "pixel_values" not in params):  # (a model of videos only)
        inputs["pixel_values_videos"] = _video_frames(model, cfg, params, gen, batch)["pixel_values"]
    video_feed = "video" in feed or "video_frames" in feed
    if video_feed and "pixel_values_videos" in params and "video_grid_thw" in params and video_id is not None:
        vcfg = _sub(cfg, "vision_config") or cfg
        merge = int(_first(vcfg, ("spatial_merge_size",), 2))
        frames = 2
        grid = (frames, 2 * merge, 2 * merge)
        video = {"pixel_values_videos": _grid_pixels(vcfg, gen, [grid] * batch),
                 "video_grid_thw": torch.tensor([grid] * batch)}
        inputs.update(video)
        n = _feature_count(model, "video", video, batch) or frames * 4
        if "video_frames" in feed:
            placeholders += [[start, video_id, n // frames, end] for _ in range(frames)]
        else:
            placeholders.append([start, video_id, n, end])
    if layout.get("images_per_sample") and isinstance(inputs.get("pixel_values"), torch.Tensor) and \
            inputs["pixel_values"].ndim == 4:
        vcfg = _sub(cfg, "vision_config") or cfg  # a video's frames where the config counts them (X-CLIP's 8)
        frames = _first(vcfg, ("num_frames",), 1)
        frames = frames if isinstance(frames, int) and 0 < frames <= 8 else 1
        inputs["pixel_values"] = inputs["pixel_values"].unsqueeze(1).expand(-1, frames, -1, -1, -1).contiguous()
    if head == "keypoint-matching" and "pixel_values" in inputs:  # a pair of images per sample
        inputs["pixel_values"] = torch.stack([inputs["pixel_values"], inputs["pixel_values"].flip(-1)], 1)
    if "past_values" in params and "past_time_features" in params and isinstance(
            getattr(cfg, "lags_sequence", None), (list, tuple)):
        inputs.update(_lagged_series(cfg, params, gen, batch))
    elif "past_values" in params:  # a time series: (batch, context, channels) with its observed mask
        context = int(_first(cfg, ("context_length",), 32))
        channels = _first(cfg, ("num_input_channels", "input_size"))
        # (batch, context, channels); (batch, context) where the config counts no channels (TimesFM: one series)
        shape = (batch, context, int(channels)) if channels is not None else (batch, context)
        inputs["past_values"] = torch.randn(*shape, generator=gen)
        if "past_observed_mask" in params:
            inputs["past_observed_mask"] = torch.ones(*shape)
    if "grid_thw" in params:  # a vision tower on its own: flattened patches and their grid
        merge = int(_first(cfg, ("spatial_merge_size", "merge_size"), 2))
        grid = (1, 2 * merge, 2 * merge)
        key = "hidden_states" if "hidden_states" in params else "pixel_values"
        inputs[key] = _grid_pixels(cfg, gen, [grid] * batch)
        inputs["grid_thw"] = torch.tensor([grid] * batch)
        if "merge_sizes" in params:  # each image's merge (VideoLLaMA 3's tower): the config's
            inputs["merge_sizes"] = torch.tensor([merge] * batch)
    if layout.get("patch_images") and isinstance(inputs.get("pixel_values"), torch.Tensor) and \
            inputs["pixel_values"].ndim == 2:
        vcfg = _sub(cfg, "vision_config") or cfg
        patch = int(_first(vcfg, ("patch_size",), 4))
        if inputs["pixel_values"].shape[1] % (patch * patch) == 0:
            inputs["pixel_values"] = inputs["pixel_values"].reshape(inputs["pixel_values"].shape[0], -1, patch, patch)
    if "audio" in feed and "audio_mel" in params:  # Gemma 3n's audio encoder: (batch, frames, mel bins), a
        mel = _audio_features(cfg, params, gen, batch, True)["input_features"]  # padding mask (True: padded)
        inputs.update(audio_mel=mel, audio_mel_mask=torch.zeros(mel.shape[:2], dtype=torch.bool))
    if "audio" in feed and "input_features" in params:
        audio = _audio_features(cfg, params, gen, batch, bool(layout.get("audio_time_first")))
        inputs.update(audio)
        if audio_id is not None:
            n = _feature_count(model, "audio", audio, batch)
            placeholders.append([_token_id(cfg, "audio_start"), audio_id, n or 1, _token_id(cfg, "audio_end")])
    if "audio" in feed and "input_values" in params and ("input_features" not in inputs or
                                                         "input_values" in _required_params(model)):
        # (a codec that requires both: the waveform and its semantic features, NeuCodec's)
        wave = _audio_values(cfg, gen, batch, layout.get("wave_channels"))
        inputs.update(wave)
        if audio_id is not None and "input_features" not in inputs:  # placeholders for the waveform's features
            n = _feature_count(model, "audio", wave, batch)
            placeholders.append([_token_id(cfg, "audio_start"), audio_id, n or 1, _token_id(cfg, "audio_end")])
    if "attention_mask" in params and "input_ids" not in params and not layout.get("no_audio_mask"):
        # a mask over the audio's samples / frames
        wave, features = inputs.get("input_values"), inputs.get("input_features")
        if wave is not None and wave.ndim == 2:
            inputs["attention_mask"] = torch.ones(wave.shape, dtype=torch.long)
        elif features is not None and features.ndim == 3:
            frames = features.shape[1 if layout.get("audio_time_first") else 2]
            inputs["attention_mask"] = torch.ones(batch, frames, dtype=torch.long)
    if "input_points" in params and "pixel_values" in inputs:   # a segment-anything prompt: one point per image
        inputs["input_points"] = torch.rand(batch, 1, 1, 2, generator=gen) * inputs["pixel_values"].shape[-1]
        if "input_labels" in params:
            inputs["input_labels"] = torch.ones(batch, 1, 1, dtype=torch.long)
    if "input_ids" in params and (not inputs or _takes_text(params, head)):
        ids = torch.tensor([_row(SEQ, placeholders, gen)] * batch)
        text = (ids < high) | (ids >= vocab)  # (random text ids past a small vocabulary too: a protein's 64)
        ids[text] = torch.randint(TEXT_LOW, high, (int(text.sum()),), generator=gen)
        if head == "multiple-choice":
            ids = torch.stack([ids, ids.flip(-1)], 1)
        inputs["input_ids"] = ids
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones_like(ids)
        if "token_type_ids" in params:
            inputs["token_type_ids"] = (ids == image_id).long() if image_id is not None else torch.zeros_like(ids)
            kinds = getattr(cfg, "type_vocab_sizes", None)
            if isinstance(kinds, (list, tuple)) and kinds:  # one type id per kind (TAPAS: segment, column, row...)
                inputs["token_type_ids"] = torch.zeros(*ids.shape, len(kinds), dtype=torch.long)
        if "mm_token_type_ids" in params:
            types = torch.zeros_like(ids)
            for kind, token in ((1, image_id), (2, video_id), (3, audio_id)):
                if token is not None:
                    types[ids == token] = kind
            inputs["mm_token_type_ids"] = types
        if "bbox" in params:
            inputs["bbox"] = _boxes(batch, ids.shape[-1], gen)
    if getattr(model, "main_input_name", None) == "inputs" and "inputs" in params:
        # a speech encoder-decoder: its encoder's own input (a waveform for Wav2Vec2's), named as generate looks
        # for it
        want = getattr(getattr(model, "encoder", None), "main_input_name", None)
        if want == "input_values" and "input_features" in inputs:
            inputs.pop("input_features")
            inputs.update(_audio_values(_sub(cfg, "encoder") or cfg, gen, batch))
            if "attention_mask" in inputs and "input_ids" not in inputs:
                inputs["attention_mask"] = torch.ones(inputs["input_values"].shape, dtype=torch.long)
        main = next((k for k in ("input_values", "input_features") if k in inputs), None)
        if main is not None:
            inputs["inputs"] = inputs.pop(main)
    _side_inputs(inputs, model, cfg, params, gen, batch, high)
    labels = head_labels(inputs, model, cfg, head, gen, batch, high)
    if not labels and "input_ids" not in inputs and inputs and "labels" in params and \
            getattr(cfg, "is_encoder_decoder", False) and head in HEAD_BY_NAME and HEAD_BY_NAME[head].generates:
        # an encoder-decoder reading no text (Pix2Struct's patches): its decoder's target tokens
        labels = {"labels": torch.randint(TEXT_LOW, high, (batch, 5), generator=gen)}
    if {"spectrogram_labels", "duration_labels"} <= params and isinstance(inputs.get("input_ids"), torch.Tensor):
        # a text-to-speech model trained on its own targets (FastSpeech 2): 2 frames a token, the spectrogram
        # of those frames, a pitch and an energy a token
        ids = inputs["input_ids"]
        frames = 2 * ids.shape[1] * int(_first(cfg, ("reduction_factor",), 1))
        mels = int(_first(cfg, ("num_mel_bins",), 80))
        labels = {"spectrogram_labels": torch.randn(batch, frames, mels, generator=gen),
                  "duration_labels": torch.full(ids.shape, 2, dtype=torch.long),
                  "pitch_labels": torch.randn(*ids.shape, 1, generator=gen),
                  "energy_labels": torch.randn(*ids.shape, 1, generator=gen)}
    codebooks = getattr(cfg, "num_codebooks", None)
    if hasattr(model, "build_delay_pattern_mask") and isinstance(codebooks, int) and codebooks > 1 and \
            isinstance(inputs.get("input_ids"), torch.Tensor) and inputs["input_ids"].ndim == 2:
        # a decoder over parallel audio codebooks (MusicGen): ids (batch * codebooks, seq), labels
        # (batch, seq, codebooks), one mask per sample
        ids = inputs["input_ids"]
        inputs["input_ids"] = ids.repeat_interleave(codebooks, 0)
        if "labels" in labels:
            labels["labels"] = ids.unsqueeze(-1).expand(-1, -1, codebooks).contiguous()
    if "decoder_input_ids" in params and head in ("rnnt", "tdt") and "input_features" in inputs:
        # a transducer's prediction network: the blank token it starts from (its one step the forward scores)
        inputs["decoder_input_ids"] = torch.full((batch, 1), int(_first(cfg, ("blank_token_id",), 0)))
    if "decoder_input_ids" in params and "labels" not in labels and "input_ids" in inputs:
        inputs["decoder_input_ids"] = torch.randint(TEXT_LOW, high, (batch, 5), generator=gen)
    return inputs, labels


def _side_inputs(inputs: dict, model, cfg, params: set, gen, batch: int, high: int) -> None:
    """Inputs a forward requires beside the modalities, shaped from the ones already made: the Q-Former's own
    prompt (InstructBLIP), region features and boxes (LXMERT), a segmentation prompt (SegGPT), the images each
    token attends to (IDEFICS), NaFlex patches with their grid (SigLIP 2), a trajectory (Decision Transformer),
    a task prompt (OneFormer)."""
    ids, pixels = inputs.get("input_ids"), inputs.get("pixel_values")
    if "qformer_input_ids" in params and ids is not None:
        qcfg = _sub(cfg, "qformer_config")
        qvocab = int(_first(qcfg, ("vocab_size",), high))
        inputs["qformer_input_ids"] = torch.randint(TEXT_LOW, min(high, qvocab), ids.shape[-2:], generator=gen)
        if "qformer_attention_mask" in params:
            inputs["qformer_attention_mask"] = torch.ones_like(inputs["qformer_input_ids"])
    if "visual_feats" in params and "visual_pos" in params and ids is not None:
        boxes = 4
        inputs["visual_feats"] = torch.randn(batch, boxes, int(_first(cfg, ("visual_feat_dim",), 64)), generator=gen)
        inputs["visual_pos"] = torch.rand(batch, boxes, int(_first(cfg, ("visual_pos_dim",), 4)), generator=gen)
    if isinstance(pixels, torch.Tensor) and pixels.ndim == 4 and "prompt_pixel_values" in params:
        if pixels.shape[-2] == 2 * pixels.shape[-1]:  # (SegGPT's image_size is the image and its prompt stacked)
            inputs["pixel_values"] = pixels = pixels[..., : pixels.shape[-1], :].contiguous()
        inputs["prompt_pixel_values"] = torch.randn(pixels.shape, generator=gen)
        if "prompt_masks" in params:
            inputs["prompt_masks"] = torch.randn(pixels.shape, generator=gen)
    if "image_attention_mask" in params and ids is not None and isinstance(pixels, torch.Tensor) and \
            pixels.ndim == 5:
        inputs["image_attention_mask"] = torch.ones(batch, ids.shape[-1], pixels.shape[1], dtype=torch.long)
    if {"states", "actions", "returns_to_go", "timesteps"} <= params and not inputs:  # a Decision Transformer
        state, act = int(_first(cfg, ("state_dim",), 4)), int(_first(cfg, ("act_dim",), 2))
        inputs.update(states=torch.randn(batch, SEQ, state, generator=gen),
                      actions=torch.randn(batch, SEQ, act, generator=gen),
                      rewards=torch.randn(batch, SEQ, 1, generator=gen),
                      returns_to_go=torch.randn(batch, SEQ, 1, generator=gen),
                      timesteps=torch.arange(SEQ).repeat(batch, 1))
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones(batch, SEQ, dtype=torch.long)
    latents = _first(cfg, ("latent_query_num",))
    if "image_embeds_position_mask" in params and ids is not None and isinstance(latents, int) and \
            isinstance(pixels, torch.Tensor):  # Kosmos-2: the image's latent queries take that many token positions
        place = torch.randint(TEXT_LOW, high, (batch, latents), generator=gen)
        inputs["input_ids"] = ids = torch.cat([ids[:, :1], place, ids[:, 1:]], 1)
        mask = torch.zeros_like(ids)
        mask[:, 1:1 + latents] = 1
        inputs["image_embeds_position_mask"] = mask
        if "attention_mask" in inputs:
            inputs["attention_mask"] = torch.ones_like(ids)
    if "task_inputs" in params and "pixel_values" in inputs:  # OneFormer's task prompt ("the task is ...")
        inputs["task_inputs"] = torch.randint(TEXT_LOW, high, (batch, int(_first(cfg, ("task_seq_len",), SEQ))),
                                              generator=gen)
    if "spatial_shapes" in params and isinstance(pixels, torch.Tensor) and pixels.ndim == 4:
        vcfg = _sub(cfg, "vision_config") or cfg
        patch = int(_first(vcfg, ("patch_size",), 4))
        side = pixels.shape[-1] // patch
        chans = pixels.shape[1]
        inputs["pixel_values"] = pixels.reshape(batch, chans, side, patch, side, patch).permute(
            0, 2, 4, 3, 5, 1).reshape(batch, side * side, patch * patch * chans)
        inputs["spatial_shapes"] = torch.tensor([[side, side]] * batch)
        if "pixel_attention_mask" in params:
            inputs["pixel_attention_mask"] = torch.ones(batch, side * side, dtype=torch.long)


def _takes_text(params: set, head: str) -> bool:
    """Whether a model fed images or audio also takes token ids: a multimodal model's prompt, a contrastive
    model's captions. A head that reads pixels or sound only leaves input_ids out where the forward allows."""
    return head not in ("image-classification", "video-classification", "audio-classification", "ctc",
                        "object-detection", "semantic-segmentation", "depth-estimation", "backbone",
                        "image-feature", "mask-generation")


def fed_modalities(inputs: dict) -> list[str]:
    """The modalities an input dict feeds, for the report."""
    out = ["text"] if "input_ids" in inputs else []
    video = "pixel_values_videos" in inputs or (isinstance(inputs.get("pixel_values"), torch.Tensor)
                                                and inputs["pixel_values"].ndim == 5)
    if "pixel_values" in inputs and not (video and "pixel_values_videos" not in inputs):
        out.append("image")
    if video:
        out.append("video")
    if "input_features" in inputs or "input_values" in inputs:
        out.append("audio")
    for key, name in (("input_points", "points"), ("past_values", "time series")):
        if key in inputs:
            out.append(name)
    return out


def _num_labels(cfg) -> int:
    n = getattr(cfg, "num_labels", None)
    return int(n) if isinstance(n, int) and n > 0 else 2


def head_labels(inputs: dict, model, cfg, head: str, gen, batch: int, high: int) -> dict:
    """The labels of the head's own loss (see heads.Head.labels); {} where it has none here."""
    kind = HEAD_BY_NAME[head].labels if head in HEAD_BY_NAME else None
    ids = inputs.get("input_ids")
    params = _forward_params(model)
    if kind is None or ("labels" not in params and kind not in ("span", "contrastive")):
        return {}
    if kind == "class":
        return {"labels": torch.randint(0, _num_labels(cfg), (batch,), generator=gen)}
    if kind == "seq2seq":
        return {"labels": torch.randint(TEXT_LOW, high, (batch, 5), generator=gen)}
    if kind == "ctc":
        return {"labels": torch.randint(TEXT_LOW, high, (batch, 2), generator=gen)}
    if kind == "contrastive":
        return {"return_loss": True} if "return_loss" in params else {}
    if kind == "pixels" and "pixel_values" in inputs:
        h, w = inputs["pixel_values"].shape[-2:]
        return {"labels": torch.randint(0, _num_labels(cfg), (batch, h, w), generator=gen)}
    if kind == "boxes":
        if not _has_scipy():  # DETR-style losses match boxes with scipy's Hungarian solver
            return {}
        return {"labels": [{"class_labels": torch.randint(0, _num_labels(cfg), (2,), generator=gen),
                            "boxes": torch.rand(2, 4, generator=gen) * 0.5 + 0.25} for _ in range(batch)]}
    if ids is None:
        return {}
    if kind == "tokens":
        return {"labels": torch.randint(0, _num_labels(cfg), ids.shape, generator=gen)}
    if kind == "span":
        if "start_positions" not in params:
            return {}
        return {"start_positions": torch.randint(0, ids.shape[-1], (batch,), generator=gen),
                "end_positions": torch.randint(0, ids.shape[-1], (batch,), generator=gen)}
    if kind == "masked":
        labels = torch.full_like(ids, -100)
        labels[:, 2::3] = ids[:, 2::3]
        return {"labels": labels}
    labels = ids.clone()
    labels[ids >= high] = -100
    return {"labels": labels}


def _has_scipy() -> bool:
    import importlib.util
    return importlib.util.find_spec("scipy") is not None


def _plain_forward_error(model, inputs: dict) -> Exception | None:
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as e:  # the caller tries the next input variant
        return e
    return None


def fitting_inputs(model, cfg, head: str, seed: int = 0, batch: int = BATCH) -> tuple[dict, dict, str]:
    """(inputs, labels, note): the richest input variant the model's plain forward accepts (the first one if
    none is accepted), and the head's labels if the plain model takes them (else none, and `note` says why:
    the training step then runs on a sum of the outputs).

    Multimodal heads try fewer modalities (VARIANTS); audio tries the layouts of LAYOUTS. A forward that says
    how many image features it made ("... tokens: X, features: Y") gets a prompt with that many placeholders."""
    inputs, labels = make_inputs(model, cfg, head, seed, batch)
    multimodal = head in ("image-text-to-text", "seq2seq-lm", "multimodal-lm", "speech-seq2seq") and any(
        k in inputs for k in ("pixel_values", "pixel_values_videos", "input_features"))
    if multimodal:
        inputs, labels = _fitting_variant(model, cfg, head, seed, batch)
    elif _fails(model, inputs, labels) and any(k in inputs for k in ("input_features", "input_values",
                                                                       "pixel_values")):
        for layout in LAYOUTS[1:]:
            tried = make_inputs(model, cfg, head, seed, batch, layout=layout)
            if not _fails(model, *tried):
                inputs, labels = tried
                break
            # an encoder with image placeholders in its text (ModernVBERT's masked LM): as many as it made features
            fixed = _with_feature_count(model, cfg, head, seed, batch, tried[0], _plain_forward_error(model, tried[0]))
            if fixed is not None:
                inputs, labels = fixed
                break
    embedded = _embedded_inputs(model, cfg, inputs, seed, batch)
    if embedded is not None:
        inputs = embedded
    note = ""
    if labels:
        was = model.training
        model.train()
        err = _plain_forward_error(model, {**inputs, **labels})
        model.train(was)
        if err is not None:
            first = (str(err).strip().splitlines() or [""])[0][:120]
            note = f"the head's loss fails plain ({type(err).__name__}: {first}): " \
                   f"trained on a sum of the outputs"
            labels = {}
    return inputs, labels, note


# required inputs that are sequences of vectors (a sub-model fed what its parent model computes: a Q-Former's
# queries, a codec decoder's latents, an assistant's context), and the config widths they may have
_VECTOR_INPUTS = ("query_embeds", "noise_embeds", "context_hidden_states", "inputs_embeds", "hidden_states",
                  "latents")
_WIDTH_KEYS = ("latent_dim", "hidden_size", "codebook_dim", "d_model", "channels", "audio_channels")


def _required_params(model) -> list:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    return [n for n, p in sig.parameters.items() if p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _embedded_inputs(model, cfg, inputs: dict, seed: int, batch: int) -> dict | None:
    """The inputs with the forward's required vector-sequence inputs (_VECTOR_INPUTS) it was not given:
    (batch, length, width) or (batch, width, length), for a width the config states (_WIDTH_KEYS) and a length of
    SEQ tokens or a WAVE-sample waveform, the first layout the plain forward accepts (None if none is needed or
    none runs). A cross-attending model also gets its encoder's states at the config's encoder_hidden_size."""
    missing = [n for n in _required_params(model) if n not in inputs and n in _VECTOR_INPUTS]
    if not missing:
        return None
    gen = torch.Generator().manual_seed(seed + 2)
    base = dict(inputs)
    params = _forward_params(model)
    enc = _first(cfg, ("encoder_hidden_size",))
    if "encoder_hidden_states" in params and isinstance(enc, int) and "encoder_hidden_states" not in base:
        base["encoder_hidden_states"] = torch.randn(batch, SEQ, enc, generator=gen)
    widths = list(dict.fromkeys(int(v) for v in (_first(cfg, (k,)) for k in _WIDTH_KEYS)
                                if isinstance(v, int) and not isinstance(v, bool) and v > 0))
    for width in widths:
        for length in (SEQ, WAVE):
            for channels_first in (False, True):
                shape = (batch, width, length) if channels_first else (batch, length, width)
                trial = dict(base, **{n: torch.randn(*shape, generator=gen) for n in missing})
                if _plain_forward_error(model, trial) is None:
                    return trial
    return None


def _fails(model, inputs: dict, labels: dict) -> bool:
    """Whether the plain forward fails on the inputs alone and with the labels (an encoder-decoder's forward
    needs its decoder's tokens)."""
    return _plain_forward_error(model, inputs) is not None and (
        not labels or _plain_forward_error(model, {**inputs, **labels}) is not None)


def _fitting_variant(model, cfg, head: str, seed: int, batch: int) -> tuple[dict, dict]:
    """The first variant of VARIANTS (in any audio layout of LAYOUTS) the plain forward accepts; the richest
    one if none is."""
    tried: list = []
    first = None
    for feed in VARIANTS:
        for layout in LAYOUTS:
            inputs, labels = make_inputs(model, cfg, head, seed, batch, feed, layout)
            key = tuple((k, tuple(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in sorted(inputs.items()))
            if key in tried:
                continue
            tried.append(key)
            first = first or (inputs, labels)
            if not _fails(model, inputs, labels):
                return inputs, labels
            err = _plain_forward_error(model, inputs)
            fixed = _with_feature_count(model, cfg, head, seed, batch, inputs, err)
            if fixed is not None:
                return fixed
    return first


def _with_feature_count(model, cfg, head: str, seed: int, batch: int, inputs: dict, err: Exception):
    """The inputs with as many image placeholders as the forward's error says it made features, if that
    makes the forward run (None otherwise)."""
    n = _image_count_from_error(err) if "token" in str(err) and "features" in str(err) else None
    audio = str(err).lower().startswith("audio")  # ("Audio features and audio tokens do not match": OmniASR's)
    image_id = _token_id(cfg, "audio" if audio else "image")
    if not n or image_id is None or "input_ids" not in inputs:
        return None
    gen = torch.Generator().manual_seed(seed + 1)
    start, end = ("audio_start", "audio_end") if audio else ("vision_start", "vision_end")
    ids = torch.tensor([_row(SEQ, [[_token_id(cfg, start), image_id, max(1, n // batch),
                                    _token_id(cfg, end)]], gen)] * batch)
    fixed = dict(inputs, input_ids=ids)
    for k in ("attention_mask",):
        if k in fixed:
            fixed[k] = torch.ones_like(ids)
    for k in ("token_type_ids", "mm_token_type_ids"):
        if k in fixed:  # (an audio placeholder's modality type is 3, as make_inputs writes it)
            fixed[k] = (ids == image_id).long() * (3 if audio and k == "mm_token_type_ids" else 1)
    fixed = {k: v for k, v in fixed.items() if k not in ("pixel_values_videos", "video_grid_thw")}
    if _plain_forward_error(model, fixed) is None:
        return fixed, head_labels(fixed, model, cfg, head, gen, batch, min(TEXT_HIGH, _vocab(cfg)))
    return None


__all__ = ["make_inputs", "fitting_inputs", "fed_modalities", "head_labels", "VARIANTS", "SEQ", "VOCAB"]


def pad_tokens(inputs: dict, labels: dict | torch.Tensor, multiple: int, left: bool = False):
    """The per-token inputs (2-D tensors shaped like input_ids: ids, masks, token types) and labels
    right-padded to a multiple of `multiple` tokens, as a tokenizer's `pad_to_multiple_of` pads them: ids and
    token types 0, attention_mask 0, labels -100 (what context parallelism asks for: 2 x cp). `labels` is a
    tensor or a dict of them; other inputs (pixels, grids, audio) are left as they are. `left`: padded at the
    start instead, as prompts for `generate` are (padding_side="left"), so that every row ends in its last token."""
    ids = inputs.get("input_ids")
    extra = 0 if ids is None or ids.ndim != 2 else -ids.shape[1] % multiple
    if not extra:
        return inputs, labels
    shape = tuple(ids.shape)

    def pad(t, value=0):
        per_token = isinstance(t, torch.Tensor) and tuple(t.shape) == shape
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value) if per_token else t

    inputs = {k: pad(v) for k, v in inputs.items()}
    if isinstance(labels, dict):
        return inputs, {k: pad(v, -100) for k, v in labels.items()}
    return inputs, pad(labels, -100)

