"""Context parallelism of layers that mix the sequence by a scan (linear attention, state-space, short convolutions).

Such a layer (Qwen3-Next's and Qwen3.5's gated delta net, Mamba's mixer, LFM2's short convolution, Jamba's and
Nemotron-H's Mamba blocks) carries a state from token to token in the plain order, which a split sequence in the
zigzag order breaks. So it runs whole: on entry its sequence-split inputs are gathered and put back in the plain
order (one all-gather), the layer runs on every rank of the axis as one device runs it (attention inside it, where
a hybrid layer has some, over the whole sequence; its cache states filled as one device's), and its output is
split again in the zigzag order, where the attention layers around it take it. Exact; the cost is the gather
(and one in the backward) and the layer's activations, which are not split: the attention layers are the ones
whose memory and work context parallelism divides.
"""
from __future__ import annotations

import functools

from torch import Tensor, nn

from ...dtensor import DTensor
from .attention import ContextSettings

# layer_types words of layers that mix the sequence without attention (linear attention, state-space scans; "hybrid":
# Falcon-H1's attention and Mamba side by side in one layer)
NOT_ATTENTION = ("linear", "mamba", "recurrent", "conv", "ssm", "rwkv", "delta", "lightning", "hybrid")


def scan_layer_types(config) -> list[str]:
    """The config's layer_types entries that name layers mixing the sequence by a scan (sorted, unique)."""
    return sorted({t for t in getattr(config, "layer_types", None) or () if isinstance(t, str) and
                   any(k in t.lower() for k in NOT_ATTENTION)})


def scan_layers(decoder: nn.Module, config) -> list[nn.Module]:
    """The decoder layers whose config.layer_types entry is a scan; a ValueError where the layer list that
    layer_types describes cannot be found (the layers could not be told apart)."""
    types = list(config.layer_types)
    lists = [m for m in decoder.modules() if isinstance(m, nn.ModuleList) and len(m) == len(types)]
    if not lists:
        raise ValueError(f"context_parallel: {type(decoder).__name__} has no list of {len(types)} layers that "
                         f"config.layer_types describes, so its scan layers ({scan_layer_types(config)}) cannot be "
                         f"run whole; run this model without context parallelism")
    scans = set(scan_layer_types(config))
    return [layer for layer, kind in zip(lists[0], types) if kind in scans]


def run_whole(settings: ContextSettings, layers: list[nn.Module]) -> None:
    """Make each layer run on the whole sequence in the plain order inside a split forward (module docstring)."""
    for layer in layers:
        layer.forward = functools.partial(_whole_forward, settings, layer.forward)


def _whole_forward(settings: ContextSettings, forward, *args, **kwargs):
    if not settings.split_pending or settings.whole_layer:   # a decoding step (whole already), or nested
        return forward(*args, **kwargs)
    seq_len = _split_length(settings, args, kwargs)
    if seq_len is None:   # nothing of this call is split over the axis
        return forward(*args, **kwargs)
    args = tuple(_whole(settings, a, seq_len) for a in args)
    kwargs = {k: _whole_mask(settings, k, v, seq_len) if k.endswith("mask") else _whole(settings, v, seq_len)
              for k, v in kwargs.items()}
    settings.whole_layer = True
    try:
        out = forward(*args, **kwargs)
    finally:
        settings.whole_layer = False
    settings.attention_calls += 1   # the sequence was mixed exactly (plain_order_outputs counts these)
    return _split_again(settings, out, seq_len)


def _split_dim(settings: ContextSettings, t) -> int | None:
    """The dim of a DTensor split over the context axis (its sequence dim, in the zigzag order), or None."""
    if not isinstance(t, DTensor):
        return None
    for d, axes in enumerate(t.dist_layout.tensor_map):
        if settings.axis_index in axes:
            return d
    return None


def _split_length(settings: ContextSettings, args: tuple, kwargs: dict) -> int | None:
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (tuple, list)) else (value,):
            d = _split_dim(settings, t)
            if d is not None:
                return t.shape[d]
    return None


def _whole(settings: ContextSettings, value, seq_len: int):
    """A sequence-split DTensor whole and in the plain order (tuples such as position_embeddings item by item)."""
    from .api import whole_in_plain_order  # api imports this module
    if isinstance(value, (tuple, list)):
        return type(value)(_whole(settings, v, seq_len) for v in value)
    d = _split_dim(settings, value)
    if d is None:
        return value
    if value.dist_layout.tensor_map[d] != (settings.axis_index,):
        raise ValueError(f"context_parallel: a scan layer's input of layout {value.dist_layout.alias_entries()} "
                         f"splits its sequence dim {d} over more axes than {settings.axis!r}; it cannot be run whole")
    return whole_in_plain_order(settings, value, d)


def _whole_mask(settings: ContextSettings, name: str, mask, seq_len: int):
    """A 2D padding mask (whole on every rank in the zigzag order: attention_mask, Falcon-H1's
    mamba_attention_mask) in the plain order."""
    if _split_dim(settings, mask) is not None:
        return _whole(settings, mask, seq_len)
    if not isinstance(mask, Tensor) or mask.ndim != 2 or mask.shape[1] != seq_len:
        if isinstance(mask, Tensor):
            raise ValueError(f"context_parallel: a scan layer got a {name} of shape {tuple(mask.shape)}; only a "
                             f"2D padding mask (batch, {seq_len}) can be put back in the plain order")
        return mask
    device = mask.to_local().device if isinstance(mask, DTensor) else mask.device
    return mask.index_select(1, settings.plain_order_index(seq_len, device))


def _split_again(settings: ContextSettings, out, seq_len: int):
    """The layer's output: its (batch, seq, ...) DTensors split again on the sequence in the zigzag order."""
    from .api import split
    if isinstance(out, (tuple, list)):
        return type(out)(_split_again(settings, o, seq_len) for o in out)
    if isinstance(out, DTensor) and out.ndim >= 2 and out.shape[1] == seq_len and _split_dim(settings, out) is None:
        return split(settings, out, zigzag=True)
    return out
