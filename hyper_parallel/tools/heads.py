"""The heads transformers registers (its `MODEL_FOR_*_MAPPING_NAMES` auto mappings), and the one the census
builds each model type with.

A type is built with the first head of `HEADS` it has: the five the census began with first (so their types
keep their head), then the other task heads, then the feature heads (pretraining, backbone, text or image
encoder), and the base model (`MODEL_MAPPING_NAMES`) for a type with no head at all. Each head says how it is
run: whether it generates (`generate` compares tokens) or runs a forward (every output compared), and what
its training labels are (`labels`, a kind `model_inputs.head_labels` knows; None: the head has no loss of its
own here and trains on a sum of its outputs).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Head:
    name: str
    mapping: str                # the MODEL_FOR_..._MAPPING_NAMES suffix ("" for MODEL_MAPPING_NAMES)
    generates: bool = False     # generate (tokens compared) when the model can
    labels: str | None = None   # the label kind its own loss takes (see model_inputs.head_labels)


HEADS: tuple[Head, ...] = (
    Head("image-text-to-text", "IMAGE_TEXT_TO_TEXT", True, "causal"),
    Head("causal-lm", "CAUSAL_LM", True, "causal"),
    Head("seq2seq-lm", "SEQ_TO_SEQ_CAUSAL_LM", True, "seq2seq"),
    Head("masked-lm", "MASKED_LM", False, "masked"),
    Head("classification", "SEQUENCE_CLASSIFICATION", False, "class"),
    Head("multimodal-lm", "MULTIMODAL_LM", True, "causal"),
    Head("speech-seq2seq", "SPEECH_SEQ_2_SEQ", True, "seq2seq"),
    Head("ctc", "CTC", False, "ctc"),
    Head("rnnt", "RNNT", False, "ctc"),
    Head("tdt", "TDT", False, "ctc"),
    Head("text-to-waveform", "TEXT_TO_WAVEFORM"),
    Head("text-to-spectrogram", "TEXT_TO_SPECTROGRAM"),
    Head("object-detection", "OBJECT_DETECTION", False, "boxes"),
    Head("zero-shot-object-detection", "ZERO_SHOT_OBJECT_DETECTION"),
    Head("universal-segmentation", "UNIVERSAL_SEGMENTATION"),
    Head("instance-segmentation", "INSTANCE_SEGMENTATION"),
    Head("semantic-segmentation", "SEMANTIC_SEGMENTATION", False, "pixels"),
    Head("image-segmentation", "IMAGE_SEGMENTATION"),
    Head("mask-generation", "MASK_GENERATION"),
    Head("depth-estimation", "DEPTH_ESTIMATION"),
    Head("normal-estimation", "NORMAL_ESTIMATION"),
    Head("pointmap-estimation", "POINTMAP_ESTIMATION"),
    Head("keypoint-detection", "KEYPOINT_DETECTION"),
    Head("keypoint-matching", "KEYPOINT_MATCHING"),
    Head("pose-estimation", "POSE_ESTIMATION"),
    Head("image-matting", "IMAGE_MATTING"),
    Head("image-to-image", "IMAGE_TO_IMAGE"),
    Head("zero-shot-image-classification", "ZERO_SHOT_IMAGE_CLASSIFICATION", False, "contrastive"),
    Head("image-classification", "IMAGE_CLASSIFICATION", False, "class"),
    Head("video-classification", "VIDEO_CLASSIFICATION", False, "class"),
    Head("audio-classification", "AUDIO_CLASSIFICATION", False, "class"),
    Head("audio-frame-classification", "AUDIO_FRAME_CLASSIFICATION"),
    Head("audio-xvector", "AUDIO_XVECTOR", False, "class"),
    Head("masked-image-modeling", "MASKED_IMAGE_MODELING"),
    Head("causal-image-modeling", "CAUSAL_IMAGE_MODELING"),
    Head("text-recognition", "TEXT_RECOGNITION"),
    Head("table-recognition", "TABLE_RECOGNITION"),
    Head("visual-question-answering", "VISUAL_QUESTION_ANSWERING"),
    Head("document-question-answering", "DOCUMENT_QUESTION_ANSWERING"),
    Head("token-classification", "TOKEN_CLASSIFICATION", False, "tokens"),
    Head("question-answering", "QUESTION_ANSWERING", False, "span"),
    Head("multiple-choice", "MULTIPLE_CHOICE", False, "class"),
    Head("next-sentence-prediction", "NEXT_SENTENCE_PREDICTION", False, "class"),
    Head("table-question-answering", "TABLE_QUESTION_ANSWERING"),
    Head("time-series-prediction", "TIME_SERIES_PREDICTION"),
    Head("time-series-classification", "TIME_SERIES_CLASSIFICATION"),
    Head("time-series-regression", "TIME_SERIES_REGRESSION"),
    Head("decision", "DECISION"),
    Head("retrieval", "RETRIEVAL"),
    Head("pretraining", "PRETRAINING"),
    Head("backbone", "BACKBONE"),
    Head("text-encoding", "TEXT_ENCODING"),
    Head("image-feature", "IMAGE"),
    Head("base", ""),
)
HEAD_BY_NAME = {h.name: h for h in HEADS}


def _mapping_name(head: Head) -> str:
    return f"MODEL_FOR_{head.mapping}_MAPPING_NAMES" if head.mapping else "MODEL_MAPPING_NAMES"


def head_mappings() -> dict:
    """head name -> {model type: model class name(s)}, as this transformers registers them."""
    from transformers.models.auto import modeling_auto
    return {h.name: getattr(modeling_auto, _mapping_name(h), {}) for h in HEADS}


def unlisted_mappings() -> list[str]:
    """Auto mappings this transformers has that HEADS does not name (a newer transformers' new head)."""
    from transformers.models.auto import modeling_auto
    known = {_mapping_name(h) for h in HEADS}
    return sorted(k for k, v in vars(modeling_auto).items()
                  if k.startswith("MODEL_") and k.endswith("_MAPPING_NAMES") and isinstance(v, dict) and k not in known)


def all_model_types() -> list[str]:
    """Every model type transformers has a model class for (a head or the base model), sorted."""
    types: set = set()
    for mapping in head_mappings().values():
        types.update(t for t, cls in mapping.items() if cls)
    return sorted(types)


def heads_of(model_type: str) -> dict:
    """head name -> class name, for every head the type has, in HEADS order."""
    out = {}
    for head, mapping in head_mappings().items():
        cls = mapping.get(model_type)
        if cls:
            out[head] = cls if isinstance(cls, str) else cls[0]
    return out


def head_of(model_type: str, head: str | None = None) -> tuple[str, str]:
    """(head name, model class name) the census builds `model_type` with: `head` if given, else the first of
    HEADS the type has, except that a causal LM that is part of a larger model gives way to it (below)."""
    found = heads_of(model_type)
    if not found:
        raise KeyError(f"model type {model_type!r} has no model class in this transformers; "
                       f"`hyper-parallel census --model-type all` runs the {len(all_model_types())} that do")
    if head is not None:
        if head not in found:
            raise KeyError(f"model type {model_type!r} has no {head!r} head; it has {', '.join(found)}")
        return head, found[head]
    name = next(iter(found))
    if name == "causal-lm":
        # the whole model where the causal LM is one part of it: an encoder-decoder's decoder (Whisper's, BART's)
        # is built as the encoder-decoder; an encoder with a causal-LM head (BERT's, is_decoder=True) as the
        # masked LM it was trained as
        name = next((h for h in ("speech-seq2seq", "seq2seq-lm", "masked-lm") if h in found), name)
    return name, found[name]


__all__ = ["Head", "HEADS", "HEAD_BY_NAME", "head_mappings", "all_model_types", "heads_of", "head_of",
           "unlisted_mappings"]
