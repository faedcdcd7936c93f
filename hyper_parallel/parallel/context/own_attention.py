"""Models whose attention context parallelism cannot take over: found from the model's code, at the call.

Context parallelism computes exact attention only where a layer hands its queries, keys and values (and the
2-D padding mask of transformers' mask builders) to transformers' attention interface: the registered
function sees global token positions there, while the model's own tensor positions are those of the split,
load-balanced sequence. A layer that computes its scores with code of its own (Bloom, Falcon, GPT-Neo, MPT,
XGLM, TrOCR, OpenAI-GPT, BLIP's text decoder), that reads the mask as a 4-D score mask of its own to add a
learned or relative bias to it (Doge's dynamic mask, Pix2Struct's position bias), that cross-attends another
sequence (IDEFICS' image features), or a decoder that derives its positions from the token ids (Kosmos-2's
padding-offset sinusoidal positions) or counts them along the padding mask (OPT) would compute wrong values,
or fail with a shape error deep inside, on the load-balanced split. They are found when `context_parallel`
is called, on every rank alike (the code is the same on every rank) and before anything communicates, and
the sequence is then split in order with no attention registered (`api.context_parallel`), the reason
recorded in the summary.

The reading is a heuristic over the classes' source, as transformers' own `_can_set_attn_implementation`
is; it looks only at the modules that see the split sequence: a vision / audio tower of its own config runs
whole and is not read, and attention layers are read in the decoder's layer lists only (a resampler deep in
a tower without a config of its own, Evolla's, runs whole too). Cross-attention code of its own is left to
run: its keys are another sequence's, whole, and each query attends them alike in any order.
"""
from __future__ import annotations

import functools
import inspect
import re

from torch import nn

INTERFACE = "ALL_ATTENTION_FUNCTIONS"
# a 4-D slice of the mask: the layer makes (b, heads, q, k) scores' mask of its own (a bias added to it)
_MASK_4D = re.compile(r"mask\w*\s*\[\s*:\s*,\s*:\s*,\s*:\s*,\s*:")
_POSITION_FROM_IDS = "create_position_ids_from_input_ids"
# default positions counted along the padding mask (OPT: `cumsum(attention_mask) * attention_mask - 1`), which the
# split's injected global positions (`arange`) differ from on a padded row
_POSITIONS_FROM_MASK = re.compile(r"position\w*\s*=\s*\(?\s*"
                                  r"(torch\.cumsum\(\s*\w*attention_mask|\w*attention_mask\w*\.cumsum\()")


@functools.lru_cache(maxsize=None)
def _source(cls: type) -> str:
    """The source of `cls` and of its transformers base classes (where a method may come from)."""
    parts = []
    for c in cls.__mro__:
        if not c.__module__.startswith("transformers."):
            continue
        try:
            parts.append(inspect.getsource(c))
        except (OSError, TypeError):
            pass
    return "\n".join(parts)


def _split_path(root: nn.Module, text_config, whole: tuple = ()):
    """(name, module) of the modules under `root` that see the split sequence: a sub-tree that has a config of
    its own (a vision / audio tower) is left out, it runs whole as on one device, and so are the `whole` ones
    (scan layers, which `scan_layers.run_whole` runs on the whole sequence in the plain order)."""
    stack = [("", root)]
    while stack:
        name, module = stack.pop()
        config = getattr(module, "config", None)
        if module is not root and config is not None and config is not text_config \
                and hasattr(config, "to_dict") and config is not getattr(root, "config", None):
            continue
        if any(module is w for w in whole):
            continue
        yield name, module
        stack.extend((f"{name}.{n}" if name else n, c) for n, c in reversed(list(module.named_children())))


def _is_attention_leaf(module: nn.Module) -> bool:
    """An attention layer: a transformers module named *Attention* with no *Attention* module inside."""
    cls = type(module)
    if "Attention" not in cls.__name__ or not cls.__module__.startswith("transformers.") \
            or "Bias" in cls.__name__:
        return False
    return not any("Attention" in type(m).__name__ for m in module.modules() if m is not module)


def _decoder_layer_lists(path: list) -> set:
    """Names of the decoder's layer lists: the module lists nearest the root that hold attention layers (a
    resampler inside a tower without a config of its own holds deeper ones, which run whole)."""
    lists = [(n, m) for n, m in path if isinstance(m, nn.ModuleList) and any(map(_is_attention_leaf, m.modules()))]
    depth = min((n.count(".") for n, _ in lists), default=0)
    return {n for n, _ in lists if n.count(".") == depth}


def own_attention_problem(root: nn.Module, text_config, whole: list | tuple = ()) -> str | None:
    """Why the modules under `root` (the decoder that gets the split sequence) would attend wrongly over it,
    or None; the first reason found, naming the module class and its place. The `whole` modules (scan layers
    run whole) are not read."""
    path = list(_split_path(root, text_config, tuple(whole)))
    lists = _decoder_layer_lists(path)
    seen = set()
    for name, module in path:
        cls = type(module)
        cross = bool(getattr(module, "is_cross_attention", False))   # one class may serve both (IDEFICS)
        if (cls, cross) in seen:
            continue
        seen.add((cls, cross))
        if hasattr(cls, _POSITION_FROM_IDS) and cls.__module__.startswith("transformers."):
            return (f"{cls.__name__} ({name}) derives the positions from the token ids (offset by the padding "
                    "index), which the split sequence's global positions do not reproduce")
        in_layers = any(name.startswith(n + ".") for n in lists)
        if not in_layers and cls.__module__.startswith("transformers.") and _POSITIONS_FROM_MASK.search(_source(cls)):
            return (f"{cls.__name__} ({name or 'the decoder'}) counts its default positions along the padding "
                    "mask, which the split sequence's global positions do not reproduce on a padded row")
        if not _is_attention_leaf(module) or not in_layers:
            continue
        source = _source(cls)
        if cross and INTERFACE in source:
            return (f"{cls.__name__} ({name}) cross-attends another sequence through the attention interface "
                    "(keys and values that are not the split sequence's)")
        if "CrossAttention" in cls.__name__ or cross:
            continue  # code of its own over another sequence's keys: per query, whatever the query order
        if INTERFACE not in source:
            return (f"{cls.__name__} ({name}) computes attention with code of its own, not through "
                    "transformers' attention interface (so its scores and masks follow the split tensor's "
                    "positions, not the tokens')")
        problem = _score_bias_problem(cls, name, source)
        if problem:
            return problem
    return None


def _score_bias_problem(cls: type, name: str, source: str) -> str | None:
    if _MASK_4D.search(source) or "position_bias" in source:
        return (f"{cls.__name__} ({name}) builds a 4-D score mask of its own (a learned or relative "
                "position bias added to the attention scores), which context-parallel attention does not "
                "compute")
    return None


def score_bias_problem(layers: list | tuple) -> str | None:
    """Why the attention inside these layers (scan layers, which run whole) would hand the registered attention a
    bias of its own to add to the scores (Inkling's relative `position_bias`), or None."""
    for layer in layers:
        for name, module in layer.named_modules():
            if _is_attention_leaf(module):
                problem = _score_bias_problem(type(module), name, _source(type(module)))
                if problem:
                    return problem
    return None
